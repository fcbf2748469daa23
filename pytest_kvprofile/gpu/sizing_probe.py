"""The sizing oracle against the real planner: plan() on each route's worst batch with exactly the
oracle's float bytes, then 16 bytes fewer, then ask ``workspace_size()``.

A route probe is pure data (built on CPU from ``for_case``); only ``plan_on_device``,
``expect_overflow`` and ``api_workspace_size`` touch CUDA and FlashInfer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pytest_kvprofile.attention.reference import paged_layout
from pytest_kvprofile.attention.wrappers import Route, make_wrapper, plan_args, run_checked
from pytest_kvprofile.sizing.case import for_case

if TYPE_CHECKING:
    import torch

    from pytest_kvprofile.attention.reference import PagedLayout
    from pytest_kvprofile.attention.wrappers import PagedWrapper
    from pytest_kvprofile.matrix.cases import Case

__all__ = ["OVERFLOW_MARKER", "RouteProbe", "api_workspace_size", "expect_overflow", "plan_on_device", "route_probes"]

OVERFLOW_MARKER = "Increase the workspace buffer size"
SHORT_BY = 16  # FlashInfer aligns its carve-outs to 16 bytes: one alignment unit less must overflow
MAX_PHYSICAL_PAGES = 4096


@dataclass(frozen=True)
class RouteProbe:
    """One route's worst batch for one case, and what the oracle says it needs."""

    case_id: str
    route: str  # the sizing route: prefill, prefill_cuda_graph, decode_tc, decode_cc_cuda_graph, ...
    wrapper: Route
    tensor_cores: bool
    cuda_graph: bool
    heads_q: int
    heads_kv: int
    head_dim: int
    head_dim_vo: int
    page_size: int
    qo_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    float_bytes: int
    exact: bool
    binding: bool  # this route sets the case's float arena
    method: str

    @property
    def id(self) -> str:
        return f"{self.case_id}-{self.route}"

    def layout(self) -> PagedLayout:
        return paged_layout(self.qo_lens, self.kv_lens, self.page_size, max_physical_pages=MAX_PHYSICAL_PAGES)


def route_probes(case: Case) -> list[RouteProbe]:
    """A probe for every route of ``case`` whose worst batch the oracle names (FA3 and MLA decode have none)."""
    res = for_case(case)
    out = []
    for route, rs in res.routes.items():
        if rs.worst_batch is None or not route.startswith(("prefill", "decode")):
            continue
        qo, kv, graph = rs.worst_batch
        out.append(RouteProbe(
            case_id=case.id, route=route, wrapper="decode" if route.startswith("decode") else "prefill",
            tensor_cores=route.startswith("decode_tc"), cuda_graph=bool(graph), heads_q=rs.heads_q,
            heads_kv=rs.heads_kv, head_dim=case.model.head_dim, head_dim_vo=case.model.dim_vo,
            page_size=case.envelope.page_size, qo_lens=tuple(qo), kv_lens=tuple(kv), float_bytes=rs.float_bytes,
            exact=rs.exact, binding=route == res.worst_route, method=res.method,
        ))
    return out


def _wrapper(probe: RouteProbe, float_bytes: int, device: torch.device | str) -> tuple[PagedWrapper, PagedLayout]:
    import torch

    layout = probe.layout()
    buf = torch.empty(float_bytes, dtype=torch.uint8, device=device)
    w = make_wrapper(probe.wrapper, buf, None, tensor_cores=probe.tensor_cores, cuda_graph=probe.cuda_graph,
                     layout=layout)
    return w, layout


def plan_on_device(probe: RouteProbe, float_bytes: int, device: torch.device | str = "cuda",
                   run: bool = True) -> float | None:
    """plan() the worst batch on a float workspace of exactly ``float_bytes``; with ``run``, run the
    kernel and return its relative error against the float32 reference (raises past bf16 tolerance)."""
    w, layout = _wrapper(probe, float_bytes, device)
    args, kw = plan_args(probe.wrapper, layout, probe.heads_q, probe.heads_kv, probe.head_dim, probe.head_dim_vo)
    w.plan(*args, **kw)
    if not run:
        return None
    return run_checked(probe.wrapper, w, layout, probe.heads_q, probe.heads_kv, probe.head_dim, probe.head_dim_vo,
                       device, plan=False)


def expect_overflow(probe: RouteProbe, float_bytes: int, device: torch.device | str = "cuda") -> str:
    """plan() with ``float_bytes`` must raise FlashInfer's buffer overflow; returns its message."""
    try:
        plan_on_device(probe, float_bytes, device, run=False)
    except Exception as exc:
        if OVERFLOW_MARKER in str(exc) or "Buffer overflow" in str(exc):
            return str(exc)
        raise AssertionError(
            f"{probe.id}: plan() with {float_bytes} bytes raised {type(exc).__name__}, not FlashInfer's buffer "
            f"overflow: {exc}"
        ) from exc
    raise AssertionError(
        f"{probe.id}: plan() fit in {float_bytes} bytes, {probe.float_bytes - float_bytes} fewer than the oracle's "
        f"{probe.float_bytes}: the oracle overstates this route's need (it claims to be exact)"
    )


def api_workspace_size(probe: RouteProbe, device: torch.device | str = "cuda") -> int | None:
    """FlashInfer's own ``workspace_size(...)`` float answer for the worst batch (None before 0.6.15)."""
    w, layout = _wrapper(probe, max(probe.float_bytes, 16), device)
    fn = getattr(w, "workspace_size", None)
    if fn is None:
        return None
    args, kw = plan_args(probe.wrapper, layout, probe.heads_q, probe.heads_kv, probe.head_dim, probe.head_dim_vo)
    return int(fn(*args, **kw)[0])
