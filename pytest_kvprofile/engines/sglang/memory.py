"""SGLang's memory model next to what its FlashInfer backend really makes: one row per case of the static path.

Why: SGLang makes no profile run. It sizes the KV pool from ``mem_fraction_static`` (weights + KV pool over GPU
memory) and leaves the rest, ``1 - mem_fraction_static`` of the GPU, for what comes after: activations, CUDA graphs
and every buffer the attention backend makes (the backend is made after the KV pools). Its default fraction is a
heuristic (``arg_groups/memory_hook.py``: 512 MiB of "constant meta data (e.g., from attention backend)" plus 1.5 MiB
per activation token, TP slack and a graph reserve, floored at 10 GiB on GPUs above 60 GiB). A row says what the
backend made after KV sizing (by SGLang's and FlashInfer's source lines, from the lifecycle's record), what of it is
workspace beyond FlashInfer's exact need for the case (``sizing.for_case``), what ``mem_fraction_static`` must leave
for it, and whether SGLang's own default covers it: its attention share (the 512 MiB constant) and its whole reserve.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from pytest_kvprofile.checks.post_kv_cost import post_kv_allocations
from pytest_kvprofile.contract.roles import Role
from pytest_kvprofile.lifecycle.phases import POST_KV_PHASES
from pytest_kvprofile.lifecycle.record import LifecycleResult
from pytest_kvprofile.matrix.cases import Case
from pytest_kvprofile.memory.budget import tokens_for
from pytest_kvprofile.units import MiB

__all__ = ["SGLANG_ATTENTION_RESERVE", "PostCaptureRow", "SglangCostRow", "cost_row", "default_mem_fraction",
           "planner_need", "post_capture_row", "post_capture_table", "sglang_table"]

# The constant of SGLang's default reserve that its comment gives to "meta data (e.g., from attention backend)"
SGLANG_ATTENTION_RESERVE = 512 * MiB


@dataclass(frozen=True)
class SglangCostRow:
    """One case on SGLang's static path (bytes per rank; KV tokens at the case's bytes per token)."""

    case: str
    gpu_bytes: int
    backend_bytes: int  # what SGLang's backend made after KV sizing and kept (its own owner only)
    backend_kv_tokens: int
    float_workspace_bytes: int  # SGLang's shared float workspace
    int_workspace_bytes: int  # the wrappers' int workspaces, all of them
    int_workspaces: int
    # FlashInfer's exact float need for the routes planned (sizing.for_case) and the int need per wrapper; None
    # where the backend plans a route the suite does not size (FlashInfer's MLA planner), and then no waste either
    float_need_bytes: int | None
    int_need_bytes: int | None
    waste_bytes: int | None  # workspace beyond the exact need: the float workspace's and every int workspace's excess
    waste_kv_tokens: int | None
    default_fraction: float  # SGLang's default mem_fraction_static on this GPU for this case
    default_reserve_bytes: int  # (1 - default_fraction) x GPU memory: what the default leaves after the KV pool
    backend: str = "sglang-flashinfer"  # the suite's backend the row is of (sglang-trtllm-mha: SGLang's SM100 default)

    @property
    def must_leave_fraction(self) -> float:
        """The share of GPU memory ``mem_fraction_static`` must leave for the backend alone."""
        return self.backend_bytes / self.gpu_bytes

    @property
    def attention_share_covers(self) -> bool:
        return self.backend_bytes <= SGLANG_ATTENTION_RESERVE

    @property
    def reserve_covers(self) -> bool:
        return self.backend_bytes <= self.default_reserve_bytes


def planner_need(result: LifecycleResult, backend_name: str) -> tuple[int, int] | None:
    """FlashInfer's exact float need and int need per wrapper for the routes the backend was seen planning (the
    waste check's ``need_for_routes``); nothing planned (trtllm-gen plans no FlashInfer route) needs nothing. None
    for an MLA layout (FlashInfer's MLA planner, which its wrappers plan on, also where trtllm-gen falls back to
    them, is not sized by the suite: ``sizing.case.routes``) or a planned route the suite does not size, rather than
    a need that leaves that route out."""
    from pytest_kvprofile.sizing.case import for_case, need_for_routes, routes

    planned = {p.route for p in result.plans if p.builder == backend_name}
    if result.case.model.attention == "mla" or not planned <= set(routes(result.case)):
        return None
    if not planned:
        return 0, 0
    float_need, sized = need_for_routes(result.case, planned)
    by_route = for_case(result.case).routes
    return float_need, max((by_route[r].int_bytes for r in sized), default=0)


def cost_row(result: LifecycleResult, backend_name: str, default_fraction: float) -> SglangCostRow | None:
    """The row of one lifecycle record of SGLang's backend (None when the run never reached KV sizing)."""
    if result.budget is None:
        return None
    case, per_token = result.case, result.budget.kv_bytes_per_token
    kept = [a for a in post_kv_allocations(result)  # the post-KV cost's own allocations, made after KV sizing
            if a.owner == backend_name and a.phase in POST_KV_PHASES]
    backend = sum(a.nbytes for a in kept)
    floats = sum(a.nbytes for a in kept if a.role is Role.FLOAT_WORKSPACE)  # SGLang's get_buffer("flashinfer_...")
    ints = [a for a in kept if a.role is Role.INT_WORKSPACE]  # each wrapper's own
    int_bytes, int_count = sum(a.nbytes for a in ints), len(ints)
    need = planner_need(result, backend_name)
    float_need, int_need = need if need is not None else (None, None)
    waste = (None if need is None else
             max(0, floats - need[0]) + max(0, int_bytes - int_count * need[1]))
    gpu = case.gpu.memory_bytes
    return SglangCostRow(
        case.id, gpu, backend, tokens_for(backend, per_token), floats, int_bytes, int_count, float_need,
        int_need, waste, None if waste is None else tokens_for(waste, per_token), default_fraction,
        int(gpu * (1 - default_fraction)), backend_name)


@dataclass(frozen=True)
class PostCaptureRow:
    """One case on SGLang's post-capture KV sizing path (``sglang-flashinfer-post-capture``; bytes per rank).

    ``static_reason``: SGLang's own reason it sizes this case statically instead (then the row is that reason
    only). ``failed``: the contract's checks the run fails. ``late_bytes``: what the backend made after the sizing
    point and still held after serving, its step memory aside (``checks.leases.made_after_closing``).
    ``headroom_bytes``: how far the device's peak after KV sizing rose above the static share
    (``total x mem_fraction_static``): what the serving headroom must hold."""

    case: str
    gpu_bytes: int
    static_reason: str | None = None
    failed: tuple[str, ...] = ()
    late_bytes: int = 0
    waste_bytes: int = 0
    waste_kv_tokens: int = 0
    headroom_bytes: int = 0
    default_fraction: float = 0.0  # SGLang's default mem_fraction_static with post-capture sizing planned
    backend: str = "sglang-flashinfer-post-capture"

    @property
    def default_headroom_bytes(self) -> int:
        return int(self.gpu_bytes * (1 - self.default_fraction))

    @property
    def default_covers(self) -> bool:
        return self.headroom_bytes <= self.default_headroom_bytes


def post_capture_row(result: LifecycleResult, default_fraction: float) -> PostCaptureRow:
    """The row of one lifecycle record of the post-capture backend."""
    from pytest_kvprofile.checks.catalog import failing_checks
    from pytest_kvprofile.checks.leases import made_after_closing
    from pytest_kvprofile.checks.workspace import case_waste
    from pytest_kvprofile.lifecycle.phases import SERVING

    case, gpu = result.case, result.case.gpu.memory_bytes
    backend = result.builder_names()[0]
    resolution = result.resolution
    if resolution is not None and resolution.engine_gate is not None:
        return PostCaptureRow(case.id, gpu, static_reason=resolution.engine_gate, backend=backend)
    late = sum(a.nbytes for a in made_after_closing(result, backend, SERVING)[0])
    waste = case_waste(result)
    budget = result.budget
    headroom = max(0, result.post_kv_peak_used - int(budget.total * budget.gmu)) if budget is not None else 0
    return PostCaptureRow(
        case.id, gpu, None, tuple(sorted(failing_checks(result))), late, waste.nbytes if waste else 0,
        waste.kv_tokens if waste else 0, headroom, default_fraction, backend)


@contextlib.contextmanager
def _gpu_memory(case: Case) -> Iterator[None]:
    """SGLang asks the device for its memory (``get_device_memory_capacity``, in MiB); the case's GPU answers."""
    import sglang.srt.arg_groups.memory_hook as hook

    from pytest_kvprofile.engines.adapter import Patches

    patches = Patches()
    patches.set(hook, "get_device_memory_capacity", lambda device=None: case.gpu.memory_bytes / MiB)
    try:
        yield
    finally:
        patches.undo()


def default_mem_fraction(case: Case, *, post_capture: bool = False, attention_backend: str = "flashinfer") -> float:
    """SGLang's own default ``mem_fraction_static`` for the case's rank (its heuristic, resolved by SGLang's
    pipeline from the case's ``ServerArgs`` without one, on the case's GPU memory); with ``post_capture``, as
    ``SGLANG_ENABLE_POST_CAPTURE_KV_SIZING=1`` resolves it (no activation or graph reserve where it applies)."""
    from pytest_kvprofile.engines.sglang.flashinfer import hf_config_dir, server_args_kwargs
    from pytest_kvprofile.engines.sglang.post_capture import post_capture_scope
    from pytest_kvprofile.engines.sglang.standins import sglang_standins

    opt_in = post_capture_scope() if post_capture else contextlib.nullcontext()
    with sglang_standins(case.gpu), _gpu_memory(case), opt_in:
        from sglang.srt import runtime_context
        from sglang.srt.server_args import ServerArgs

        kwargs = server_args_kwargs(case, str(hf_config_dir(case)), attention_backend)
        kwargs["mem_fraction_static"] = None
        context = runtime_context.create_context(ServerArgs(**kwargs), role="scheduler")
        with runtime_context.use_context(context):
            return float(runtime_context.get_schedule().mem_fraction_static)


def sglang_table(rows: list[SglangCostRow], refused: dict[str, str]) -> list[str]:
    """The static path's table of results/sglang-ci.md: one line per row, then the refused cases with their reason."""
    out = [
        "| case | after KV sizing, per rank | of it: float / int workspaces | waste vs exact need | "
        "`mem_fraction_static` must leave | SGLang's default (reserve) | "
        "attention share (512 MiB) covers | default reserve covers |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        per_int = r.int_workspace_bytes / MiB / max(1, r.int_workspaces)
        if r.waste_bytes is None or r.float_need_bytes is None or r.int_need_bytes is None:
            waste = "not sized (FlashInfer's MLA planner: the suite sizes prefill and decode routes)"
        else:
            need = f"need {r.float_need_bytes / MiB:.1f} + {r.int_workspaces} x {r.int_need_bytes / MiB:.2f} MiB"
            waste = f"{r.waste_bytes / MiB:.1f} MiB ({r.waste_kv_tokens} KV tokens; {need})"
        label = r.case if r.backend == "sglang-flashinfer" else f"{r.case} ({r.backend})"
        out.append(
            f"| {label} | {r.backend_bytes / MiB:.1f} MiB ({r.backend_kv_tokens} KV tokens) | "
            f"{r.float_workspace_bytes / MiB:.0f} MiB / {r.int_workspaces} x {per_int:.0f} MiB | {waste} | "
            f"{r.must_leave_fraction:.3f} of {r.gpu_bytes / MiB / 1024:.1f} GiB | "
            f"{r.default_fraction:.3f} ({r.default_reserve_bytes / MiB:.0f} MiB) | "
            f"{'yes' if r.attention_share_covers else 'no'} | {'yes' if r.reserve_covers else 'no'} |")
    if refused:
        out += ["", "Refused by name (not run):", ""]
        out += [f"- {case}: {reason.removeprefix(f'case {case}: ')}" for case, reason in refused.items()]
    return out



def post_capture_table(rows: list[PostCaptureRow]) -> list[str]:
    """The post-capture table of results/sglang-ci.md: one line per case, SGLang's static reason where it has one."""
    out = [
        "| case | contract's checks | made after the sizing point and kept | waste vs exact need | "
        "serving headroom used | SGLang's post-capture default (headroom) | default headroom covers |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        label = r.case if r.backend == "sglang-flashinfer-post-capture" else f"{r.case} ({r.backend})"
        if r.static_reason is not None:
            why = r.static_reason.split(" statically: ", 1)[-1].split(";", 1)[0]
            out.append(f"| {label} | sized statically: {why} | - | - | - | - | - |")
            continue
        verdict = "all pass" if not r.failed else "fails " + ", ".join(r.failed)
        out.append(
            f"| {label} | {verdict} | {r.late_bytes / MiB:.2f} MiB | "
            f"{r.waste_bytes / MiB:.1f} MiB ({r.waste_kv_tokens} KV tokens) | {r.headroom_bytes / MiB:.1f} MiB | "
            f"{r.default_fraction:.3f} ({r.default_headroom_bytes / MiB:.0f} MiB) | "
            f"{'yes' if r.default_covers else 'no'} |")
    return out
