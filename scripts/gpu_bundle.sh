#!/usr/bin/env bash
# Build an offline bundle for a GPU runner (run on a connected machine).
#
#   scripts/gpu_bundle.sh BUNDLE_DIR [PYTHON_VERSION] [PLATFORM]
#
# Defaults fit this workplace's H200 machine: CPython 3.12, manylinux x86_64, torch already
# installed there (torch, triton, numpy and the nvidia-* CUDA wheels are NOT bundled; see
# /work/.library/device/KINDS.md). What is bundled: this package's wheel, flashinfer-python at the
# version installed here (the oracle and the builders must see the same planner) and whichever of
# its dependencies the runner lacks. Override the skip list with KVPROFILE_BUNDLE_SKIP.
set -euo pipefail
BUNDLE=${1:?usage: gpu_bundle.sh BUNDLE_DIR [PYTHON_VERSION] [PLATFORM]}
PYVER=${2:-3.12}
PLATFORM=${3:-manylinux_2_28_x86_64}
PY=${PYTHON:-python3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
FI_VERSION=$("$PY" -c "from importlib.metadata import version; print(version('flashinfer-python'))")
SKIP=${KVPROFILE_BUNDLE_SKIP:-"torch triton numpy pytest pytest-xdist pyyaml nvidia-ml-py packaging requests tqdm click einops ninja tabulate cuda-bindings cuda-core cuda-pathfinder cuda-toolkit filelock fsspec jinja2 markupsafe networkx sympy mpmath typing-extensions setuptools pluggy iniconfig execnet"}

mkdir -p "$BUNDLE/wheels" "$BUNDLE/jit-cache"
"$PY" -m pip wheel --no-deps -w "$BUNDLE/wheels" "$ROOT"
# Resolve flashinfer's dependency tree for the runner's platform without downloading torch:
# pip's install report lists what a fresh install would pull; the runner's own packages are dropped.
"$PY" -m pip install --dry-run --ignore-installed --only-binary=:all: --python-version "$PYVER" \
    --platform "$PLATFORM" --platform manylinux2014_x86_64 --platform linux_x86_64 \
    --target "$BUNDLE/.resolve" --report "$BUNDLE/resolve.json" "flashinfer-python==$FI_VERSION" >/dev/null
"$PY" - "$BUNDLE/resolve.json" "$SKIP" > "$BUNDLE/requirements.txt" <<'PYEOF'
import json, re, sys
report = json.load(open(sys.argv[1]))
skip = {re.sub(r"[-_.]+", "-", s).lower() for s in sys.argv[2].split()}
for item in report["install"]:
    meta = item["metadata"]
    name = re.sub(r"[-_.]+", "-", meta["name"]).lower()
    if name in skip or name.startswith("nvidia-cuda-") or name.startswith(("nvidia-cublas", "nvidia-cudnn-cu", "nvidia-nccl")):
        continue
    print(f"{meta['name']}=={meta['version']}")
PYEOF
"$PY" -m pip download --no-deps --only-binary=:all: --python-version "$PYVER" --platform "$PLATFORM" \
    --platform manylinux2014_x86_64 --platform linux_x86_64 -d "$BUNDLE/wheels" -r "$BUNDLE/requirements.txt"
cp "$ROOT/scripts/run_gpu_tier.sh" "$BUNDLE/"
cp -r "$ROOT/pytest_kvprofile/matrices" "$BUNDLE/matrices"
rm -rf "$BUNDLE/.resolve"
echo "bundle: $BUNDLE ($(ls "$BUNDLE/wheels" | wc -l) wheels, flashinfer-python $FI_VERSION); on the runner: $BUNDLE/run_gpu_tier.sh $BUNDLE"
