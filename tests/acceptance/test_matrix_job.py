"""``benchmarks/matrix_job.py``: a backend on a whole matrix in (model, GPU) shards that resume and merge."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("matrix_job", ROOT / "benchmarks" / "matrix_job.py")
assert _spec is not None and _spec.loader is not None
job = importlib.util.module_from_spec(_spec)
sys.modules["matrix_job"] = job
_spec.loader.exec_module(job)

SMALL = """name: small
envelope: {max_num_seqs: 64, max_num_batched_tokens: 2048, max_model_len: 4096, num_ubatches: 1}
models:
  qwen3-8b: {heads_q: 32, heads_kv: 8, head_dim: 128, num_layers: 36, weights_gib: 15.3}
gpus: [L40S, H100]
tp: [1]
"""


def test_shards_are_the_matrix_model_gpu_pairs_with_runnable_cases():
    shards = job.shards("ci")
    assert [(s.model, s.gpu, s.cases) for s in shards] == [
        ("qwen3-8b", "l40s", 12), ("qwen3-8b", "b200", 12), ("glm-4-9b-32q2kv", "l40s", 12),
        ("glm-4-9b-32q2kv", "b200", 12), ("llama-3.1-8b", "l40s", 4), ("llama-3.1-8b", "b200", 4),
        ("deepseek-v2-lite-mla", "l40s", 4), ("deepseek-v2-lite-mla", "b200", 4)]
    assert shards[0].keyword == "qwen3-8b- and -l40s-"


def test_a_model_name_that_prefixes_another_is_refused(tmp_path: Path):
    path = tmp_path / "m.yaml"
    path.write_text(SMALL.replace("gpus:", "  qwen3-8b-fp8: {heads_q: 32, heads_kv: 8, head_dim: 128, num_layers: 36}\n"
                                           "gpus:"))
    with pytest.raises(SystemExit, match="prefix of another model's name"):
        job.shards(str(path))


REFUSING = """
import dataclasses
from pytest_kvprofile.builtin.stubs import STUB_BACKENDS


def backends():
    return dataclasses.replace(STUB_BACKENDS[0], name="no-h100",
                               refuses_layout=lambda case: "no H100" if case.gpu.slug == "h100" else None)
"""


def test_a_shard_whose_every_layout_the_engine_refuses_runs_no_pytest(tmp_path: Path, monkeypatch):
    """The engine is asked once, before the shards; its answer is kept, and such a shard is recorded, not run."""
    (tmp_path / "refusing_backend.py").write_text(REFUSING)
    monkeypatch.syspath_prepend(str(tmp_path))
    matrix = tmp_path / "small.yaml"
    matrix.write_text(SMALL)
    out = tmp_path / "job"
    out.mkdir()
    found, seconds = job.with_accepted(job.shards(str(matrix)), str(matrix), "refusing_backend:backends", out)
    assert [(s.name, s.cases, s.accepted) for s in found] == [("qwen3-8b--l40s", 1, 1), ("qwen3-8b--h100", 1, 0)]
    assert seconds >= 0 and json.loads((out / "accepted.json").read_text())["shards"] == {
        "qwen3-8b--l40s": 1, "qwen3-8b--h100": 0}
    again, asked = job.with_accepted(job.shards(str(matrix)), str(matrix), "refusing_backend:backends", out)
    assert again == found and asked == 0.0  # read back, not asked again
    monkeypatch.setattr(job, "run_shard", lambda *a: pytest.fail("a refused shard must not run"))
    assert job.main(["--backend", "refusing_backend:backends", "--matrix", str(matrix), "--dir", str(out),
                     "--shards", "0"]) == 0
    skipped = [s for s in found if s.accepted == 0]
    monkeypatch.setattr(job, "shards", lambda m: [dataclasses.replace(s, accepted=None) for s in skipped])
    assert job.main(["--backend", "refusing_backend:backends", "--matrix", str(matrix), "--dir", str(out)]) == 0
    run = json.loads((out / "qwen3-8b--h100.time.json").read_text())
    assert run["wall_s"] == 0.0 and run["summary"].startswith("not run")
    assert "not run: the engine refuses every layout" in (out / "job.md").read_text()


@pytest.mark.slow  # two pytest runs of a few cases each
def test_a_stopped_job_resumes_and_merges(tmp_path: Path):
    matrix = tmp_path / "small.yaml"
    matrix.write_text(SMALL)
    out = tmp_path / "job"
    args = ["--backend", "stub-flashinfer", "--matrix", str(matrix), "--dir", str(out), "--workers", "1"]
    assert job.main([*args, "--shards", "1"]) == 0
    first = json.loads((out / "qwen3-8b--l40s.time.json").read_text())
    assert not (out / "verdict.json").exists() and "1 of 2 shards" in (out / "job.md").read_text()
    assert job.main(args) == 0
    assert json.loads((out / "qwen3-8b--l40s.time.json").read_text()) == first  # not run again
    merged = json.loads((out / "verdict.json").read_text())
    assert [b["may_opt_in"] for b in merged["backends"]] == [True]
    assert "2 of 2 shards" in (out / "job.md").read_text()
