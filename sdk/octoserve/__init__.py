"""octoserve: the client SDK of the octoserve serving node (and, in a full install, the node itself).

    from octoserve import Client, AsyncClient, OverloadedError

    with Client("127.0.0.1:50051") as client:
        print(client.complete("llama-3-8b", "Hello", max_tokens=16).text)

The SDK needs only grpcio, protobuf and the Google API common protos; it installs alone from `sdk/` in the
repository. The node's services live under `octoserve.services`, `octoserve.router`, `octoserve.prefill_worker` and
`octoserve.decode_worker` in a full install. The public API's `.proto` file ships next to its generated modules
(`octoserve/v1/generate.proto`).
"""

# Imported on first use (PEP 562): the client pulls in grpc and asyncio, which the node's commands that never
# talk gRPC (simulate, plan) should not pay for at start-up.
_CLIENT_NAMES = frozenset({
    "AsyncClient", "Chunk", "Client", "Completion", "DeadlineExceededError", "InvalidArgumentError", "ModelInfo",
    "ModelNotFoundError", "OctoserveClientError", "OverloadedError", "RetryBudget", "RetryPolicy",
    "SloInfeasibleError", "UnauthenticatedError", "UnavailableError", "Usage",
})
_TYPES_NAMES = frozenset({"FinishReason", "Priority"})


def __getattr__(name: str):
    if name in _CLIENT_NAMES:
        from octoserve import client

        return getattr(client, name)
    if name in _TYPES_NAMES:
        from octoserve import types

        return getattr(types, name)
    raise AttributeError(f"module 'octoserve' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _CLIENT_NAMES | _TYPES_NAMES)


__all__ = [
    "AsyncClient", "Chunk", "Client", "Completion", "DeadlineExceededError", "FinishReason", "InvalidArgumentError",
    "ModelInfo", "ModelNotFoundError", "OctoserveClientError", "OverloadedError", "Priority", "RetryBudget",
    "RetryPolicy", "SloInfeasibleError", "UnauthenticatedError", "UnavailableError", "Usage",
]
