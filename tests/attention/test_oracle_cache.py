"""The oracle cache under hostile conditions, with a fake compiler so that no test waits on nvcc.

tests/sizing/test_oracle.py already covers: a fresh cache built once by three processes, a
truncated library rebuilt, a group/other-writable library refused, the oracle dir's mode 0700,
and a compiler failure carrying the command and the compiler's stderr. This file adds what those
leave open: a foreign library or a lost digest, a library swapped after verification (never handed
to ctypes), a library owned by someone else, the modes of every cache entry, and processes racing
to repair a corrupted cache.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import stat
import time
from pathlib import Path
from typing import Any

import pytest

from pytest_kvprofile.attention import oracle as oracle_mod
from pytest_kvprofile.attention import oracle_build


@pytest.fixture
def fake_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fake nvcc (for the cache key) and a fake compile that records each build in ``builds/``."""
    bin_dir = tmp_path / "cuda" / "bin"
    bin_dir.mkdir(parents=True)
    nvcc = bin_dir / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'fake nvcc 1.0'\n")
    nvcc.chmod(0o755)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    monkeypatch.setenv("KVPROFILE_CACHE_DIR", str(tmp_path / "cache"))
    builds = tmp_path / "builds"
    builds.mkdir()

    def compile_(install: Any, nvcc: Path, workdir: Path) -> tuple[Path, list[str]]:
        time.sleep(0.3)  # long enough for racing processes to overlap
        (builds / f"{os.getpid()}-{time.monotonic_ns()}").touch()
        lib = workdir / oracle_mod.LIB_NAME
        lib.write_bytes(b"\x7fELF fake oracle " + os.urandom(64))
        return lib, [str(nvcc), "fake"]

    monkeypatch.setattr(oracle_build, "_compile", compile_)
    return builds


def _refuse_cdll(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    loaded: list[str] = []

    def cdll(path: str) -> Any:
        loaded.append(path)
        raise AssertionError(f"ctypes.CDLL({path}) was called")

    monkeypatch.setattr(oracle_mod.ctypes, "CDLL", cdll)
    return loaded


@pytest.mark.parametrize("damage", ["foreign library", "lost digest", "foreign digest"])
def test_a_damaged_entry_is_rebuilt(fake_build: Path, damage: str) -> None:
    lib = oracle_mod.ensure_built()
    digest = lib.parent / oracle_mod.DIGEST_NAME
    if damage == "foreign library":
        lib.write_bytes(Path("/bin/true").read_bytes())
    elif damage == "lost digest":
        digest.unlink()
    else:
        digest.write_text("0" * 64 + "\n")
    again = oracle_mod.ensure_built()
    assert len(list(fake_build.iterdir())) == 2
    assert again == lib and oracle_build._valid_build(lib.parent)


def test_a_library_swapped_after_verification_never_reaches_ctypes(fake_build: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    lib = oracle_mod.ensure_built()
    lib.write_bytes(b"\x7fELF swapped in by someone else")
    loaded = _refuse_cdll(monkeypatch)
    with pytest.raises(oracle_mod.OracleError, match="changed after verification"):
        oracle_mod.Oracle(lib, oracle_mod.flashinfer_install())
    assert loaded == []


def test_a_library_owned_by_someone_else_is_refused(fake_build: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lib = oracle_mod.ensure_built()
    if os.getuid() == 0:
        os.chown(lib, 65534, -1)
    else:  # cannot give a file away: pretend to be someone else instead
        uid = os.getuid()
        monkeypatch.setattr(oracle_mod.os, "getuid", lambda: uid + 1)
    loaded = _refuse_cdll(monkeypatch)
    with pytest.raises(oracle_mod.OracleSecurityError, match="owned by uid"):
        oracle_mod.ensure_built()
    with pytest.raises(oracle_mod.OracleSecurityError, match="owned by uid"):
        oracle_mod.Oracle(lib, oracle_mod.flashinfer_install())
    assert loaded == []


def test_every_cache_entry_is_private(fake_build: Path) -> None:
    lib = oracle_mod.ensure_built()
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (lib.parent.parent, lib.parent, lib)}
    assert modes == {"oracle": 0o700, lib.parent.name: 0o700, lib.name: 0o600}
    locks = list(lib.parent.parent.glob("*.lock"))
    assert locks and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in locks)


def test_a_preexisting_shared_cache_dir_is_made_private(fake_build: Path) -> None:
    root = Path(os.environ["KVPROFILE_CACHE_DIR"]) / "oracle"
    root.mkdir(parents=True)
    root.chmod(0o777)
    oracle_mod.ensure_built()
    assert stat.S_IMODE(root.stat().st_mode) == 0o700


def _repair_in_child(queue: Any) -> None:
    try:
        queue.put(str(oracle_mod.ensure_built()))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        queue.put(f"error: {type(exc).__name__}: {exc}")


def test_processes_racing_to_repair_a_corrupted_cache_rebuild_once(fake_build: Path) -> None:
    lib = oracle_mod.ensure_built()
    lib.write_bytes(lib.read_bytes()[:8])  # truncated
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_repair_in_child, args=(queue,)) for _ in range(4)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert results == [str(lib)] * 4, results
    assert len(list(fake_build.iterdir())) == 2  # the first build and exactly one repair
    assert oracle_build._valid_build(lib.parent)
    assert not list(lib.parent.parent.glob(".build-*"))
