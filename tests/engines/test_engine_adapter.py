"""A new engine needs no copy of vLLM's adapter: a toy engine (its config, its metadata class, its builder, a
"platform" it reads the GPU from) adapted on ``engines/adapter.py`` and ``engines/batches.py`` alone runs through
the lifecycle on a ci case and passes, on the legacy path (it declares nothing) and on the reservation path (its
builder class carries a reservation API of its own names). docs/engines.md lists what such a module provides."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pytest_kvprofile.checks.catalog import failing_checks
from pytest_kvprofile.contract.protocol import Batch, WorkspaceDeclaration
from pytest_kvprofile.contract.support import ProfilingSupport
from pytest_kvprofile.engines.adapter import EngineAdapter, EngineBuildError, Patches, ReservingAdapter, engine_backend
from pytest_kvprofile.engines.batches import (
    capture_sizes,
    pad_to_capture,
    pages_per_request,
    query_lens,
    runner_batch,
    window_batches,
)
from pytest_kvprofile.engines.contract_api import reservation_api
from pytest_kvprofile.lifecycle.driver import close_parts, run_lifecycle
from pytest_kvprofile.lifecycle.record import LEGACY, PROFILING
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix
from pytest_kvprofile.units import MiB

# -- the toy engine: knows nothing of the harness ----------------------------------------------------------------


class ToyPlatform:
    """What the engine reads the GPU from (a real engine probes the driver; on CPU an adapter stands it in)."""

    gpu_name: str | None = None


@dataclasses.dataclass(frozen=True)
class ToyConfig:
    max_reqs: int
    max_tokens: int
    pages_per_req: int
    capture_sizes: tuple[int, ...]


@dataclasses.dataclass
class ToyMetadata:
    query_start_loc: list[int]
    seq_lens: list[int]
    block_table: list[range]
    num_tokens: int


class ToyAttentionBuilder:
    """The engine's metadata builder: persistent index buffers from its constructor, a scratch tensor per build."""

    def __init__(self, config: ToyConfig, device: torch.device) -> None:
        if ToyPlatform.gpu_name is None:
            raise RuntimeError("no GPU")  # what a CPU-only machine answers without the stand-in
        self.config = config
        self.qo_indptr = torch.zeros(config.max_reqs + 1, dtype=torch.int32, device=device)
        self.kv_lens = torch.zeros(config.max_reqs, dtype=torch.int32, device=device)
        self.captured: list[int] = []

    def _fill(self, md: ToyMetadata) -> None:
        n = len(md.seq_lens)
        self.qo_indptr[:n + 1].copy_(torch.tensor(md.query_start_loc, dtype=torch.int32))
        self.kv_lens[:n].copy_(torch.tensor(md.seq_lens, dtype=torch.int32))

    def build(self, md: ToyMetadata) -> str:
        self._fill(md)
        scratch = torch.empty(md.num_tokens * 64, dtype=torch.uint8, device="cuda")  # freed within the build
        del scratch
        return "serving"

    def build_for_capture(self, md: ToyMetadata) -> str:
        if md.num_tokens not in self.config.capture_sizes:
            raise ValueError(f"{md.num_tokens} tokens is not a capture size")
        self._fill(md)
        self.captured.append(md.num_tokens)
        return "capture"


class ReservingToyBuilder(ToyAttentionBuilder):
    """The same builder taught profiling-time reservation, under the engine's own names."""

    @classmethod
    def profiling_support(cls, config: ToyConfig) -> bool:
        return True  # REQUIRED, as vLLM's pull request answers

    def reserve_workspace(self) -> None:
        self.workspace = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")


# -- its adapter: the toy engine's own module would hold only this ---------------------------------------------


class ToyAdapter(EngineAdapter):
    name = "toy-engine"
    builder_label = "the toy engine's ToyAttentionBuilder"

    def standins(self) -> Any:
        import contextlib

        @contextlib.contextmanager
        def platform() -> Any:
            patches = Patches()
            patches.set(ToyPlatform, "gpu_name", self.case.gpu.name)
            try:
                yield ToyPlatform
            finally:
                patches.undo()

        return platform()

    def make_engine_config(self) -> ToyConfig:
        env = self.case.envelope
        return ToyConfig(env.max_num_seqs, env.max_num_batched_tokens, pages_per_request(self.case),
                         tuple(capture_sizes(self.case)))

    def make_engine_builder(self, key: Any) -> ToyAttentionBuilder:
        return (self.builder_cls or ToyAttentionBuilder)(self.config(), torch.device("cuda"))

    def engine_metadata(self, batch: Batch) -> ToyMetadata:
        config = self.config()
        rb = runner_batch(self.case, pad_to_capture(batch, config.capture_sizes, self.case.mtp), config.max_reqs)
        return ToyMetadata(rb.query_start_loc, list(rb.seq_lens), rb.block_table(), rb.num_tokens)

    def build_for_capture(self, builder: Any, metadata: Any) -> Any:
        return builder.build_for_capture(metadata)

    def build_serving(self, builder: Any, metadata: Any) -> Any:
        return builder.build(metadata)


class ReservingToyAdapter(ReservingAdapter, ToyAdapter):
    name = "toy-engine-reserving"

    def __init__(self, case: Any) -> None:
        super().__init__(case, ReservingToyBuilder)
        api = reservation_api(ReservingToyBuilder, ("profiling_support",), ("reserve_workspace",))
        assert api is not None
        self.api = api

    def declaration_args(self) -> tuple[Any, ...]:
        return (self.config(),)

    def declared_workspace(self, case: Any) -> WorkspaceDeclaration:
        return WorkspaceDeclaration(float_bytes=0, int_bytes=0)


TOY = engine_backend("toy-engine", lambda case: [ToyAdapter(case)], engine="torch", install_hint="pip install torch")
RESERVING_TOY = engine_backend("toy-engine-reserving", lambda case: [ReservingToyAdapter(case)], engine="torch",
                               install_hint="pip install torch")
CASE = next(c for c in load_matrix(packaged_matrix("ci")).cases if c.id == "qwen3-8b-tp1-dcp1-mtp1-l40s-gmu0.90")


# -- the tests ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("backend", "path"), [(TOY, LEGACY), (RESERVING_TOY, PROFILING)], ids=["legacy", "reserving"])
def test_a_toy_engine_on_the_generic_adapter_passes_the_lifecycle(backend, path):
    result = run_lifecycle(backend, CASE)
    adapter = result.builders[0]
    try:
        assert not result.errors, result.errors
        assert result.path == path
        assert failing_checks(result) == {}
        # one engine builder per micro-batch, made by the adapter; every kind of batch built, captures padded
        assert sorted(adapter.builders) == list(range(CASE.envelope.num_ubatches))
        assert set(adapter.built) == {"prefill", "mixed", "decode"}
        captured = {n for b in adapter.builders.values() for n in b.captured}
        assert captured and captured <= set(capture_sizes(CASE))
        owned = [a for a in result.allocations if a.owner == adapter.name]
        assert owned and all(a.phase != "weights" for a in owned)
        if path == PROFILING:
            assert adapter.get_persistent_workspace_memory_profiling_support() is ProfilingSupport.REQUIRED
            # the runner's order: in the window, then fresh builders after KV sizing, then after kernel warmup
            assert "reservation" in {a.phase for a in owned if a.size >= 4 * MiB} <= {"reservation", "rebind", "warmup"}
    finally:
        close_parts(result)
    assert ToyPlatform.gpu_name is None  # the stand-in was undone after every call
    assert adapter.builders == {}


def test_a_failed_engine_build_names_the_case_the_batch_and_the_engines_error():
    class Failing:
        def __init__(self, config: ToyConfig, device: torch.device) -> None:
            assert ToyPlatform.gpu_name == CASE.gpu.name  # made inside the stand-ins

        def build(self, md: ToyMetadata) -> str:
            raise ValueError("no route")

    adapter = ToyAdapter(CASE, Failing)
    ctx = SimpleNamespace(num_ubatches=1, capturing=False)
    with pytest.raises(EngineBuildError) as info:
        adapter.build(ctx, Batch("prefill", 2, 64))  # type: ignore[arg-type]
    message = str(info.value)
    assert CASE.id in message and "prefill 2 reqs / 64 tokens" in message and "ubatch 0" in message
    assert "the toy engine's ToyAttentionBuilder.build()" in message and "ValueError: no route" in message
    adapter.close()


def test_the_batches_are_the_runners_layout():
    q = 1 + CASE.mtp
    sizes = capture_sizes(CASE)
    padded = pad_to_capture(Batch("decode", 3, 3 * q, cuda_graph=True), sizes, CASE.mtp)
    assert padded.num_tokens == min(s for s in sizes if s >= 3 * q and s % q == 0) and padded.cuda_graph
    assert pad_to_capture(Batch("prefill", 3, 100), sizes, CASE.mtp) == Batch("prefill", 3, 100)
    assert query_lens(CASE, Batch("mixed", 4, 100)) == [q, q, 48, 48]
    rb = runner_batch(CASE, Batch("mixed", 4, 100))
    assert rb.query_start_loc == [0, q, 2 * q, 2 * q + 48, 2 * q + 96] and rb.num_tokens == 2 * q + 96
    assert rb.seq_lens == (CASE.envelope.max_model_len,) * 4
    assert rb.num_computed_tokens == [s - ql for s, ql in zip(rb.seq_lens, rb.query_lens)]
    assert rb.block_table()[1][0] == pages_per_request(CASE) and list(rb.slot_mapping) == list(range(rb.num_tokens))
    shapes = window_batches(CASE)
    graphs = [b for b in shapes if b.cuda_graph]
    assert shapes[:len(graphs)] == graphs and [b.kind for b in shapes[len(graphs):]] == ["mixed", "prefill", "decode"]


def test_the_generic_modules_import_no_engine_and_nothing_of_vllms_adapter():
    program = ("import sys, pytest_kvprofile.engines.adapter, pytest_kvprofile.engines.batches; "
               "print(sorted(m for m in sys.modules if 'vllm' in m or m in ('torch', 'numpy')))")
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
