"""Where one case's CPU goes: its own lifecycle, each probe, and each check (``benchmarks/PROFILE.md``).

    python benchmarks/case_parts.py [--backend stub-flashinfer] [--cases 150]

Runs a built-in stub over the first runnable cases of a synthetic default-shaped matrix (``matrixgen``), three
of them once untimed first, timing each part in process CPU seconds. A probe runs inside the first check that
reads it, so its time is taken apart (``probe:NAME``) and the check's own is what remains. A measuring aid: it
prints, asserts nothing.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import matrixgen  # noqa: E402 - sys.path is set first


def measure(backend_name: str, count: int) -> tuple[collections.Counter[str], int]:
    import pytest_kvprofile.lifecycle.driver as driver
    import pytest_kvprofile.lifecycle.probes as probes
    from pytest_kvprofile.builtin.stubs import STUB_BACKENDS
    from pytest_kvprofile.checks.base import CheckOptions
    from pytest_kvprofile.checks.catalog import checks_for
    from pytest_kvprofile.matrix.schema import load_matrix

    backend = next(s for s in STUB_BACKENDS if s.name == backend_name)
    with tempfile.TemporaryDirectory() as tmp:
        cases = [c for c in load_matrix(matrixgen.write_matrix(Path(tmp), 2 * count)).cases
                 if c.skip_reason is None][:count]
    spent: collections.Counter[str] = collections.Counter()
    in_probe = [0.0]
    run_probe = probes.run_probe

    def timed_probe(result: Any, probe: str) -> Any:
        t = time.process_time()
        try:
            return run_probe(result, probe)
        finally:
            took = time.process_time() - t
            spent[f"probe:{probe}"] += took
            in_probe[0] += took

    options = CheckOptions()
    for case in cases[:3]:  # imports and first-call caches, untimed
        result = driver.run_lifecycle(backend, case)
        for check in checks_for(result.path):
            if check.relevant(result.case, result.builders):
                check.run(result, options)
    driver.run_probe = timed_probe  # type: ignore[attr-defined]
    for case in cases:
        t = time.process_time()
        result = driver.run_lifecycle(backend, case)
        spent["lifecycle"] += time.process_time() - t
        for check in checks_for(result.path):
            if check.relevant(result.case, result.builders):
                in_probe[0] = 0.0
                t = time.process_time()
                check.run(result, options)
                spent[f"check:{check.name}"] += time.process_time() - t - in_probe[0]
    return spent, len(cases)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="stub-flashinfer")
    parser.add_argument("--cases", type=int, default=150)
    args = parser.parse_args(argv)
    spent, n = measure(args.backend, args.cases)
    print(f"{args.backend}, {n} cases, CPU ms a case")
    for part, seconds in spent.most_common():
        print(f"{part:50s} {seconds / n * 1000:8.2f}")
    print(f"{'total':50s} {sum(spent.values()) / n * 1000:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
