"""The benchmark script runs end to end on tiny sizes and reports numbers (no timing is asserted)."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "run.py"
EXPECTED = {
    ("overhead", "per-item wall ratio"),
    ("overhead", "per-item CPU ratio"),
    ("memory", "peak RSS"),
    ("scaling", "collection time/case"),
    ("scaling", "lifecycle+checks time/case"),
    ("device", "SimulatedCuda creation / plain CPU"),
    ("device", "lifecycle simulation per case"),
}


@pytest.mark.slow  # a benchmark run, however small: 15 s
def test_smoke_run_prints_a_table_of_numbers(tmp_path: Path) -> None:
    out, js = tmp_path / "results.md", tmp_path / "results.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out), "--json", str(js)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    rows = json.loads(js.read_text())["rows"]
    measured = [r for r in rows if r["value"] is not None]
    found = {(s, m) for r in measured for s, m in EXPECTED if r["section"] == s and r["metric"].startswith(m)}
    assert found == EXPECTED, f"missing rows: {EXPECTED - found}"
    for r in measured:
        assert isinstance(r["value"], (int, float)) and math.isfinite(r["value"]) and r["value"] > 0, r
        assert r["status"] in ("met", "MISSED", "info"), r
    assert all(r["status"] != "MISSED" or r["target"] for r in rows), "a missed row must name its target"

    table = [ln for ln in proc.stdout.splitlines() if ln.startswith("| ")]
    assert table[0].split("|")[1].strip() == "section"
    assert len(table) == len(rows) + 1
    for r in measured:
        line = next(ln for ln in table if f" {r['metric']} " in ln)
        assert float(line.split("|")[3]) == float(f"{r['value']:.4g}")

    md = out.read_text()
    assert "## Machine" in md and "cores:" in md and "python:" in md and "torch:" in md
    assert "flashinfer-python:" in md and "date (UTC):" in md
    assert md.count("\n| ") == len(rows) + 1


def _baseline_rows(tmp_path: Path, mode: str, section: str) -> list[dict[str, Any]]:
    """``run.py --smoke --baseline HEAD MODE`` (HEAD against this checkout): the rows of ``section``."""
    js = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--baseline", "HEAD", mode,
                           "--out", str(tmp_path / "results.md"), "--json", str(js)],
                          capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [r for r in json.loads(js.read_text())["rows"] if r["section"] == section]


@pytest.mark.slow  # two trees, each through the suite, the lifecycle probe and (with valgrind) callgrind: ~2 min
def test_baseline_rows_put_before_and_after_side_by_side(tmp_path: Path) -> None:
    """``--baseline REF``: every before/after measurement once per tree, and the instruction counts (a count, not a
    time) with their ratio, or a row saying valgrind is missing."""
    rows = _baseline_rows(tmp_path, "--only-baseline", "before/after")
    for metric in ("per-item CPU ratio", "lifecycle+checks CPU per case", "collection of"):
        labels = [r["metric"].rsplit(", ", 1)[1] for r in rows if r["metric"].startswith(metric)]
        assert labels == ["before (HEAD)", "after"], (metric, labels)
    counts = [r for r in rows if r["metric"].startswith("lifecycle+checks instructions per case")]
    if shutil.which("valgrind") is None:
        assert [r["note"] for r in counts] == ["valgrind not installed"]
    else:
        assert [r["metric"].rsplit(", ", 1)[1] for r in counts] == ["before (HEAD)", "after", "after / before"]
        assert all(r["value"] > 0 for r in counts)
        assert 0.9 < counts[2]["value"] < 1.1  # the same tree twice: the count barely moves


@pytest.mark.slow  # the suite on ci.yaml in two trees, then bare pytest: about a minute
def test_main_job_rows_put_before_and_after_side_by_side(tmp_path: Path) -> None:
    """``--baseline REF --main-job``: the README's main job once per tree (``--smoke``: on ci.yaml), its wall and
    its per-item ratio against bare pytest, and the speed-up."""
    rows = _baseline_rows(tmp_path, "--main-job", "main job")
    walls = [r for r in rows if r["metric"].startswith("README main job wall")]
    assert [r["metric"].rsplit(", ", 1)[1] for r in walls] == ["before (HEAD)", "after"]
    assert all(r["value"] > 0 for r in rows)
    assert [r["metric"] for r in rows][-1] == "main job wall, before / after"
    assert "--main-job --repeats 1" in (tmp_path / "results.md").read_text()


def _load_script(path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A benchmarks/ script as a module, undone after the test: its entry in ``sys.modules`` (its dataclasses look
    their module up) and the ``sys.path`` entry it adds for ``matrixgen``."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"kvprofile_bench_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    monkeypatch.setattr(sys, "path", list(sys.path))
    spec.loader.exec_module(module)
    return module


def test_the_engine_probe_counts_calls_through_this_trees_torch_function_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine section counts torch calls by wrapping the measured tree's mode class; it moved in issue 53's split
    of torch mode (``torch_mode._Mode`` -> ``torch_dispatch.PlacementMode``), and the section failed on it."""
    from torch.overrides import TorchFunctionMode

    from pytest_kvprofile.memory import torch_dispatch, torch_mode

    run = _load_script(SCRIPT, monkeypatch)
    mode = run._torch_function_mode(torch_mode)
    assert mode is torch_dispatch.PlacementMode and issubclass(mode, TorchFunctionMode)
    assert "__torch_function__" in vars(mode)  # the wrapper replaces the method the mode itself defines
    assert run._engine_env(Path("/tree"))["PYTHONPATH"].split(":") == [
        "/tree", "/tree/examples/vllm-flashinfer-reserving"]


@pytest.mark.slow  # one real-FlashInfer case, its first untimed: ~20 s
def test_the_engine_probe_runs_on_this_tree() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--engine-probe", "flashinfer", "--cases", "1"],
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
    assert data["cases"] == 1 and data["torch_calls"] > 0 and data["life"] > 0


def test_case_parts_takes_each_probe_apart_from_the_check_that_reads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """``benchmarks/case_parts.py``: the case's lifecycle, its probes and its checks, each timed once."""
    import pytest_kvprofile.lifecycle.driver as driver

    monkeypatch.setattr(driver, "run_probe", driver.run_probe)  # measure() wraps it: put it back afterwards
    parts = _load_script(SCRIPT.parent / "case_parts.py", monkeypatch)
    spent, n = parts.measure("stub-flashinfer", 3)
    assert n == 3
    assert {"lifecycle", "probe:reservation", "check:reservation_exception_safe"} <= set(spent)
    assert all(seconds >= 0 for seconds in spent.values())
