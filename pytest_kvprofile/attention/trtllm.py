"""How FlashInfer's trtllm-gen launcher carves the workspace a caller hands it, ported from its own code.

Source: ``flashinfer/data/csrc/trtllm_fmha_kernel_launcher.cu`` (``trtllm_paged_attention_launcher``, the path of
``trtllm_batch_decode_with_kv_cache`` and ``trtllm_batch_decode_with_kv_cache_mla``) and
``include/flashinfer/trtllm/fmha/fmhaKernels.cuh`` (``computeCtaAndClusterConfig``, ``fitsMultiCtasKvScratch``).
The launcher bump-allocates from the front of the workspace (``AlignedAllocator``, 16-byte aligned):

1. When LSE is asked for (DCP: the engine merges the ranks' partial outputs by their LSE), a softmax-stats slab of
   ``sizeof(float2) x num_qo_heads x batch_size x round_up(max_q_len, 256)`` bytes plus a 1 MiB guard.
2. In generation mode, the multi-CTA KV scratch takes the rest: partial stats ``max(SMs, CTAs) x stepQ`` float2
   and partial O ``CTAs x stepQ x headDimPerCtaV (x2 with 2-CTA MMA)`` 2-byte elements. The stock split is one wave
   (``CTAs <= SMs``, ``oneWaveSplits = SMs / baseNumCtas``), and FlashInfer refuses ``tileSizeQ > 128``.

The context (prefill) kernel runs without multi-CTA KV, so it needs no scratch. Nothing here imports FlashInfer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pytest_kvprofile.units import MiB

__all__ = ["LAUNCHER_SOURCE", "LAUNCHER_TEXT", "MAX_STEP_Q", "SOFTMAX_GUARD_BYTES", "SOFTMAX_Q_ROUND",
           "TrtllmCarve", "launcher_path", "scratch_bound", "softmax_stats_bytes"]

LAUNCHER_SOURCE = "flashinfer/data/csrc/trtllm_fmha_kernel_launcher.cu"
SOFTMAX_STAT_BYTES = 8  # sizeof(float2)
SOFTMAX_Q_ROUND = 256  # round_up(max_q_len, int64_t{256})
SOFTMAX_GUARD_BYTES = 1 * MiB  # kTrtllmGenSoftmaxStatsGuardBytes
ALIGN = 16  # float_allocator.aligned_alloc<...>(..., 16, ...)
MAX_STEP_Q = 128  # fmhaKernels.cuh: "The tileSizeQ and tileSizeKv must be <= 128."
PARTIAL_ELT_BYTES = 2  # fitsMultiCtasKvScratch: bytesPerPartialElt

LAUNCHER_TEXT: tuple[str, ...] = (
    "constexpr size_t kTrtllmGenSoftmaxStatsGuardBytes = 1 * 1024 * 1024;",
    "static_cast<size_t>(round_up(max_q_len, int64_t{256}));",
    "sizeof(float2) * softmax_slots + kTrtllmGenSoftmaxStatsGuardBytes, 16,",
    "runner_params.mMultiCtasKvScratchBytes = float_allocator.remaining_space;",
)
"""Lines of the installed launcher this module's constants restate (``tests/attention/test_trtllm_carve.py``
reads them from the wheel, so a FlashInfer that changes the carve fails there, not in a verdict)."""


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def softmax_stats_bytes(num_qo_heads: int, batch_size: int, max_q_len: int) -> int:
    """The LSE slab the launcher carves first when LSE is asked for (16-byte aligned, guard included)."""
    slots = num_qo_heads * batch_size * _round_up(max(1, max_q_len), SOFTMAX_Q_ROUND)
    return _round_up(SOFTMAX_STAT_BYTES * slots + SOFTMAX_GUARD_BYTES, ALIGN)


def scratch_bound(num_sm: int, head_dim_v: int, two_cta_mma: bool) -> int:
    """The multi-CTA KV scratch one generation launch writes, at most: one wave of CTAs (at most one per SM), each
    with ``stepQ <= 128`` rows of partial stats and partial O over ``head_dim_v`` (x2 with 2-CTA MMA, MLA's)."""
    stats = num_sm * MAX_STEP_Q * SOFTMAX_STAT_BYTES
    partial_o = num_sm * MAX_STEP_Q * head_dim_v * PARTIAL_ELT_BYTES * (2 if two_cta_mma else 1)
    return _round_up(stats + partial_o, ALIGN)


@dataclass(frozen=True)
class TrtllmCarve:
    """What one trtllm-gen route's launch carves from its workspace: the LSE slab (0 without LSE) and the scratch
    (0 for the context kernel), with the shape that decides each."""

    route: str
    lse: bool
    num_qo_heads: int
    batch_size: int
    max_q_len: int
    head_dim_v: int
    slab_bytes: int
    scratch_bytes: int
    two_cta: bool = False

    @property
    def total_bytes(self) -> int:
        return self.slab_bytes + self.scratch_bytes

    def formula(self) -> str:
        """The arithmetic, in the launcher's terms, for a message."""
        parts = []
        if self.lse:
            parts.append(f"LSE slab 8 B x {self.num_qo_heads} q heads x {self.batch_size} x "
                         f"round_up({self.max_q_len}, 256) + 1 MiB guard = {self.slab_bytes} bytes")
        if self.scratch_bytes:
            parts.append(f"multi-CTA KV scratch of one wave, SMs x stepQ (<= 128) x (8 B + head_dim_v {self.head_dim_v}"
                         f" x 2 B{' x 2 (2-CTA MMA)' if self.two_cta else ''}) = {self.scratch_bytes} bytes")
        return "; ".join(parts) or "nothing (context kernel, no LSE)"


def launcher_path() -> Path | None:
    """The installed FlashInfer's launcher source, or None when FlashInfer (or its sources) is absent."""
    import importlib.util

    spec = importlib.util.find_spec("flashinfer")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "data" / "csrc" / "trtllm_fmha_kernel_launcher.cu"
    return path if path.is_file() else None
