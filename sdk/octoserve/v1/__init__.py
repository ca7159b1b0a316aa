"""Generated protobuf / gRPC modules of the public API, `octoserve/v1/generate.proto` (shipped alongside).

Do not edit the `*_pb2*` files: run scripts/gen_protos.sh.
"""
