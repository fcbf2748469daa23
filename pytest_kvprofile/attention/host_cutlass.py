"""FlashInfer's CUTLASS sm100 FMHA module (``fmha_cutlass_sm100``) on the simulated device: its ``plan`` on the host.

Why: on Blackwell a ragged prefill wrapper made with ``backend="cutlass"`` (an engine's FlashInfer backend may make its
ragged wrapper so on SM100) plans through ``fmha_varlen_plan``: it allocates its own work lists and launches
``blackwell_fmha_plan`` (``include/flashinfer/attention/blackwell/plan.cuh``, one block of 256 threads). The plan
carves nothing from the float workspace; what it costs is those four tensors per plan. Without a host module the
first prefill plan of such a backend fails on a CPU machine ("No supported CUDA architectures found").

:func:`blackwell_fmha_plan` is that kernel's greedy schedule, written for the host: for every head, every request
and every query tile from the last, the bucket (CTA) of least cost so far takes the tile (ties to the lowest bucket,
as the kernel's warp-reduced ``min`` breaks them), and its cost grows by the tile's KV length (causal: less the
tiles after it), in float32 as the kernel adds; ``work_indptr`` is the exclusive prefix sum of each bucket's count,
and each bucket's tiles are written in the order it took them. ``run`` has no host implementation.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, Callable, NoReturn

from pytest_kvprofile.attention.host_plan import SimulatedDeviceUnsupported

if TYPE_CHECKING:
    from torch import Tensor

    from pytest_kvprofile.attention.host_plan import ModuleArg, PlanDevice

__all__ = ["CutlassPlan", "blackwell_fmha_plan", "fmha_cutlass_loader"]

MAX_BUCKETS = 256  # the kernel's block size: one thread per bucket
_SM100_FAMILY = ((10, 0), (10, 3), (11, 0))  # is_sm100a_supported / is_sm110a_supported


class CutlassPlan(SimpleNamespace):
    """The schedule: ``work_indptr`` (``num_buckets + 1``) and, per work item, its query tile, head and request."""

    work_indptr: list[int]
    qo_tile_indices: list[int]
    head_indices: list[int]
    batch_indices: list[int]


def blackwell_fmha_plan(qo_offsets: list[int], kv_offsets: list[int], qo_tile_size: int, num_heads: int,
                        num_buckets: int, causal: bool) -> CutlassPlan:
    """``plan_kernel``'s schedule of a ragged batch (segment offsets of the queries and the keys)."""
    import numpy as np

    if not 0 < num_buckets <= MAX_BUCKETS:
        raise ValueError(f"blackwell_fmha_plan: {num_buckets} buckets; the plan kernel schedules 1 to {MAX_BUCKETS}")
    cost = np.zeros(num_buckets, dtype=np.float32)
    taken: list[list[tuple[int, int, int]]] = [[] for _ in range(num_buckets)]
    batch = len(qo_offsets) - 1
    for head in range(num_heads):
        for b in range(batch):
            qo_len, kv_len = qo_offsets[b + 1] - qo_offsets[b], kv_offsets[b + 1] - kv_offsets[b]
            tiles = -(-qo_len // qo_tile_size)
            for tile in range(tiles - 1, -1, -1):
                bucket = int(np.argmin(cost))  # the first of equal minima
                cost[bucket] += np.float32(kv_len - (tiles - tile - 1) * qo_tile_size if causal else kv_len)
                taken[bucket].append((tile, head, b))
    indptr = [0]
    for items in taken:
        indptr.append(indptr[-1] + len(items))
    flat = [item for items in taken for item in items]
    return CutlassPlan(work_indptr=indptr, qo_tile_indices=[t for t, _, _ in flat],
                       head_indices=[h for _, h, _ in flat], batch_indices=[b for _, _, b in flat])


def _cutlass_module(device: PlanDevice) -> SimpleNamespace:
    def plan(qo_segment_offsets: Tensor, kv_segment_offsets: Tensor, work_indptr: Tensor, qo_tile_indices: Tensor,
             head_indices: Tensor, batch_indices: Tensor, qo_tile_size: int, num_heads: int, num_buckets: int,
             causal: bool) -> None:
        schedule = blackwell_fmha_plan(qo_segment_offsets.tolist(), kv_segment_offsets.tolist(), int(qo_tile_size),
                                       int(num_heads), int(num_buckets), bool(causal))
        work = len(schedule.qo_tile_indices)
        if work > qo_tile_indices.numel():
            raise RuntimeError(f"blackwell_fmha_plan: {work} work items overflow the {qo_tile_indices.numel()}-entry "
                               "work lists fmha_varlen_plan allocates")
        work_indptr.numpy()[:num_buckets + 1] = schedule.work_indptr
        for out, values in ((qo_tile_indices, schedule.qo_tile_indices), (head_indices, schedule.head_indices),
                            (batch_indices, schedule.batch_indices)):
            out.numpy()[:work] = values

    def run(*args: object, **kwargs: object) -> NoReturn:
        raise SimulatedDeviceUnsupported("FlashInfer's CUTLASS sm100 FMHA run() is not supported on the simulated "
                                         f"{device.compute_capability} device (its plan() is served; "
                                         "pytest_kvprofile.attention.host_cutlass)")

    return SimpleNamespace(plan=plan, run=run)


def fmha_cutlass_loader(device: PlanDevice) -> Callable[..., SimpleNamespace]:
    """Stands in for ``flashinfer.prefill.get_fmha_module(dtype_q, ..., device, use_fp16_qk_reduction)``: the host
    module on an SM100/SM110 device, FlashInfer's own refusal elsewhere."""
    module = _cutlass_module(device)

    def get_fmha_module(*args: ModuleArg, **kwargs: ModuleArg) -> SimpleNamespace:
        if tuple(device.compute_capability) not in _SM100_FAMILY:
            raise ValueError("CUTLASS FMHA requires SM100a (B200/GB200) or SM110a. SM12x (RTX 5090/DGX Spark) lacks "
                             "tcgen05 MMA required by this kernel. Use backend='fa2' instead.")
        return module

    return get_fmha_module
