"""One number per case: what ``workspace_covers_planner`` demands is what the JSON sizing report and
``kvprofile size`` say, on every distinct layout of the default matrix.

The check is exercised, not just ``for_case``: a REQUIRED builder declaring exactly the CLI's bytes (and
planning every route into views of that size) passes it, 16 bytes less (one FlashInfer alignment unit) fails
for a shortfall, and 2 MiB more per micro-batch is reported as waste, which fails only over a waste budget.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from pytest_kvprofile.checks.base import CheckOptions, WasteBudget
from pytest_kvprofile.checks.workspace import check_workspace_covers_planner
from pytest_kvprofile.cli import main
from pytest_kvprofile.contract.backends import EnginePolicy
from pytest_kvprofile.contract.protocol import WorkspaceDeclaration
from pytest_kvprofile.contract.support import ProfilingSupport
from pytest_kvprofile.lifecycle.driver import make_device
from pytest_kvprofile.lifecycle.phases import RESERVATION
from pytest_kvprofile.lifecycle.record import PROFILING, LifecycleResult, ProbeTarget, ViewGrant
from pytest_kvprofile.matrix.cases import Envelope, layout_case
from pytest_kvprofile.matrix.gpus import lookup_gpu
from pytest_kvprofile.matrix.models import ModelSpec
from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix
from pytest_kvprofile.sizing.comparison import distinct_layout_cases, report_for_matrix
from pytest_kvprofile.units import MiB

DEFAULT = packaged_matrix("default")
OPTIONS = CheckOptions()
BUDGET = CheckOptions(max_waste=WasteBudget(2.0))


class Declares:
    """A REQUIRED builder that declares given bytes and does nothing else."""

    name = "declares"

    def get_persistent_workspace_memory_profiling_support(self) -> ProfilingSupport:
        return ProfilingSupport.REQUIRED


def _verdict(case, float_bytes: int, int_bytes: int, options: CheckOptions = OPTIONS) -> list[str]:
    """The check on a record where the builder declared ``float_bytes`` and asked each micro-batch's arena for a
    view of that size, naming no route (so every route of the case plans into it)."""
    views = [ViewGrant(RESERVATION, Declares.name, "reserve_persistent_workspace", None, u, 0,
                       -(-float_bytes // 256) * 256) for u in range(case.envelope.num_ubatches)]
    result = LifecycleResult(
        backend="one-truth", case=case, probe=ProbeTarget(None, case, make_device), policy=EnginePolicy(),
        builders=[Declares()], path=PROFILING,
        declared={Declares.name: WorkspaceDeclaration(float_bytes, int_bytes)}, grants=views,
    )
    return check_workspace_covers_planner(result, options)


def _cli(case, *extra: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["size", "--model", case.model.name, "--gpu", case.gpu.name, "--tp", str(case.tp),
                   "--dcp", str(case.dcp), "--mtp", str(case.mtp), "--kv-dtype", case.model.kv_dtype, "--json",
                   *extra])
    assert rc == 0, out.getvalue()
    return json.loads(out.getvalue())


def test_check_report_and_cli_agree_on_every_distinct_default_layout():
    cases = distinct_layout_cases(load_matrix(DEFAULT).cases)
    rows = {(r["model"], r["kv_dtype"], r["gpu"], r["tp"], r["dcp"], r["mtp"]): r
            for r in report_for_matrix(str(DEFAULT))}
    assert len(cases) == len(rows) > 600
    assert {c.model.kv_dtype for c in cases} == {"bf16", "fp8", "fp8_e4m3", "nvfp4"}
    for case in cases:
        cli = _cli(case)
        row = rows[(case.model.name, case.model.kv_dtype, case.gpu.name, case.tp, case.dcp, case.mtp)]
        need, need_int = cli["float_workspace_bytes"], cli["int_workspace_bytes"]
        assert row["required_float_bytes"] == need and row["required_int_bytes"] == need_int, case.id
        assert _verdict(case, need, need_int) == [], case.id
        short = _verdict(case, need - 16, need_int)
        assert len(short) == 1 and "short by" in short[0], (case.id, short)
        assert _verdict(case, need + 2 * MiB, need_int) == [], case.id
        waste = _verdict(case, need + 2 * MiB, need_int, BUDGET)
        assert len(waste) == 1 and "wasted" in waste[0] and "over the waste budget" in waste[0], (case.id, waste)


def test_capture_sizes_are_tokens_and_mtp_divides_them():
    """A decode capture of S tokens plans S // (1 + mtp) requests; a size that holds no request, or more
    requests than max_num_seqs, is not captured."""
    env = Envelope(max_num_seqs=64, max_num_batched_tokens=2048, cuda_graph_sizes=(1, 2, 4, 8, 128, 512))
    assert [(c.num_reqs, c.num_tokens) for c in env.decode_captures(0)] == [(8, 8), (4, 4), (2, 2), (1, 1)]
    assert [(c.num_reqs, c.num_tokens) for c in env.decode_captures(3)] == [(32, 128), (2, 8), (1, 4)]
    assert Envelope(cuda_graph_sizes=()).decode_captures(1) == ()


@pytest.mark.parametrize("mtp", [0, 1, 3])
def test_the_readme_sizing_step_gives_a_number_the_check_accepts(mtp):
    """README: ``kvprofile size --model M --gpu G --tp N`` with the matrix's capture sizes, as tokens."""
    model = load_matrix(DEFAULT).models["qwen3-8b"]
    case = layout_case(model, lookup_gpu("L40S"), 1, 1, mtp, load_matrix(DEFAULT).cases[0].envelope)
    sizes = ",".join(str(s) for s in case.envelope.cuda_graph_sizes)
    data = _cli(case, "--cuda-graph-sizes", sizes)
    assert data["case"] == case.id
    assert _verdict(case, data["float_workspace_bytes"], data["int_workspace_bytes"]) == []


def test_the_cli_sizes_for_the_gpu_the_check_sizes_for():
    """``--gpu`` brings the catalog's SM count and compute capability; ``--sm`` alone is an inline GPU,
    which the check sizes as compute capability 9.0, as it does an inline matrix GPU without one."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["size", "--heads-q", "32", "--heads-kv", "8", "--head-dim", "128", "--gpu", "L40S",
                     "--json"]) == 0
        assert main(["size", "--heads-q", "32", "--heads-kv", "8", "--head-dim", "128", "--sm", "142",
                     "--json"]) == 0
    catalog, inline = (json.loads(line) for line in out.getvalue().splitlines())
    assert (catalog["num_sm"], catalog["compute_capability"]) == (142, [8, 9])
    assert (inline["num_sm"], inline["compute_capability"]) == (142, [9, 0])
    model = ModelSpec("cli", 32, 8, 128, 1)
    env = load_matrix(DEFAULT).cases[0].envelope
    case = layout_case(model, lookup_gpu("L40S"), 1, 1, 0, env)
    assert _verdict(case, catalog["float_workspace_bytes"], catalog["int_workspace_bytes"]) == []
