"""FlashInfer's ``quantization`` JIT module (``packbits``, ``segment_packbits``) done on the host, for the simulated
GPU.

Why: a prefill wrapper's ``plan()`` with a custom mask packs it into bits on the device before planning
(``segment_packbits``, ``flashinfer/quantization/packbits.py``); an engine's target-verify steps (MTP) may plan
that way.
The packing is ``numpy.packbits`` per segment (FlashInfer documents the same semantics), written into the caller's
output, so the planner after it sees what it sees on a GPU.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["host_quantization_module"]

BitOrder = Literal["big", "little"]


def _packbits(x: Tensor, bitorder: BitOrder, y: Tensor) -> None:
    """``y[:] = numpy.packbits(x, bitorder)``."""
    import numpy as np

    packed = np.packbits(x.numpy().astype(np.bool_), bitorder=bitorder)
    y.numpy()[:packed.size] = packed


def _segment_packbits(x: Tensor, indptr: Tensor, indptr_new: Tensor, bitorder: BitOrder, y: Tensor) -> None:
    """Segment ``i`` (``x[indptr[i]:indptr[i+1]]``) packed into ``y[indptr_new[i]:indptr_new[i+1]]``."""
    import numpy as np

    bits = x.numpy().astype(np.bool_)
    src = indptr.numpy().astype(np.int64)
    dst = indptr_new.numpy().astype(np.int64)
    out = y.numpy()
    for i in range(len(src) - 1):
        packed = np.packbits(bits[src[i]:src[i + 1]], bitorder=bitorder)
        if packed.size != dst[i + 1] - dst[i]:
            raise ValueError(f"segment_packbits: segment {i} packs to {packed.size} bytes, indptr_new gives "
                             f"{dst[i + 1] - dst[i]}")
        out[dst[i]:dst[i + 1]] = packed


def host_quantization_module() -> SimpleNamespace:
    """Stands in for ``gen_quantization_module().build_and_load()``."""
    return SimpleNamespace(packbits=_packbits, segment_packbits=_segment_packbits)
