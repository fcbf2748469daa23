#!/usr/bin/env python3
"""Fetch other flashinfer-python versions' planner headers, for the host oracle to compile against.

    python scripts/fetch_flashinfer_headers.py                     # the engines' pins + one of each generation
    python scripts/fetch_flashinfer_headers.py 0.6.9 0.7.2 --dest DIR

Each version's wheel is downloaded with ``pip download --no-deps`` (the ordinary client; nothing is installed)
and only ``flashinfer/data/include`` and ``flashinfer/data/cccl`` are unpacked, to ``DEST/<version>/flashinfer/``.
DEST defaults to ``$KVPROFILE_FLASHINFER_HEADERS``, else ``${XDG_CACHE_HOME:-~/.cache}/pytest-kvprofile/
flashinfer-headers``. Point ``KVPROFILE_FLASHINFER_HEADERS`` at DEST and ``required_workspace(...,
flashinfer_version=V)`` / ``sizing_method(V)`` use V's own planner; ``pytest -m slow tests/sizing/
test_generations.py`` checks every cached version. Tests never download.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# The engines' pins (FLASHINFER_PINS in pytest_kvprofile/engines/*/facts.py) and the first release of each planner
# generation (pytest_kvprofile.attention.planner.GENERATIONS), read without importing the package's heavy parts.
DEFAULT_VERSIONS = ("0.6.9", "0.6.12", "0.6.13", "0.6.14", "0.6.15", "0.6.16", "0.6.17", "0.6.18.post1", "0.7.0",
                    "0.7.1", "0.7.2", "0.7.2.post1")
KEEP = ("flashinfer/data/include/", "flashinfer/data/cccl/")


def default_dest() -> Path:
    env = os.environ.get("KVPROFILE_FLASHINFER_HEADERS")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "pytest-kvprofile" / "flashinfer-headers"


def fetch(version: str, dest: Path) -> str:
    out = dest / version
    if (out / "flashinfer/data/include/flashinfer/attention/scheduler.cuh").is_file():
        return f"{version}: already at {out}"
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               f"flashinfer-python=={version}", "-d", tmp]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            last = (res.stderr.strip().splitlines() or ["pip failed"])[-1]
            return f"{version}: not fetched ({last})"
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            for name in zf.namelist():
                if name.startswith(KEEP) and not name.endswith("/"):
                    zf.extract(name, out)
    return f"{version}: {out}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("versions", nargs="*", default=list(DEFAULT_VERSIONS))
    ap.add_argument("--dest", type=Path, default=None)
    args = ap.parse_args(argv)
    dest = args.dest or default_dest()
    dest.mkdir(parents=True, exist_ok=True)
    failed = 0
    for v in args.versions:
        line = fetch(v, dest)
        failed += "not fetched" in line
        print(line)
    print(f"export KVPROFILE_FLASHINFER_HEADERS={dest}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
