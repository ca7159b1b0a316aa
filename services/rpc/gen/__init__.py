"""Generated protobuf / gRPC modules for protos/octoserve/v1 (do not edit; run scripts/gen_protos.sh)."""
