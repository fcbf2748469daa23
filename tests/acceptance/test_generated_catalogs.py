"""The docs' generated catalog tables equal what ``scripts/generate_catalogs.py`` renders from the code."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _generator():
    spec = importlib.util.spec_from_file_location("generate_catalogs", ROOT / "scripts" / "generate_catalogs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_generated_table_is_current():
    assert _generator().stale() == {}, "run: python scripts/generate_catalogs.py --write"


def test_a_changed_row_is_found_stale_and_rewritten(tmp_path):
    gen = _generator()
    (tmp_path / "docs").mkdir()
    shutil.copy(ROOT / "docs" / "contract.md", tmp_path / "docs" / "contract.md")
    doc = tmp_path / "docs" / "contract.md"
    doc.write_text(doc.read_text().replace("| L4 | 58 |", "| L4 | 60 |"))
    stale = gen.stale(tmp_path)
    assert set(stale) == {"gpus"}
    path, new = stale["gpus"]
    path.write_text(new)
    assert gen.stale(tmp_path) == {}
    assert "| L4 | 58 | 24 GB | PCIe | 8.9 |" in doc.read_text()
