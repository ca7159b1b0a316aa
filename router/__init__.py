"""The router: octoserve's only client-facing service (octoserve.v1.Generation)."""
