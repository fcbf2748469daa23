"""When the harness constructs a backend's builders, and how often (pytest_kvprofile/registry.py says why).

Per (backend, case): once at collection to classify the pair and once for the lifecycle; once at
configure, on the first runnable case, to inspect the backend; and, per distinct layout, once for the
warmup-retry probe's shared prefix, in each state where the main run saw the warmup allocate: its clean
warmup and each of its allocations (its fault points) run in children forked from it; where probes do not fork,
once for each of them (the probe ignores gmu, so it runs on the case with its id and gmu blanked).
"""

import json

import pytest

COUNTING_BACKEND = """
import collections
from pytest_kvprofile import Backend, Lease, ProfilingSupport, WorkspaceDeclaration

MADE = collections.Counter()


class Counted:
    name = "counted"
    warmup_materializes_persistent = True  # warmed inside the window, where its scratch is measured

    def __init__(self, case):
        MADE[case.id] += 1
        self.warmed = False

    def warmup(self, ctx):
        if not self.warmed:  # one transient scratch: one fault point for the probe
            ctx.free(ctx.allocate(1 << 20, "tuning scratch"))
            self.warmed = True

    def get_persistent_workspace_memory_profiling_support(self):
        return ProfilingSupport.REQUIRED

    def declared_workspace(self, case):
        from pytest_kvprofile.sizing import for_case
        need = for_case(case)
        return WorkspaceDeclaration(need.float_bytes, need.int_bytes)

    def reserve_persistent_workspace(self, ctx):
        return ctx.lease(())


def factory():
    return Backend(name="counted", make_builders=lambda case: [Counted(case)])
"""

CONFTEST = """
import json

def pytest_sessionfinish(session):
    import countedbk
    with open("made.json", "w") as f:
        json.dump(dict(countedbk.MADE), f)
"""


@pytest.mark.parametrize("policy", ["always", "never", "auto"], ids=["forked-probes", "fresh-probes", "auto"])
def test_builders_are_made_once_per_pair_for_the_lifecycle(pytester, suite_args, monkeypatch, policy):
    monkeypatch.setenv("KVPROFILE_PROBE_FORK", policy)
    no_fork = policy != "always"  # a context-mode backend's prefix costs less than a fork: auto re-runs it
    pytester.makepyfile(countedbk=COUNTING_BACKEND)
    pytester.makeconftest(CONFTEST)
    pytester.syspathinsert()
    result = pytester.runpytest(*suite_args, "-p", "no:xdist", "--kvprofile-backend", "countedbk:factory")
    assert result.ret == 0 and result.parseoutcomes()["passed"] > 30
    made = json.loads((pytester.path / "made.json").read_text())
    probe = made.pop("")
    first, *rest = made
    assert made[first] == 3, made  # inspect + classify + lifecycle
    assert rest and all(made[c] == 2 for c in rest), made  # classify + lifecycle
    # per layout (each case here has its own): the clean warmup inside the window and its one fault point, each
    # in a child forked from one shared prefix, or each on its own fresh builders where probes do not fork
    assert probe == (2 if no_fork else 1) * len(made), made
