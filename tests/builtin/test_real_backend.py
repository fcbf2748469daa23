"""The built-in ``flashinfer`` backend of FlashInfer's own wrappers, through the reference lifecycle (issue 13,
item 5): it passes every check, its lazy twin fails naming FlashInfer's source lines, and the bytes it declares
are exactly what FlashInfer's planner needs for the worst batch (16 fewer overflow), on CPU."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from pytest_kvprofile.builtin.flashinfer_real import (
    REAL_FLASHINFER_BACKENDS,
    REAL_FLASHINFER_MUTANTS,
    RealFlashInferBuilder,
)
from pytest_kvprofile.checks.catalog import failing_checks
from pytest_kvprofile.contract.backends import layout_refusal
from pytest_kvprofile.lifecycle import driver
from pytest_kvprofile.lifecycle.record import ProbeTarget
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix
from pytest_kvprofile.sizing import for_case

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # FlashInfer's cutlass-dsl imports
OVERFLOW = r"Buffer overflow when allocating memory for .* Increase the workspace buffer size\."
REAL, LAZY = REAL_FLASHINFER_BACKENDS[0], REAL_FLASHINFER_MUTANTS[0]

# Distinct layouts: CUDA-core and tensor-core decode, GQA 2/4/8/16, TP, DCP (heads_q * dcp decode heads),
# MTP 0/1/3 (1 + mtp tokens per captured request), PCIe (with the DMA resource) and NVLink GPUs.
LAYOUTS = [
    "qwen3-8b-tp1-dcp1-mtp0-l40s-gmu0.90",
    "gemma-2-9b-hd256-tp1-dcp1-mtp0-h100-gmu0.90",
    "glm-4-9b-32q2kv-tp2-dcp1-mtp1-l40s-gmu0.98",
    "llama-3-70b-tp4-dcp2-mtp3-b200-gmu0.98",
    "qwen3-8b-tp4-dcp4-mtp1-h200-gmu0.90",
]


def _cases() -> dict[str, Any]:
    return {c.id: c for c in load_matrix(packaged_matrix("default")).cases}


def _flashinfer_sites(result: Any, owner: str) -> set[str]:
    return {f"flashinfer/{f}" for f in ("prefill.py", "decode.py")
            for a in result.allocations if a.owner == owner and a.stack and f"flashinfer/{f}:" in a.stack}


@pytest.mark.parametrize("case_id", LAYOUTS)
def test_real_wrappers_pass_every_check(case_id: str) -> None:
    case = _cases()[case_id]
    result = driver.run_lifecycle(REAL, case)
    assert not result.errors, result.errors[0].describe()
    assert failing_checks(result) == {}
    assert _flashinfer_sites(result, "flashinfer") == {"flashinfer/prefill.py", "flashinfer/decode.py"}
    builder = result.builders[0]
    captured = {c.num_reqs for c in case.envelope.decode_captures(case.mtp)}
    for slot in builder.slots.values():
        assert set(slot.graph) == captured
        assert slot.decode.use_tensor_cores == builder.tensor_cores
        for role, wrapper in slot.wrappers():
            assert wrapper._plan_info is not None, f"{role} wrapper of ubatch {slot.ubatch} was never planned"
            assert wrapper._float_workspace_buffer.untyped_storage().data_ptr() == \
                slot.arena.tensor.untyped_storage().data_ptr(), "the float workspace is not the shared arena"


@pytest.mark.parametrize("case_id", LAYOUTS[:2])
def test_lazy_twin_fails_naming_flashinfer_and_the_builder(case_id: str) -> None:
    result = driver.run_lifecycle(LAZY, _cases()[case_id])
    failures = failing_checks(result)
    assert "persistent_memory_visible_at_closing" in failures
    message = failures["persistent_memory_visible_at_closing"][0]
    assert "flashinfer/prefill.py:" in message and "flashinfer/decode.py:" in message
    assert "builder call site" in message and "flashinfer_real.py:" in message
    assert "after KV sizing" in message


@pytest.mark.parametrize("case_id", LAYOUTS[:2])
def test_shared_int_workspace_twin_fails_from_flashinfers_own_buffers(case_id: str) -> None:
    """FlashInfer's wrappers give their int workspaces their role in torch mode; handing every wrapper the prefill
    wrapper's (``reset_workspace_buffer``) is seen from the ledger, whatever the builder says."""
    result = driver.run_lifecycle(REAL_FLASHINFER_MUTANTS[1], _cases()[case_id])
    failures = failing_checks(result)
    assert set(failures) == {"int_workspace_per_wrapper"}, failures
    message = " ".join(failures["int_workspace_per_wrapper"])
    assert "overlapping bytes of one int workspace" in message and "flashinfer/prefill.py:" in message


def test_mla_layouts_are_refused_by_name() -> None:
    mla = next(c for c in _cases().values() if c.model.attention == "mla")
    with pytest.raises(ValueError, match="MLA"):
        RealFlashInferBuilder(mla)
    assert "BatchMLAPagedAttentionWrapper" in (layout_refusal(REAL, mla) or "")  # listed, not failed per check


@contextlib.contextmanager
def _reserved(case: Any) -> Iterator[Any]:
    """A run stopped right after the builder's reservation: its wrappers live on the declared arena."""
    run = driver.LifecycleRun(ProbeTarget(REAL, case, driver.make_device), driver.make_device(case))
    with run.device_mode():
        run.make_builders()
        builder = run.builders[0]
        run.manager.reserve("engine", builder.declared_workspace(case).float_bytes)
        builder.reserve_persistent_workspace(run.ctx(builder))
        yield builder


def _graph_prefill(ws: Any, qo: list[int], kv: list[int], page: int) -> tuple[Any, tuple[Any, ...]]:
    """A CUDA-graph FA2 prefill wrapper on ``ws`` and the worst batch's page table."""
    import flashinfer

    pages = [-(-k // page) for k in kv]
    host = (torch.tensor([0, *torch.tensor(qo).cumsum(0).tolist()], dtype=torch.int32),
            torch.tensor([0, *torch.tensor(pages).cumsum(0).tolist()], dtype=torch.int32),
            torch.arange(sum(pages), dtype=torch.int32),
            torch.tensor([k - (p - 1) * page for k, p in zip(kv, pages)], dtype=torch.int32))
    bufs = [t.to("cuda") for t in host]
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
        ws, "NHD", use_cuda_graph=True, backend="fa2", qo_indptr_buf=bufs[0], paged_kv_indptr_buf=bufs[1],
        paged_kv_indices_buf=bufs[2], paged_kv_last_page_len_buf=bufs[3])
    return w, host


@pytest.mark.parametrize("case_id", [LAYOUTS[0], LAYOUTS[3]])
def test_declared_bytes_are_what_the_real_wrapper_carves(case_id: str) -> None:
    """``workspace_covers_planner`` grounded: on the builder's own arena tensor, FlashInfer's wrapper plans the
    planner's worst batch at exactly the declared float bytes and overflows at 16 bytes fewer; the builder's
    own wrappers plan their routes' worst batches at the declared bytes."""
    case = _cases()[case_id]
    need = for_case(case)
    qo, kv, graph = list(need.worst_batch[0]), list(need.worst_batch[1]), need.worst_batch[2]
    assert need.worst_route == "prefill_cuda_graph" and graph
    heads, model, page = case.heads, case.model, case.envelope.page_size
    plan_kw = {"head_dim_vo": model.dim_vo, "causal": True, "q_data_type": torch.bfloat16,
               "kv_data_type": torch.bfloat16}
    with _reserved(case) as builder:
        declared = builder.declared_workspace(case).float_bytes
        assert declared == need.float_bytes
        arena = builder.slots[0].arena.tensor
        fits, host = _graph_prefill(arena[:declared], qo, kv, page)
        fits.plan(*host, heads.heads_q, heads.heads_kv, model.head_dim, page, **plan_kw)
        short, host = _graph_prefill(arena[:declared - 16], qo, kv, page)
        with pytest.raises(RuntimeError, match=OVERFLOW):
            short.plan(*host, heads.heads_q, heads.heads_kv, model.head_dim, page, **plan_kw)
        slot = builder.slots[0]
        for route, rs in need.routes.items():
            if rs.worst_batch is None or route.startswith("prefill"):
                continue
            rqo, rkv, rgraph = list(rs.worst_batch[0]), list(rs.worst_batch[1]), rs.worst_batch[2]
            wrapper = slot.graph.get(len(rqo)) if rgraph else slot.decode
            if wrapper is not None:
                builder._plan(slot, wrapper, "decode", rqo, rkv)
        builder._plan(slot, slot.prefill, "prefill", *(list(x) for x in need.routes["prefill"].worst_batch[:2]))


@pytest.mark.slow
def test_full_default_matrix() -> None:
    """Every possible non-MLA case of the default matrix: the backend passes every check, its twin fails."""
    cases = [c for c in _cases().values()
             if c.model.attention != "mla" and c.skip_reason is None and c.unsized_reason is None]
    bad, missed = {}, []
    for case in cases:
        failures = failing_checks(driver.run_lifecycle(REAL, case))
        if failures:
            bad[case.id] = failures
        if "persistent_memory_visible_at_closing" not in failing_checks(driver.run_lifecycle(LAZY, case)):
            missed.append(case.id)
    assert not bad, f"{len(bad)} cases fail, e.g. {next(iter(bad.items()))}"
    assert not missed, f"the lazy twin passes on {missed[:5]}"


def test_a_shared_int_workspace_is_found_from_flashinfers_wrappers_without_bound_workspaces() -> None:
    """Issue 37, point 2: the wrappers are found from FlashInfer's own objects in torch mode, so a builder that
    reports nothing in ``bound_workspaces()`` is judged too."""
    from pytest_kvprofile.builtin.flashinfer_real import SharedIntWorkspaceRealBuilder

    class Silent(SharedIntWorkspaceRealBuilder):
        name = "flashinfer-shared-int-silent"

        def bound_workspaces(self) -> list[Any]:
            return []

    backend = dataclasses.replace(REAL_FLASHINFER_MUTANTS[1], name=Silent.name, make_builders=lambda c: [Silent(c)])
    result = driver.run_lifecycle(backend, _cases()[LAYOUTS[0]])
    failures = failing_checks(result)
    assert "int_workspace_per_wrapper" in failures, failures
    assert any("took as its int workspace the one a live" in m for m in failures["int_workspace_per_wrapper"])
    correct = driver.run_lifecycle(REAL_FLASHINFER_BACKENDS[0], _cases()[LAYOUTS[0]])
    assert correct.shared_ints == [] and "int_workspace_per_wrapper" not in failing_checks(correct)
