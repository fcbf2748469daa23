"""Host modules for FlashInfer's batch prefill/decode JIT loaders on the simulated device.

Why: a wrapper's ``plan()`` carves its float and int workspaces and writes the plan info into the
int workspace; on a CPU-only machine that code never runs, so a float workspace too small for a batch
and the plan's own allocations stay invisible. Under ``simulated_gpu`` the loaders
(``get_batch_prefill_module``, ``get_batch_decode_module``) return the modules built here: ``plan`` is
FlashInfer's own ``PrefillPlan``/``DecodePlan`` from the installed wheel's headers, compiled for the
host into the sizing oracle's library (``csrc/oracle.cu``; same cache, lock and digest rules,
``oracle_build.py``), run on the simulated tensors' host memory for the simulated GPU's SM count. Its
errors are FlashInfer's own ("Buffer overflow when allocating memory for ... Increase the workspace
buffer size."). ``run`` is a float32 reference on the paged KV cache (GQA, causal mask, sliding
window, soft cap); what it does not model raises :class:`SimulatedDeviceUnsupported`.

The batch MLA loader (``get_batch_mla_module``, FA2/FA3) is served the same way: ``plan`` is ``MLAPlan``,
wrapped in FlashInfer's own ``_BatchMLAModuleProxy`` so the planned work lists are staged into the int
workspace as on the GPU; its ``run`` raises :class:`SimulatedDeviceUnsupported` naming MLA run.

The CUDA-core decode planner asks the driver for its kernel's occupancy; here it is the bound the
sizing model uses (``planner.decode_blocks_per_sm_bound``), so plan and sizing agree.
"""

from __future__ import annotations

import ctypes
import math
import sys
import threading
from types import FrameType, SimpleNamespace
from typing import TYPE_CHECKING, Any, Callable, NoReturn, Protocol, Sequence, TypeAlias

from pytest_kvprofile.attention.oracle import LOAD_MODE, get_oracle
from pytest_kvprofile.attention.planner import decode_blocks_per_sm_bound
from pytest_kvprofile.attention.reference import attend
from pytest_kvprofile.matrix.gpus import smem_optin_for

if TYPE_CHECKING:
    from pathlib import Path

    from torch import Tensor

# an argument of FlashInfer's JIT module loaders (dtypes, head dims, flags), read by position as FlashInfer passes it
ModuleArg: TypeAlias = Any

__all__ = ["HostPlanError", "HostPlanner", "PlanDevice", "SimulatedDeviceUnsupported", "decode_loader",
           "get_host_planner", "mla_loader", "prefill_loader"]

_INFO_CAP = 64
_vp = ctypes.c_void_p
_i64 = ctypes.c_int64
_u64 = ctypes.c_uint64
_int = ctypes.c_int


class HostPlanError(RuntimeError):
    """FlashInfer's planner raised on the host (its message is FlashInfer's own)."""


class SimulatedDeviceUnsupported(NotImplementedError):
    """A FlashInfer module or kernel that has no host implementation on the simulated device.

    Defined here, where the host modules raise it, and named by ``memory/simulated_gpu.py`` too: sizing sits below
    the device model and imports nothing of it."""


class PlanDevice(Protocol):
    """What a host module reads of the simulated device it plans for (``memory/device.py``'s ``SimDevice``)."""

    num_sm: int
    compute_capability: tuple[int, int]


def _unsupported(what: str) -> Exception:
    return SimulatedDeviceUnsupported(f"{what} is not supported on the simulated device "
                                      "(pytest_kvprofile.attention.host_plan)")


class HostPlanner:
    """ctypes binding of the host ``plan()`` entry points of the oracle library."""

    def __init__(self, lib_path: Path | str) -> None:
        lib = ctypes.CDLL(str(lib_path), mode=LOAD_MODE)
        lib.kvp_last_error.restype = ctypes.c_char_p
        lib.kvp_host_prefill_plan.argtypes = [
            _vp, _u64, _vp, _vp, _u64, _vp, _vp, _i64, _i64, _i64, _i64, _i64, _int, _i64, _i64, _i64,
            _i64, _int, _i64, _i64, _int, _int, _int, _int, _int, _vp, _int, _vp, _int]
        lib.kvp_host_prefill_plan.restype = _int
        lib.kvp_host_decode_plan.argtypes = [
            _vp, _u64, _vp, _vp, _u64, _vp, _i64, _i64, _i64, _i64, _int, _i64, _int, _int, _int, _int, _int,
            _vp, _int, _vp]
        lib.kvp_host_decode_plan.restype = _int
        lib.kvp_host_mla_plan.argtypes = [
            _vp, _u64, _vp, _vp, _u64, _vp, _vp, _vp, _i64, _i64, _i64, _int, _int, _int, _int, _int, _vp, _int,
            _vp, _vp]
        lib.kvp_host_mla_plan.restype = _int
        self._staged = _u64()
        self._lib = lib
        self._info = (_i64 * _INFO_CAP)()
        self._len = _int()

    def _result(self, rc: int) -> list[int]:
        if rc:
            msg = self._lib.kvp_last_error()
            raise HostPlanError(msg.decode(errors="replace") if msg else "host plan failed")
        return list(self._info[: self._len.value])

    def prefill(self, float_ptr: int, float_size: int, int_ptr: int, pinned_ptr: int, int_size: int,
                qo_indptr_ptr: int, kv_indptr_ptr: int, total_num_rows: int, batch_size: int, heads_q: int,
                heads_kv: int, page_size: int, cuda_graph: bool, head_dim_qk: int, head_dim_vo: int,
                window_left: int, fixed_split_size: int, disable_split_kv: bool, num_colocated_ctas: int,
                uniform_q_len: int, fixed_uniform_q_len: bool, device: tuple[int, int, int, int],
                kv_dtype_bytes: int = 2) -> list[int]:
        """``PrefillPlan`` on host buffers; returns ``PrefillPlanInfo::ToVector()``."""
        rc = self._lib.kvp_host_prefill_plan(
            float_ptr, float_size, int_ptr, pinned_ptr, int_size, qo_indptr_ptr, kv_indptr_ptr, total_num_rows,
            batch_size, heads_q, heads_kv, page_size, int(cuda_graph), head_dim_qk, head_dim_vo, window_left,
            fixed_split_size, int(disable_split_kv), num_colocated_ctas, uniform_q_len, int(fixed_uniform_q_len),
            *device, ctypes.addressof(self._info), _INFO_CAP, ctypes.addressof(self._len), kv_dtype_bytes)
        return self._result(rc)

    def decode(self, float_ptr: int, float_size: int, int_ptr: int, pinned_ptr: int, int_size: int,
               indptr_ptr: int, batch_size: int, heads_q: int, heads_kv: int, page_size: int, cuda_graph: bool,
               head_dim: int, blocks_per_sm: int, device: tuple[int, int, int, int]) -> list[int]:
        """CUDA-core ``DecodePlan`` on host buffers; returns ``DecodePlanInfo::ToVector()``."""
        num_sm = device[0]
        rc = self._lib.kvp_host_decode_plan(
            float_ptr, float_size, int_ptr, pinned_ptr, int_size, indptr_ptr, batch_size, heads_q, heads_kv,
            page_size, int(cuda_graph), head_dim, blocks_per_sm, num_sm, *device[1:],
            ctypes.addressof(self._info), _INFO_CAP, ctypes.addressof(self._len))
        return self._result(rc)

    def mla(self, float_ptr: int, float_size: int, int_ptr: int, pinned_ptr: int, int_size: int,
            qo_indptr_ptr: int, kv_indptr_ptr: int, kv_len_ptr: int, batch_size: int, num_heads: int,
            head_dim_o: int, causal: bool, device: tuple[int, int, int, int]) -> tuple[list[int], int]:
        """``MLAPlan`` on host buffers; returns ``(MLAPlanInfo::ToVector(), staged int workspace bytes)``."""
        rc = self._lib.kvp_host_mla_plan(
            float_ptr, float_size, int_ptr, pinned_ptr, int_size, qo_indptr_ptr, kv_indptr_ptr, kv_len_ptr,
            batch_size, num_heads, head_dim_o, int(causal), *device, ctypes.addressof(self._info), _INFO_CAP,
            ctypes.addressof(self._len), ctypes.addressof(self._staged))
        return self._result(rc), int(self._staged.value)


_local = threading.local()


def get_host_planner() -> HostPlanner:
    """This thread's planner, building the oracle library on first use (raises OracleUnavailable)."""
    oracle = get_oracle()
    cached: tuple[Path, HostPlanner] | None = getattr(_local, "planner", None)
    if cached is not None and cached[0] == oracle.path:
        return cached[1]
    planner = HostPlanner(oracle.path)
    _local.planner = (oracle.path, planner)
    return planner


# (the device planned on, route, float workspace, graph, int workspace, the wrapper whose plan() it is or None)
PlanObserver = Callable[[PlanDevice, str, "Tensor", bool, "Tensor", object], None]
_plan_observers: list[PlanObserver] = []


def observe_plans(callback: PlanObserver) -> Callable[[], None]:
    """Call ``callback(device, route, float_workspace, cuda_graph, int_workspace, wrapper)`` for every ``plan()``
    served from now on; the returned function stops it. ``route`` is the wrapper's (``prefill``, ``decode``, ``mla``):
    a tensor-core decode wrapper plans with the prefill module but is a decode route; ``wrapper`` is the FlashInfer
    wrapper object whose ``plan()`` it is (None when none is found). Why: the workspace checks size the routes a
    builder's wrappers really plan, into the float and int buffers they really plan into, wrapper by wrapper."""
    _plan_observers.append(callback)

    def stop() -> None:
        if callback in _plan_observers:
            _plan_observers.remove(callback)

    return stop


def _note_plan(device: PlanDevice, module_route: str, float_ws: Tensor, cuda_graph: bool, int_ws: Tensor) -> None:
    if not _plan_observers:
        return
    frame: FrameType | None
    wrapper: object = None
    route, frame = module_route, sys._getframe(2)
    for _ in range(8):  # the wrapper whose plan() called the module: its class names the route
        if frame is None:
            break
        kind = type(frame.f_locals.get("self")).__name__
        if "Decode" in kind or "Prefill" in kind or "MLA" in kind:
            route = "decode" if "Decode" in kind else "mla" if "MLA" in kind else "prefill"
            wrapper = frame.f_locals.get("self")
            break
        frame = frame.f_back
    for callback in tuple(_plan_observers):
        callback(device, route, float_ws, bool(cuda_graph), int_ws, wrapper)


def _device_tuple(device: PlanDevice) -> tuple[int, int, int, int]:
    cc = tuple(device.compute_capability)
    return (device.num_sm, cc[0], cc[1], smem_optin_for(cc))  # type: ignore[arg-type]


def _nbytes(t: Tensor) -> int:
    return int(t.numel()) * int(t.element_size())


def _host_int32(t: Tensor, what: str) -> Tensor:
    import torch

    if t.dtype != torch.int32:
        raise _unsupported(f"{what} of dtype {t.dtype} (the host planner takes int32 indptrs)")
    return t.contiguous()


def prefill_loader(device: PlanDevice) -> Callable[..., SimpleNamespace]:
    """Stands in for ``flashinfer.prefill.get_batch_prefill_module(backend, *args)``."""
    cache: dict[tuple[object, ...], SimpleNamespace] = {}

    def get_batch_prefill_module(backend: str, *args: ModuleArg) -> SimpleNamespace:
        key = (backend, *args)
        if key not in cache:
            if backend != "fa2":
                raise _unsupported(f"FlashInfer batch prefill backend {backend!r} (only 'fa2' has a host planner)")
            cache[key] = _prefill_module(device, args)
        return cache[key]

    return get_batch_prefill_module


def decode_loader(device: PlanDevice) -> Callable[..., SimpleNamespace]:
    """Stands in for ``flashinfer.decode.get_batch_decode_module(*args)``."""
    cache: dict[tuple[object, ...], SimpleNamespace] = {}

    def get_batch_decode_module(*args: ModuleArg) -> SimpleNamespace:
        if args not in cache:
            cache[args] = _decode_module(device, args)
        return cache[args]

    return get_batch_decode_module


def mla_loader(device: PlanDevice) -> Callable[..., object]:
    """Stands in for ``flashinfer.mla``'s ``get_batch_mla_module(backend, dtype_q, dtype_kv, dtype_o, dtype_idx,
    head_dim_ckv, head_dim_kpe, use_profiler)``: the generated FA2/FA3 backends plan with the same ``MLAPlan``
    (``batch_mla_plan.cu``, ``batch_mla_sm90_plan.cu``); their ``run`` has no host implementation."""
    cache: dict[tuple[object, ...], object] = {}

    def get_batch_mla_module(backend: str, *args: ModuleArg) -> object:
        key = (backend, *args)
        if key not in cache:
            if backend not in ("fa2", "fa3"):
                raise _unsupported(f"FlashInfer batch MLA backend {backend!r} (only 'fa2'/'fa3' have a host planner)")
            cache[key] = _mla_module(device, backend)
        return cache[key]

    return get_batch_mla_module


def _mla_module(device: PlanDevice, backend: str) -> object:
    dev = _device_tuple(device)

    def plan(float_ws: Tensor, int_ws: Tensor, pinned_ws: Tensor, qo_indptr: Tensor, kv_indptr: Tensor, kv_len: Tensor,
             num_heads: int, head_dim_o: int, causal: bool) -> tuple[list[int], int]:
        qo = _host_int32(qo_indptr, "qo_indptr")
        kv = _host_int32(kv_indptr, "kv_indptr")
        lens = _host_int32(kv_len, "kv_len")
        if qo.numel() < lens.numel() + 1 or kv.numel() < lens.numel() + 1:
            raise ValueError("MLA plan needs qo_indptr and kv_indptr of at least len(kv_len) + 1 entries")
        try:
            _note_plan(device, "mla", float_ws, True, int_ws)
            return get_host_planner().mla(
                float_ws.data_ptr(), _nbytes(float_ws), int_ws.data_ptr(), pinned_ws.data_ptr(), _nbytes(int_ws),
                qo.data_ptr(), kv.data_ptr(), lens.data_ptr(), int(lens.numel()), int(num_heads), int(head_dim_o),
                bool(causal), dev)
        except HostPlanError as exc:
            raise RuntimeError(str(exc)) from None

    def run(*args: object, **kwargs: object) -> NoReturn:
        raise _unsupported(f"FlashInfer batch MLA run() ({backend!r}; its plan() is served)")

    raw = SimpleNamespace(plan=plan, run=run)
    proxy: Callable[[SimpleNamespace], object] | None  # the adapter class, None on a FlashInfer without one
    try:  # FlashInfer's own adapter stages the planned work lists from the pinned buffer into the int workspace
        from flashinfer.jit.attention.modules import _BatchMLAModuleProxy
        proxy = _BatchMLAModuleProxy
    except ImportError:
        proxy = None
    if proxy is None:
        return SimpleNamespace(plan=lambda *a: plan(*a)[0], plan_with_staged_workspace_bytes=plan, run=run)
    return proxy(raw)


def _prefill_module(device: PlanDevice, module_args: Sequence[ModuleArg]) -> SimpleNamespace:
    pos_encoding = int(module_args[6]) if len(module_args) > 6 else 0
    kv_bytes = _kv_dtype_bytes(module_args)
    dev = _device_tuple(device)

    def plan(float_ws: Tensor, int_ws: Tensor, pinned_ws: Tensor, qo_indptr: Tensor, kv_indptr: Tensor, kv_lens: Tensor,
             total_num_rows: int, batch_size: int, heads_q: int, heads_kv: int, page_size: int, cuda_graph: bool,
             head_dim_qk: int, head_dim_vo: int, causal: bool, window_left: int, fixed_split_size: int = -1,
             disable_split_kv: bool = False, num_colocated_ctas: int = 0, uniform_q_len: int = 0,
             fixed_uniform_q_len: bool = False) -> list[int]:
        qo = _host_int32(qo_indptr, "qo_indptr")
        kv = _host_int32(kv_indptr, "kv_indptr")
        try:
            _note_plan(device, "prefill", float_ws, cuda_graph, int_ws)
            return get_host_planner().prefill(
                float_ws.data_ptr(), _nbytes(float_ws), int_ws.data_ptr(), pinned_ws.data_ptr(), _nbytes(int_ws),
                qo.data_ptr(), kv.data_ptr(), int(total_num_rows), int(batch_size), int(heads_q), int(heads_kv),
                int(page_size), bool(cuda_graph), int(head_dim_qk), int(head_dim_vo), int(window_left),
                int(fixed_split_size), bool(disable_split_kv), int(num_colocated_ctas), int(uniform_q_len),
                bool(fixed_uniform_q_len), dev, kv_bytes)
        except HostPlanError as exc:
            raise RuntimeError(str(exc)) from None

    def paged_run(float_ws: Tensor, int_ws: Tensor, plan_info: object, q: Tensor, k_cache: Tensor, v_cache: Tensor,
                  qo_indptr: Tensor, kv_indptr: Tensor, kv_indices: Tensor, last_page_len: Tensor, o: Tensor,
                  lse: Tensor | None, mask_mode: int, layout: int, window_left: int, enable_pdl: bool,
                  custom_mask: Tensor | None = None, mask_indptr: Tensor | None = None, alibi: Tensor | None = None,
                  prefix_len: Tensor | None = None, token_pos: Tensor | None = None,
                  max_item_len: Tensor | None = None, logits_soft_cap: float = 0.0, sm_scale: float | None = None,
                  *rest: object) -> Tensor:
        if custom_mask is not None or prefix_len is not None or token_pos is not None:
            raise _unsupported("a custom mask or prefix/item positions in run()")
        if pos_encoding:
            raise _unsupported(f"pos_encoding_mode {pos_encoding} in run()")
        paged_reference(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, last_page_len, o, lse,
                        causal=mask_mode == 1, layout=layout, window_left=window_left,
                        logits_soft_cap=logits_soft_cap, sm_scale=sm_scale)
        return o

    def ragged_run(*args: object, **kwargs: object) -> NoReturn:
        raise _unsupported("run() of the ragged prefill wrapper (its plan() is served)")

    def workspace_size(*args: object, **kwargs: object) -> NoReturn:
        raise _unsupported("workspace_size() (use pytest_kvprofile.sizing.for_case)")

    def prewarm(variant: str = "independent") -> None:
        return None

    return SimpleNamespace(plan=plan, workspace_size=workspace_size, ragged_run=ragged_run, paged_run=paged_run,
                           prewarm_paged_kv_stride_variant=prewarm)


def _kv_dtype_bytes(module_args: Sequence[ModuleArg]) -> int:
    """``sizeof(DTypeKV)`` of the module FlashInfer asked for: its arguments are (q, kv, o dtypes, ...), as
    ``get_batch_prefill_module`` receives them; the JIT module passes it to the planner."""
    kv = module_args[1] if len(module_args) > 1 else None
    return int(getattr(kv, "itemsize", 2)) or 2


def _decode_module(device: PlanDevice, module_args: Sequence[ModuleArg]) -> SimpleNamespace:
    pos_encoding = int(module_args[6]) if len(module_args) > 6 else 0
    dev = _device_tuple(device)

    def plan(float_ws: Tensor, int_ws: Tensor, pinned_ws: Tensor, indptr: Tensor, batch_size: int, heads_q: int,
             heads_kv: int, page_size: int, cuda_graph: bool, window_left: int, logits_soft_cap: float,
             head_dim_qk: int, head_dim_vo: int, empty_q: Tensor | None = None,
             empty_kv: Tensor | None = None) -> list[int]:
        if head_dim_qk != head_dim_vo:
            raise RuntimeError("CUDA cores template only supports equal head dim for QK and VO, please use tensor "
                               "cores template for different head dim")
        kv = _host_int32(indptr, "indptr")
        kv_bytes = int(empty_kv.element_size()) if empty_kv is not None else 2
        group = int(heads_q) // max(int(heads_kv), 1)
        blocks = decode_blocks_per_sm_bound(int(head_dim_qk), group, dev[1], kv_bytes)
        try:
            _note_plan(device, "decode", float_ws, cuda_graph, int_ws)
            return get_host_planner().decode(
                float_ws.data_ptr(), _nbytes(float_ws), int_ws.data_ptr(), pinned_ws.data_ptr(), _nbytes(int_ws),
                kv.data_ptr(), int(batch_size), int(heads_q), int(heads_kv), int(page_size), bool(cuda_graph),
                int(head_dim_qk), blocks, dev)
        except HostPlanError as exc:
            raise RuntimeError(str(exc)) from None

    def run(float_ws: Tensor, int_ws: Tensor, plan_info: object, q: Tensor, k_cache: Tensor, v_cache: Tensor,
            kv_indptr: Tensor, kv_indices: Tensor, last_page_len: Tensor, o: Tensor, lse: Tensor | None, layout: int,
            window_left: int, enable_pdl: bool, alibi: Tensor | None = None, logits_soft_cap: float = 0.0,
            sm_scale: float | None = None, *rest: object) -> Tensor:
        if pos_encoding:
            raise _unsupported(f"pos_encoding_mode {pos_encoding} in run()")
        import torch

        qo_indptr = torch.arange(q.shape[0] + 1, dtype=torch.int32)
        paged_reference(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, last_page_len, o, lse,
                        causal=False, layout=layout, window_left=window_left, logits_soft_cap=logits_soft_cap,
                        sm_scale=sm_scale)
        return o

    def workspace_size(*args: object, **kwargs: object) -> NoReturn:
        raise _unsupported("workspace_size() (use pytest_kvprofile.sizing.for_case)")

    return SimpleNamespace(plan=plan, workspace_size=workspace_size, run=run)


def paged_reference(q: Tensor, k_cache: Tensor, v_cache: Tensor, qo_indptr: Tensor, kv_indptr: Tensor,
                    kv_indices: Tensor, last_page_len: Tensor, o: Tensor, lse: Tensor | None, *, causal: bool,
                    layout: int, window_left: int,
                    logits_soft_cap: float, sm_scale: float | None) -> None:
    """Float32 attention over a paged KV cache into ``o`` (NHD layout 0, HND layout 1), request by request through
    ``reference.attend``, the one reference both tiers use."""
    if lse is not None:
        raise _unsupported("return_lse in run()")
    qo = [int(x) for x in qo_indptr.tolist()]
    kvp = [int(x) for x in kv_indptr.tolist()]
    idx = kv_indices.tolist()
    last = last_page_len.tolist()
    head_dim = int(q.shape[-1])
    if layout == 1:
        k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    page_size, heads_kv = int(k_cache.shape[1]), int(k_cache.shape[2])
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    for b in range(len(qo) - 1):
        pages = idx[kvp[b]:kvp[b + 1]]
        kv_len = (len(pages) - 1) * page_size + int(last[b]) if pages else 0
        if qo[b + 1] == qo[b]:
            continue
        if kv_len <= 0:
            o[qo[b]:qo[b + 1]] = 0
            continue
        k = k_cache[pages].reshape(-1, heads_kv, k_cache.shape[-1])[:kv_len]
        v = v_cache[pages].reshape(-1, heads_kv, v_cache.shape[-1])[:kv_len]
        out = attend(q[qo[b]:qo[b + 1]], k, v, kv_len, scale=scale, causal=causal, window_left=window_left,
                     logits_soft_cap=logits_soft_cap)
        o[qo[b]:qo[b + 1]] = out.to(o.dtype)
