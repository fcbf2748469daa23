"""Regenerate the docs' catalog tables from the code, between ``<!-- generated: NAME -->`` and
``<!-- end generated: NAME -->`` markers.

    python scripts/generate_catalogs.py          # exit 1 and name the stale tables
    python scripts/generate_catalogs.py --write  # rewrite them in place

Tables done so far:

- ``gpus`` (docs/contract.md): from ``matrix/gpus.py``;
- ``checks`` (docs/checks.md): from ``checks/catalog.py``'s ``CHECKS``, each check's own ``rule`` (the test's
  docstring and the failure's first line say the same);
- ``catches`` (docs/checks.md): each mutant's declaration (``@mutant``: class, checks, options) with the cases each
  check failed on in the last recount over the default matrix, ``tests/builtin/catch_counts.json``
  (``scripts/recount_catches.py`` writes it);
- ``bug_classes`` (docs/contract.md): ``contract/bug_classes.py``'s ``BUG_CLASSES``;
- ``options`` (docs/reference.md): what the plugin's ``pytest_addoption`` adds, each option beside its ini twin,
  its ``help`` the meaning (``pytest --help`` prints the same).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent

_GPU_LABELS = {"H100": "H100 (SXM)"}  # the doc's name where the catalog's alone is ambiguous
_INTERCONNECT = {"nvlink": "NVLink", "pcie": "PCIe"}


def gpu_table() -> str:
    from pytest_kvprofile.matrix.gpus import GPU_CATALOG
    from pytest_kvprofile.units import GB

    rows = ["| GPU | SMs | memory | interconnect | CC |", "|---|---|---|---|---|"]
    for gpu in GPU_CATALOG.values():
        cc = ".".join(map(str, gpu.compute_capability))
        rows.append(f"| {_GPU_LABELS.get(gpu.name, gpu.name)} | {gpu.num_sm} | {gpu.memory_bytes // GB} GB | "
                    f"{_INTERCONNECT[gpu.interconnect]} | {cc} |")
    return "\n".join(rows)


def checks_table() -> str:
    """One row per check, in the order the suite runs them: its path, bug classes and rule."""
    from pytest_kvprofile.checks.catalog import CHECKS

    rows = ["| check | path | bug classes | rule |", "|---|---|---|---|"]
    rows += [f"| `{c.name}` | {c.path} | {', '.join(map(str, c.bugs))} | {c.rule} |" for c in CHECKS]
    return "\n".join(rows)


CATCH_COUNTS = ROOT / "tests" / "builtin" / "catch_counts.json"


def catch_table() -> str:
    """One row per mutant: its label, class, each declared check with the cases it failed on, and the cases where
    nothing failed. Own-class checks first, then the collateral ones, each by cases failed."""
    from pytest_kvprofile.builtin.mutants import MUTANTS
    from pytest_kvprofile.checks.catalog import CHECKS

    counts = json.loads(CATCH_COUNTS.read_text(encoding="utf-8"))
    rows = ["| mutant | bug class | failing checks (cases) | escaped |", "|---|---|---|---|"]
    for mutant in MUTANTS:
        recount = counts.get(mutant.name)
        if recount is None:
            raise SystemExit(f"{CATCH_COUNTS.relative_to(ROOT)}: no recount of {mutant.name}; "
                             f"run scripts/recount_catches.py --only {mutant.name}")
        own = {c.name for c in CHECKS if mutant.bug_class in c.bugs}
        checks = sorted(mutant.catches, key=lambda c: (c not in own, -recount["counts"].get(c, 0), c))
        labels = ["torch mode"] * mutant.backend.torch_mode
        if mutant.options is not None and mutant.options.max_waste is not None:
            budget = mutant.options.max_waste
            labels.append(f"{budget.amount:g} {budget.unit} waste budget")
        label = f" ({', '.join(labels)})" if labels else ""
        failing = ", ".join(f"{c} ({recount['counts'].get(c, 0)})" for c in checks)
        rows.append(f"| {mutant.name}{label} | {mutant.bug_class} | {failing} | {recount['escaped']} |")
    return "\n".join(rows)


def bug_class_list() -> str:
    """The numbered list of bug classes, wrapped as the docs' Markdown is (116 columns, 4-space continuation)."""
    from pytest_kvprofile.contract.bug_classes import BUG_CLASSES

    return "\n".join(textwrap.fill(b.summary, width=116, initial_indent=f"{b.number}. ", subsequent_indent="    ",
                                   break_long_words=False, break_on_hyphens=False) for b in BUG_CLASSES)


class _Options:
    """Stands in for pytest's parser and its option group: records what ``pytest_addoption`` adds, in order."""

    def __init__(self) -> None:
        self.options: list[tuple[str, str | None, str]] = []  # (name, metavar, help)
        self.inis: dict[str, str] = {}

    def getgroup(self, *args: object, **kwargs: object) -> _Options:
        return self

    def addoption(self, *names: str, metavar: str | None = None, help: str = "", **kwargs: object) -> None:
        self.options += [(n, metavar, help.replace("%%", "%")) for n in names if n.startswith("--kvprofile")]

    def addini(self, name: str, help: str, **kwargs: object) -> None:
        self.inis[name] = help


def _as_code(help_text: str) -> str:
    """A help string as Markdown: its quoted literals, options and ini keys in backticks."""
    text = re.sub(r"(?<![A-Za-z])'([^']+)'(?![A-Za-z])", r"`\1`", help_text)
    parts = text.split("`")  # the odd parts are code already
    for i in range(0, len(parts), 2):
        parts[i] = re.sub(r"(--[a-z][a-z-]+|\b[a-z]+(?:_[a-z]+)+\b)", r"`\1`", parts[i])
    return "`".join(parts)


def options_table() -> str:
    """One row per ``--kvprofile-*`` option, beside its ini twin, then the ini keys without one."""
    from pytest_kvprofile.plugin import pytest_addoption

    parser = _Options()
    pytest_addoption(parser)  # type: ignore[arg-type]
    rows = ["| option | ini | meaning |", "|---|---|---|"]
    twins = set()
    for name, metavar, meaning in parser.options:
        ini = name.lstrip("-").replace("-", "_")
        twin = f"`{ini}`" if ini in parser.inis else ""
        twins.add(ini)
        rows.append(f"| `{name}{' ' + metavar if metavar else ''}` | {twin} | {_as_code(meaning)} |")
    rows += [f"| | `{ini}` | {_as_code(meaning)} |" for ini, meaning in parser.inis.items() if ini not in twins]
    return "\n".join(rows)


TABLES: dict[str, tuple[str, Callable[[], str]]] = {
    "gpus": ("docs/contract.md", gpu_table),
    "checks": ("docs/checks.md", checks_table),
    "catches": ("docs/checks.md", catch_table),
    "bug_classes": ("docs/contract.md", bug_class_list),
    "options": ("docs/reference.md", options_table),
}


def _block(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- generated: {name} -->\n)(.*?)(\n<!-- end generated: {name} -->)", re.S)


def stale(root: Path = ROOT) -> dict[str, tuple[Path, str]]:
    """The tables whose block differs from the code: name -> (file, the file's text with the block regenerated)."""
    out = {}
    for name, (rel, render) in TABLES.items():
        path = root / rel
        text = path.read_text(encoding="utf-8")
        match = _block(name).search(text)
        if match is None:
            raise SystemExit(f"{rel}: no '<!-- generated: {name} -->' block")
        new = text[: match.start(2)] + render() + text[match.end(2):]
        if new != text:
            out[name] = (path, new)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the stale tables in place")
    args = parser.parse_args(argv)
    changed = stale()
    for name, (path, new) in changed.items():
        if args.write:
            path.write_text(new, encoding="utf-8")
        print(f"{'rewrote' if args.write else 'stale'}: {name} in {path.relative_to(ROOT)}")
    return 1 if changed and not args.write else 0


if __name__ == "__main__":
    sys.exit(main())
