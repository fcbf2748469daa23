#!/usr/bin/env bash
# Run the GPU tier on an offline runner from a bundle made by gpu_bundle.sh.
#
#   run_gpu_tier.sh BUNDLE_DIR [extra pytest args]
#
# Installs the bundle's wheels with --no-index (packages the runner already has, e.g. torch, are
# kept), writes a one-GPU matrix for the detected device, then runs the conformance suite (stubs and
# the real FlashInfer backend) and the GPU-tier tests on real CUDA. FlashInfer's JIT cache lives in
# BUNDLE_DIR/jit-cache, so a second run reuses the compiled kernels. Results: BUNDLE_DIR/results/.
# Env: PYTHON (default python3), KVPROFILE_BASE_MATRIX (default the bundle's ci.yaml),
# KVPROFILE_EXTRA_MATRICES (space-separated, e.g. the bundle's ci.yaml to also run its other GPUs),
# KVPROFILE_PYTEST_TIMEOUT (default 540 s; the first run also JIT-compiles FlashInfer's kernels).
set -euo pipefail
BUNDLE=$(cd "${1:?usage: run_gpu_tier.sh BUNDLE_DIR [pytest args]}" && pwd)
shift
PY=${PYTHON:-python3}
OUT="$BUNDLE/results/$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p "$OUT" "$BUNDLE/jit-cache"
export FLASHINFER_WORKSPACE_BASE="$BUNDLE/jit-cache"
export KVPROFILE_CACHE_DIR="${KVPROFILE_CACHE_DIR:-$BUNDLE/oracle-cache}"  # the sizing oracle, built once by nvcc
if [ -z "${CUDA_HOME:-}" ] && command -v nvcc >/dev/null; then export CUDA_HOME=$(dirname "$(dirname "$(command -v nvcc)")"); fi
CC=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n1 | tr -d ' ')
case "$CC" in 9.0|10.0|10.3|12.0|12.1) export FLASHINFER_CUDA_ARCH_LIST="${FLASHINFER_CUDA_ARCH_LIST:-${CC}a}" ;;
              *) export FLASHINFER_CUDA_ARCH_LIST="${FLASHINFER_CUDA_ARCH_LIST:-$CC}" ;; esac
# Top-level names only: what the runner already has (torch, numpy, ...) is kept if it satisfies them.
"$PY" -m pip install --no-index --find-links "$BUNDLE/wheels" "$BUNDLE"/wheels/pytest_kvprofile-*.whl \
    "flashinfer-python==$(cat "$BUNDLE/flashinfer-version")" 2>&1 | tail -n 2
BASE=${KVPROFILE_BASE_MATRIX:-$BUNDLE/matrices/ci.yaml}
"$PY" -m pytest_kvprofile.gpu.matrix_gen --base "$BASE" --out "$OUT/detected.yaml" --json "$OUT/topology.json" --torch
MATRICES=(--kvprofile-matrix "$OUT/detected.yaml")
for m in ${KVPROFILE_EXTRA_MATRICES:-}; do MATRICES+=(--kvprofile-matrix "$m"); done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/nvidia-smi.csv"
"$PY" -c "import torch, flashinfer; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'flashinfer', flashinfer.__version__)" | tee "$OUT/versions.txt"
cd "$OUT"
set +e
timeout "${KVPROFILE_PYTEST_TIMEOUT:-540}" "$PY" -m pytest -p no:cacheprovider --kvprofile-gpu \
    --pyargs pytest_kvprofile.suite pytest_kvprofile.gpu_suite "${MATRICES[@]}" \
    --kvprofile-backend stubs --kvprofile-backend pytest_kvprofile.gpu.flashinfer_builders:gpu_backends \
    --kvprofile-json "$OUT/report.json" --junitxml "$OUT/junit.xml" --durations 15 -q "$@" 2>&1 | tee "$OUT/pytest.log"
RC=${PIPESTATUS[0]}
echo "run_gpu_tier: exit $RC; results in $OUT (report.json, junit.xml, pytest.log, topology.json)"
exit "$RC"
