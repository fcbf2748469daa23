"""A line-by-line Python port of FlashInfer's host planners' sizing arithmetic.

Why a port as well as the compiled oracle: the analytic model needs to evaluate many candidate
batches cheaply while it constructs a worst case, and it must still work where no CUDA compiler is
installed. The port follows ``flashinfer/attention/scheduler.cuh`` (``PrefillSplitQOKVIndptr``,
``PrefillPlanImpl``, ``DecodePlanImpl`` and the decode work estimation); the test suite checks it
against the oracle, which runs the real code.

Version families (``family``), read from the wheels' ``scheduler.cuh`` (``Generation`` holds the table):
  ``"0.6-materialize"`` (<= 0.6.13): no count-only planner; ``"0.6-materialize-d512"`` (0.6.14): own CTA tiles
  for a VO dim of 512 or more; ``"0.6"`` (0.6.15): ``PrefillPlanWorkspaceSize``;
  ``"0.6-uniform"`` (0.6.16-0.6.17): ``uniform_q_len``; ``"0.6-kv-dtype"`` (0.6.18-0.7.0): ``kv_dtype_bytes``.
  All four carve ``tmp_v = H_qo*padded*cta_tile_q*D_vo*4`` and the block-valid mask only when split.
  ``"0.7-unfixed"`` (0.7.1-0.7.3) and ``"0.7"`` (>= 0.7.4): ``rows = ceil(padded*cta_tile_q / (H_qo/H_kv))``, the
  mask under every CUDA graph; only ``"0.7"`` has ``fixed_uniform_q_len``. 0.7.3 is not on PyPI; it is placed
  with 0.7.2 (no ``fixed_uniform_q_len``), which carves at least as much.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

FAMILY_06_MATERIALIZE = "0.6-materialize"
FAMILY_06_MATERIALIZE_D512 = "0.6-materialize-d512"
FAMILY_06 = "0.6"
FAMILY_06_UNIFORM = "0.6-uniform"
FAMILY_06_KV_DTYPE = "0.6-kv-dtype"
FAMILY_07_UNFIXED = "0.7-unfixed"
FAMILY_07 = "0.7"


@dataclass(frozen=True)
class Generation:
    """What one family of FlashInfer's planner does differently: its signatures and its sizing arithmetic.

    ``first``: the first release with it. ``count_only``: ``PrefillPlanWorkspaceSize``/``DecodePlanWorkspaceSize``
    exist. ``uniform_q``: ``PrefillPlan`` takes ``uniform_q_len`` (the tensor-core decode wrapper passes its query
    length when it is above 1). ``kv_dtype_bytes``: it takes ``sizeof(DTypeKV)``, and ``FA2DetermineCtaTileQ``
    reads it and ``head_dim_qk``. ``rows_by_group``: the partial outputs are ``ceil(padded*cta/group)`` rows,
    not ``padded*cta``, and the block-valid mask is carved under every CUDA graph. ``fixed_uniform_q``: the
    wrapper passes ``uniform_q_len`` always, with ``fixed_uniform_q_len=True``, and a graph past the split budget
    never splits. ``d512_tiles``: ``FA2DetermineCtaTileQ`` gives a VO dim of 512 or more tiles of 16/32."""

    family: str
    first: tuple[int, int, int]
    count_only: bool
    uniform_q: bool
    kv_dtype_bytes: bool
    rows_by_group: bool
    fixed_uniform_q: bool
    d512_tiles: bool


GENERATIONS: tuple[Generation, ...] = (
    #          family                      first       count  uniform kv_dt  rows   fixed  d512
    Generation(FAMILY_06_MATERIALIZE,      (0, 0, 0),  False, False, False, False, False, False),
    Generation(FAMILY_06_MATERIALIZE_D512, (0, 6, 14), False, False, False, False, False, True),
    Generation(FAMILY_06,                  (0, 6, 15), True,  False, False, False, False, True),
    Generation(FAMILY_06_UNIFORM,          (0, 6, 16), True,  True,  False, False, False, True),
    Generation(FAMILY_06_KV_DTYPE,         (0, 6, 18), True,  True,  True,  False, False, True),
    Generation(FAMILY_07_UNFIXED,          (0, 7, 1),  True,  True,  True,  True,  False, True),
    Generation(FAMILY_07,                  (0, 7, 4),  True,  True,  True,  True,  True,  True),
)
_BY_FAMILY = {g.family: g for g in GENERATIONS}


def generation(family: str) -> Generation:
    """The table row of a family (``family_of``'s answer)."""
    try:
        return _BY_FAMILY[family]
    except KeyError:
        raise ValueError(f"unknown FlashInfer planner family {family!r}; known: {sorted(_BY_FAMILY)}") from None


def rows_by_group(family: str) -> bool:
    """Whether the family sizes split partial outputs per query row (0.7.1+), not per packed tile row."""
    return generation(family).rows_by_group


def decode_uniform_args(family: str, q_len_per_req: int) -> tuple[int, bool]:
    """``(uniform_q_len, fixed_uniform_q_len)`` the family's tensor-core decode wrapper passes to ``plan``."""
    gen = generation(family)
    if gen.fixed_uniform_q:
        return q_len_per_req, True
    if gen.uniform_q and q_len_per_req > 1:
        return q_len_per_req, False
    return 0, False

PREFILL_BLOCKS_PER_SM = 2  # hard-coded in PrefillPlanImpl


def family_of(version: str) -> str:
    """Map a FlashInfer version string to the sizing family its planner belongs to."""
    parts = []
    for piece in version.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    while len(parts) < 3:
        parts.append(0)
    key = (parts[0], parts[1], parts[2])
    return [g for g in GENERATIONS if g.first <= key][-1].family


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def align_up(x: int, a: int) -> int:
    return ceil_div(x, a) * a if a > 1 else x


@dataclass(frozen=True)
class PlannerDevice:
    """What the planners read from the device: SM count, compute capability, opt-in smem."""

    num_sm: int
    cc_major: int = 9
    cc_minor: int = 0
    smem_optin: int = 101376


def cta_tile_q(avg_packed_qo_len: int, head_dim_vo: int, head_dim_qk: int, dev: PlannerDevice,
               kv_dtype_bytes: int = 2, family: str = FAMILY_07) -> int:
    """``FA2DetermineCtaTileQ`` of the family (head_dim is the VO dim at the batch-prefill call sites).

    From 0.6.14 a VO dim of 512 or more has its own tiles (16, or 32 past 32 packed rows); from 0.6.18 (the
    generations with ``kv_dtype_bytes``) a QK dim of 512 or more takes 16 and a short query falls back to 64
    when one KV step of the 1x4 layout does not fit the opt-in shared memory. Before, only the 128/64/16 rule."""
    gen = generation(family)
    qk = head_dim_qk or head_dim_vo
    if head_dim_vo >= 512 and gen.d512_tiles:
        return 16 if avg_packed_qo_len <= 32 else 32
    if qk >= 512 and gen.kv_dtype_bytes:
        return 16
    if avg_packed_qo_len > 64 and head_dim_vo < 256:
        return 128
    if dev.cc_major >= 8:
        if avg_packed_qo_len > 16:
            return 64
        if gen.kv_dtype_bytes and 16 * qk * 2 + (qk + head_dim_vo) * 16 * 4 * kv_dtype_bytes > dev.smem_optin:
            return 64
        return 16
    return 64


def max_cta_tile_q(head_dim_vo: int, head_dim_qk: int, dev: PlannerDevice, family: str = FAMILY_07) -> int:
    """The largest tile the planner can pick: it grows with the packed query length."""
    return cta_tile_q(1 << 40, head_dim_vo, head_dim_qk, dev, family=family)


def max_batch_size_if_split(num_sm: int, heads_kv: int) -> int:
    return (PREFILL_BLOCKS_PER_SM * num_sm) // heads_kv


@dataclass(frozen=True)
class PlanSize:
    """Bytes one ``plan()`` carves, and the quantities that decided them."""

    float_bytes: int
    int_bytes: int
    padded_batch_size: int
    cta_tile_q: int
    split_kv: bool
    new_batch_size: int


class _Alloc:
    """Counting-mode ``AlignedAllocator``."""

    __slots__ = ("used",)

    def __init__(self) -> None:
        self.used = 0

    def take(self, size: int, alignment: int) -> None:
        self.used = align_up(self.used, alignment) + size


def prefill_split_rows(family: str, heads_q: int, heads_kv: int, padded: int, cta: int) -> int:
    """The rows of a split plan's partial outputs; ``prefill_float_bytes`` grows strictly with them, so a search for
    the largest plan compares rows and sizes the winner once."""
    if rows_by_group(family):
        return ceil_div(padded * cta, heads_q // heads_kv)
    return padded * cta


def prefill_float_bytes(family: str, heads_q: int, heads_kv: int, head_dim_vo: int, padded: int,
                        cta: int) -> int:
    """``batch_prefill_tmp_v`` + ``batch_prefill_tmp_s`` for a split plan."""
    rows = prefill_split_rows(family, heads_q, heads_kv, padded, cta)
    alloc = _Alloc()
    alloc.take(heads_q * rows * head_dim_vo * 4, 16)
    alloc.take(heads_q * rows * 4, 16)
    return alloc.used


def prefill_int_bytes(family: str, padded: int, batch_size: int, total_rows: int, split: bool,
                      cuda_graph: bool) -> int:
    alloc = _Alloc()
    for _ in range(3):
        alloc.take(4 * padded, 16)
    alloc.take(4 * (batch_size + 1), 16)
    alloc.take(4, 1)
    if cuda_graph:
        alloc.take(4, 16)
    if split:
        alloc.take(4 * (total_rows + 1), 16)
        if not rows_by_group(family) and cuda_graph:
            alloc.take(padded, 16)
    if rows_by_group(family) and cuda_graph:
        alloc.take(padded, 16)
    return alloc.used


def _prefill_chunk_search(cuda_graph: bool, max_bs: int, packed: Sequence[int], kv: Sequence[int],
                          cta: int, min_chunk: int) -> tuple[bool, int]:
    """``PrefillBinarySearchKVChunkSize``."""
    max_kv = max([1, *kv])
    tiles = [ceil_div(p, cta) for p in packed]
    kv1 = [max(k, 1) for k in kv]
    low, high = min_chunk, max_kv
    while low < high:
        mid = (low + high) // 2
        nb = 0
        for t, k in zip(tiles, kv1):
            nb += t * ceil_div(k, mid)
        if nb > max_bs:
            low = mid + 1
        else:
            high = mid
    return cuda_graph or low < max_kv, low


def prefill_plan(family: str, qo_lens: Sequence[int], kv_pages: Sequence[int], *, heads_q: int,
                 heads_kv: int, head_dim_qk: int, head_dim_vo: int, page_size: int, dev: PlannerDevice,
                 cuda_graph: bool, uniform_q_len: int = 0, fixed_uniform_q_len: bool = False,
                 kv_dtype_bytes: int = 2) -> PlanSize:
    """Sizes ``PrefillPlan`` carves for one batch (window_left=-1, no fixed split, split enabled)."""
    if heads_q % heads_kv:
        raise ValueError(f"num_qo_heads {heads_q} should be divisible by num_kv_heads {heads_kv}")
    batch = len(qo_lens)
    g = heads_q // heads_kv
    max_bs = max_batch_size_if_split(dev.num_sm, heads_kv)
    packed = [q * g for q in qo_lens]
    total_rows = sum(qo_lens)
    min_chunk = max(128 // page_size, 1)
    gen = generation(family)
    uniform = gen.uniform_q and uniform_q_len > 0
    if not gen.kv_dtype_bytes:
        kv_dtype_bytes = 2  # the planner of this generation has no such argument and plans as 2 bytes
    if cuda_graph:
        if uniform:
            pu = uniform_q_len * g
            if any(p != pu for p in packed):
                raise ValueError("uniform_q_len does not describe this batch")
            cta = cta_tile_q(pu, head_dim_vo, head_dim_qk, dev, kv_dtype_bytes, family)
            tiles = batch * ceil_div(pu, cta)
        else:
            max_seq = total_rows - batch + 1
            cta = cta_tile_q(max_seq * g, head_dim_vo, head_dim_qk, dev, kv_dtype_bytes, family)
            tiles = ceil_div(total_rows * g, cta) + batch - 1
    else:
        cta = cta_tile_q(sum(packed) // batch, head_dim_vo, head_dim_qk, dev, kv_dtype_bytes, family)
        tiles = sum(ceil_div(p, cta) for p in packed)
    split, chunk = _prefill_chunk_search(cuda_graph, max_bs, packed, kv_pages, cta, min_chunk)
    if gen.fixed_uniform_q and fixed_uniform_q_len and uniform_q_len > 0 and tiles > max_bs:
        split = False
    new_bs = 0
    for p, k in zip(packed, kv_pages):
        new_bs += ceil_div(p, cta) * ceil_div(max(k, 1), chunk)
    padded = max(max_bs, tiles) if cuda_graph else new_bs
    fbytes = prefill_float_bytes(family, heads_q, heads_kv, head_dim_vo, padded, cta) if split else 0
    ibytes = prefill_int_bytes(family, padded, batch, total_rows, split, cuda_graph)
    return PlanSize(fbytes, ibytes, padded, cta, split, new_bs)


def decode_plan(qo_heads: int, heads_kv: int, head_dim: int, kv_pages: Sequence[int], *,
                page_size: int, num_sm: int, blocks_per_sm: int, cuda_graph: bool) -> PlanSize:
    """Sizes the CUDA-core ``DecodePlan`` carves, with kernel occupancy given as blocks_per_sm."""
    batch = len(kv_pages)
    gdy = heads_kv
    max_grid = blocks_per_sm * num_sm
    if batch * gdy >= max_grid:
        split, new_bs = False, batch
    else:
        low, high = max(128 // page_size, 1), max([0, *kv_pages])
        while low < high:
            mid = (low + high) // 2
            nb = sum(ceil_div(p, mid) for p in kv_pages)
            if nb * gdy > max_grid:
                low = mid + 1
            else:
                high = mid
        new_bs = sum(ceil_div(max(p, 1), low) for p in kv_pages)
        split = not (new_bs == batch and not cuda_graph)
    padded = (max_grid // gdy if split else batch) if cuda_graph else new_bs
    ialloc = _Alloc()
    ialloc.take(4 * padded, 16)
    ialloc.take(4 * padded, 16)
    ialloc.take(4 * (padded + 1), 16)
    ialloc.take(4, 1)
    fbytes = 0
    if split:
        falloc = _Alloc()
        falloc.take(qo_heads * padded * head_dim * 4, 16)
        falloc.take(qo_heads * padded * 4, 16)
        fbytes = falloc.used
        ialloc.take(padded, 16)
    return PlanSize(fbytes, ialloc.used, padded, 0, split, new_bs)


def decode_blocks_per_sm_bound(head_dim: int, group_size: int, cc_major: int = 9,
                               kv_dtype_bytes: int = 2) -> int:
    """A safe upper bound on the CUDA-core decode kernel's occupancy when it is not measured.

    The real planner asks ``cudaOccupancyMaxActiveBlocksPerMultiprocessor``; registers are unknown
    on the host, so this bounds it by threads (2048 per SM) and shared memory (228 KiB per SM, the
    largest of any catalog GPU) only, which can only over-state occupancy and so the workspace.
    """
    vec_size = max(16 // kv_dtype_bytes, head_dim // 32)
    bdx = max(head_dim // vec_size, 1)
    bdy = group_size
    num_threads = max(128, bdx * bdy)
    bdz = max(num_threads // (bdx * bdy), 1)
    stages = 2 if cc_major >= 8 else 1
    tile = (2 if kv_dtype_bytes == 1 else 4) if group_size == 1 else 1
    smem = 2 * stages * tile * bdy * bdz * head_dim * kv_dtype_bytes + max(
        tile * num_threads * 8, 2 * bdy * bdz * 4)
    by_threads = 2048 // num_threads
    by_smem = (228 * 1024) // max(smem, 1)
    return max(1, min(32, by_threads, by_smem))
