#!/usr/bin/env bash
# Regenerates the protobuf / gRPC modules from protos/octoserve/v1/*.proto with grpc_tools.protoc.
# - The public API (generate.proto, which lives in the SDK at sdk/octoserve/v1/ and is linked from protos/) goes to
#   sdk/octoserve/v1/, importable as `octoserve.v1.generate_pb2` with the SDK alone.
# - The internal APIs (worker, kv, scheduler) go to services/rpc/gen/; their imports of each other are rewritten to
#   be package-relative, and their import of the public API points at `octoserve.v1`.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
SDK="$ROOT/sdk/octoserve/v1"
OUT="$ROOT/services/rpc/gen"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

"$PY" -m grpc_tools.protoc -I "$ROOT/protos" \
  --python_out="$TMP" --pyi_out="$TMP" --grpc_python_out="$TMP" \
  "$ROOT"/protos/octoserve/v1/*.proto

rm -f "$OUT"/*_pb2*.py "$OUT"/*_pb2*.pyi "$SDK"/*_pb2*.py "$SDK"/*_pb2*.pyi
mkdir -p "$OUT"
cp "$TMP"/octoserve/v1/generate_pb2* "$SDK"/
rm "$TMP"/octoserve/v1/generate_pb2*
cp "$TMP"/octoserve/v1/* "$OUT"/
sed -i -E 's/^from octoserve\.v1 import generate_pb2/from octoserve.v1 import generate_pb2/; t; s/^from octoserve\.v1 import (\w+_pb2)/from . import \1/' \
  "$OUT"/*.py "$OUT"/*.pyi
sed -i -E 's/^from octoserve\.v1 import (\w+_pb2)/from . import \1/' "$SDK"/*.py "$SDK"/*.pyi
cat > "$OUT/__init__.py" <<'PYEOF'
"""Generated protobuf / gRPC modules for protos/octoserve/v1 (do not edit; run scripts/gen_protos.sh)."""
PYEOF
echo "generated: $(cd "$SDK" && ls *.py | tr '\n' ' ')$(cd "$OUT" && ls *.py | tr '\n' ' ')"
