#!/usr/bin/env bash
# Run the GPU tier on an offline runner from the carry scripts/device_bundle.sh builds.
#
#   scripts/run_gpu_tier.sh --bundle DIR --out DIR [--target DIR] [--env-only] [-- extra pytest args]
#
# Run from this repository's checkout on a machine that already has torch (CUDA build), nvcc,
# pytest and nvidia-ml-py. Steps, each failing early with a message that says what is missing:
#   1. a GPU (NVML/nvidia-smi), before anything slow;
#   2. the real CUDA toolkit: CUDA_HOME, else the directory nvcc itself reports (`nvcc --dryrun`
#      prints _HERE_, so a wrapper script in /usr/local/bin is followed), else nvcc's resolved
#      link; the first one whose lib64 holds libcudart wins, and CUDA_HOME is exported as it;
#   3. -lcuda for FlashInfer's JIT link: the toolkit's lib64/stubs, else the driver's libcuda.so.1
#      linked as libcuda.so into OUT/link (LIBRARY_PATH); neither is an error;
#   4. the carry, installed without network into TARGET (default OUT/site, on PYTHONPATH);
#   5. a small matrix for the detected GPU (scripts/gpu_tier_base.yaml through matrix_gen);
#   6. FlashInfer's JIT modules for that matrix, built once into OUT/jit and timed on their own;
#   7. pytest on the suite (stub and real FlashInfer backends) and the GPU-tier tests, in what is
#      left of KVPROFILE_GPU_BUDGET_S (default 480 s) for the whole run.
# Results in OUT: verdict.json, report.json, junit.xml, pytest.log, hardware.json, run.log.
# The compiler variable CC is never set or changed (FlashInfer passes it to nvcc as -ccbin).
# Exit: pytest's status; 3 no GPU; 4 environment (toolkit, libcuda, carry); 5 out of time in JIT.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
BUNDLE="" OUT="" TARGET="" ENV_ONLY=0
EXTRA=()
while [ $# -gt 0 ]; do
    case "$1" in
        --bundle) BUNDLE=$2; shift 2 ;;
        --out) OUT=$2; shift 2 ;;
        --target) TARGET=$2; shift 2 ;;
        --env-only) ENV_ONLY=1; shift ;;
        --) shift; EXTRA=("$@"); break ;;
        *) echo "run_gpu_tier: unknown argument $1 (usage: --bundle DIR --out DIR [--target DIR] [--env-only] [-- pytest args])" >&2; exit 2 ;;
    esac
done
[ -n "$OUT" ] || { echo "run_gpu_tier: --out DIR is required" >&2; exit 2; }
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
exec > >(tee -a "$OUT/run.log") 2> >(tee -a "$OUT/run.log" >&2)
PY=${PYTHON:-python3}
BUDGET=${KVPROFILE_GPU_BUDGET_S:-480}
START=$(date +%s)
elapsed() { echo $(( $(date +%s) - START )); }
die() { local code=$1; shift; echo "run_gpu_tier: $*" >&2; exit "$code"; }

# 1. A GPU, asked of NVML (no CUDA context), before anything slow.
gpu_count() {
    "$PY" -c "import pynvml; pynvml.nvmlInit(); print(pynvml.nvmlDeviceGetCount())" 2>/dev/null \
        || nvidia-smi -L 2>/dev/null | grep -c '^GPU' || echo 0
}
if [ "$ENV_ONLY" = 0 ]; then
    COUNT=$(gpu_count | tail -n1)
    [ "${COUNT:-0}" -gt 0 ] 2>/dev/null || die 3 "no GPU found (NVML and nvidia-smi report none); the GPU tier needs a CUDA device, run the CPU tier instead"
fi

# 2. The real toolkit: the first candidate whose lib64 holds libcudart.
resolve_cuda_home() {
    local nvcc here c
    local cands=()
    [ -n "${CUDA_HOME:-}" ] && cands+=("$CUDA_HOME")
    nvcc=$(command -v nvcc || true)
    if [ -n "$nvcc" ]; then
        here=$("$nvcc" --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ _HERE_=//p' | head -n1 || true)
        [ -n "$here" ] && cands+=("$here/..")
        cands+=("$(dirname "$(dirname "$(readlink -f "$nvcc")")")")
    fi
    cands+=(/usr/local/cuda)
    for c in "${cands[@]}"; do
        c=$(readlink -f "$c" 2>/dev/null || true)
        [ -n "$c" ] || continue
        if [ -x "$c/bin/nvcc" ] && compgen -G "$c/lib64/libcudart.so*" >/dev/null; then
            echo "$c"
            return 0
        fi
    done
    echo "tried: ${cands[*]}" >&2
    return 1
}
CUDA_HOME=$(resolve_cuda_home) || die 4 "no CUDA toolkit with bin/nvcc and lib64/libcudart.so* found (CUDA_HOME=${CUDA_HOME:-unset}, nvcc=$(command -v nvcc || echo none)); set CUDA_HOME to the toolkit"
export CUDA_HOME
export PATH="$CUDA_HOME/bin:$PATH"
echo "run_gpu_tier: CUDA toolkit $CUDA_HOME"

# 3. -lcuda: the toolkit's stubs, else the driver's libcuda.so.1 under the name the linker wants.
find_driver_libcuda() {
    local p
    p=$( (ldconfig -p 2>/dev/null || true) | awk '/libcuda\.so\.1 .*x86-64/ {print $NF; exit}')
    [ -n "$p" ] && { echo "$p"; return 0; }
    for p in /usr/local/nvidia/lib64/libcuda.so.1 /usr/lib/x86_64-linux-gnu/libcuda.so.1 /usr/lib64/libcuda.so.1 \
             /usr/lib/wsl/lib/libcuda.so.1; do
        [ -e "$p" ] && { echo "$p"; return 0; }
    done
    return 1
}
if [ -e "$CUDA_HOME/lib64/stubs/libcuda.so" ]; then
    echo "run_gpu_tier: -lcuda from $CUDA_HOME/lib64/stubs"
elif DRIVER=$(find_driver_libcuda); then
    mkdir -p "$OUT/link"
    ln -sf "$DRIVER" "$OUT/link/libcuda.so"
    export LIBRARY_PATH="$OUT/link${LIBRARY_PATH:+:$LIBRARY_PATH}"
    echo "run_gpu_tier: -lcuda from the driver's $DRIVER (linked into $OUT/link)"
else
    die 4 "-lcuda cannot be resolved: $CUDA_HOME/lib64/stubs/libcuda.so is missing and no driver libcuda.so.1 was found (ldconfig, /usr/local/nvidia/lib64, /usr/lib/x86_64-linux-gnu); FlashInfer's JIT link would fail with 'cannot find -lcuda'"
fi
if [ "$ENV_ONLY" = 1 ]; then
    echo "run_gpu_tier: environment ok (--env-only)"
    exit 0
fi

# 4. The carry, without network.
[ -n "$BUNDLE" ] && [ -f "$BUNDLE/flashinfer-trimmed.tar.xz" ] || die 4 "--bundle must name the folder scripts/device_bundle.sh wrote (flashinfer-trimmed.tar.xz, wheels/)"
BUNDLE=$(cd "$BUNDLE" && pwd)
TARGET=${TARGET:-$OUT/site}
mkdir -p "$TARGET"
tar -C "$TARGET" -xJf "$BUNDLE/flashinfer-trimmed.tar.xz"
"$PY" -m pip install --quiet --no-index --no-deps --target "$TARGET" "$BUNDLE"/wheels/apache_tvm_ffi-*.whl \
    || die 4 "installing apache-tvm-ffi from $BUNDLE/wheels failed"
export PYTHONPATH="$TARGET:$REPO${PYTHONPATH:+:$PYTHONPATH}"
PLUGIN=()
"$PY" -c "import importlib.metadata as m, sys; sys.exit(0 if any(e.value == 'pytest_kvprofile.plugin' for e in m.entry_points(group='pytest11')) else 1)" \
    || PLUGIN=(-p pytest_kvprofile.plugin)
"$PY" -c "import torch, flashinfer, tvm_ffi; print('run_gpu_tier: torch', torch.__version__, 'cuda', torch.version.cuda, '| flashinfer', flashinfer.__version__, 'from', flashinfer.__file__)" \
    || die 4 "the carry does not import on this machine (see the traceback above)"

COMPUTE_CAP=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n1 | tr -d ' ')
case "$COMPUTE_CAP" in 9.0|10.0|10.3|12.0|12.1) ARCH="${COMPUTE_CAP}a" ;; *) ARCH="$COMPUTE_CAP" ;; esac
export FLASHINFER_CUDA_ARCH_LIST="${FLASHINFER_CUDA_ARCH_LIST:-$ARCH}"
export FLASHINFER_WORKSPACE_BASE="$OUT/jit"
export KVPROFILE_CACHE_DIR="${KVPROFILE_CACHE_DIR:-$OUT/oracle-cache}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"

# 5. A small matrix for this GPU.
"$PY" -m pytest_kvprofile.gpu.matrix_gen --base "${KVPROFILE_BASE_MATRIX:-$REPO/scripts/gpu_tier_base.yaml}" \
    --out "$OUT/matrix.yaml" --json "$OUT/topology.json" --torch

# 6. JIT, timed on its own; the modules land in OUT/jit and the tests load them from there.
JIT_LEFT=$(( BUDGET - $(elapsed) - 120 ))
[ "$JIT_LEFT" -gt 30 ] || die 5 "no time left for the JIT build"
set +e
timeout "$JIT_LEFT" "$PY" - "$OUT/matrix.yaml" "$OUT/jit.json" <<'PYEOF'
import json, sys, time
import torch
from flashinfer.decode import get_batch_decode_module
from flashinfer.prefill import get_batch_prefill_module
from pytest_kvprofile.matrix.schema import load_matrix
dims = sorted({(c.model.head_dim, c.model.dim_vo) for c in load_matrix(sys.argv[1]).cases})
bf, times = torch.bfloat16, {}
for qk, vo in dims:
    t = time.perf_counter()
    get_batch_prefill_module("fa2", bf, bf, bf, torch.int32, qk, vo, 0, False, False, False)
    times[f"prefill_fa2_{qk}_{vo}"] = round(time.perf_counter() - t, 1)
    if qk == vo:
        t = time.perf_counter()
        get_batch_decode_module(bf, bf, bf, torch.int32, qk, qk, 0, False, False)
        times[f"decode_{qk}"] = round(time.perf_counter() - t, 1)
json.dump({"jit_seconds": times, "total": round(sum(times.values()), 1)}, open(sys.argv[2], "w"), indent=1)
print("run_gpu_tier: JIT", times)
PYEOF
JIT_RC=$?
set -e
[ "$JIT_RC" = 124 ] && die 5 "FlashInfer's JIT build did not finish in ${JIT_LEFT}s"
[ "$JIT_RC" = 0 ] || die 4 "FlashInfer's JIT build failed (exit $JIT_RC; the nvcc/ld error is above)"

# 7. The tests, in what is left of the budget.
TEST_LEFT=$(( BUDGET - $(elapsed) - 10 ))
printf '[pytest]\naddopts = -p no:cacheprovider\n' > "$OUT/pytest.ini"
set +e
(cd "$OUT" && timeout "$TEST_LEFT" "$PY" -m pytest -c "$OUT/pytest.ini" --rootdir "$OUT" "${PLUGIN[@]}" --kvprofile-gpu \
    --pyargs pytest_kvprofile.suite pytest_kvprofile.gpu_suite --kvprofile-matrix "$OUT/matrix.yaml" \
    --kvprofile-backend stubs --kvprofile-backend flashinfer \
    --kvprofile-json "$OUT/report.json" --kvprofile-verdict "$OUT/verdict.json" --junitxml "$OUT/junit.xml" \
    --durations 20 -rfEs -q "${EXTRA[@]}" 2>&1 | tee "$OUT/pytest.log")
RC=${PIPESTATUS[0]}
set -e
"$PY" - "$OUT" "$CUDA_HOME" "$(elapsed)" "$RC" <<'PYEOF' || true
import json, os, subprocess, sys
out, cuda_home, seconds, rc = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
def read(name):
    path = os.path.join(out, name)
    return json.load(open(path)) if os.path.isfile(path) else None
smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,compute_cap", "--format=csv,noheader"],
                     capture_output=True, text=True).stdout.strip()
import torch, flashinfer
doc = {"nvidia_smi": smi, "torch": torch.__version__, "torch_cuda": torch.version.cuda,
       "flashinfer": flashinfer.__version__, "cuda_home": cuda_home, "topology": read("topology.json"),
       "jit": read("jit.json"), "total_seconds": seconds, "pytest_exit": rc,
       "report_hardware": (read("report.json") or {}).get("hardware")}
json.dump(doc, open(os.path.join(out, "hardware.json"), "w"), indent=1, default=str)
PYEOF
echo "run_gpu_tier: pytest exit $RC after $(elapsed)s; results in $OUT (verdict.json report.json junit.xml pytest.log hardware.json run.log)"
exit "$RC"
