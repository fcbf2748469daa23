"""Installed backends named on the command line: by a backend's name or by its entry point's name."""

import importlib
import sys

import pytest

from pytest_kvprofile.contract.backends import Backend, BackendError
from pytest_kvprofile.registry import resolve_backends

PACKAGE = '''
from pytest_kvprofile.builtin.stubs import STUB_BACKENDS
import dataclasses

BASE = STUB_BACKENDS[0]


def pair():
    return [dataclasses.replace(BASE, name="acme-attn"), dataclasses.replace(BASE, name="acme-attn-exact")]


def broken():
    raise RuntimeError("no GPU driver")
'''


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """A package ``acme_kvprofile`` installed with two entry points: ``acme`` (two backends) and ``acme-broken``."""
    (tmp_path / "acme_kvprofile.py").write_text(PACKAGE)
    info = tmp_path / "acme_kvprofile-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-kvprofile\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[pytest_kvprofile.backends]\nacme = acme_kvprofile:pair\nacme-broken = acme_kvprofile:broken\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield
    sys.modules.pop("acme_kvprofile", None)


def test_a_backend_an_entry_point_makes_is_named_alone(installed):
    assert [b.name for b in resolve_backends(["acme-attn-exact"])] == ["acme-attn-exact"]


def test_an_entry_point_named_gives_every_backend_it_makes(installed):
    assert [b.name for b in resolve_backends(["acme"])] == ["acme-attn", "acme-attn-exact"]


def test_an_unknown_name_lists_what_is_installed(installed):
    with pytest.raises(BackendError) as err:
        resolve_backends(["acme-typo"])
    message = str(err.value)
    assert "'acme-typo'" in message and "acme-attn-exact" in message and "pytest_kvprofile.backends" in message


def test_a_named_entry_point_that_fails_to_load_says_why(installed):
    with pytest.raises(BackendError, match=r"'acme-broken'.*acme_kvprofile:broken.*no GPU driver"):
        resolve_backends(["acme-broken"])


def test_built_ins_come_first(installed):
    backends = resolve_backends(["stub-flashinfer"])
    assert [b.name for b in backends] == ["stub-flashinfer"] and all(isinstance(b, Backend) for b in backends)
