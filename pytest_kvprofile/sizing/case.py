"""What one matrix case needs: the single sizing computation every consumer calls.

``workspace_covers_planner``, the JSON sizing report, ``kvprofile size``, the stub and GPU
builders and the example backend all call :func:`for_case`, so the number a backend is told to
reserve is the number the check demands. The per-rank heads come from the case (TP, and DCP for
the decode wrapper), the SM count and compute capability from its GPU, and the batches from its
envelope through :func:`plan_envelope`, which reads the captured decode steps from
``Envelope.decode_captures`` (capture sizes are tokens).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

from pytest_kvprofile.matrix.cases import Case
from pytest_kvprofile.matrix.engine_facts import route_policy, workspace_rule
from pytest_kvprofile.sizing.analytic import PlanEnvelope
from pytest_kvprofile.sizing.requirement import SizingResult, required_workspace

DEFAULT_COMPUTE_CAPABILITY = (9, 0)  # an inline matrix GPU without one is sized as a Hopper part
_MEMO = "_kvprofile_for_case"  # per-case answers, in the (frozen) case's instance dict like cached_property
_ROUTE_MEMO = "_kvprofile_route_need"  # need_for_routes' answers per set of routes, kept the same way


def decode_tensor_cores(case: Case) -> bool:
    """Whether the case's decode wrapper runs the tensor-core (prefill) planner, as the route policy says
    (``RoutePolicy.decode_tensor_cores``: from a GQA group, and under MTP)."""
    heads = case.heads
    return route_policy().decode_tensor_cores(heads.heads_q, heads.heads_kv, case.mtp)


def routes(case: Case) -> tuple[str, ...]:
    """MLA decode runs FlashInfer's MLA planner, which is not modelled; its prefill is FA2."""
    return ("prefill",) if case.model.attention == "mla" else ("prefill", "decode")


def compute_capability(case: Case) -> tuple[int, int]:
    cc = case.gpu.compute_capability
    return cc if cc != (0, 0) else DEFAULT_COMPUTE_CAPABILITY


def plan_envelope(case: Case) -> PlanEnvelope:
    """Every batch one ``plan()`` of this case can see; CUDA graphs on when a decode step is captured."""
    env = case.envelope
    sizes = tuple(c.num_tokens for c in env.decode_captures(case.mtp))
    return PlanEnvelope(
        max_num_seqs=env.max_num_seqs, max_num_batched_tokens=env.max_num_batched_tokens,
        max_model_len=env.max_model_len, page_size=env.page_size, cuda_graph=bool(sizes),
        cuda_graph_sizes=sizes, mtp=case.mtp,
    )


class UnsizableCase(ValueError):
    """The case's FlashInfer routes cannot be sized here: the engine runs its KV dtype on trtllm-gen only on its GPU
    (NVFP4 on SM10x). Never sized as another dtype: the engine plans no FA2 route, and the suite sizes none."""


def sizable_refusal(case: Case) -> str | None:
    """Why the case's FA2 routes cannot be planned (``Case.unsized_reason``), or None."""
    reason = case.unsized_reason
    return None if reason is None else f"case {case.id}: {reason}"


def for_case(case: Case, *, use_oracle: bool | None = None) -> SizingResult:
    """The float/int workspace this case's rank must reserve, the worst batch and how it was found.

    ``use_oracle``: None (what the check uses) confirms with FlashInfer's host-compiled planner when it
    can be built, True requires it, False sizes from the analytic model alone. The answer is kept on
    the case (builders and checks ask many times per lifecycle). The routes are planned for the case's KV
    dtype (``sizeof(DTypeKV)``); :class:`UnsizableCase` where the engine plans no FA2 route for it.
    """
    memo: dict[bool | None, SizingResult] = case.__dict__.setdefault(_MEMO, {})
    result = memo.get(use_oracle)
    if result is None:
        refusal = sizable_refusal(case)
        if refusal is not None:
            raise UnsizableCase(refusal)
        heads = case.heads
        result = memo[use_oracle] = _for_layout(
            heads.heads_q, heads.heads_kv, heads.heads_q_decode, case.model.head_dim, case.model.dim_vo,
            case.gpu.num_sm, plan_envelope(case), routes(case), decode_tensor_cores(case),
            compute_capability(case), use_oracle, case.model.kv_dtype_bytes,
        )
    return result


@functools.lru_cache(maxsize=4096)
def _for_layout(heads_q: int, heads_kv: int, heads_q_decode: int, head_dim: int, head_dim_vo: int, num_sm: int,
                envelope: PlanEnvelope, route_names: tuple[str, ...], tc: bool,
                capability: tuple[int, int], use_oracle: bool | None, kv_bytes: int = 2) -> SizingResult:
    return required_workspace(
        heads_q=heads_q, heads_kv=heads_kv, heads_q_decode=heads_q_decode, head_dim=head_dim,
        head_dim_vo=head_dim_vo, num_sm=num_sm, envelope=envelope, routes=route_names, decode_tensor_cores=tc,
        compute_capability=capability, use_oracle=use_oracle, kv_dtype_bytes=kv_bytes,
    )


def route_of(sub_route: str) -> str:
    """The case route (``prefill``, ``decode``, ``fa3``) a sized sub-route (``decode_tc_cuda_graph``) belongs to."""
    return sub_route.split("_", 1)[0]


def is_graph_sub_route(sub_route: str) -> bool:
    """Whether a sized sub-route is planned for CUDA-graph replay (``prefill_cuda_graph``, ``decode_tc_cuda_graph``)."""
    return sub_route.endswith("_cuda_graph")


PlannedRoute = tuple[str, bool | None]
"""A case route and the CUDA-graph mode its plans use: ``True`` with graphs only, ``False`` without, None both."""


def need_for_routes(case: Case, planned: Iterable[str] | None) -> tuple[int, tuple[str, ...]]:
    """The float workspace the planner carves for the routes a builder plans natively, and those sub-routes.

    ``planned``: case routes (``prefill``, ``decode``) whose wrappers plan into the float workspace; None means
    every route of the case (a builder that names no route). A route sent elsewhere (trtllm-gen plans into its
    own workspace) needs nothing here, so a builder whose routes are all trtllm-gen needs 0 bytes. Routes share
    one float workspace per micro-batch and plan one after another, so the need is the maximum, not the sum.
    Each route is sized with and without CUDA graphs; :func:`need_for_planned` sizes the modes a builder plans.
    """
    wanted = routes(case) if planned is None else tuple(planned)
    return need_for_planned(case, [(r, None) for r in wanted])


def need_for_planned(case: Case, planned: Iterable[PlannedRoute]) -> tuple[int, tuple[str, ...]]:
    """:func:`need_for_routes` for the sub-routes a builder plans: each route with the CUDA-graph mode its plans use
    (an engine may plan prefill without graphs only, decode with and without). A mode the case does not size (graphs
    on a case that captures none) stands for the route's every sub-route."""
    wanted = frozenset(planned)
    memo: dict[frozenset[PlannedRoute], tuple[int, tuple[str, ...]]] = case.__dict__.setdefault(_ROUTE_MEMO, {})
    answer = memo.get(wanted)
    if answer is None:
        sized = for_case(case)
        chosen: set[str] = set()
        for route, graph in wanted:
            mine = [name for name in sized.routes if route_of(name) == route]
            modes = [name for name in mine if graph is None or is_graph_sub_route(name) == graph]
            chosen.update(modes or mine)
        subs = tuple(name for name in sized.routes if name in chosen)
        answer = memo[wanted] = (max((sized.routes[name].float_bytes for name in subs), default=0), subs)
    return answer


def default_float_bytes(rule: str, case: Case) -> int:
    """An engine's default float workspace ``rule`` (``EngineFacts.float_workspaces``) for the case's rank: its fixed
    bytes, grown to batched tokens x rank query heads x head dim x its bytes per element where the engine grows it."""
    return workspace_rule(rule).bytes_for(case.envelope.max_num_batched_tokens, case.heads.heads_q,
                                          case.model.head_dim)
