"""gRPC glue shared by every octoserve service.

- `gen/`: generated protobuf / gRPC modules (scripts/gen_protos.sh; committed so importing needs no protoc).
Protobuf types stop here: the services convert them to the core dataclasses at their edge.
"""
