"""Issue 52, item 11: a refusal says what to do and names the author's file and line where the allocation, the view
or the plan was made (ctx mode too: the builder's line that called ``ctx.allocate`` or ``ctx.get_workspace``), and
the overrun does not blame the legitimate ``rebind()`` re-creations of what the lease release freed.

One mutant per check, on one ci case: the check's headline carries its remedy and a ``path.py:line``."""

from __future__ import annotations

import re
from typing import Any

import pytest

from pytest_kvprofile.builtin.mutants import MUTANT_BACKENDS, check_options_for
from pytest_kvprofile.checks.catalog import CHECKS, failing_checks
from pytest_kvprofile.lifecycle.driver import close_parts, run_lifecycle
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix

CI = {c.id: c for c in load_matrix(packaged_matrix("ci")).cases}
CASE = CI["qwen3-8b-tp1-dcp1-mtp0-l40s-gmu0.90"]
DCP_CASE = CI["qwen3-8b-tp4-dcp2-mtp0-l40s-gmu0.90"]  # trtllm-gen carves its LSE slab under DCP only
MUTANTS = {b.name: b for b in MUTANT_BACKENDS}
SITE = re.compile(r"[\w/.-]+\.py:\d+")

# check -> (mutant, its remedy, the author's file the line is in; None: the message names no allocation)
EXPECT: dict[str, tuple[str, str, str | None]] = {
    "persistent_memory_visible_at_closing": ("mutant-01-lazy-workspace", "Make it inside the profiling window",
                                             "stubs.py"),
    "lease_outlives_closing_measurement": ("mutant-02-early-release", "Do not release it yourself", None),
    "lease_released_before_graph_profiling": ("mutant-03-never-released", "Free what the lease held", "stubs.py"),
    "arena_stable_after_closing": ("mutant-04b-realloc-on-rebind", "ask no larger view after it", "mutants.py"),
    "arena_not_grown_after_lock": ("mutant-04c-swallowed-grow-after-lock", "ask that view before lock",
                                   "mutants.py"),
    "captured_memory_stays": ("mutant-04d-remakes-captured-index-buffers", "refill it in place",
                              "mutants_workspaces.py"),
    "ubatch_arenas_disjoint": ("mutant-05-ubatch-alias", "ctx.get_workspace(nbytes, ubatch)", None),
    "support_declaration": ("mutant-06c-neutral-frees-late-state-in-close", "Declare REQUIRED", "mutants.py"),
    "warmup_idempotent": ("mutant-07a-warmup-not-idempotent", "Return early once warmed", "mutants.py"),
    "warmup_retryable": ("mutant-07d-post-kv-warmup-leaks", "Free what a failed warmup made", "mutants.py"),
    "profile_replayed_after_warmup": ("mutant-08-profile-once", "Replay the profile run", "stubs.py"),
    "no_synthetic_workspace_in_capture": ("mutant-09-synthetic-in-capture", "Skip synthetic profiling work",
                                          "mutants.py"),
    "graph_pool_full_high_water": ("mutant-10-graph-gross-minus-retained", "graph_estimate='high_water'", None),
    "workspace_covers_planner": ("mutant-12-wrong-version-formula", "declare what `kvprofile size` says",
                                 "stubs.py"),
    "resource_capacity_honoured": ("mutant-13b-resource-over-capacity", "Declare the capacity it really holds",
                                   "resources.py"),
    "no_state_outlives_case": ("mutant-14a-global-after-kv-sizing", "Make it inside the profiling window",
                               "process_state.py"),
    "int_workspace_per_wrapper": ("mutant-15a-int-workspace-too-small", "Give each wrapper at least", "stubs.py"),
    "no_use_after_free": ("mutant-16a-plans-into-released-workspace", "Ask ctx.get_workspace() again", "stubs.py"),
    "no_post_kv_overrun": ("mutant-07d-post-kv-warmup-leaks", "Make what you keep inside the profiling window",
                           "mutants.py"),
    "legacy_path_unchanged": ("mutant-06b-unsupported-reserves", "Free what the window made", "stubs.py"),
    "teardown_clean": ("mutant-18b-close-double-free", "drop each allocation from the builder", "mutants.py"),
    "reservation_exception_safe": ("mutant-17a-reservation-keeps-partial", "Reuse or free what the failed attempt",
                                   "stubs.py"),
    "capture_retryable": ("mutant-07g-torch-failed-capture-keeps-step", "free what build() made",
                          "mutants_field.py"),
    "budget_counts_every_byte": ("mutant-10c-torch-runner-buffers-before-snapshot", "Take the engine's snapshot",
                                 "mutants_field.py"),
    "transient_peak_profiled": ("mutant-08b-gdn-scan-warmed-at-64-tokens", "Warm the scratch at the serving shape",
                                "mutants_field.py"),
    "trtllm_workspace_covers_launcher": ("mutant-11e-trtllm-no-lse-slab", "Size it as", "stubs.py"),
}


def _failed(name: str) -> dict[str, list[str]]:
    backend = MUTANTS[name]
    result = run_lifecycle(backend, DCP_CASE if name == "mutant-11e-trtllm-no-lse-slab" else CASE)
    close_parts(result)
    return failing_checks(result, check_options_for(backend))


@pytest.mark.parametrize("check", sorted(EXPECT))
def test_the_refusal_says_what_to_do_and_where(check: str) -> None:
    mutant, remedy, source = EXPECT[check]
    failed = _failed(mutant)
    assert check in failed, sorted(failed)
    head = failed[check][0]
    assert remedy in head, head
    if source is not None:
        sites = SITE.findall(head)
        assert any(s.rsplit(":", 1)[0].endswith(source) for s in sites), (source, head)


def test_every_check_is_held_to_a_remedy() -> None:
    assert set(EXPECT) == {c.name for c in CHECKS}


@pytest.mark.parametrize(("mutant", "check", "site"), [
    # ctx mode: what the retried reservation holds beside a clean one, at the builder's line
    ("mutant-17a-reservation-keeps-partial", "reservation_exception_safe",
     r"at \S+builtin/stubs\.py:\d+ in _new_wrapper"),
    # the error that replaced the injected one: where the builder raised it (its cleanup's double free)
    ("mutant-17c-cleanup-masks-first-error", "reservation_exception_safe",
     r"\(raised at \S+builtin/stubs\.py:\d+ in _drop\) instead of the out-of-memory error"),
    # a half-built warmup leaves nothing to point at: its warmup method is named
    ("mutant-07b-warmup-not-retryable", "warmup_retryable", r"\(warmup at \S+builtin/mutants\.py:\d+ in \w+\.warmup\)"),
    ("mutant-18a-close-raises", "teardown_clean", r"\(raised at \S+builtin/mutants\.py:\d+ in close\)"),
])
def test_a_probed_refusal_names_the_authors_line(mutant: str, check: str, site: str) -> None:
    head = _failed(mutant)[check][0]
    assert re.search(site, head), head


def test_a_ctx_mode_allocation_names_the_builders_line_and_its_call_site() -> None:
    head = _failed("mutant-13d-resource-made-in-late-warmup")["persistent_memory_visible_at_closing"][0]
    assert re.search(r"lifecycle/resources\.py:\d+ in _allocate \(builder call site \S+builtin/resources\.py:\d+ "
                     r"in warmup\)", head), head


def test_the_refusal_of_a_locked_arena_names_the_line_that_asked() -> None:
    head = _failed("mutant-04c-swallowed-grow-after-lock")["arena_not_grown_after_lock"][0]
    assert re.search(r"flashinfer in build\(\) at \S+builtin/mutants\.py:\d+ in build asked the locked arena", head)


def test_the_overrun_does_not_blame_what_rebind_made_again_for_the_released_lease() -> None:
    """The rebind() wrappers the lease release freed are context, not responsible allocations; what is left is the
    cause (the leaked autotune scratch), and an engine-side overrun blames no builder allocation."""
    head = _failed("mutant-07d-post-kv-warmup-leaks")["no_post_kv_overrun"][0]
    responsible, rest = head.split("Responsible allocations: ", 1)[1].split(". Not responsible, made again in "
                                                                          "rebind()", 1)
    assert "'autotune scratch'" in responsible and "from rebind()" not in responsible, head
    assert "'prefill int workspace [ubatch 0]'" in rest and "from rebind() in phase 'rebind'" in rest
    engine: Any = _failed("mutant-10-graph-gross-minus-retained")["no_post_kv_overrun"][0]
    assert "Responsible allocations: no builder allocation (engine accounting). Not responsible" in engine, engine
    assert "the engine's budget misses the rest" in engine
