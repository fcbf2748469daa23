"""What a matrix expands into: engine limits (the envelope), cases and the resources they carry.

Capture sizes are tokens, as an engine's CUDA-graph capture sizes are. A decode step captured at S
tokens carries ``S // (1 + mtp)`` requests of ``1 + mtp`` query tokens each; :meth:`Envelope.decode_captures`
is the one place that turns capture sizes into captured batches, and both the lifecycle and the
sizing module read it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from pytest_kvprofile.matrix.gpus import GpuSpec
from pytest_kvprofile.matrix.models import ModelSpec, RankHeads, rank_heads
from pytest_kvprofile.units import GiB

KV_SIZING_REQUESTS = ("engine", "profile")
"""What a matrix asks of the engine's KV sizing (``envelope.kv_sizing``): ``engine``, the engine's default sizing
point; ``profile``, the profiling window (an engine that sizes later by default is asked to turn that off). The
engine's adapter resolves the request per case (``EnginePolicy.kv_sizing_for``)."""

YamlValue: TypeAlias = Any  # a value read from a matrix file's YAML: checked where it is read, then used as that type


@dataclass(frozen=True)
class DecodeCapture:
    """One CUDA-graph decode step: ``num_reqs`` requests of ``1 + mtp`` tokens, ``num_tokens`` in all."""

    num_reqs: int
    num_tokens: int


@dataclass(frozen=True)
class Envelope:
    """The engine limits a case is profiled and sized for (the engine's scheduler and compilation config).

    ``cuda_graph_sizes`` are capture sizes in tokens; an empty tuple means no CUDA graphs.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 32768
    page_size: int = 16
    cuda_graph_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    num_ubatches: int = 1
    nontorch_mib: int = 512
    kv_sizing: str = "engine"  # KV_SIZING_REQUESTS

    def decode_captures(self, mtp: int) -> tuple[DecodeCapture, ...]:
        """The decode steps CUDA graphs are captured for, largest first.

        A capture of S tokens plans ``S // (1 + mtp)`` requests. Sizes that hold no whole request,
        more requests than ``max_num_seqs`` or more tokens than ``max_num_batched_tokens`` are never
        a uniform decode step, so they are not captured (the engine drops them the same way); two sizes
        that plan the same requests are one capture.
        """
        memo: dict[int, tuple[DecodeCapture, ...]] = self.__dict__.setdefault("_decode_captures", {})
        if mtp in memo:
            return memo[mtp]
        q = 1 + mtp
        reqs = {
            s // q for s in self.cuda_graph_sizes
            if 1 <= s // q <= self.max_num_seqs and (s // q) * q <= self.max_num_batched_tokens
        }
        memo[mtp] = tuple(DecodeCapture(r, r * q) for r in sorted(reqs, reverse=True))
        return memo[mtp]


@dataclass(frozen=True)
class Resource:
    """A non-builder owner of persistent device memory that a case carries (e.g. a DMA workspace)."""

    kind: str
    params: tuple[tuple[str, YamlValue], ...] = ()

    def get(self, key: str, default: YamlValue = None) -> YamlValue:
        return dict(self.params).get(key, default)


@dataclass(frozen=True)
class Case:
    """One (model, GPU, TP, DCP, MTP, gmu) point of a matrix."""

    id: str
    matrix: str
    model: ModelSpec
    gpu: GpuSpec
    tp: int
    dcp: int
    mtp: int
    gmu: float
    envelope: Envelope
    skip_reason: str | None = None
    resources: tuple[Resource, ...] = ()

    @functools.cached_property
    def heads(self) -> RankHeads:
        return rank_heads(self.model, self.tp, self.dcp)

    @property
    def weights_bytes(self) -> int:
        return int(self.model.weights_gib * GiB) // self.tp

    @property
    def nontorch_bytes(self) -> int:
        """CUDA context and library handles; TP adds NCCL's buffers."""
        return (self.envelope.nontorch_mib + (256 if self.tp > 1 else 0)) << 20

    @property
    def unsized_reason(self) -> str | None:
        """Why this suite cannot size the case's FlashInfer routes (the engine routes its KV dtype on this GPU to
        trtllm-gen only: NVFP4 on SM10x), or None. Such a layout is refused by name on every backend, never sized
        as another dtype and never run with a sizing its checks cannot trust."""
        model = self.model
        refusal = model.kv.fa2_refusal(self.gpu.compute_capability, max(model.head_dim, model.dim_vo))
        if refusal is None:
            return None
        return (f"unsized by the suite: {refusal}; trtllm-gen plans into its own workspace, which this suite does "
                "not size: never sized as another dtype")

    def fa2_kv_torch_dtype(self, who: str) -> str:
        """The ``kv_data_type`` ``who`` plans this case's FA2 routes with (``KvDtype.fa2_torch_dtype``)."""
        model = self.model
        return model.kv.fa2_torch_dtype(who, self.gpu.compute_capability, max(model.head_dim, model.dim_vo))

    @property
    def layout_key(self) -> tuple[object, ...]:
        """Everything but gmu: cases equal under this key run identical pre-KV phases."""
        return (self.matrix, self.model.name, self.model.kv_dtype, self.gpu.name, self.tp, self.dcp, self.mtp,
                self.envelope)


@dataclass
class Matrix:
    path: str
    name: str
    models: dict[str, ModelSpec]
    cases: list[Case] = field(default_factory=list)


def case_id(model: str, tp: int, dcp: int, mtp: int, gpu: GpuSpec, gmu: float) -> str:
    return f"{model}-tp{tp}-dcp{dcp}-mtp{mtp}-{gpu.slug}-gmu{gmu:.2f}"




def layout_case(model: ModelSpec, gpu: GpuSpec, tp: int, dcp: int, mtp: int, envelope: Envelope, *,
                gmu: float = 0.9, matrix: str = "adhoc") -> Case:
    """A case outside any matrix file (the CLI, the sizing report), id'd as a matrix would id it."""
    return Case(id=case_id(model.name, tp, dcp, mtp, gpu, gmu), matrix=matrix, model=model, gpu=gpu, tp=tp,
                dcp=dcp, mtp=mtp, gmu=gmu, envelope=envelope)
