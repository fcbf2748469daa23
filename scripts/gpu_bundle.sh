#!/usr/bin/env bash
# Build an offline bundle for a GPU runner (run on a connected machine).
#
#   scripts/gpu_bundle.sh BUNDLE_DIR [PYTHON_VERSION] [PLATFORM]
#
# Defaults fit this workplace's H200 machine: CPython 3.12, manylinux x86_64, torch already
# installed there (torch, triton, numpy and the nvidia-* CUDA wheels are NOT bundled; see
# /work/.library/device/KINDS.md). What is bundled: this package's wheel, flashinfer-python at the
# version installed here (the oracle and the builders must see the same planner) and whichever of
# its dependencies. torch, triton and the CUDA library wheels (nvidia-*-cu12/-cu13, except CUTLASS
# DSL's) are never bundled; KVPROFILE_BUNDLE_SKIP adds names. On the runner pip installs only
# what the installed packages do not already satisfy.
set -euo pipefail
BUNDLE=${1:?usage: gpu_bundle.sh BUNDLE_DIR [PYTHON_VERSION] [PLATFORM]}
PYVER=${2:-3.12}
PLATFORM=${3:-manylinux_2_28_x86_64}
PY=${PYTHON:-python3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
FI_VERSION=$("$PY" -c "from importlib.metadata import version; print(version('flashinfer-python'))")
SKIP=${KVPROFILE_BUNDLE_SKIP:-"torch triton"}

mkdir -p "$BUNDLE/wheels" "$BUNDLE/jit-cache"
"$PY" -m pip wheel --no-deps -w "$BUNDLE/wheels" "$ROOT"
# Resolve flashinfer's dependency tree for the runner's platform without downloading torch:
# pip's install report lists what a fresh install would pull; the runner's own packages are dropped.
"$PY" -m pip install --dry-run --ignore-installed --only-binary=:all: --python-version "$PYVER" \
    --platform "$PLATFORM" --platform manylinux2014_x86_64 --platform linux_x86_64 \
    --target "$BUNDLE/.resolve" --report "$BUNDLE/resolve.json" "flashinfer-python==$FI_VERSION" \
    "$BUNDLE"/wheels/pytest_kvprofile-*.whl >/dev/null
"$PY" - "$BUNDLE/resolve.json" "$SKIP" > "$BUNDLE/requirements.txt" <<'PYEOF'
import json, re, sys
report = json.load(open(sys.argv[1]))
skip = {re.sub(r"[-_.]+", "-", s).lower() for s in sys.argv[2].split()} | {"pytest-kvprofile"}
for item in report["install"]:
    meta = item["metadata"]
    name = re.sub(r"[-_.]+", "-", meta["name"]).lower()
    cuda_lib = name.startswith("nvidia-") and name.endswith(("-cu12", "-cu13")) and not name.startswith("nvidia-cutlass-dsl")
    if name in skip or cuda_lib:
        continue
    print(f"{meta['name']}=={meta['version']}")
PYEOF
"$PY" -m pip download --no-deps --only-binary=:all: --python-version "$PYVER" --platform "$PLATFORM" \
    --platform manylinux2014_x86_64 --platform linux_x86_64 -d "$BUNDLE/wheels" -r "$BUNDLE/requirements.txt"
echo "$FI_VERSION" > "$BUNDLE/flashinfer-version"
cp "$ROOT/scripts/run_gpu_tier.sh" "$BUNDLE/"
cp -r "$ROOT/pytest_kvprofile/matrices" "$BUNDLE/matrices"
rm -rf "$BUNDLE/.resolve"
echo "bundle: $BUNDLE ($(ls "$BUNDLE/wheels" | wc -l) wheels, flashinfer-python $FI_VERSION); on the runner: $BUNDLE/run_gpu_tier.sh $BUNDLE"
