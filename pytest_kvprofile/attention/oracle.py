"""The host oracle: FlashInfer's own planners, compiled for the CPU, called through ctypes.

Why: ``plan()`` on the installed FlashInfer is the authority on the bytes a workspace needs; this
module asks the library ``oracle_build.py`` compiles from its planner headers, for any SM count.
The library is loaded privately (``RTLD_LOCAL``) and its stub CUDA runtime is hidden and bound
inside it, so a real ``libcudart`` loaded globally first (a CUDA torch) cannot answer for it.

The build/cache names (``ensure_built``, ``cache_root``, ``flashinfer_install``, the errors) are
re-exported here so callers keep one import.
"""

from __future__ import annotations

import ctypes
import os
import threading
from array import array
from itertools import accumulate
from pathlib import Path
from typing import Sequence

from pytest_kvprofile.attention.oracle_build import (
    DIGEST_NAME,
    INSTALL_HINT,
    LIB_NAME,
    FlashInferInstall,
    OracleBuildError,
    OracleError,
    OracleSecurityError,
    OracleUnavailable,
    build_info,
    cache_root,
    check_owner_mode,
    count_only,
    ensure_built,
    find_nvcc,
    flashinfer_install,
    sha256,
)

__all__ = [
    "DIGEST_NAME",
    "LIB_NAME",
    "FlashInferInstall",
    "Oracle",
    "OracleBuildError",
    "OracleError",
    "OracleSecurityError",
    "OracleUnavailable",
    "build_info",
    "cache_root",
    "ensure_built",
    "flashinfer_install",
    "get_oracle",
    "indptrs",
    "oracle_available",
]

# Private load: the library's symbols never join the global scope other libraries resolve against.
LOAD_MODE = os.RTLD_LOCAL | os.RTLD_NOW

_u64 = ctypes.c_uint64
_vp = ctypes.c_void_p


class Oracle:
    """ctypes binding of one loaded oracle library. Not thread-safe: one per thread."""

    def __init__(self, lib_path: Path, install: FlashInferInstall) -> None:
        self.path = lib_path
        self.install = install
        self.version = install.version
        self.family = install.family
        self.materializes = not count_only(install)  # <= 0.6.14 has no count-only planner
        digest = (lib_path.parent / DIGEST_NAME).read_text().strip()
        check_owner_mode(lib_path)
        if sha256(lib_path) != digest:
            raise OracleError(f"{lib_path} changed after verification; refusing to load it")
        lib = ctypes.CDLL(str(lib_path), mode=LOAD_MODE)
        lib.kvp_set_device.argtypes = [ctypes.c_int] * 4
        lib.kvp_set_device.restype = None
        lib.kvp_last_error.restype = ctypes.c_char_p
        c_int, c_i64 = ctypes.c_int, ctypes.c_int64
        lib.kvp_prefill_plan_size.argtypes = [
            _vp, _vp, c_int, c_int, c_int, c_int, c_int, c_int, c_int, c_int, c_int, c_int, c_i64,
            c_int, c_int, _vp, _u64, _vp, _u64, _vp, _vp, _vp, c_int]
        lib.kvp_prefill_plan_size.restype = c_int
        lib.kvp_decode_plan_size.argtypes = [
            _vp, c_int, c_int, c_int, c_int, c_int, c_int, c_int, c_int, c_int, _vp, _u64, _vp,
            _u64, _vp, _vp, _vp]
        lib.kvp_decode_plan_size.restype = c_int
        self._lib = lib
        self._f = _u64()
        self._i = _u64()
        self._fp = ctypes.addressof(self._f)
        self._ip = ctypes.addressof(self._i)
        self._info = (ctypes.c_int64 * 15)()
        self._device: tuple[int, int, int, int] | None = None
        self._scratch: dict[str, ctypes.Array[ctypes.c_char]] = {}

    def set_device(self, num_sm: int, cc_major: int = 9, cc_minor: int = 0,
                   smem_optin: int = 101376) -> None:
        """What the stubbed runtime reports: SM count, compute capability, opt-in smem per block."""
        dev = (num_sm, cc_major, cc_minor, smem_optin)
        if dev != self._device:
            self._lib.kvp_set_device(*dev)
            self._device = dev

    def _error(self) -> OracleError:
        msg = self._lib.kvp_last_error()
        return OracleError(msg.decode(errors="replace") if msg else "oracle call failed")

    def _buffer(self, name: str, size: int) -> tuple[int, int]:
        buf = self._scratch.get(name)
        if buf is None or len(buf) < size:
            buf = (ctypes.c_char * size)()
            self._scratch[name] = buf
        return ctypes.addressof(buf), len(buf)

    def prefill_raw(self, qo_indptr: array[int], kv_indptr: array[int], heads_q: int, heads_kv: int,
                    head_dim_qk: int, head_dim_vo: int, page_size: int, cuda_graph: bool,
                    uniform_q_len: int = 0, fixed_uniform_q_len: bool = False,
                    materialize: bool = False, float_capacity: int = 1 << 40,
                    int_capacity: int = 1 << 24, kv_dtype_bytes: int = 2) -> tuple[int, int]:
        """One ``PrefillPlan`` sizing. ``qo_indptr`` (tokens) and ``kv_indptr`` (pages) are
        ``array('i')`` buffers passed by address, so a hot loop allocates nothing per call.
        ``kv_dtype_bytes``: ``sizeof(DTypeKV)``, which FlashInfer's JIT module passes to the planner."""
        n = len(qo_indptr) - 1
        fptr = iptr = None
        fcap = icap = 0
        if materialize:
            fcap = float_capacity
            iptr, icap = self._buffer("int", int_capacity)
        rc = self._lib.kvp_prefill_plan_size(
            qo_indptr.buffer_info()[0], kv_indptr.buffer_info()[0], n, heads_q, heads_kv,
            head_dim_qk, head_dim_vo, page_size, int(cuda_graph), -1, 0, 0, uniform_q_len,
            int(fixed_uniform_q_len), int(materialize), fptr, fcap, iptr, icap, self._fp,
            self._ip, ctypes.addressof(self._info), kv_dtype_bytes)
        if rc:
            raise self._error()
        return self._f.value, self._i.value

    def prefill(self, qo_lens: Sequence[int], kv_lens: Sequence[int], *, heads_q: int,
                heads_kv: int, head_dim: int, head_dim_vo: int | None = None, page_size: int,
                cuda_graph: bool, uniform_q_len: int = 0, fixed_uniform_q_len: bool = False,
                materialize: bool | None = None, kv_dtype_bytes: int = 2) -> tuple[int, int]:
        """Float and int bytes the installed planner carves for a batch (kv_lens in tokens)."""
        qo, kv = indptrs(qo_lens, kv_lens, page_size)
        if materialize is None:
            materialize = self.materializes
        return self.prefill_raw(qo, kv, heads_q, heads_kv, head_dim, head_dim_vo or head_dim,
                                page_size, cuda_graph, uniform_q_len, fixed_uniform_q_len,
                                materialize, kv_dtype_bytes=kv_dtype_bytes)

    def decode(self, kv_lens: Sequence[int], *, heads_q: int, heads_kv: int, head_dim: int,
               page_size: int, cuda_graph: bool, blocks_per_sm: int, num_sm: int,
               materialize: bool | None = None) -> tuple[int, int]:
        """CUDA-core ``DecodePlan`` sizes with the kernel occupancy given as blocks_per_sm."""
        kv = array("i", accumulate((-(-k // page_size) for k in kv_lens), initial=0))
        if materialize is None:
            materialize = self.materializes
        fptr = iptr = None
        fcap = icap = 0
        if materialize:
            fcap = 1 << 40
            iptr, icap = self._buffer("int", 1 << 24)
        rc = self._lib.kvp_decode_plan_size(
            kv.buffer_info()[0], len(kv_lens), heads_q, heads_kv, head_dim, page_size,
            int(cuda_graph), blocks_per_sm, num_sm, int(materialize), fptr, fcap, iptr, icap,
            self._fp, self._ip, None)
        if rc:
            raise self._error()
        return self._f.value, self._i.value


def indptrs(qo_lens: Sequence[int], kv_lens: Sequence[int], page_size: int) -> tuple[array[int], array[int]]:
    """``array('i')`` qo (tokens) and kv (pages) indptrs, as FlashInfer's paged wrappers pass them."""
    if len(qo_lens) != len(kv_lens) or not qo_lens:
        raise ValueError("qo_lens and kv_lens must be non-empty and of equal length")
    qo = array("i", accumulate(qo_lens, initial=0))
    kv = array("i", accumulate((-(-k // page_size) for k in kv_lens), initial=0))
    return qo, kv


_local = threading.local()


def get_oracle(install: FlashInferInstall | None = None) -> Oracle:
    """This thread's oracle for ``install`` (default: the installed FlashInfer), building/loading it on first
    use (raises OracleUnavailable, or OracleBuildError when the compiler fails on these headers)."""
    install = install or flashinfer_install()
    cache: dict[tuple[str, Path], Oracle] = getattr(_local, "oracles", None) or {}
    _local.oracles = cache
    key = (str(cache_root()), install.include_dir)
    cached = cache.get(key)
    if cached is not None and cached.path.is_file():
        return cached
    path = ensure_built(install=install)
    oracle = cache[key] = Oracle(path, install)
    return oracle


def oracle_available() -> tuple[bool, str]:
    """(True, where) when the oracle is or can be built here; (False, why + how to fix) otherwise."""
    try:
        install = flashinfer_install()
    except OracleUnavailable as exc:
        return False, str(exc)
    nvcc = find_nvcc()
    if nvcc is None:
        return False, f"no CUDA compiler found; {INSTALL_HINT}"
    return True, f"nvcc at {nvcc}; FlashInfer {install.version} headers at {install.include_dir}"
