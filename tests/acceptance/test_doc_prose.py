"""Every docs page reads in short sentences and short paragraphs (scripts/doc_stats.py measures them)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs").glob("*.md"))


def _doc_stats() -> ModuleType:
    if "doc_stats" in sys.modules:
        return sys.modules["doc_stats"]
    spec = importlib.util.spec_from_file_location("doc_stats", ROOT / "scripts" / "doc_stats.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["doc_stats"] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_the_page_keeps_its_sentences_and_paragraphs_short(page: Path) -> None:
    stats = _doc_stats().measure(page)
    assert not stats.problems, f"docs/{page.name}: {'; '.join(stats.problems)} (scripts/doc_stats.py)"


def test_a_long_paragraph_or_long_sentences_are_caught(tmp_path: Path) -> None:
    doc_stats = _doc_stats()
    short = "The check reads the run. It names the bytes.\n\n| a table | is not prose " + "word " * 200 + "|\n"
    page = tmp_path / "page.md"
    page.write_text(short)
    assert doc_stats.measure(page).problems == []
    page.write_text(short + "\n" + "A planted paragraph runs on. " * 30 + "\n")
    assert any("paragraph of 150 words" in p for p in doc_stats.measure(page).problems)
    page.write_text(" ".join(["one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
                              "fifteen sixteen seventeen eighteen nineteen twenty twentyone."] * 3) + "\n")
    assert any("median sentence 21" in p for p in doc_stats.measure(page).problems)
