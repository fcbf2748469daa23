#!/usr/bin/env bash
# Build the device carry for an offline GPU runner (run on a connected machine with this repo's venv).
#
#   scripts/device_bundle.sh [OUT_DIR]        (default: .device-bundle, git-ignored)
#
# The runner this targets (CPython 3.12 x86-64, torch built for CUDA 13, nvcc, pytest, xdist,
# PyYAML, nvidia-ml-py, ninja; no network; at most 64 MiB carried per run) lacks flashinfer-python
# and apache-tvm-ffi. The wheel alone is ~100 MB, so the carry holds a trimmed FlashInfer instead:
#   - the Python modules of every FlashInfer subpackage that `import flashinfer` and the FA2
#     prefill/decode JIT generators load (whole subpackages, so lazy imports inside them resolve);
#   - the JIT templates and sources those generators read, and the header closure (nvcc -M) of
#     the sources they generate and of the sizing oracle (planner headers), for head dims 64/128/256;
#   - the dist-info METADATA (the oracle and reports read the version from it);
# all in one tar.xz, plus the apache-tvm-ffi wheel for cp312 manylinux_2_28_x86_64 at the version
# installed here. The FlashInfer version is the one installed here, because the oracle that sizes
# the workspaces on CPU must run the same planner the GPU runs. Env: PYTHON (default .venv/bin/python).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-$ROOT/.device-bundle}
PY=${PYTHON:-$ROOT/.venv/bin/python}
LIMIT_MIB=24
NVCC=${NVCC:-$(command -v nvcc || true)}
[ -n "$NVCC" ] || { echo "device_bundle: nvcc is needed to compute the header closure (nvcc -M)" >&2; exit 2; }

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
rm -rf "$OUT"
mkdir -p "$OUT"

# 1. What FlashInfer loads and reads: modules imported, files opened by the JIT generators.
FLASHINFER_WORKSPACE_BASE="$WORK/jit" FLASHINFER_CUDA_ARCH_LIST="9.0a" "$PY" - "$WORK" <<'PYEOF'
import json, os, sys
work = sys.argv[1]
opened = set()
sys.addaudithook(lambda ev, args: opened.add(os.fspath(args[0])) if ev == "open" and isinstance(args[0], (str, bytes, os.PathLike)) else None)
import importlib.metadata, importlib.util
import torch
import flashinfer
from flashinfer import BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper  # noqa: F401
from flashinfer.jit.attention.modules import gen_batch_decode_module, gen_batch_prefill_module
pkg = os.path.dirname(flashinfer.__file__)
bf, specs = torch.bfloat16, []
for hd in (64, 128, 256):
    specs.append(gen_batch_prefill_module("fa2", bf, bf, bf, torch.int32, hd, hd, 0, False, False, False))
    specs.append(gen_batch_decode_module(bf, bf, bf, torch.int32, hd, hd, 0, False, False))
for s in specs:
    s.write_ninja()
mods = sorted(m for m in sys.modules if m == "flashinfer" or m.startswith("flashinfer."))
json.dump({
    "package_dir": pkg,
    "version": importlib.metadata.version("flashinfer-python"),
    "tvm_ffi_version": importlib.metadata.version("apache-tvm-ffi"),
    "modules": mods,
    "opened": sorted(p for p in opened if p.startswith(pkg + "/data/")),
    "sources": sorted({str(src) for s in specs for src in s.sources}),
    "dist_info": str(importlib.metadata.distribution("flashinfer-python")._path),
}, open(os.path.join(work, "probe.json"), "w"), indent=1)
PYEOF

# 2. The header closure: nvcc -M over the generated sources (one head dim: the includes do not
#    depend on it) and over the oracle's translation unit.
"$PY" - "$WORK" "$NVCC" "$ROOT" <<'PYEOF'
import json, os, subprocess, sys
work, nvcc, root = sys.argv[1:4]
probe = json.load(open(os.path.join(work, "probe.json")))
pkg = probe["package_dir"]
data = os.path.join(pkg, "data")
import tvm_ffi, sysconfig
inc = [f"-I{data}/cccl/cub", f"-I{data}/cccl/libcudacxx/include", f"-I{data}/cccl/thrust",
       f"-I{data}/include", f"-I{data}/csrc", f"-I{data}/cutlass/include", f"-I{data}/cutlass/tools/util/include",
       f"-I{data}/spdlog/include", f"-I{os.path.join(os.path.dirname(tvm_ffi.__file__), 'include')}",
       f"-I{sysconfig.get_paths()['include']}"]
flags = ["-std=c++17", "-DFLASHINFER_ENABLE_BF16", "-DFLASHINFER_ENABLE_F16", "-DFLASHINFER_ENABLE_FP8_E4M3",
         "-DFLASHINFER_ENABLE_FP8_E5M2", "-arch=sm_90a"]
sources = [s for s in probe["sources"] if "head_dim_qk_128" in s]
sources.append(os.path.join(root, "pytest_kvprofile", "sizing", "csrc", "oracle.cu"))
headers = set()
for src in sources:
    gen_inc = [f"-I{os.path.dirname(src)}"]
    res = subprocess.run([nvcc, *flags, *inc, *gen_inc, "-M", src], capture_output=True, text=True)
    if res.returncode:
        sys.exit(f"device_bundle: nvcc -M {src} failed:\n{res.stderr[-2000:]}")
    for tok in res.stdout.replace("\\\n", " ").split():
        path = os.path.realpath(tok)
        if path.startswith(data + "/"):
            headers.add(path)
json.dump(sorted(headers), open(os.path.join(work, "headers.json"), "w"), indent=1)
PYEOF

# 3. Stage the trimmed tree and pack it.
"$PY" - "$WORK" "$OUT" <<'PYEOF'
import json, os, shutil, sys
work, out = sys.argv[1:3]
probe = json.load(open(os.path.join(work, "probe.json")))
headers = json.load(open(os.path.join(work, "headers.json")))
pkg = probe["package_dir"]
stage = os.path.join(work, "stage")
keep = set(headers) | set(probe["opened"])
subpackages = {m.split(".")[1] for m in probe["modules"] if m.count(".") >= 1}
for name in os.listdir(pkg):
    path = os.path.join(pkg, name)
    if name.endswith(".py"):
        keep.add(path)
    elif os.path.isdir(path) and name in subpackages:
        for dirpath, _, files in os.walk(path):
            keep.update(os.path.join(dirpath, f) for f in files if f.endswith(".py"))
for path in sorted(keep):
    rel = os.path.relpath(path, os.path.dirname(pkg))
    dst = os.path.join(stage, rel)
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    shutil.copy2(path, dst)
dist = probe["dist_info"]
dst = os.path.join(stage, os.path.basename(dist))
os.makedirs(dst)
for f in ("METADATA", "entry_points.txt", "top_level.txt"):
    if os.path.isfile(os.path.join(dist, f)):
        shutil.copy2(os.path.join(dist, f), dst)
open(os.path.join(dst, "INSTALLER"), "w").write("pytest-kvprofile device_bundle.sh (trimmed)\n")
manifest = {"flashinfer_version": probe["version"], "apache_tvm_ffi_version": probe["tvm_ffi_version"],
            "python_modules": sum(1 for p in keep if p.endswith(".py")), "data_files": sum(1 for p in keep if "/data/" in p),
            "headers": len(headers), "jit_files_read": len(probe["opened"]), "subpackages": sorted(subpackages)}
json.dump(manifest, open(os.path.join(out, "manifest.json"), "w"), indent=1)
PYEOF
tar -C "$WORK/stage" -cJf "$OUT/flashinfer-trimmed.tar.xz" .
TVM_VERSION=$("$PY" -c "import json; print(json.load(open('$OUT/manifest.json'))['apache_tvm_ffi_version'])")
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d "$OUT/wheels" "apache-tvm-ffi==$TVM_VERSION"

BYTES=$(du -sb "$OUT" | cut -f1)
echo "device_bundle: $OUT holds $(ls "$OUT" "$OUT/wheels" | grep -c -E '\.(xz|whl)$') archives, $BYTES bytes ($((BYTES / 1048576)) MiB; limit $LIMIT_MIB MiB)"
cat "$OUT/manifest.json"
if [ "$BYTES" -ge $((LIMIT_MIB * 1048576)) ]; then
    echo "device_bundle: the carry is over $LIMIT_MIB MiB" >&2
    exit 1
fi
