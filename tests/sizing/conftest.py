"""Build the host oracle once per test session, into a private temp cache."""

from __future__ import annotations

import os

import pytest

from pytest_kvprofile.sizing import oracle as oracle_mod


@pytest.fixture(scope="session")
def oracle_cache(tmp_path_factory):
    """A session cache dir holding one built oracle; KVPROFILE_CACHE_DIR points at it."""
    ok, why = oracle_mod.oracle_available()
    if not ok:
        pytest.skip(f"host oracle unavailable: {why}")
    base = tmp_path_factory.getbasetemp()
    # Under xdist every worker has its own basetemp below one shared parent: share the cache
    # there so the file lock makes the workers build once between them.
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    root = base / "kvp-oracle-cache"
    root.mkdir(mode=0o700, exist_ok=True)
    old = os.environ.get("KVPROFILE_CACHE_DIR")
    os.environ["KVPROFILE_CACHE_DIR"] = str(root)
    try:
        lib = oracle_mod.ensure_built()
        yield root, lib
    finally:
        if old is None:
            os.environ.pop("KVPROFILE_CACHE_DIR", None)
        else:
            os.environ["KVPROFILE_CACHE_DIR"] = old


@pytest.fixture
def oracle(oracle_cache):
    return oracle_mod.get_oracle()
