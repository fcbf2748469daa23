"""Failure messages a person reads: hundreds of like allocations are one line with a count (issue 21.9).

A real-wrapper backend once printed 2,320 lines for one check, one per allocation. Each check below is
driven with a builder that keeps 300 like allocations, and its message must group them (owner, tag, bytes,
method, phase, source line, with the count and the total) and stay short.
"""

from __future__ import annotations

from typing import Any

import pytest

from pytest_kvprofile import Backend, BuilderContext, EnginePolicy, run_lifecycle
from pytest_kvprofile.builtin.stubs import FlashInferLikeBuilder, MMPrefixLikeBuilder
from pytest_kvprofile.checks.base import CheckOptions
from pytest_kvprofile.checks.resources import check_resource_capacity_honoured
from pytest_kvprofile.checks.support import check_legacy_path_unchanged
from pytest_kvprofile.checks.warmup import check_profile_replayed_after_warmup
from pytest_kvprofile.matrix.schema import load_matrices, packaged_matrix
from pytest_kvprofile.registry import builtin_backends
from pytest_kvprofile.units import MiB

MANY = 300


@pytest.fixture(scope="module")
def case() -> Any:
    return next(c for c in load_matrices([packaged_matrix("ci")])[0].cases if c.skip_reason is None)


class KeepsPagesOnTheLegacyPath(MMPrefixLikeBuilder):
    """UNSUPPORTED, yet keeps 300 staging pages from the profile run (legacy_path_unchanged's bug)."""

    def __init__(self, case: Any) -> None:
        super().__init__(case)
        self.pages: list[Any] = []

    def dummy_run(self, ctx: BuilderContext) -> None:
        super().dummy_run(ctx)
        if ctx.profiling and not self.pages:
            self.pages = [ctx.allocate(MiB, "staging page") for _ in range(MANY)]


class WarmsManyEntries(FlashInferLikeBuilder):
    """Its in-window warmup keeps 300 autotune entries; the engine does not replay the profile (bug 8)."""

    def __init__(self, case: Any) -> None:
        super().__init__(case)
        self.entries: list[Any] = []

    def warmup(self, ctx: BuilderContext) -> None:
        if not self.entries:
            self.entries = [ctx.allocate(MiB, "autotune entry") for _ in range(MANY)]
        super().warmup(ctx)


def _one_grouped_line(violations: list[str], tag: str) -> None:
    assert len(violations) == 1, violations
    (message,) = violations
    assert f"{tag!r} 1.00 MiB (1048576 bytes) x {MANY} = {MANY:.2f} MiB" in message, message
    assert message.count(repr(tag)) == 1 and len(message) < 1000, message


def test_legacy_path_unchanged_groups_what_the_window_left(case):
    backend = Backend(name="keeps-pages", make_builders=lambda c: [FlashInferLikeBuilder(c),
                                                                    KeepsPagesOnTheLegacyPath(c)])
    violations = check_legacy_path_unchanged(run_lifecycle(backend, case), CheckOptions())
    _one_grouped_line(violations, "staging page")
    assert f"{MANY:.2f} MiB ({MANY * MiB} bytes)" in violations[0] and "phase 'profile_run'" in violations[0]


def test_profile_replayed_after_warmup_groups_what_the_warmup_made(case):
    backend = Backend(name="warms-many", make_builders=lambda c: [WarmsManyEntries(c)],
                      policy=EnginePolicy(replay_after_warmup=False))
    violations = check_profile_replayed_after_warmup(run_lifecycle(backend, case), CheckOptions())
    _one_grouped_line(violations, "autotune entry")
    assert "from warmup() in phase 'profile_warmup'" in violations[0]


def test_resource_capacity_message_is_grouped_and_says_what_to_do(case):
    violations = check_resource_capacity_honoured(
        run_lifecycle(builtin_backends()["mutant-13b-resource-over-capacity"], case), CheckOptions())
    assert len(violations) == 1 and " from materialize() in phase " in violations[0]
    assert violations[0].endswith("Declare the capacity it really holds, or allocate within it")
