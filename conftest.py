"""Root conftest: the plugin tests itself with pytester, and every test shares one oracle build.

pytester points HOME at a temporary directory for every run; the oracle's cache is pinned to the
real one first (an environment variable, so pytester's in-process and subprocess runs inherit it),
so the FlashInfer planner library is compiled once per machine, not once per test or per session.
``oracle_cache`` is the one fixture that builds it; tests that copy or damage a cache work on a
copy or on their own ``KVPROFILE_CACHE_DIR``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

import pytest

from pytest_kvprofile.attention.oracle import (
    Oracle,
    cache_root,
    ensure_built,
    get_oracle,
    oracle_available,
)

os.environ.setdefault("KVPROFILE_CACHE_DIR", str(cache_root()))

pytest_plugins = ["pytester"]


class OracleCache(NamedTuple):
    """The shared cache directory and the verified library inside it."""

    root: Path
    lib: Path


@pytest.fixture(scope="session")
def oracle_cache() -> OracleCache:
    """The built host oracle (skips with the reason and the fix when this machine cannot build it).

    Built under the cache's file lock, so xdist workers sharing the directory build it once."""
    ok, why = oracle_available()
    if not ok:
        pytest.skip(f"host oracle unavailable: {why}")
    return OracleCache(cache_root(), ensure_built())


@pytest.fixture
def oracle(oracle_cache: OracleCache) -> Oracle:
    """This thread's loaded oracle."""
    return get_oracle()
