"""The legacy path's cost: what a backend's parts allocate after KV sizing and keep, reported, not judged."""

from pytest_kvprofile.builtin.mutants import MUTANT_BACKENDS
from pytest_kvprofile.builtin.stubs import STUB_BACKENDS
from pytest_kvprofile.checks.base import CheckDetails, CheckOutcome
from pytest_kvprofile.checks.post_kv_cost import post_kv_cost
from pytest_kvprofile.lifecycle.driver import close_parts, run_lifecycle
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix
from pytest_kvprofile.report.summary import legacy_cost_lines

CASE = next(c for c in load_matrix(packaged_matrix("ci")).cases if c.id == "qwen3-8b-tp1-dcp1-mtp0-l40s-gmu0.98")


def _cost(name: str):
    backend = next(b for b in (*MUTANT_BACKENDS, *STUB_BACKENDS) if b.name == name)
    return post_kv_cost(run_lifecycle(backend, CASE))


def test_lazy_legacy_builders_cost_is_named_by_owner_and_summed_into_kv_tokens():
    cost = _cost("stub-mm-prefix")  # UNSUPPORTED mm-prefix keeps the model legacy; FlashInfer builds lazily
    assert cost is not None and cost.nbytes > 0
    assert {s.owner for s in cost.sources} >= {"flashinfer"}
    assert sum(s.nbytes for s in cost.sources) == cost.nbytes
    per_token = run_lifecycle(STUB_BACKENDS[0], CASE).budget.kv_bytes_per_token
    assert cost.kv_tokens == -(-cost.nbytes // per_token)
    assert "appear after the closing measurement on qwen3-8b-tp1-dcp1-mtp0-l40s-gmu0.98" in cost.describe()
    record = CheckOutcome("legacy_path_unchanged", "x", CASE.id, CheckDetails(legacy_cost=cost.as_dict()))
    line = legacy_cost_lines([record])[0]
    assert line.startswith("x (legacy path): on 1 cases") and f"{cost.kv_tokens} KV tokens" in line


def test_a_legacy_backend_that_allocates_nothing_prints_no_cost_line():
    cost = _cost("stub-gdn")
    assert cost.nbytes == 0 and cost.sources == ()
    assert legacy_cost_lines([CheckOutcome("legacy_path_unchanged", "gdn", CASE.id,
                                             CheckDetails(legacy_cost=cost.as_dict()))]) == []


def test_close_parts_records_a_raising_close_without_raising():
    class Raising:
        name = "r"

        def close(self):
            raise RuntimeError("boom")

    result = run_lifecycle(STUB_BACKENDS[0], CASE)
    result.builders.append(Raising())
    close_parts(result)
    assert result.errors[-1].phase == "teardown" and "close() raised: boom" in result.errors[-1].message
