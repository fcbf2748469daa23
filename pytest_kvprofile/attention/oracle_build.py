"""Building the host oracle: FlashInfer's planner headers compiled with ``nvcc``, cached and verified.

Why: the only authority on how many bytes a FlashInfer ``plan()`` carves is the installed
FlashInfer. Its planners are host code; compiled with ``nvcc`` against the wheel's headers and
linked with a stub CUDA runtime (``csrc/cuda_stubs.cpp``) they run on a CPU for any SM count.
``oracle.py`` binds the library this module builds.

The library is built once per (FlashInfer version, digest of the headers the planners live in,
compiler version, our sources, link flags) and cached under ``$KVPROFILE_CACHE_DIR`` or
``${XDG_CACHE_HOME:-~/.cache}/pytest-kvprofile/oracle/<key>/``. Builds run in a temp dir and are
renamed into place under an ``fcntl`` lock, so concurrent xdist workers build once. The library's
sha256 is kept in a sidecar and checked before every load; a library owned by someone else or
writable by group/others is refused.

Symbol isolation: the stub runtime's symbols are hidden (``cuda_stubs.cpp``) and the library is
linked ``-Bsymbolic``, so a real ``libcudart`` that a CUDA torch loaded ``RTLD_GLOBAL`` earlier can
neither answer the planners' ``cudaDeviceGetAttribute`` calls nor see our stand-ins.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import stat
import subprocess
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from pytest_kvprofile.attention.planner import Generation, family_of, generation

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("oracle.cu", "cuda_stubs.cpp")
LIB_NAME = "libkvporacle.so"
DIGEST_NAME = LIB_NAME + ".sha256"
META_NAME = "build.json"
# The headers whose text decides the planners' arithmetic; their digest is part of the cache key.
# Linked so that the library's references to the stub runtime bind inside it, whatever is loaded globally.
LINK_FLAGS = ("-Xlinker", "--no-undefined", "-Xlinker", "-Bsymbolic")
KEY_HEADERS = (
    "flashinfer/attention/scheduler.cuh",
    "flashinfer/allocator.h",
    "flashinfer/utils.cuh",
    "flashinfer/exception.h",
    "flashinfer/attention/heap.h",
)
# A directory of other FlashInfer versions' headers (``scripts/fetch_flashinfer_headers.py`` fills it):
# ``$KVPROFILE_FLASHINFER_HEADERS/<version>/flashinfer/data/include``. Only read, never downloaded into.
HEADERS_ENV = "KVPROFILE_FLASHINFER_HEADERS"
INSTALL_HINT = (
    "install a CUDA compiler: `pip install pytest-kvprofile[nvcc]` (the nvidia-cuda-nvcc wheel), "
    "or put nvcc on PATH, or set CUDA_HOME to a CUDA toolkit"
)


class OracleError(RuntimeError):
    """The oracle could not be built, loaded or queried."""


class OracleUnavailable(OracleError):
    """No CUDA compiler (or no FlashInfer headers): the oracle cannot be built on this machine."""


class OracleBuildError(OracleError):
    """The compiler ran and failed; the message carries the command and its stderr."""

    def __init__(self, message: str, stderr: str = "") -> None:
        super().__init__(message)
        self.stderr = stderr

    @property
    def first_error(self) -> str:
        """The compiler's first ``error`` line (file, line and what), or the first line of its stderr."""
        lines = [ln.strip() for ln in self.stderr.splitlines() if ln.strip()]
        for ln in lines:
            if "error" in ln.lower():
                return ln
        return lines[0] if lines else str(self).splitlines()[0]


class OracleSecurityError(OracleError):
    """A cached library is not owned by this user or is writable by group/others."""


@dataclass(frozen=True)
class FlashInferInstall:
    """Where a FlashInfer keeps its headers, and which planner family its version has.

    ``installed``: the importable package (False: another version's headers, unpacked from its wheel)."""

    version: str
    package_dir: Path
    include_dir: Path
    cccl_dir: Path | None
    installed: bool = True

    @property
    def family(self) -> str:
        return family_of(self.version)

    @property
    def scheduler(self) -> Path:
        return self.include_dir / KEY_HEADERS[0]


@lru_cache(maxsize=1)
def flashinfer_install() -> FlashInferInstall:
    """Locate the installed FlashInfer package and its headers without importing it."""
    spec = importlib.util.find_spec("flashinfer")
    if spec is None or not spec.submodule_search_locations:
        raise OracleUnavailable("flashinfer-python is not installed: `pip install flashinfer-python`")
    pkg = Path(next(iter(spec.submodule_search_locations)))
    try:
        version = importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        version = _version_from_file(pkg)
    return _install_at(pkg, version, installed=True)


def _install_at(pkg: Path, version: str, *, installed: bool) -> FlashInferInstall:
    include = pkg / "data" / "include"
    if not (include / KEY_HEADERS[0]).is_file():
        raise OracleUnavailable(f"FlashInfer {version} at {pkg} ships no {KEY_HEADERS[0]} under {include}")
    cccl = pkg / "data" / "cccl"
    return FlashInferInstall(version, pkg, include, cccl if cccl.is_dir() else None, installed)


def headers_root() -> Path | None:
    """``$KVPROFILE_FLASHINFER_HEADERS`` when set: other FlashInfer versions' unpacked headers, one dir each."""
    root = os.environ.get(HEADERS_ENV)
    return Path(root) if root else None


def cached_versions() -> tuple[str, ...]:
    """The FlashInfer versions whose headers ``$KVPROFILE_FLASHINFER_HEADERS`` holds."""
    root = headers_root()
    if root is None or not root.is_dir():
        return ()
    return tuple(sorted(p.name for p in root.iterdir()
                        if (p / "flashinfer" / "data" / "include" / KEY_HEADERS[0]).is_file()))


def flashinfer_headers(version: str) -> FlashInferInstall:
    """Another FlashInfer version's headers, from ``$KVPROFILE_FLASHINFER_HEADERS/<version>`` (no download)."""
    root = headers_root()
    if root is None:
        raise OracleUnavailable(
            f"FlashInfer {version} is not installed and {HEADERS_ENV} is not set; "
            f"`python scripts/fetch_flashinfer_headers.py {version}` fetches its headers")
    if not (root / version).is_dir():
        raise OracleUnavailable(
            f"FlashInfer {version} is not installed and {HEADERS_ENV}={root} holds no {version}/; "
            f"`python scripts/fetch_flashinfer_headers.py {version}` fetches its headers")
    return _install_at(root / version / "flashinfer", version, installed=False)


def install_for(version: str | None) -> FlashInferInstall:
    """The installed FlashInfer when ``version`` is None or its version, else that version's cached headers."""
    try:
        inst = flashinfer_install()
    except OracleUnavailable:
        if version is None:
            raise
        return flashinfer_headers(version)
    return inst if version in (None, inst.version) else flashinfer_headers(version)


def _version_from_file(pkg: Path) -> str:
    for name in ("_build_meta.py", "version.py"):
        path = pkg / name
        if path.is_file():
            for line in path.read_text().splitlines():
                if "version" in line and "=" in line:
                    return line.split("=", 1)[1].strip().strip("\"'")
    return "0.0.0"


def find_nvcc() -> Path | None:
    """``$CUDA_HOME/bin/nvcc``, then ``nvcc`` on PATH, then the nvidia-cuda-nvcc wheel."""
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home:
        cand = Path(cuda_home) / "bin" / "nvcc"
        if os.access(cand, os.X_OK):
            return cand
    found = shutil.which("nvcc")
    if found:
        return Path(found)
    spec = importlib.util.find_spec("nvidia")
    if spec is not None and spec.submodule_search_locations:
        for base in spec.submodule_search_locations:
            cand = Path(base) / "cuda_nvcc" / "bin" / "nvcc"
            if os.access(cand, os.X_OK):
                return cand
    return None


@lru_cache(maxsize=8)
def _compiler_version(nvcc: str) -> str:
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        raise OracleUnavailable(f"{nvcc} --version failed ({exc}); {INSTALL_HINT}") from None
    if out.returncode != 0:
        raise OracleUnavailable(f"{nvcc} --version failed: {out.stderr.strip()}; {INSTALL_HINT}")
    return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else "unknown"


def cache_root() -> Path:
    """``$KVPROFILE_CACHE_DIR``, else ``${XDG_CACHE_HOME:-~/.cache}/pytest-kvprofile``."""
    override = os.environ.get("KVPROFILE_CACHE_DIR")
    if override:
        return Path(override)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "pytest-kvprofile"


def header_features(install: FlashInferInstall) -> dict[str, bool]:
    """The planner signatures ``scheduler.cuh`` of this install declares (read from its text)."""
    text = install.scheduler.read_text(errors="replace")
    utils = install.include_dir / "flashinfer" / "utils.cuh"
    utils_text = utils.read_text(errors="replace") if utils.is_file() else ""
    return {
        "d512_tiles": "head_dim >= 512" in utils_text,
        "count_only": "PrefillPlanWorkspaceSize(" in text,
        "uniform_q": "int64_t uniform_q_len" in text,
        "fixed_uniform_q": "bool fixed_uniform_q_len" in text,
        "kv_dtype_bytes": "uint32_t kv_dtype_bytes" in text,
        "rows_by_group": "max_partial_rows" in text,
    }


def generation_mismatch(install: FlashInferInstall) -> str | None:
    """Where the headers disagree with the family table of the version (planner.GENERATIONS), or None.

    The oracle compiles against what the headers declare whatever the table says; a mismatch means the
    Python port and the analytic model (which follow the table) would size this version wrongly."""
    gen: Generation = generation(install.family)
    found = header_features(install)
    diff = [f"{k}: headers {v}, table {getattr(gen, k)}" for k, v in found.items() if getattr(gen, k) != v]
    if not diff:
        return None
    return f"FlashInfer {install.version} (family {install.family}): " + "; ".join(diff)


def _abi_flags(install: FlashInferInstall) -> list[str]:
    feats = header_features(install)
    return [f"-DKVP_HAS_COUNT_ONLY={int(feats['count_only'])}",
            f"-DKVP_HAS_UNIFORM_Q={int(feats['uniform_q'])}",
            f"-DKVP_HAS_FIXED_UNIFORM_Q={int(feats['fixed_uniform_q'])}",
            f"-DKVP_HAS_KV_DTYPE_BYTES={int(feats['kv_dtype_bytes'])}"]


def count_only(install: FlashInferInstall) -> bool:
    """Whether ``PrefillPlanWorkspaceSize`` exists (0.6.15+); without it the oracle materializes every plan."""
    return header_features(install)["count_only"]


def build_key(install: FlashInferInstall, nvcc: Path) -> str:
    """Digest of everything that decides the library's behaviour."""
    h = hashlib.sha256()
    h.update(install.version.encode())
    for rel in KEY_HEADERS:
        path = install.include_dir / rel
        if path.is_file():
            h.update(rel.encode())
            h.update(path.read_bytes())
    h.update(_compiler_version(str(nvcc)).encode())
    for name in SOURCES:
        h.update((CSRC / name).read_bytes())
    h.update(" ".join((*_abi_flags(install), *LINK_FLAGS)).encode())
    return f"fi{install.version}-{h.hexdigest()[:16]}"


def _mkdir_private(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid():
        raise OracleSecurityError(
            f"refusing to use {path}: owned by uid {st.st_uid}, not by this user ({os.getuid()})")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o700)


def sha256(path: Path) -> str:
    """Hex digest of a file (the sidecar a library is checked against before loading)."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_owner_mode(path: Path) -> None:
    """Refuse a file another user owns or that group/others may write (it is about to be dlopen'ed)."""
    st = path.stat()
    if st.st_uid != os.getuid():
        raise OracleSecurityError(
            f"refusing to load {path}: owned by uid {st.st_uid}, not by this user ({os.getuid()})")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise OracleSecurityError(
            f"refusing to load {path}: writable by group/others (mode {stat.filemode(st.st_mode)}); "
            f"remove it or `chmod go-w` it")


def _valid_build(keydir: Path) -> bool:
    lib, digest = keydir / LIB_NAME, keydir / DIGEST_NAME
    if not lib.is_file() or not digest.is_file():
        return False
    check_owner_mode(keydir)
    check_owner_mode(lib)
    return digest.read_text().strip() == sha256(lib)


def _compile(install: FlashInferInstall, nvcc: Path, workdir: Path) -> tuple[Path, list[str]]:
    includes = []
    if install.cccl_dir is not None:
        for sub in ("libcudacxx/include", "cub", "thrust"):
            if (install.cccl_dir / sub).is_dir():
                includes.append(f"-I{install.cccl_dir / sub}")
    includes.append(f"-I{install.include_dir}")
    common = ["-std=c++17", "-O2", "-Xcompiler", "-fPIC", *_abi_flags(install)]
    steps = [
        [str(nvcc), *common, "-cudart", "none", *includes, "-c", str(CSRC / "oracle.cu"),
         "-o", str(workdir / "oracle.o")],
        [str(nvcc), *common, "-c", str(CSRC / "cuda_stubs.cpp"), "-o", str(workdir / "stubs.o")],
        [str(nvcc), "-shared", "-cudart", "none", str(workdir / "oracle.o"),
         str(workdir / "stubs.o"), *LINK_FLAGS, "-o", str(workdir / LIB_NAME)],
    ]
    for cmd in steps:
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, cwd=workdir, timeout=900)
        except OSError as exc:
            raise OracleUnavailable(f"cannot run {cmd[0]} ({exc}); {INSTALL_HINT}") from None
        if res.returncode != 0:
            raise OracleBuildError(
                f"building the FlashInfer host oracle failed (exit {res.returncode}).\n"
                f"command: {' '.join(cmd)}\nstderr:\n{res.stderr.strip()}", res.stderr)
    return workdir / LIB_NAME, steps[0]


def _build_into(root: Path, keydir: Path, install: FlashInferInstall, nvcc: Path) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    try:
        os.chmod(tmp, 0o700)
        t0 = time.perf_counter()
        lib, cmd = _compile(install, nvcc, tmp)
        elapsed = time.perf_counter() - t0
        os.chmod(lib, 0o600)
        (tmp / DIGEST_NAME).write_text(sha256(lib) + "\n")
        (tmp / META_NAME).write_text(json.dumps({
            "flashinfer_version": install.version,
            "compiler": str(nvcc),
            "compiler_version": _compiler_version(str(nvcc)),
            "command": cmd,
            "build_seconds": round(elapsed, 3),
            "built_at": time.time(),
            "pid": os.getpid(),
        }, indent=1))
        for name in ("oracle.o", "stubs.o"):
            (tmp / name).unlink(missing_ok=True)
        if keydir.exists():
            shutil.rmtree(keydir)
        os.rename(tmp, keydir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def ensure_built(force: bool = False, install: FlashInferInstall | None = None) -> Path:
    """Path of a verified oracle library, building it (once, under a lock) if needed.

    ``install``: whose headers to compile (default: the installed FlashInfer)."""
    install = install or flashinfer_install()
    nvcc = find_nvcc()
    if nvcc is None:
        raise OracleUnavailable(f"no CUDA compiler found for the FlashInfer host oracle; {INSTALL_HINT}")
    root = cache_root() / "oracle"
    _mkdir_private(root)
    keydir = root / build_key(install, nvcc)
    if not force and _valid_build(keydir):
        return keydir / LIB_NAME
    with open(root / (keydir.name + ".lock"), "a+") as lockf:
        os.chmod(lockf.name, 0o600)
        fcntl.flock(lockf, fcntl.LOCK_EX)
        try:
            if force or not _valid_build(keydir):
                _build_into(root, keydir, install, nvcc)
        finally:
            fcntl.flock(lockf, fcntl.LOCK_UN)
    if not _valid_build(keydir):
        raise OracleError(f"oracle library in {keydir} failed verification right after its build")
    return keydir / LIB_NAME


def is_built(install: FlashInferInstall | None = None) -> bool:
    """Whether a verified oracle library for ``install`` is in the cache already (no build; False without nvcc)."""
    install = install or flashinfer_install()
    nvcc = find_nvcc()
    return nvcc is not None and _valid_build(cache_root() / "oracle" / build_key(install, nvcc))


def build_info(lib_path: Path) -> dict[str, object]:  # parsed JSON (strings, numbers, a list)
    """The build sidecar (compiler, command, build time) of a built library."""
    meta = lib_path.parent / META_NAME
    return json.loads(meta.read_text()) if meta.is_file() else {}
