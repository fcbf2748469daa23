"""One backend on a whole matrix as a measured, resumable job: shards by (model, GPU), each a pytest run of its own.

Why shards: a vLLM backend on the 1,308 runnable cases of ``default.yaml`` is a long job on a 2-core machine; a shard
that finished keeps its verdict and its time in ``DIR``, so a job stopped (a timeout, a reboot) resumes where it was
and re-runs nothing. The shards' verdicts merge into one with ``kvprofile verdict merge`` (the union must cover the
whole matrix, as for several runners), and ``DIR/job.md`` reports the measured wall and CPU time of every shard and
their sum, against the target (``--target-min``, 20 minutes for a vLLM backend on the default matrix: issue 54).

    python benchmarks/matrix_job.py --backend vllm-flashinfer --matrix default --dir /tmp/job [--shards K]

``--shards K`` runs at most K more shards this time (the job stays resumable); ``PYTHONPATH`` reaches example
backends, as for pytest. Before the first shard the job asks the backend's engine once which layouts it refuses
(``Backend.refuses_layout``, as collection does; kept in ``DIR/accepted.json``): a shard whose every case is refused
runs no pytest (it would only collect the matrix to skip all of it) and is reported as such; the merge needs only the
shards that plan a case.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))


@dataclass(frozen=True)
class Shard:
    """The cases of one model on one GPU: selected by ``-k`` on their ids' model and GPU slug."""

    model: str
    gpu: str
    cases: int
    accepted: int | None = None  # of ``cases``, those the backend's engine accepts (None: not asked)

    @property
    def name(self) -> str:
        return f"{self.model}--{self.gpu}"

    @property
    def keyword(self) -> str:
        return f"{self.model}- and -{self.gpu}-"


@dataclass(frozen=True)
class ShardRun:
    shard: str
    cases: int
    wall_s: float
    cpu_s: float
    rc: int
    summary: str


def shards(matrix: str) -> list[Shard]:
    """Every (model, GPU) of the matrix with a runnable case, in the matrix's order."""
    from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix

    path = Path(matrix) if Path(matrix).is_file() else packaged_matrix(matrix)
    counts: dict[tuple[str, str], int] = {}
    for case in load_matrix(path).cases:
        key = (case.model.name, case.gpu.slug)
        counts[key] = counts.get(key, 0) + (case.skip_reason is None)
    names = [m for m, _ in counts]
    for m in names:  # "-k qwen3-8b-" must not also select another model whose name extends it
        if any(o != m and o.startswith(m + "-") for o in names):
            raise SystemExit(f"model {m!r} is a prefix of another model's name: shard by -k cannot tell them apart")
    return [Shard(m, g, n) for (m, g), n in counts.items() if n]


def with_accepted(all_shards: list[Shard], matrix: str, backend_spec: str, out: Path) -> tuple[list[Shard], float]:
    """The shards with how many of their cases the backend's engine accepts, asked once per job (``accepted.json``)
    and the seconds asking took (0 when read back)."""
    import dataclasses

    cache = out / "accepted.json"
    if cache.is_file():
        known = json.loads(cache.read_text())
        return [dataclasses.replace(s, accepted=known["shards"][s.name]) for s in all_shards], 0.0
    from pytest_kvprofile.contract.backends import layout_refusal
    from pytest_kvprofile.matrix.schema import load_matrix
    from pytest_kvprofile.registry import resolve_backends

    t0 = time.perf_counter()
    backends = resolve_backends([backend_spec], entry_points=False)
    counts: dict[str, int] = {s.name: 0 for s in all_shards}
    for case in load_matrix(Path(matrix)).cases:
        name = f"{case.model.name}--{case.gpu.slug}"
        if case.skip_reason is None and name in counts and any(layout_refusal(b, case) is None for b in backends):
            counts[name] += 1
    seconds = round(time.perf_counter() - t0, 1)
    cache.write_text(json.dumps({"backend": backend_spec, "seconds": seconds, "shards": counts}))
    return [dataclasses.replace(s, accepted=counts[s.name]) for s in all_shards], seconds


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run_shard(shard: Shard, backend: str, matrix: str, out: Path, workers: int) -> ShardRun:
    verdict = out / f"{shard.name}.verdict.json"
    cmd = [sys.executable, "-m", "pytest", "--kvprofile", "--kvprofile-matrix", matrix, "--kvprofile-backend",
           backend, "-k", shard.keyword, "-q", "-p", "no:cacheprovider", "--tb=no", "--kvprofile-verdict",
           str(verdict), *(["-n", str(workers)] if workers > 1 else [])]
    cpu0, t0 = _children_cpu(), time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=os.environ.copy())
    wall, cpu = time.perf_counter() - t0, _children_cpu() - cpu0
    tail = [ln for ln in proc.stdout.splitlines() if " in " in ln and ("passed" in ln or "failed" in ln)]
    # 1: some check failed; 5: no check ran (the engine refuses every case of the shard); the verdict records both
    if proc.returncode not in (0, 1, 5) or not verdict.is_file():
        raise SystemExit(f"shard {shard.name} did not run (rc {proc.returncode}):\n{proc.stdout[-2000:]}"
                         f"{proc.stderr[-2000:]}")
    return ShardRun(shard.name, shard.cases, round(wall, 1), round(cpu, 1), proc.returncode,
                    tail[-1] if tail else "")


def report(out: Path, backend: str, matrix: str, all_shards: list[Shard], target_min: float) -> str:
    done = [ShardRun(**json.loads(p.read_text())) for p in sorted(out.glob("*.time.json"))]
    asked = json.loads((out / "accepted.json").read_text())["seconds"] if (out / "accepted.json").is_file() else 0.0
    wall, cpu = sum(r.wall_s for r in done) + asked, sum(r.cpu_s for r in done) + asked
    cases = sum(r.cases for r in done)
    total = sum(s.cases for s in all_shards)
    lines = [f"# `{backend}` on `{matrix}`: {len(done)} of {len(all_shards)} shards, {cases} of {total} runnable "
             "cases", "",
             f"Measured wall {wall / 60:.1f} min, CPU {cpu / 60:.1f} min (children included; asking the engine which "
             f"layouts it refuses: {asked:g} s). "
             + (f"Whole matrix: {'met' if wall / 60 <= target_min else 'MISSED'} against {target_min:g} min."
                if len(done) == len(all_shards) else
                "Not finished: the whole matrix is not measured yet (resume with the same --dir)."), "",
             "| shard | cases | wall s | CPU s | rc | pytest |", "|---|---|---|---|---|---|"]
    lines += [f"| {r.shard} | {r.cases} | {r.wall_s} | {r.cpu_s} | {r.rc} | {r.summary} |" for r in done]
    text = "\n".join(lines) + "\n"
    (out / "job.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", required=True)
    ap.add_argument("--matrix", default="default", help="a packaged matrix name or a YAML path")
    ap.add_argument("--dir", type=Path, required=True, help="where shards keep their verdicts and times")
    ap.add_argument("--shards", type=int, default=None, help="run at most this many more shards now")
    ap.add_argument("--workers", type=int, default=2, help="pytest-xdist workers per shard")
    ap.add_argument("--target-min", type=float, default=20.0)
    args = ap.parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    matrix = args.matrix if Path(args.matrix).is_file() else str(
        __import__("pytest_kvprofile.matrix.schema", fromlist=["packaged_matrix"]).packaged_matrix(args.matrix))
    all_shards, _ = with_accepted(shards(matrix), matrix, args.backend, args.dir)
    todo = [s for s in all_shards if not (args.dir / f"{s.name}.time.json").is_file()]
    for shard in todo[:args.shards]:
        if shard.accepted == 0:
            print(f"[job] {shard.name}: {shard.cases} cases, every one refused by the engine: no run", flush=True)
            run = ShardRun(shard.name, shard.cases, 0.0, 0.0, 0, "not run: the engine refuses every layout")
        else:
            print(f"[job] {shard.name}: {shard.cases} cases", flush=True)
            run = run_shard(shard, args.backend, matrix, args.dir, args.workers)
        (args.dir / f"{shard.name}.time.json").write_text(json.dumps(asdict(run)))
    print(report(args.dir, args.backend, args.matrix, all_shards, args.target_min))
    if all((args.dir / f"{s.name}.time.json").is_file() for s in all_shards):
        from pytest_kvprofile.cli import main as kvprofile

        verdicts = [str(args.dir / f"{s.name}.verdict.json") for s in all_shards if s.accepted != 0]
        if not verdicts:
            print(f"[job] the engine refuses every layout of {args.matrix}: no verdict to merge")
            return 0
        return kvprofile(["verdict", "merge", *verdicts, "-o", str(args.dir / "verdict.json")])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
