"""Run backends over cases without pytest: the catch table of the mutant catalog, and sweeps.

The pytest suite is the interface for backend authors; this is the same checks as a plain loop,
for the project's own acceptance tests (the catch table of docs/checks.md).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable

from pytest_kvprofile.checks.catalog import CheckOptions, failing_checks
from pytest_kvprofile.contract.backends import layout_refusal
from pytest_kvprofile.contract.bug_classes import mutant_class
from pytest_kvprofile.lifecycle.driver import close_parts, run_lifecycle

if TYPE_CHECKING:
    from pytest_kvprofile.contract.backends import Backend
    from pytest_kvprofile.matrix.cases import Case


@dataclass
class Sweep:
    """Per backend: how often each check failed, the cases no check failed, and one message per check."""

    backend: str
    bug_class: int | None
    cases: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    escaped: list[str] = field(default_factory=list)
    examples: dict[str, str] = field(default_factory=dict)

    @property
    def caught_everywhere(self) -> bool:
        return self.cases > 0 and not self.escaped


def sweep(backends: Iterable[Backend], cases: Iterable[Case],
          options_for: Callable[[Backend], CheckOptions] = lambda backend: CheckOptions()) -> list[Sweep]:
    """``options_for(backend)``: the options a backend is judged under (the budget mutants carry a waste budget).
    A case the suite would not run on a backend (``layout_refusal``: the engine refuses it, or its routes are not
    sized) is left out, as the suite lists it as skipped."""
    cases = [c for c in cases if c.skip_reason is None]
    out = []
    for backend in backends:
        s = Sweep(backend.name, mutant_class(backend.name))
        for case in cases:
            if layout_refusal(backend, case) is not None:
                continue
            result = run_lifecycle(backend, case)
            close_parts(result)  # as the session does: teardown_clean reads the parts' close()
            failed = failing_checks(result, options_for(backend))
            s.cases += 1
            if not failed:
                s.escaped.append(case.id)
            for check, violations in failed.items():
                s.failures[check] += 1
                s.examples.setdefault(check, violations[0])
        out.append(s)
    return out


def catch_table(sweeps: list[Sweep]) -> list[str]:
    """Markdown: backend -> checks that failed (on how many cases), and cases where nothing failed."""
    lines = ["| backend | bug class | cases | failing checks (cases) | escaped |", "|---|---|---|---|---|"]
    for s in sweeps:
        checks = ", ".join(f"{name} ({n})" for name, n in sorted(s.failures.items())) or "none"
        lines.append(f"| {s.backend} | {s.bug_class or '-'} | {s.cases} | {checks} | {len(s.escaped)} |")
    return lines
