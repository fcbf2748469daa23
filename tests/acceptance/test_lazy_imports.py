"""Heavy modules load lazily: importing the plugin and building a session touches no torch/flashinfer/NVML."""

import subprocess
import sys

PROGRAM = """
import sys
import pytest_kvprofile.plugin
from pytest_kvprofile.plugin.session import Settings, build_session
from pytest_kvprofile.matrix.schema import packaged_matrix
from pytest_kvprofile.checks.catalog import CHECKS
session = build_session(Settings(matrices=(str(packaged_matrix("ci")),)), [], "cpu")
assert sum(len(session.pairs_for(c)) for c in CHECKS) > 0
heavy = sorted(m for m in ("torch", "flashinfer", "pynvml", "numpy") if m in sys.modules)
print("HEAVY", heavy)
"""


def test_plugin_import_and_collection_import_nothing_heavy():
    out = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, check=True).stdout
    assert "HEAVY []" in out, out


TORCH_MODE = """
import sys
from pytest_kvprofile.builtin.stubs import TORCH_STUB_BACKENDS
from pytest_kvprofile.checks.catalog import failing_checks
from pytest_kvprofile.lifecycle.driver import run_lifecycle
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix
case = load_matrix(packaged_matrix("ci")).cases[0]
assert failing_checks(run_lifecycle(TORCH_STUB_BACKENDS[0], case)) == {}
print("FLASHINFER", "flashinfer" in sys.modules)
"""


def test_a_torch_mode_backend_that_never_uses_flashinfer_does_not_import_it():
    """Torch mode imports FlashInfer (3 s) only when a backend's code does (issue 25, item 2)."""
    out = subprocess.run([sys.executable, "-c", TORCH_MODE], capture_output=True, text=True, check=True).stdout
    assert "FLASHINFER False" in out, out
