"""The GPU tier from the command line on a CPU machine (pytester)."""

from __future__ import annotations

import importlib

import pytest

pytest.importorskip("pynvml")


def test_gpu_flag_without_cuda_is_a_usage_error(pytester):
    from pytest_kvprofile.gpu.nvml import cuda_device_count

    if cuda_device_count()[0]:
        pytest.skip("this machine has a CUDA device")
    pytester.makepyfile("def test_x():\n    pass\n")
    result = pytester.runpytest_subprocess("--kvprofile-gpu", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--kvprofile-gpu: no CUDA device was found*run without it for the CPU tier*"])


@pytest.mark.parametrize("module", [
    "pytest_kvprofile.gpu.topology", "pytest_kvprofile.gpu.pinning", "pytest_kvprofile.gpu.cuda_device",
    "pytest_kvprofile.builtin.flashinfer_real", "pytest_kvprofile.gpu.sizing_probe",
    "pytest_kvprofile.gpu.matrix_gen", "pytest_kvprofile.plugin.gpu", "pytest_kvprofile.gpu_suite.test_gpu_tier",
])
def test_gpu_modules_import_without_cuda(module):
    assert importlib.import_module(module) is not None


def test_gpu_suite_is_skipped_with_a_reason_on_the_cpu_tier(pytester):
    pytester.makeconftest(
        "import importlib\n"
        "def pytest_configure(config):\n"
        "    mod = importlib.import_module('pytest_kvprofile.plugin.gpu')\n"
        "    if not config.pluginmanager.is_registered(mod):\n"
        "        config.pluginmanager.register(mod, 'kvprofile-gpu')\n")
    result = pytester.runpytest_subprocess("--pyargs", "pytest_kvprofile.gpu_suite", "-rs", "-p", "no:cacheprovider",
                                           "--kvprofile-matrix", _ci_matrix())
    outcomes = result.parseoutcomes()
    assert outcomes.get("skipped", 0) >= 8 and "passed" not in outcomes and "failed" not in outcomes
    result.stdout.fnmatch_lines(["*GPU tier: pass --kvprofile-gpu on a machine with a CUDA device*"])


def _ci_matrix() -> str:
    from pytest_kvprofile.matrix.schema import packaged_matrix

    return str(packaged_matrix("ci"))
