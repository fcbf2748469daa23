"""Every mutant fails a check of its own bug class on every default-matrix case where its bug applies,
every correct stub passes every check there, and every check is shown to fail on a mutant of its class.

One test item per backend, so each backend's verdict is its own. The lifecycle and checks run as
plain functions (``tests/plugin/test_plugin_suite.py`` shows the same verdicts through pytest).
A plain run sweeps a covering subset of the default matrix's layouts at their highest gmu (see
:func:`representative_layouts`); the ``slow`` tests sweep every case and print the catch table:

    .venv/bin/pytest -m slow -s -p no:cacheprovider tests/builtin/test_mutant_catalog.py
"""

from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import pytest

from pytest_kvprofile.builtin.mutants import (
    EXPECTED_CATCHES,
    MUTANT_BACKENDS,
    WASTE_BUDGET,
    WrongVersionFormulaBuilder,
    check_options_for,
)
from pytest_kvprofile.builtin.stubs import ROUTE_STUB_BACKENDS, TORCH_STUB_BACKENDS
from pytest_kvprofile.builtin.stubs import STUB_BACKENDS as CTX_STUB_BACKENDS
from pytest_kvprofile.checks.catalog import CHECKS, failing_checks
from pytest_kvprofile.contract.bug_classes import mutant_class
from pytest_kvprofile.lifecycle.driver import close_parts, run_lifecycle
from pytest_kvprofile.matrix.cases import Case
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix
from pytest_kvprofile.memory.budget import KV_ALIGN
from pytest_kvprofile.report.sweep import catch_table, sweep
from pytest_kvprofile.sizing import for_case
from pytest_kvprofile.sizing.case import need_for_planned

GMU_DEPENDENT = "no_post_kv_overrun"
STUB_BACKENDS = (*CTX_STUB_BACKENDS, *TORCH_STUB_BACKENDS, *ROUTE_STUB_BACKENDS)
M12 = "mutant-12-wrong-version-formula"

# What each mutant fails over the default matrix: the catch table's columns (declared with each mutant).
EXPECTED_FAILURES: dict[str, set[str]] = {name: set(c.checks) for name, c in EXPECTED_CATCHES.items()}


def _m12_reserves_what_the_planner_needs(case: Case) -> str | None:
    """Why mutant 12 is correct on a case: the 0.6.x formula lands within the waste budget above need (on each
    micro-batch's arena)."""
    excess = WrongVersionFormulaBuilder(case).float_bytes() - for_case(case).float_bytes
    budget = WASTE_BUDGET.limit_bytes(1, None) or 0
    fits = 0 <= excess * case.envelope.num_ubatches <= budget
    return None if fits else f"0.6.x formula is {excess} B off the requirement"


# Layouts (case id without gmu) where a mutant is equivalent to the correct stub, each with the
# evidence that it is: no check may fail there, and the evidence must hold. Mutant 12: FlashInfer
# 0.7.x's CUDA-graph padding adds nothing the 0.6.x formula misses for head_dim 256 at TP 4 on
# 132 SMs (H100/H200, no MTP) and on the L40S's 142 SMs with MTP 1 or 3; it lands 1.13 to 1.63 MiB
# above the requirement on each of its two micro-batch arenas, inside the 4 MiB waste budget it is judged under.
def _every_route_needs_the_same(case: Case) -> str | None:
    """Why mutants 11c/11d are correct on a case: the smallest sub-route needs what the largest does, so a view
    sized for it covers every route planned into it."""
    needs = [r.float_bytes for r in for_case(case).routes.values()]
    return None if min(needs) == max(needs) else f"sub-routes need {min(needs)} to {max(needs)} B"


# Mutants 11c/11d size every view for the case's smallest sub-route: at MTP 3 with DCP (or TP 8) on these layouts
# every sub-route of the planner needs the same bytes, so they are the correct stub there.
SAME_NEED_LAYOUTS = frozenset([
    "llama-3-70b-tp8-dcp4-mtp3-b200", "llama-3-70b-tp8-dcp4-mtp3-rtx-pro-6000-blackwell",
    "glm-4-9b-32q2kv-tp4-dcp4-mtp3-b200", "glm-4-9b-32q2kv-tp2-dcp2-mtp3-rtx-pro-6000-blackwell",
    "glm-4-9b-32q2kv-tp4-dcp4-mtp3-rtx-pro-6000-blackwell", "gemma-2-9b-hd256-tp8-dcp4-mtp3-l40s",
    "gemma-2-9b-hd256-tp8-dcp4-mtp3-b200", "gemma-2-9b-hd256-tp8-dcp4-mtp3-rtx-pro-6000-blackwell",
])

EQUIVALENT: dict[str, tuple[frozenset[str], Callable[[Case], str | None]]] = {
    "mutant-11c-short-native-route": (SAME_NEED_LAYOUTS, _every_route_needs_the_same),
    "mutant-11d-torch-short-native-route": (SAME_NEED_LAYOUTS, _every_route_needs_the_same),
    M12: (frozenset(
        [f"gemma-2-9b-hd256-tp4-dcp{d}-mtp{m}-l40s" for d in (1, 2, 4) for m in (1, 3)]
        + [f"gemma-2-9b-hd256-tp4-dcp{d}-mtp0-{g}" for d in (1, 2, 4) for g in ("h100", "h200")]
    ), _m12_reserves_what_the_planner_needs),
}


@dataclass(frozen=True)
class Outcome:
    """One lifecycle's failing checks and how far the post-KV peak went past total x gmu (bytes)."""

    failed: dict[str, list[str]]
    overrun: int


def layout_id(case: Case) -> str:
    return case.id.rsplit("-gmu", 1)[0]


@functools.cache
def default_cases() -> tuple[Case, ...]:
    return tuple(c for c in load_matrix(packaged_matrix("default")).cases
                 if c.skip_reason is None and c.unsized_reason is None)


def _no_lse_asked(case: Case) -> str | None:
    """Why mutant 11e is correct on a case: without DCP no LSE is asked; the scratch is the launcher's whole carve."""
    return None if case.dcp == 1 else f"DCP {case.dcp} asks trtllm-gen for LSE"


# Mutant 11e sizes its trtllm-gen workspace for the multi-CTA scratch alone: correct wherever DCP is off.
EQUIVALENT["mutant-11e-trtllm-no-lse-slab"] = (
    frozenset(layout_id(c) for c in default_cases() if c.dcp == 1), _no_lse_asked)


def _graph_prefill_needs_no_more(case: Case) -> str | None:
    """Why mutant 11f is correct on a case: FlashInfer's CUDA-graph prefill plan needs no more than the eager one, so
    the view sized for eager prefill covers it."""
    graph, eager = need_for_planned(case, [("prefill", True)])[0], need_for_planned(case, [("prefill", False)])[0]
    return None if graph <= eager else f"graph prefill needs {graph} B, eager {eager} B"


# Mutant 11f plans CUDA-graph prefill into a view sized for eager prefill: where the graph plan needs no more (TP 8,
# and TP 2-4 on two KV heads), it is the correct stub.
EQUIVALENT["mutant-11f-prefill-graph-into-eager-view"] = (
    frozenset(layout_id(c) for c in default_cases() if _graph_prefill_needs_no_more(c) is None),
    _graph_prefill_needs_no_more)


def highest_gmu_per_layout(cases: Iterable[Case]) -> list[Case]:
    """Each layout (``case.layout_key``: everything but gmu) once, at its highest gmu.

    gmu enters only at KV sizing: every phase before it is identical across a layout's cases, and
    only ``no_post_kv_overrun`` reads gmu. The KV pool is total x gmu minus the non-KV bytes and
    the graph estimate, rounded down to a KV block; the highest gmu leaves the least headroom to
    the device's total, so an out-of-memory after KV sizing shows there first. Not kept by
    ``distinct_layout_cases``, which keeps a layout's first case (here the lowest gmu).

    What this hides: a post-KV excess under one KV block (2 MiB) shows as an overrun only where the
    rounding leaves less than it, which can be the lower gmu (mutant 10 on 22 layouts); such
    mutants are caught by their other own-class check on every case. The slow full sweep asserts
    that this is all the reduction hides (``_assert_highest_gmu_shows_every_failure``).
    """
    out: dict[tuple, Case] = {}
    for case in cases:
        best = out.get(case.layout_key)
        if case.skip_reason is None and (best is None or case.gmu > best.gmu):
            out[case.layout_key] = case
    return list(out.values())


def representative_layouts(cases: Iterable[Case]) -> list[Case]:
    """Of :func:`highest_gmu_per_layout`, enough layouts that every model x GPU meets each of its TP, DCP
    and MTP values, and its resource-carrying layouts, at least once (chosen greedily in matrix order).

    Why: the serving sweep made each lifecycle dearer, and 29 backends x 657 layouts would hold the
    project's test run above its one-minute budget; the bugs are per-phase behaviours that show on
    every layout (the slow full sweep proves it: every mutant is caught on every case), so a covering
    subset loses no mutant, while the exact catch-table columns are asserted by the slow sweep.
    """
    seen: set[tuple] = set()
    out = []
    for case in highest_gmu_per_layout(cases):
        pair = (case.model.name, case.gpu.name)
        keys = {(*pair, "tp", case.tp), (*pair, "dcp", case.dcp), (*pair, "mtp", case.mtp),
                (*pair, "resources", bool(case.resources))}
        if keys - seen:
            seen |= keys
            out.append(case)
    return out


def covering_layouts(cases: Iterable[Case]) -> list[Case]:
    """Of the representative layouts, enough that every model, GPU, TP, DCP and MTP value of the matrix, and a
    resource-carrying layout, is met at least once (greedily, in matrix order): a dozen layouts, where the
    representative ones are 195."""
    seen: set[tuple] = set()
    out = []
    for case in representative_layouts(cases):
        keys = {("model", case.model.name), ("gpu", case.gpu.name), ("tp", case.tp), ("dcp", case.dcp),
                ("mtp", case.mtp), ("resources", bool(case.resources))}
        if keys - seen:
            seen |= keys
            out.append(case)
    return out


def plain_run_layouts(backend: Any) -> list[Case]:
    """The plain run's layouts for a backend: the covering ones (``pytest -m slow`` runs every default case, and
    proves each mutant caught on every case its bug applies to); every fourth one in torch mode, where each
    lifecycle runs real torch calls and costs several times a context-mode one."""
    cases = covering_layouts(default_cases())
    return cases[::4] if backend.torch_mode else cases


def outcomes(backend: Any, cases: Iterable[Case]) -> dict[str, Outcome]:
    out = {}
    for case in cases:
        result = run_lifecycle(backend, case)
        close_parts(result)  # as the session does: teardown_clean reads the parts' close()
        out[case.id] = Outcome(failing_checks(result, check_options_for(backend)), result.post_kv_overrun)
    return out


@functools.cache
def full_outcomes(name: str) -> dict[str, Outcome]:
    """Every default case for one backend; shared by the slow tests of one process."""
    backend = next(b for b in (*MUTANT_BACKENDS, *STUB_BACKENDS) if b.name == name)
    return outcomes(backend, default_cases())


def _assert_mutant(backend: Any, cases: list[Case], results: dict[str, Outcome], *, full: bool) -> None:
    """Own bug class caught on every case but the listed equivalent ones; over the full sweep, the
    failing checks are exactly the catch table's columns (a subset of them over a covering subset)."""
    own = {c.name for c in CHECKS if mutant_class(backend.name) in c.bugs}
    layouts, evidence = EQUIVALENT.get(backend.name, (frozenset(), lambda case: None))
    swept = {layout_id(c) for c in cases}
    problems = [f"listed equivalent layout {lid} is not in the sweep" for lid in sorted(layouts - swept) if full]
    layouts = layouts & swept
    for case in cases:
        failed = results[case.id].failed
        if layout_id(case) in layouts:
            why_not = evidence(case)
            if failed or why_not:
                problems.append(f"{case.id} is listed equivalent but fails {sorted(failed)}; {why_not or ''}")
        elif not own & failed.keys():
            number = mutant_class(backend.name)
            problems.append(f"{case.id}: no check of bug class {number} failed, only {sorted(failed)}")
    seen = {name for r in results.values() for name in r.failed}
    expected = EXPECTED_FAILURES[backend.name]
    if (seen != expected) if full else not (own & expected & seen and seen <= expected):
        problems.append(f"fails {sorted(seen)}, expected {'' if full else 'a subset of '}{sorted(expected)}")
    assert not problems, f"{backend.name} on {len(cases)} cases:\n" + "\n".join(problems[:20])


def _assert_passes(backend: Any, cases: list[Case], results: dict[str, Outcome]) -> None:
    failing = {cid: {name: v[0] for name, v in r.failed.items()} for cid, r in results.items() if r.failed}
    assert len(results) == len(cases) and not failing, f"{backend.name} fails on {len(failing)} cases: " + \
        "; ".join(f"{cid}: {f}" for cid, f in list(failing.items())[:3])


def _assert_highest_gmu_shows_every_failure(results: dict[str, Outcome]) -> None:
    """What fails at a lower gmu fails at the layout's highest gmu, but for sub-block overruns."""
    by_layout: dict[tuple, list[Case]] = defaultdict(list)
    for case in default_cases():
        by_layout[case.layout_key].append(case)
    hidden = []
    for layout in by_layout.values():
        top = max(layout, key=lambda c: c.gmu)
        for case in layout:
            extra = results[case.id].failed.keys() - results[top.id].failed.keys()
            if extra - {GMU_DEPENDENT} or (GMU_DEPENDENT in extra and results[case.id].overrun >= KV_ALIGN):
                hidden.append((case.id, sorted(extra), results[case.id].overrun))
    assert not hidden, f"the highest-gmu sweep would hide: {hidden[:10]}"


MUTANT_IDS = [b.name for b in MUTANT_BACKENDS]
STUB_IDS = [b.name for b in STUB_BACKENDS]


def test_expected_failures_name_every_mutant_and_only_shipped_checks():
    assert set(EXPECTED_FAILURES) == set(MUTANT_IDS)
    assert set().union(*EXPECTED_FAILURES.values()) <= {c.name for c in CHECKS}


@pytest.mark.parametrize("backend", MUTANT_BACKENDS, ids=MUTANT_IDS)
def test_mutant_fails_its_own_bug_class_wherever_its_bug_applies(backend):
    cases = plain_run_layouts(backend)
    _assert_mutant(backend, cases, outcomes(backend, cases), full=False)


@pytest.mark.parametrize("backend", STUB_BACKENDS, ids=STUB_IDS)
def test_correct_stub_passes_every_check(backend):
    cases = plain_run_layouts(backend)
    _assert_passes(backend, cases, outcomes(backend, cases))


def test_the_representative_layouts_cover_every_axis_value():
    cases = representative_layouts(default_cases())
    every = highest_gmu_per_layout(default_cases())
    assert 0 < len(cases) < len(every) / 3
    for axis in ("tp", "dcp", "mtp"):
        for pair in {(c.model.name, c.gpu.name) for c in every}:
            want = {getattr(c, axis) for c in every if (c.model.name, c.gpu.name) == pair}
            got = {getattr(c, axis) for c in cases if (c.model.name, c.gpu.name) == pair}
            assert got == want, (pair, axis)
    assert any(c.resources for c in cases) and any(layout_id(c) in EQUIVALENT[M12][0] for c in cases)


@pytest.mark.parametrize("check", CHECKS, ids=[c.name for c in CHECKS])
def test_check_is_shown_to_fail_on_a_mutant_of_its_bug_class(check):
    """Static over the table; the per-mutant tests prove the table against the sweep."""
    catchers = [b.name for b in MUTANT_BACKENDS
                if check.name in EXPECTED_FAILURES[b.name] and mutant_class(b.name) in check.bugs]
    assert catchers, f"no mutant of bug classes {check.bugs} fails {check.name}"


@pytest.mark.slow
@pytest.mark.parametrize("backend", MUTANT_BACKENDS, ids=MUTANT_IDS)
def test_mutant_on_every_default_case(backend):
    results = full_outcomes(backend.name)
    _assert_mutant(backend, list(default_cases()), results, full=True)
    _assert_highest_gmu_shows_every_failure(results)


@pytest.mark.slow
@pytest.mark.parametrize("backend", STUB_BACKENDS, ids=STUB_IDS)
def test_stub_on_every_default_case(backend):
    results = full_outcomes(backend.name)
    _assert_passes(backend, list(default_cases()), results)
    _assert_highest_gmu_shows_every_failure(results)


@pytest.mark.slow
def test_catch_table_over_the_default_matrix():
    """``sweep`` and ``catch_table`` as the README shows them; run with ``-s`` to print the table."""
    cases = default_cases()
    sweeps = sweep(MUTANT_BACKENDS, cases, check_options_for)
    lines = catch_table(sweeps)
    print(f"\ncatch table over the default matrix ({len(cases)} runnable cases):\n" + "\n".join(lines))
    for s in sweeps:
        if s.escaped:
            print(f"{s.backend} escapes on: {', '.join(s.escaped)}")
    assert len(lines) == len(MUTANT_BACKENDS) + 2
    assert {s.backend: set(s.failures) for s in sweeps} == EXPECTED_FAILURES
    listed = {name: {c.id for c in cases if layout_id(c) in EQUIVALENT.get(name, (frozenset(),))[0]}
              for name in MUTANT_IDS}
    assert {s.backend: set(s.escaped) for s in sweeps} == listed
    assert {s.cases for s in sweeps} == {len(cases)}
