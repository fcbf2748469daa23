#!/usr/bin/env python3
"""Recount the catch table: every mutant and built-in stub over every runnable case of the default matrix.

Usage::

    scripts/recount_catches.py [--jobs N] [--chunk CASES] [--only NAME ...] [--out tests/builtin/catch_counts.json]

Each backend runs in a spawned worker, through the slow sweep's own functions
(``tests/builtin/test_mutant_catalog.py``), and is held to the same asserts: a mutant fails exactly its declared
checks and escapes only on its listed equivalent layouts; a stub passes every case. The file is written after each
backend, so a stopped run resumes where it stopped. ``scripts/generate_catalogs.py --write`` then renders the catch
table of docs/checks.md from it.

Slow: 7 to 490 s per backend on 2 cores, and 900 s or more for the process-state mutants (14e to 14j), whose bug
leaves a thread or module state behind on every case: ``--chunk 300`` runs them in fresh workers.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "tests" / "builtin" / "catch_counts.json"
SLOWEST = ("mutant-14e", "mutant-14f", "mutant-14g", "mutant-14h", "mutant-14i", "mutant-14j")


def _catalog() -> Any:
    """The slow sweep's module (``tests/builtin/test_mutant_catalog.py``), importable from this tree."""
    for path in (str(ROOT / "tests" / "builtin"), str(ROOT)):
        if path not in sys.path:
            sys.path.insert(0, path)
    import test_mutant_catalog

    return test_mutant_catalog


def _backend(catalog: Any, name: str) -> Any:
    return next(b for b in (*catalog.MUTANT_BACKENDS, *catalog.STUB_BACKENDS) if b.name == name)


def _outcomes(task: tuple[str, int, int]) -> tuple[str, int, dict[str, Any], float]:
    """One backend on the default cases ``start:stop``, in a fresh worker: each case's outcome."""
    name, start, stop = task
    catalog = _catalog()
    backend = _backend(catalog, name)
    started = time.monotonic()
    results = catalog.outcomes(backend, list(catalog.default_cases())[start:stop])
    return name, start, results, time.monotonic() - started


def row(name: str, results: dict[str, Any], seconds: float) -> dict[str, Any]:
    """One backend's recount from every case's outcome, held to the slow sweep's asserts: failing checks by count,
    the cases where nothing failed, the asserts' problems."""
    catalog = _catalog()
    backend = _backend(catalog, name)
    cases = list(catalog.default_cases())
    problems = None
    try:
        if name in catalog.MUTANT_IDS:
            catalog._assert_mutant(backend, cases, results, full=True)
        else:
            catalog._assert_passes(backend, cases, results)
        catalog._assert_highest_gmu_shows_every_failure(results)
    except AssertionError as error:
        problems = str(error)[:3000]
    counts = Counter(check for outcome in results.values() for check in outcome.failed)
    return {"name": name, "cases": len(results), "counts": dict(sorted(counts.items())),
            "escaped": sum(1 for o in results.values() if not o.failed), "problems": problems,
            "seconds": round(seconds, 1)}


def _write(path: Path, done: dict[str, dict[str, Any]]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({name: done[name] for name in sorted(done)}, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2, help="spawned workers (default 2)")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="recount these backends again")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--chunk", type=int, default=0, metavar="CASES",
                        help="run a backend's cases in chunks of this many, each in a fresh worker (0: all in one); "
                             "each case starts from a fresh process's state, so the counts are the same")
    args = parser.parse_args(argv)
    catalog = _catalog()
    names = [b.name for b in (*catalog.MUTANT_BACKENDS, *catalog.STUB_BACKENDS)]
    unknown = sorted(set(args.only or ()) - set(names))
    if unknown:
        parser.error(f"--only: no mutant or stub named {', '.join(unknown)}")
    done = json.loads(args.out.read_text(encoding="utf-8")) if args.out.exists() else {}
    todo = list(args.only) if args.only else [n for n in names if n not in done]
    todo.sort(key=lambda n: n.startswith(SLOWEST))  # the slowest last: a stopped run keeps the most
    print(f"{len(todo)} to recount of {len(names)} over {len(catalog.default_cases())} cases", flush=True)
    total = len(catalog.default_cases())
    size = args.chunk or total
    tasks = [(name, start, min(start + size, total)) for name in todo for start in range(0, total, size)]
    parts: dict[str, dict[int, tuple[dict[str, Any], float]]] = {name: {} for name in todo}
    failed = 0
    with mp.get_context("spawn").Pool(args.jobs, maxtasksperchild=1 if args.chunk else 4) as pool:
        for name, start, results, seconds in pool.imap_unordered(_outcomes, tasks):
            parts[name][start] = (results, seconds)
            if len(parts[name]) < len(range(0, total, size)):
                continue
            merged = {cid: o for results, _ in parts[name].values() for cid, o in results.items()}
            done[name] = row(name, merged, sum(seconds for _, seconds in parts[name].values()))
            _write(args.out, done)
            failed += done[name]["problems"] is not None
            problem = done[name]["problems"]
            verdict = "PROBLEM: " + problem.splitlines()[0] if problem else "ok"
            print(f"{time.strftime('%H:%M:%S')} {name}: {done[name]['seconds']} s, {verdict}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
