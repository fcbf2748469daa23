"""Regenerate the docs' catalog tables from the code, between ``<!-- generated: NAME -->`` and
``<!-- end generated: NAME -->`` markers.

    python scripts/generate_catalogs.py          # exit 1 and name the stale tables
    python scripts/generate_catalogs.py --write  # rewrite them in place

Tables done so far: ``gpus`` (docs/contract.md, from ``matrix/gpus.py``). The others (checks, bug classes, catch
table, options) are still kept by hand and checked by tests/acceptance/test_docs.py and test_catalogs.py.
"""

from __future__ import annotations

import argparse
import re
import sys
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


TABLES: dict[str, tuple[str, Callable[[], str]]] = {"gpus": ("docs/contract.md", gpu_table)}


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
