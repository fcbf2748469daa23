"""scripts/run_gpu_tier.sh on a CPU machine: it fails fast without a GPU, finds the real toolkit
behind a wrapper nvcc, and refuses early when -lcuda cannot resolve (fake toolkits in tmp dirs)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "run_gpu_tier.sh"
DRIVER_LIBCUDA = any(Path(p).exists() for p in ("/usr/local/nvidia/lib64/libcuda.so.1",
                                                 "/usr/lib/x86_64-linux-gnu/libcuda.so.1", "/usr/lib64/libcuda.so.1"))


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60,
                          env=env if env is not None else dict(os.environ, PYTHON=sys.executable))


def _toolkit(tmp_path: Path, stubs: bool) -> dict[str, str]:
    """A toolkit in tmp/cuda-13.0 reached only through a wrapper script tmp/wrap/nvcc (no lib64 beside it)."""
    real = tmp_path / "cuda-13.0"
    (real / "bin").mkdir(parents=True)
    (real / "lib64").mkdir()
    (real / "lib64" / "libcudart.so.13").write_bytes(b"")
    if stubs:
        (real / "lib64" / "stubs").mkdir()
        (real / "lib64" / "stubs" / "libcuda.so").write_bytes(b"")
    nvcc = real / "bin" / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho '#$ _HERE_={real}/bin' >&2\n")
    nvcc.chmod(0o755)
    wrap = tmp_path / "wrap"
    wrap.mkdir()
    (wrap / "nvcc").write_text(f"#!/bin/sh\nexec {nvcc} \"$@\"\n")
    (wrap / "nvcc").chmod(0o755)
    path = f"{wrap}:/usr/bin:/bin"
    return {"PATH": path, "HOME": str(tmp_path), "PYTHON": sys.executable, "CUDA_HOME": str(tmp_path / "not-a-toolkit")}


def test_fails_fast_and_clearly_without_a_gpu(tmp_path: Path) -> None:
    from pytest_kvprofile.gpu.nvml import cuda_device_count

    if cuda_device_count()[0]:
        pytest.skip("this machine has a GPU")
    t0 = time.monotonic()
    res = _run("--bundle", str(tmp_path / "none"), "--out", str(tmp_path / "out"))
    assert res.returncode == 3, res.stdout + res.stderr
    assert "no GPU found" in res.stderr and "run the CPU tier instead" in res.stderr
    assert time.monotonic() - t0 < 20
    assert "no GPU found" in (tmp_path / "out" / "run.log").read_text()


def test_follows_a_wrapper_nvcc_to_the_toolkit_with_lib64(tmp_path: Path) -> None:
    res = _run("--out", str(tmp_path / "out"), "--env-only", env=_toolkit(tmp_path, stubs=True))
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"CUDA toolkit {tmp_path / 'cuda-13.0'}\n" in res.stdout
    assert f"-lcuda from {tmp_path / 'cuda-13.0'}/lib64/stubs" in res.stdout


@pytest.mark.skipif(DRIVER_LIBCUDA, reason="this machine has a driver libcuda.so.1, which the script would use")
def test_no_stubs_and_no_driver_is_an_early_clear_error(tmp_path: Path) -> None:
    res = _run("--out", str(tmp_path / "out"), "--env-only", env=_toolkit(tmp_path, stubs=False))
    assert res.returncode == 4, res.stdout + res.stderr
    assert "-lcuda cannot be resolved" in res.stderr and "cannot find -lcuda" in res.stderr


def test_the_script_never_assigns_cc() -> None:
    text = SCRIPT.read_text()
    assert not re.search(r"(^|[\s;(])(export\s+)?CC=", text, re.M), "CC reaches nvcc as -ccbin through FlashInfer"
