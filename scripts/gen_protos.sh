#!/usr/bin/env bash
# Regenerates services/rpc/gen/ from protos/octoserve/v1/*.proto with grpc_tools.protoc.
# The generated modules are flattened into one package and their cross-imports rewritten to be package-relative
# (`from . import generate_pb2`), so they import as `services.rpc.gen.generate_pb2` wherever the repo is.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
OUT="$ROOT/services/rpc/gen"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

"$PY" -m grpc_tools.protoc -I "$ROOT/protos" \
  --python_out="$TMP" --pyi_out="$TMP" --grpc_python_out="$TMP" \
  "$ROOT"/protos/octoserve/v1/*.proto

rm -f "$OUT"/*_pb2*.py "$OUT"/*_pb2*.pyi
mkdir -p "$OUT"
cp "$TMP"/octoserve/v1/* "$OUT"/
sed -i -E 's/^from octoserve\.v1 import (\w+_pb2)/from . import \1/' "$OUT"/*.py "$OUT"/*.pyi
cat > "$OUT/__init__.py" <<'PYEOF'
"""Generated protobuf / gRPC modules for protos/octoserve/v1 (do not edit; run scripts/gen_protos.sh)."""
PYEOF
echo "generated: $(cd "$OUT" && ls *.py | tr '\n' ' ')"
