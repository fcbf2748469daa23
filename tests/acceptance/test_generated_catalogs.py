"""The docs' generated catalog tables equal what ``scripts/generate_catalogs.py`` renders from the code."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("generate_catalogs", ROOT / "scripts" / "generate_catalogs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _copy_docs(tmp_path):
    (tmp_path / "docs").mkdir()
    for page in ("contract.md", "checks.md", "reference.md"):
        shutil.copy(ROOT / "docs" / page, tmp_path / "docs" / page)


def test_every_generated_table_is_current():
    assert _generator().stale() == {}, "run: python scripts/generate_catalogs.py --write"


def test_a_changed_row_is_found_stale_and_rewritten(tmp_path):
    gen = _generator()
    _copy_docs(tmp_path)
    doc = tmp_path / "docs" / "contract.md"
    doc.write_text(doc.read_text().replace("| L4 | 58 |", "| L4 | 60 |"))
    stale = gen.stale(tmp_path)
    assert set(stale) == {"gpus"}
    path, new = stale["gpus"]
    path.write_text(new)
    assert gen.stale(tmp_path) == {}
    assert "| L4 | 58 | 24 GB | PCIe | 8.9 |" in doc.read_text()


def test_a_changed_check_rule_or_catch_count_is_found_stale(tmp_path):
    gen = _generator()
    _copy_docs(tmp_path)
    doc = tmp_path / "docs" / "checks.md"
    text = (ROOT / "docs" / "checks.md").read_text()
    row = "| mutant-17a-reservation-keeps-partial | 17 | reservation_exception_safe (1812) | 0 |"
    assert row in text
    doc.write_text(text.replace(row, row.replace("(1812)", "(1811)")))
    assert set(gen.stale(tmp_path)) == {"catches"}
    rule = "| `warmup_idempotent` | profiling | 7 | a second warmup allocates nothing |"
    assert rule in text
    doc.write_text(text.replace(rule, rule.replace("nothing", "little")))
    assert set(gen.stale(tmp_path)) == {"checks"}


def test_a_changed_bug_class_or_option_is_found_stale(tmp_path, monkeypatch):
    """Both ways: an edited doc line is stale, and so is the doc when the code's record changes."""
    from pytest_kvprofile.contract import bug_classes

    gen = _generator()
    _copy_docs(tmp_path)
    contract, reference = tmp_path / "docs" / "contract.md", tmp_path / "docs" / "reference.md"
    line = "5. micro-batch arenas aliasing each other"
    contract.write_text(contract.read_text().replace(line, line.replace("each other", "one another")))
    assert set(gen.stale(tmp_path)) == {"bug_classes"}
    shutil.copy(ROOT / "docs" / "contract.md", contract)
    renamed = tuple(bug_classes.BugClass(b.number, b.summary + "!") if b.number == 5 else b
                    for b in bug_classes.BUG_CLASSES)
    monkeypatch.setattr(bug_classes, "BUG_CLASSES", renamed)
    assert set(gen.stale(tmp_path)) == {"bug_classes"}
    monkeypatch.undo()
    row = "| `--kvprofile-verdict PATH` | `kvprofile_verdict` | the opt-in verdict (attach it) |"
    assert row in reference.read_text()
    reference.write_text(reference.read_text().replace(row, row.replace("attach", "keep")))
    assert set(gen.stale(tmp_path)) == {"options"}


def test_the_options_table_renders_help_as_markdown():
    gen = _generator()
    assert gen._as_code("MiB ('64') or --collect-only, like kvprofile_max_waste; vLLM's") == \
        "MiB (`64`) or `--collect-only`, like `kvprofile_max_waste`; vLLM's"


def test_the_recount_is_of_every_mutant_and_stub_and_held_them_to_the_sweep():
    """The counts the catch table is rendered from: one recount per mutant and stub, none with a problem, each
    mutant failing exactly its declared checks, each stub failing nothing."""
    from pytest_kvprofile.builtin.mutants import MUTANTS
    from pytest_kvprofile.builtin.stubs import ROUTE_STUB_BACKENDS, STUB_BACKENDS, TORCH_STUB_BACKENDS

    counts = json.loads((ROOT / "tests" / "builtin" / "catch_counts.json").read_text())
    stubs = {b.name for b in (*STUB_BACKENDS, *TORCH_STUB_BACKENDS, *ROUTE_STUB_BACKENDS)}
    assert set(counts) == {m.name for m in MUTANTS} | stubs, "run: scripts/recount_catches.py"
    assert {row["cases"] for row in counts.values()} == {1812}
    assert [name for name, row in counts.items() if row["problems"]] == []
    assert {m.name: set(counts[m.name]["counts"]) for m in MUTANTS} == {m.name: set(m.catches) for m in MUTANTS}
    assert {name: (counts[name]["counts"], counts[name]["escaped"]) for name in stubs} == \
        {name: ({}, 1812) for name in stubs}
