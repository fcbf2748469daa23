"""Matrices: which models, GPUs and parallel layouts a run covers, expanded into cases.

This package is the code; the shipped matrix files (the data) are YAML in ``pytest_kvprofile/matrices/``.

| name | module | what it is |
|---|---|---|
| `Case`, `Envelope`, `DecodeCapture`, `Matrix`, `Resource` | `cases` | one expanded point, the engine limits, captured decode steps |
| `MatrixError`, `load_matrix`, `load_matrices`, `packaged_matrix` | `schema` | YAML validation and expansion |
| `Axis`, `AXES` (not re-exported) | `axes` | one record per axis: key, parse, expansion, id part, exclusion |
| `GpuSpec`, `lookup_gpu`, `GPU_CATALOG` | `gpus` | the GPU catalog (SMs, memory, interconnect, compute capability) |
| `ModelSpec`, `RankHeads`, `rank_heads`, `kv_bytes_per_token`, `impossible_layout` | `models` | head layouts and their per-rank view |
"""  # noqa: E501 - markdown table rows cannot wrap

from __future__ import annotations

from pytest_kvprofile.matrix.cases import (
    Case,
    DecodeCapture,
    Envelope,
    Matrix,
    Resource,
)
from pytest_kvprofile.matrix.gpus import GPU_CATALOG, GpuSpec, lookup_gpu
from pytest_kvprofile.matrix.models import (
    ModelSpec,
    RankHeads,
    impossible_layout,
    kv_bytes_per_token,
    rank_heads,
)
from pytest_kvprofile.matrix.schema import (
    MatrixError,
    load_matrices,
    load_matrix,
    packaged_matrix,
)

__all__ = [
    "GPU_CATALOG",
    "Case",
    "DecodeCapture",
    "Envelope",
    "GpuSpec",
    "Matrix",
    "MatrixError",
    "ModelSpec",
    "RankHeads",
    "Resource",
    "impossible_layout",
    "kv_bytes_per_token",
    "load_matrices",
    "load_matrix",
    "lookup_gpu",
    "packaged_matrix",
    "rank_heads",
]
