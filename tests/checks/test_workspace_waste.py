"""Waste is a cost, not a refusal; the routes a builder plans are the routes sized (issue 21.1-2, 22.4 and 22.8).

Each rule has a correct backend that the former rule refused (waste over a 2 MiB slack; every route sized
whatever the builder plans) and that passes now, and a buggy twin that is still refused: waste over a budget
the user sets, a native route planned into a short arena view, an unused trtllm-gen workspace and private float
buffers over a budget.
"""

from __future__ import annotations

import json

import pytest

from pytest_kvprofile.builtin.stubs import vllm_default_float_bytes
from pytest_kvprofile.checks.base import CheckOptions, CheckOutcome, WasteBudget, parse_waste_budget
from pytest_kvprofile.checks.workspace import case_waste, check_workspace_covers_planner
from pytest_kvprofile.engines.vllm.facts import VLLM_DEFAULT_FLOAT_BYTES
from pytest_kvprofile.lifecycle.driver import run_lifecycle
from pytest_kvprofile.matrix.models import kv_bytes_per_token
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix
from pytest_kvprofile.registry import builtin_backends
from pytest_kvprofile.report.summary import waste_costs, waste_lines, waste_reason
from pytest_kvprofile.sizing.case import need_for_routes
from pytest_kvprofile.units import MiB

CI = packaged_matrix("ci")
BACKENDS = builtin_backends()
BUDGET = CheckOptions(max_waste=WasteBudget(64.0))
NO_BUDGET = CheckOptions()


@pytest.fixture(scope="module")
def case():
    """qwen3-8b at TP 1 on an L40S: 147,456 KV bytes per token per rank, both routes FA2."""
    return next(c for c in load_matrix(CI).cases if c.id == "qwen3-8b-tp1-dcp1-mtp0-l40s-gmu0.90")


def _run(name: str, case):
    return run_lifecycle(BACKENDS[name], case)


@pytest.mark.parametrize(("text", "budget"), [
    ("64", WasteBudget(64.0, "MiB")), ("64 MiB", WasteBudget(64.0, "MiB")), ("2000 tok", WasteBudget(2000.0, "tok")),
    ("2000tokens", WasteBudget(2000.0, "tok")), ("1.5%", WasteBudget(1.5, "%")), (" 0 ", WasteBudget(0.0, "MiB")),
])
def test_waste_budget_parses_mib_tokens_and_percent(text, budget):
    assert parse_waste_budget(text) == budget


@pytest.mark.parametrize("text", ["", "lots", "-5", "5 GiB", "5%%"])
def test_a_bad_waste_budget_names_its_option(text):
    with pytest.raises(ValueError, match="kvprofile_max_waste"):
        parse_waste_budget(text, "ini option kvprofile_max_waste")


def test_a_budget_is_bytes_tokens_or_a_share_of_the_kv_pool():
    assert WasteBudget(64.0).limit_bytes(100, None) == 64 * MiB
    assert WasteBudget(10.0, "tok").limit_bytes(147_456, None) == 1_474_560
    assert WasteBudget(1.0, "%").limit_bytes(1, 1000 * MiB) == 10 * MiB
    assert WasteBudget(1.0, "%").limit_bytes(1, None) is None  # no KV pool sized: nothing to judge against


def test_the_pull_requests_default_arena_is_a_cost_not_a_refusal(case):
    """vLLM's default arena, max(394 MiB, tokens x heads x dim x 16 B): refused before (waste over the 2 MiB slack),
    passing now with its waste reported in bytes and KV tokens; refused again over a budget the user sets."""
    result = _run("stub-vllm-default-arena", case)
    have = 2 * vllm_default_float_bytes(case)  # two micro-batch arenas
    need = 2 * need_for_routes(case, None)[0]
    assert have - need > 2 * MiB
    assert check_workspace_covers_planner(result, NO_BUDGET) == []
    waste = case_waste(result)
    assert waste.nbytes == have - need
    assert waste.kv_tokens == -(-waste.nbytes // kv_bytes_per_token(case.model, case.tp, case.dcp))
    doc = waste.as_dict()
    assert doc["builders"][0]["sized_routes"] == ["prefill", "prefill_cuda_graph", "decode_tc", "decode_tc_cuda_graph"]
    assert json.loads(json.dumps(doc)) == doc
    over = check_workspace_covers_planner(result, BUDGET)
    assert len(over) == 1 and "over the waste budget of 64 MiB" in over[0] and f"{waste.kv_tokens} KV tokens" in over[0]


def test_every_route_on_trtllm_gen_needs_no_arena(case):
    """No native wrapper, zero arena, the trtllm-gen workspace made in the window: every check passes."""
    result = _run("stub-trtllm-gen", case)
    assert not result.grants
    from pytest_kvprofile.checks.catalog import failing_checks

    assert failing_checks(result, BUDGET) == {}
    waste = case_waste(result).builders[0]
    assert (waste.native, waste.sized, waste.trtllm, waste.waste_bytes) == ((), (), ("prefill", "decode"), 0)


def test_one_native_route_is_sized_for_that_route(case):
    """Decode native in views that name their route, prefill on trtllm-gen: sized for decode alone, no waste."""
    result = _run("stub-native-decode", case)
    assert {g.route for g in result.grants if g.requester == "flashinfer-native-decode"} == {"decode"}
    assert check_workspace_covers_planner(result, BUDGET) == []
    waste = case_waste(result).builders[0]
    assert waste.sized == ("decode_tc", "decode_tc_cuda_graph") and waste.trtllm == ("prefill",)
    assert waste.need_per_ubatch == need_for_routes(case, ("decode",))[0] < need_for_routes(case, None)[0]


@pytest.mark.parametrize("name", ["mutant-11c-short-native-route", "mutant-11d-torch-short-native-route"])
def test_a_native_route_planned_into_a_short_view_still_fails(name, case):
    violations = check_workspace_covers_planner(_run(name, case), NO_BUDGET)
    assert violations and all("short by" in v for v in violations)
    assert "routes prefill, prefill_cuda_graph" in violations[0]


def test_an_unused_trtllm_workspace_is_waste(case):
    """394 MiB made where every route plans natively: about 2,801 KV tokens per rank, refused over a budget."""
    result = _run("mutant-19c-unused-trtllm-workspace", case)
    waste = case_waste(result)
    assert waste.nbytes == VLLM_DEFAULT_FLOAT_BYTES and waste.kv_tokens == 2802
    assert check_workspace_covers_planner(result, NO_BUDGET) == []
    over = check_workspace_covers_planner(result, BUDGET)
    assert len(over) == 1 and "a trtllm-gen workspace no route uses" in over[0] and "'trtllm-gen workspace'" in over[0]


def test_private_float_buffers_count_in_what_a_builder_reserves(case):
    """A vLLM-style float workspace per wrapper beside the arena view: counted, refused over a budget."""
    result = _run("mutant-19d-private-float-workspace", case)
    waste = case_waste(result).builders[0]
    assert waste.private_bytes == 4 * VLLM_DEFAULT_FLOAT_BYTES  # prefill and decode wrappers, two micro-batches
    assert waste.float_waste == waste.private_bytes  # the arena itself is exactly the need
    over = check_workspace_covers_planner(result, BUDGET)
    assert len(over) == 1 and "own buffers 1576.00 MiB" in over[0]
    assert "'prefill private float workspace [ubatch 1]' 394.00 MiB (413138944 bytes)" in over[0]


def test_a_view_names_only_a_route_of_the_case(case):
    from pytest_kvprofile.contract.protocol import BuilderContext

    class Run:
        pass

    run = Run()
    run.case = case
    with pytest.raises(ValueError, match="route must be one of"):
        BuilderContext(run, "b").get_workspace(MiB, 0, route="xqa")


def test_the_summary_and_the_verdict_quote_the_worst_case():
    records = [CheckOutcome.from_json({
                "backend": "b", "check": "workspace_covers_planner", "case": c,
                "waste": {"case": c, "bytes": n * MiB, "mib": float(n), "kv_tokens": 7 * n, "kv_pool_percent": 1.0,
                          "builders": [{"builder": "fi", "sized_routes": ["decode_tc"], "float_waste_bytes": n * MiB,
                                        "arena_bytes": n * MiB, "private_float_bytes": 0, "unused_trtllm_bytes": 0,
                                        "waste_bytes": n * MiB}]}})
               for c, n in (("small", 3), ("big", 9), ("none", 0))]
    costs = waste_costs(records)["b"]
    assert [c["case"] for c in costs] == ["big", "small", "none"]
    reason = waste_reason(costs)
    assert "on 2 of 3 cases" in reason and "at most 9.00 MiB (9437184 bytes, 63 KV tokens per rank) on big" in reason
    lines = waste_lines(records)
    assert lines[0].startswith("b: workspace waste") and "routes sized decode_tc" in lines[1]
    assert waste_reason(waste_costs(records[2:])["b"]) is None


def _size(*args: str) -> dict:
    import contextlib
    import io

    from pytest_kvprofile.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["size", "--model", "qwen3-8b", "--gpu", "L40S", "--matrix", str(CI), "--json", *args]) == 0
    return json.loads(out.getvalue())


def test_kvprofile_size_says_which_routes_it_sized(case):
    """``--routes`` sizes the routes a builder plans natively, as the check does; the default is every route."""
    every, decode, none = _size(), _size("--routes", "decode"), _size("--routes", "")
    assert every["sized_routes"] == ["prefill", "prefill_cuda_graph", "decode_tc", "decode_tc_cuda_graph"]
    assert every["float_workspace_bytes"] == need_for_routes(case, None)[0] and every["trtllm_routes"] == []
    assert decode["sized_routes"] == ["decode_tc", "decode_tc_cuda_graph"] and decode["trtllm_routes"] == ["prefill"]
    assert decode["float_workspace_bytes"] == need_for_routes(case, ("decode",))[0]
    assert (none["float_workspace_bytes"], none["int_workspace_bytes"], none["sized_routes"]) == (0, 0, [])


def test_kvprofile_size_refuses_a_route_the_case_does_not_have(capsys):
    from pytest_kvprofile.cli import main

    assert main(["size", "--model", "qwen3-8b", "--gpu", "L40S", "--routes", "xqa"]) == 2
    assert "--routes: xqa is not a route of the case" in capsys.readouterr().err


def test_a_view_is_sized_for_the_batch_planned_into_it_not_for_its_name():
    """Issue 37, point 5: the prefill part of mixed batches sent into a view named route="decode" (sized for decode
    alone) is short for prefill; the correct builder that keeps decode-only views for decode passes."""
    from pytest_kvprofile import Backend
    from pytest_kvprofile.builtin.stubs import NativeDecodeBuilder

    class MixedIntoDecodeView(NativeDecodeBuilder):
        name = "mixed-into-decode-view"

        def build(self, ctx, batch):
            if batch.kind == "mixed":
                self._plan(ctx, self.wrappers[("decode", batch.ubatch)])
            else:
                super().build(ctx, batch)

    case = next(c for c in load_matrix(packaged_matrix("ci")).cases
                if c.id == "glm-4-9b-32q2kv-tp1-dcp1-mtp0-b200-gmu0.90")
    decode_need = need_for_routes(case, ("decode",))[0]
    assert need_for_routes(case, ("prefill",))[0] > decode_need  # the layout where the name matters
    bad = run_lifecycle(Backend(name="bad", make_builders=lambda c: [MixedIntoDecodeView(c)]), case)
    found = check_workspace_covers_planner(bad, CheckOptions())
    assert any("plans mixed batches (prefill) into an arena view named route='decode'" in v for v in found), found
    good = run_lifecycle(Backend(name="good", make_builders=lambda c: [NativeDecodeBuilder(c)]), case)
    assert check_workspace_covers_planner(good, CheckOptions()) == []


def test_the_same_waste_is_twice_the_kv_tokens_on_an_fp8_cache(case):
    """The KV tokens a cost is worth follow the case's KV dtype: with FP8 a cached token costs half the bytes."""
    import dataclasses

    fp8 = dataclasses.replace(case, model=dataclasses.replace(case.model, kv_dtype="fp8_e4m3"),
                              id=case.id + "-kvfp8_e4m3")
    bf16_waste, fp8_waste = (case_waste(_run("mutant-19c-unused-trtllm-workspace", c)) for c in (case, fp8))
    assert fp8_waste.nbytes == bf16_waste.nbytes == VLLM_DEFAULT_FLOAT_BYTES
    assert (bf16_waste.kv_tokens, fp8_waste.kv_tokens) == (2802, 5604)  # 394 MiB / 147,456 and / 73,728 B, up
