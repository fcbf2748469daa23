"""Share one host-oracle build between the reliability tests and their pytester runs.

pytester gives every run a fresh HOME, so without this each run would rebuild the oracle (seconds
of nvcc) inside the first check, where a short ``--kvprofile-timeout`` would turn it into a hang.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from pytest_kvprofile.sizing import oracle as oracle_mod


@pytest.fixture(scope="session")
def shared_oracle_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    root = base / "kvp-oracle-cache"
    root.mkdir(mode=0o700, exist_ok=True)
    return root


@pytest.fixture(autouse=True)
def _oracle_cache_env(shared_oracle_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("KVPROFILE_CACHE_DIR", str(shared_oracle_cache))
    if oracle_mod.oracle_available()[0]:
        oracle_mod.ensure_built()
    yield
