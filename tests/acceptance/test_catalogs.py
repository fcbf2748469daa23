"""One record per catalog entry, and the docs that list them read the same records (issue 34.1): the bug classes
(``contract/bug_classes.py``) against ``docs/contract.md``, the checks' bug classes against the table, and the
catch table in ``docs/checks.md`` against the mutants (the class in each name, ``mutant_class``) and their expected
catches (``EXPECTED_CATCHES``, declared with each mutant: ``@mutant``).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pytest_kvprofile.builtin.flashinfer_real import REAL_FLASHINFER_MUTANTS
from pytest_kvprofile.builtin.mutants import EXPECTED_CATCHES, MUTANT_BACKENDS
from pytest_kvprofile.checks.catalog import CHECKS
from pytest_kvprofile.contract.bug_classes import BUG_CLASSES, bug_class, mutant_class

ROOT = Path(__file__).resolve().parents[2]
CHECK_NAMES = {c.name for c in CHECKS}


def _numbered_list(text: str, heading: str) -> dict[int, str]:
    """The ``1. ...`` list under ``heading``, each item's lines joined into one sentence."""
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    items: dict[int, str] = {}
    current = None
    for line in section.splitlines():
        m = re.match(r"(\d+)\. (.*)", line)
        if m:
            current = int(m.group(1))
            items[current] = m.group(2).strip()
        elif current is not None and line.startswith("    ") and line.strip():
            items[current] += " " + line.strip()
        elif not line.strip():
            current = None if items else current
    return items


def test_the_contract_lists_exactly_the_bug_class_table():
    listed = _numbered_list((ROOT / "docs" / "contract.md").read_text(), "## Bug classes")
    assert listed == {b.number: b.summary for b in BUG_CLASSES}


def test_bug_classes_are_numbered_in_order_and_unknown_ones_are_named():
    assert [b.number for b in BUG_CLASSES] == list(range(1, len(BUG_CLASSES) + 1))
    with pytest.raises(ValueError, match="unknown bug class 99"):
        bug_class(99)


def test_every_check_names_known_classes_and_every_class_has_a_check_and_a_mutant():
    numbers = {b.number for b in BUG_CLASSES}
    for check in CHECKS:
        assert check.bugs and set(check.bugs) <= numbers, (check.name, check.bugs)
    caught = {n for c in CHECKS for n in c.bugs}
    carried = {mutant_class(b.name) for b in MUTANT_BACKENDS}
    assert caught == numbers and carried == numbers


def _catch_table() -> dict[str, list[str]]:
    rows: dict[str, list[str]] = {}
    for line in (ROOT / "docs" / "checks.md").read_text().splitlines():
        if re.match(r"\| (gpu-)?mutant-", line):
            cols = [c.strip() for c in line.strip().strip("|").split("|")]
            name = cols[0].split()[0]
            assert name not in rows, f"docs/checks.md's catch table has two rows for {name}"
            rows[name] = cols
    return rows


def test_the_catch_table_is_the_catalog():
    rows = _catch_table()
    catalog = {b.name: b for b in MUTANT_BACKENDS}
    assert set(EXPECTED_CATCHES) == set(catalog)
    assert set(catalog) <= set(rows), f"docs/checks.md's catch table lacks {sorted(set(catalog) - set(rows))}"
    others = {b.name: b for b in REAL_FLASHINFER_MUTANTS}
    problems = []
    for name, cols in rows.items():
        backend = catalog.get(name) or others.get(name)
        if backend is None:
            problems.append(f"{name}: no such mutant")
            continue
        if cols[1] != str(mutant_class(backend.name)):
            problems.append(f"{name}: bug class {cols[1]} in docs/checks.md, {mutant_class(backend.name)} in its name")
        named = {w for w in re.findall(r"[a-z_]+", cols[2]) if w in CHECK_NAMES}
        if name in EXPECTED_CATCHES and named != EXPECTED_CATCHES[name].checks:
            expected = sorted(EXPECTED_CATCHES[name].checks)
            problems.append(f"{name}: docs/checks.md names {sorted(named)}, mutants.py {expected}")
        own = {c.name for c in CHECKS if mutant_class(backend.name) in c.bugs}
        if not named & own:
            problems.append(f"{name}: its row names no check of bug class {mutant_class(backend.name)}")
    assert not problems, "\n".join(problems)


def test_mutant_names_are_unique_across_the_catalogs():
    names = [b.name for b in (*MUTANT_BACKENDS, *REAL_FLASHINFER_MUTANTS)]
    ids = [re.match(r"mutant-(\d+[a-z]?)-", n).group(1) for n in names]  # type: ignore[union-attr]
    assert len(set(names)) == len(names) and len(set(ids)) == len(ids), sorted(i for i in ids if ids.count(i) > 1)
