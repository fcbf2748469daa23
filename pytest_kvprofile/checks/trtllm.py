"""The check of a builder's trtllm-gen workspace against what FlashInfer's trtllm-gen launcher carves from it.

Why: a route on trtllm-gen plans nothing, so ``workspace_covers_planner`` has no plan to compare. Yet the launcher
bump-allocates from the workspace it is handed (``csrc/trtllm_fmha_kernel_launcher.cu``): under DCP an LSE slab of
``8 B x heads x DCP x step tokens`` first, then the multi-CTA KV scratch from the rest. A workspace sized without
the slab leaves the scratch too little, and the kernel writes past the buffer; no memory figure shows it. The check
sizes the routes the builder leaves to trtllm-gen with ``sizing/trtllm.py`` (MHA and MLA) and compares the
largest trtllm-gen workspace the builder makes (``Role.TRTLLM_WORKSPACE``; torch mode: the float buffer of a
trtllm-gen wrapper). It reads the ledger only, so a run that stopped early is judged on what it made.
"""

from __future__ import annotations

import pytest_kvprofile.lifecycle.phases as lc
from pytest_kvprofile.checks.base import Check, CheckOptions
from pytest_kvprofile.checks.evidence import fmt_alloc, resource_names
from pytest_kvprofile.contract.roles import Role
from pytest_kvprofile.contract.support import ProfilingSupport, declared_support
from pytest_kvprofile.lifecycle.record import PROFILING, LifecycleResult
from pytest_kvprofile.units import bytes_text


def _native(result: LifecycleResult, name: str) -> tuple[str, ...]:
    """The routes the builder plans natively (``workspace_covers_planner``'s reading); none where the case's FA2
    routes cannot be sized (the engine runs its KV dtype on trtllm-gen only)."""
    from pytest_kvprofile.checks.workspace import builder_waste
    from pytest_kvprofile.sizing.case import UnsizableCase

    try:
        return builder_waste(result, name).native
    except UnsizableCase:
        return ()


def check_trtllm_workspace_covers_launcher(result: LifecycleResult, options: CheckOptions) -> list[str]:
    from pytest_kvprofile.sizing.trtllm import trtllm_need, trtllm_routes

    case = result.case
    resources = resource_names(result)
    out: list[str] = []
    for b in result.builders:
        name = getattr(b, "name", "")
        if name in resources or declared_support(b) is not ProfilingSupport.REQUIRED:
            continue
        held = [a for a in result.allocations if a.owner == name and a.kind == "device"
                and a.role is Role.TRTLLM_WORKSPACE]
        if not held:
            continue
        routes = trtllm_routes(case, _native(result, name))
        need, carve = trtllm_need(case, routes)
        workspace = max(held, key=lambda a: (a.nbytes, a.id))
        if carve is None or workspace.nbytes >= need:
            continue
        short = need - workspace.nbytes
        dcp = (f"under DCP {case.dcp} the launcher carves an LSE slab for {carve.num_qo_heads} query heads "
               f"(heads x DCP) x {carve.batch_size} x round_up({carve.max_q_len}, 256) first, and the multi-CTA KV "
               "scratch gets what is left" if carve.lse else "the multi-CTA KV scratch of one wave does not fit")
        out.append(
            f"builder {name!r}: trtllm-gen workspace short by {bytes_text(short)} for its {carve.route} launch when "
            f"serving: {fmt_alloc(workspace)} holds {workspace.nbytes} bytes, but FlashInfer's trtllm-gen "
            f"launcher carves {bytes_text(need)} ({carve.formula()}; flashinfer/data/csrc/"
            f"trtllm_fmha_kernel_launcher.cu). {dcp[0].upper() + dcp[1:]}, so the kernel writes past the workspace. "
            f"Size it as pytest_kvprofile.sizing.trtllm.trtllm_need(case, {routes!r})[0] (vLLM's "
            "compute_trtllm_sparse_mla_workspace_bytes adds the slab to its base the same way): "
            f"`kvprofile size --model {case.model.name} --gpu '{case.gpu.name}' --tp {case.tp} --dcp {case.dcp} "
            f"--mtp {case.mtp} --trtllm {','.join(routes)}`")
    return out


CHECKS: tuple[Check, ...] = (
    Check("trtllm_workspace_covers_launcher", "the largest trtllm-gen workspace a builder makes covers what "
          "FlashInfer's trtllm-gen launcher carves for the routes it leaves to trtllm-gen (MHA and MLA): the LSE "
          "slab under DCP and the multi-CTA KV scratch", PROFILING, lc.SETUP, (11,),
          check_trtllm_workspace_covers_launcher),
)
