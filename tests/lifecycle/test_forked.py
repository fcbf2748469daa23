"""lifecycle/forked.py: a probe step in a forked child returns its value or raises its error in the parent, and a
child that dies is reported, so the probe re-runs the step in-process."""

import os

import pytest

from pytest_kvprofile.lifecycle import forked

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


def test_the_child_sees_the_parents_state_and_leaves_it_unchanged():
    state = {"made": [1, 2]}

    def step():
        state["made"].append(3)
        return list(state["made"]), os.getpid()

    made, pid = forked.in_child(step)
    assert made == [1, 2, 3] and pid != os.getpid()
    assert state == {"made": [1, 2]}


def test_an_error_in_the_child_is_raised_in_the_parent_with_its_cause():
    class Unpicklable(Exception):
        def __init__(self, a, b):
            super().__init__(f"{a}/{b}")

    def step():
        try:
            raise MemoryError("injected")
        except MemoryError as exc:
            raise Unpicklable(1, 2) from exc

    with pytest.raises(Exception) as info:
        forked.in_child(step)
    assert type(info.value).__name__ == "Unpicklable" and str(info.value) == "1/2"
    assert type(info.value.__cause__).__name__ == "MemoryError" and str(info.value.__cause__) == "injected"
    with pytest.raises(KeyError, match="gone"):
        forked.in_child(lambda: {}["gone"])


def test_a_child_that_dies_without_answering_is_reported():
    with pytest.raises(forked.ChildFailed, match="no answer"):
        forked.in_child(lambda: os._exit(3))


def test_forking_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("KVPROFILE_NO_FORK", "1")
    assert not forked.can_fork()
    monkeypatch.setenv("KVPROFILE_NO_FORK", "0")
    monkeypatch.setenv("KVPROFILE_PROBE_FORK", "auto")
    assert forked.can_fork()
    monkeypatch.setenv("KVPROFILE_PROBE_FORK", "never")
    assert not forked.can_fork()
    monkeypatch.delenv("KVPROFILE_PROBE_FORK")
    assert not forked.can_fork()  # opt-in: the default re-runs every prefix


def test_only_a_prefix_that_costs_more_than_a_fork_is_forked(monkeypatch):
    """auto: an engine's builders in torch mode fork; stubs and FlashInfer's own wrappers re-run their prefix."""
    monkeypatch.setenv("KVPROFILE_PROBE_FORK", "auto")
    assert forked.worth_forking(True, True)
    assert not any(forked.worth_forking(torch, engine) for torch, engine in ((True, False), (False, False)))
    monkeypatch.setenv("KVPROFILE_PROBE_FORK", "always")
    assert forked.worth_forking(False, False)
    monkeypatch.setenv("KVPROFILE_PROBE_FORK", "sometimes")
    with pytest.raises(ValueError, match="KVPROFILE_PROBE_FORK='sometimes': expected one of auto, always, never"):
        forked.can_fork()


@pytest.mark.parametrize("name", ["stub-flashinfer", "stub-flashinfer-torch", "mutant-07a-warmup-not-idempotent",
                                  "mutant-07b-warmup-not-retryable", "mutant-07e-torch-warmup-keeps-partial",
                                  "mutant-17a-reservation-keeps-partial", "mutant-17b-torch-reservation-keeps-partial",
                                  "mutant-17c-cleanup-masks-first-error"])
def test_probes_give_the_same_verdict_forked_and_on_fresh_builders(name, monkeypatch):
    from pytest_kvprofile.checks.catalog import failing_checks
    from pytest_kvprofile.lifecycle import probe_reservation, probe_warmup
    from pytest_kvprofile.lifecycle.driver import run_lifecycle
    from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix
    from pytest_kvprofile.registry import builtin_backends

    backend = builtin_backends()[name]
    case = next(c for c in load_matrix(packaged_matrix("ci")).cases if c.skip_reason is None)
    verdicts = []
    for policy in ("always", "never"):
        monkeypatch.setenv("KVPROFILE_PROBE_FORK", policy)
        probe_warmup._probe_simulated.cache_clear()
        probe_reservation._reservation_simulated.cache_clear()
        result = run_lifecycle(backend, case)
        verdicts.append(failing_checks(result))
    assert verdicts[0] == verdicts[1]
    assert bool(verdicts[0]) == name.startswith("mutant-"), verdicts[0]
