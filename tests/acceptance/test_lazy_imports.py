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
