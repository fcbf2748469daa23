"""Exact FlashInfer workspace sizing: what a backend must reserve for every batch it can plan.

``required_workspace`` returns, for one per-rank head layout, SM count and envelope, the float
and int workspace bytes the installed FlashInfer's planners carve for the worst batch of each
enabled route, and that batch. The closed form comes from :mod:`.analytic`; the host oracle
(:mod:`.oracle`, FlashInfer's planners compiled for the CPU) confirms it on the worst batch.

Routes share one float arena (an engine's global workspace manager hands every wrapper the same
buffer, and the wrappers of one step plan one after another), so the float requirement is the
*maximum* over routes, not the sum. Each wrapper has its own int buffer, so ``int_bytes`` is the
per-wrapper maximum.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

from pytest_kvprofile.attention.oracle import Oracle, OracleError, OracleUnavailable, get_oracle
from pytest_kvprofile.attention.oracle_build import (
    HEADERS_ENV,
    INSTALL_HINT,
    FlashInferInstall,
    OracleBuildError,
    cache_root,
    find_nvcc,
    generation_mismatch,
    install_for,
)
from pytest_kvprofile.attention.planner import family_of
from pytest_kvprofile.sizing.analytic import (
    DEFAULT_INT_WORKSPACE,
    Layout,
    PlanBatch,
    PlanEnvelope,
    RouteResult,
    decode_cc,
    decode_tc,
    fa3_int,
    prefill_graph,
    prefill_nograph,
)


@dataclass(frozen=True)
class RouteSizing:
    """One route's worst case, as confirmed (or not) by the oracle."""

    route: str
    float_bytes: int
    int_bytes: int
    worst_batch: tuple[tuple[int, ...], tuple[int, ...], bool] | None
    exact: bool
    gap_bytes: int
    confirmed_by_oracle: bool
    heads_q: int
    heads_kv: int
    blocks_per_sm: int | None
    notes: tuple[str, ...]


@dataclass(frozen=True)
class SizingResult:
    """What a backend must reserve: float arena bytes (max over routes) and int bytes per wrapper."""

    float_bytes: int
    int_bytes: int
    worst_batch: tuple[tuple[int, ...], tuple[int, ...], bool] | None
    method: str  # "oracle" | "analytic"
    exact: bool
    flashinfer_version: str
    num_sm: int
    heads_q: int
    heads_kv: int
    routes: dict[str, RouteSizing]
    notes: tuple[str, ...]
    worst_route: str = ""
    gap_bytes: int = 0
    kv_dtype_bytes: int = 2  # sizeof(DTypeKV) the routes were planned with
    method_reason: str = ""  # why ``method`` (sizing_method's reason; for "analytic", why not the oracle)


@dataclass(frozen=True)
class SizingMethod:
    """Which method sizes a FlashInfer version here, and why.

    ``method``: ``"oracle"`` (its own planner, compiled for the host from its headers) or ``"analytic"`` (the
    closed forms and the Python port of its generation, ``family``). ``reason``: for the oracle, which headers
    and compiler; for the analytic model, why the oracle cannot run (no compiler, no headers, or the first
    compiler error)."""

    method: str
    flashinfer_version: str
    family: str
    reason: str


def _method_key() -> tuple[str, str, str]:
    return (str(cache_root()), str(find_nvcc()), os.environ.get(HEADERS_ENV, ""))


def _oracle_or_why(version: str | None) -> tuple[Oracle | None, SizingMethod]:
    """This thread's oracle for ``version`` (None: the installed one) and how it sizes; no oracle when it cannot."""
    install, how = _method_for(version, _method_key())
    return (get_oracle(install) if install is not None else None), how


@lru_cache(maxsize=32)
def _method_for(version: str | None, _key: tuple[str, str, str]) -> tuple[FlashInferInstall | None, SizingMethod]:
    """Which headers the oracle compiles for ``version``, or why it cannot (built once; loaded per thread)."""
    try:
        install = install_for(version)
    except OracleUnavailable as exc:
        if version is None:
            raise
        return None, SizingMethod("analytic", version, family_of(version), str(exc))
    fam = install.family
    where = "installed" if install.installed else f"headers from {HEADERS_ENV}"
    nvcc = find_nvcc()
    if nvcc is None:
        return None, SizingMethod("analytic", install.version, fam,
                                  f"nvcc not found on CUDA_HOME, PATH or the nvidia-cuda-nvcc wheel; {INSTALL_HINT}")
    try:
        get_oracle(install)
    except OracleBuildError as exc:
        return None, SizingMethod(
            "analytic", install.version, fam,
            f"the oracle does not compile against flashinfer-python {install.version} ({where}, family {fam}): "
            f"{exc.first_error}")
    except OracleError as exc:
        return None, SizingMethod("analytic", install.version, fam,
                                  f"the oracle for flashinfer-python {install.version} cannot load: "
                                  f"{str(exc).splitlines()[0]}")
    reason = (f"flashinfer-python {install.version}'s planner ({where}, family {fam}) compiled for the host "
              f"from {install.include_dir} with {nvcc}")
    mismatch = generation_mismatch(install)
    if mismatch:
        reason += f"; its headers differ from the analytic model's family table ({mismatch})"
    return install, SizingMethod("oracle", install.version, fam, reason)


def sizing_method(flashinfer_version: str | None = None, *, use_oracle: bool | None = None) -> SizingMethod:
    """Which method sizes ``flashinfer_version`` (default: the installed FlashInfer) here, and why.

    Builds the oracle when it can (once; cached like ``for_case``'s). ``use_oracle=False`` answers "analytic"
    ("the caller asked for the analytic model"). Never raises for a missing compiler or a failed build: that is
    the reason. Raises ``OracleUnavailable`` only when no FlashInfer is installed and no version is named."""
    if use_oracle is False:
        version = flashinfer_version or installed_flashinfer_version()
        return SizingMethod("analytic", version, family_of(version), "use_oracle=False: the analytic model only")
    return _method_for(flashinfer_version, _method_key())[1]


def installed_flashinfer_version() -> str:
    """The installed flashinfer-python version (read from metadata; FlashInfer is not imported)."""
    from pytest_kvprofile.attention.oracle import flashinfer_install

    return flashinfer_install().version


def route_results(*, heads_q: int, heads_kv: int, head_dim: int, head_dim_vo: int | None,
                  num_sm: int, envelope: PlanEnvelope, routes: tuple[str, ...],
                  decode_tensor_cores: bool, family: str, heads_q_decode: int | None,
                  decode_blocks_per_sm: int | None,
                  compute_capability: tuple[int, int], kv_dtype_bytes: int = 2) -> list[RouteResult]:
    """The analytic worst case of every sub-route that ``routes`` enables."""
    dvo = head_dim_vo or head_dim
    cc = compute_capability
    lay = Layout(heads_q, heads_kv, head_dim, dvo, num_sm, cc[0], cc[1], kv_bytes=kv_dtype_bytes)
    dec = Layout(heads_q_decode or heads_q, heads_kv, head_dim, dvo, num_sm, cc[0], cc[1], kv_bytes=kv_dtype_bytes)
    out: list[RouteResult] = []
    for route in routes:
        if route == "prefill":
            out.append(prefill_nograph(family, lay, envelope))
            if envelope.cuda_graph:
                out.append(prefill_graph(family, lay, envelope))
        elif route == "decode":
            graphs = (False, True) if envelope.cuda_graph else (False,)
            for graph in graphs:
                if decode_tensor_cores:
                    out.append(decode_tc(family, dec, envelope, graph))
                else:
                    out.append(decode_cc(family, dec, envelope, graph, decode_blocks_per_sm))
        elif route == "fa3":
            out.append(fa3_int(lay, envelope, envelope.cuda_graph))
        else:
            raise ValueError(f"unknown route {route!r}; known: prefill, decode, fa3")
    return out


def _validate(heads_q: int, heads_kv: int, head_dim: int, num_sm: int,
              heads_q_decode: int | None) -> None:
    if heads_q < 1 or heads_kv < 1 or head_dim < 1 or num_sm < 1:
        raise ValueError("heads_q, heads_kv, head_dim and num_sm must be positive")
    if heads_q % heads_kv:
        raise ValueError(f"heads_q={heads_q} is not a multiple of heads_kv={heads_kv}")
    if heads_q_decode is not None and heads_q_decode % heads_kv:
        raise ValueError(f"heads_q_decode={heads_q_decode} is not a multiple of heads_kv={heads_kv}")


def _confirm(res: RouteResult, batch: PlanBatch, envelope: PlanEnvelope, oracle: Oracle) -> tuple[int, int]:
    """Oracle float/int bytes on the route's worst batch (``batch``: ``res.batch``, known not None)."""
    from pytest_kvprofile.sizing.search import oracle_evaluator

    return oracle_evaluator(oracle, res, envelope)(batch)


def _sizing_method(version: str, installed: str | None, family: str, use_oracle: bool | None,
                   notes: list[str]) -> tuple[Oracle | None, SizingMethod]:
    """The planner that confirms the model (FlashInfer ``version``'s own, when it builds) and how the sizing was made;
    why the oracle is not used is added to ``notes``. ``use_oracle=True`` raises where it cannot be used."""
    oracle = None
    if use_oracle is False:
        how = SizingMethod("analytic", version, family, "use_oracle=False: the analytic model only")
    else:
        oracle, how = _oracle_or_why(None if version == installed else version)
        if oracle is None and use_oracle:
            raise OracleUnavailable(f"the oracle cannot size FlashInfer {version}: {how.reason}")
        if oracle is None:
            notes.append(f"oracle unavailable, analytic only: {how.reason}")
    if version != installed and oracle is None:
        notes.append(f"FlashInfer {version} is not installed: sized from the {family} family's "
                     "model and the Python port, not confirmed by that version's planner")
    return oracle, how


def _route_sizing(res: RouteResult, envelope: PlanEnvelope, oracle: Oracle | None) -> RouteSizing:
    """One route's sizing: the model's, confirmed by the oracle on its worst batch (the larger kept where they
    differ, and said in the route's notes)."""
    fbytes, exact, confirmed = res.float_bytes, res.exact, False
    rnotes = list(res.notes)
    if oracle is not None and res.batch is not None:
        got_f, _ = _confirm(res, res.batch, envelope, oracle)
        confirmed = got_f == res.float_bytes if res.exact else got_f <= res.float_bytes
        if not confirmed:
            rnotes.append(f"oracle carves {got_f} bytes on the worst batch, model said "
                          f"{res.float_bytes}; using the larger")
            fbytes, exact = max(fbytes, got_f), False
    batch = res.batch.as_tuple() if res.batch is not None else None
    return RouteSizing(res.route, fbytes, res.int_bytes, batch, exact, res.gap_bytes, confirmed,
                       res.layout.heads_q, res.layout.heads_kv, res.blocks_per_sm, tuple(rnotes))


@lru_cache(maxsize=4096)
def _required(heads_q: int, heads_kv: int, head_dim: int, head_dim_vo: int | None, num_sm: int,
              envelope: PlanEnvelope, routes: tuple[str, ...], decode_tensor_cores: bool,
              flashinfer_version: str | None, use_oracle: bool | None,
              heads_q_decode: int | None, decode_blocks_per_sm: int | None,
              compute_capability: tuple[int, int], kv_dtype_bytes: int) -> SizingResult:
    _validate(heads_q, heads_kv, head_dim, num_sm, heads_q_decode)
    installed: str | None
    try:
        installed = installed_flashinfer_version()
    except OracleUnavailable:
        installed = None
    version = flashinfer_version or installed
    if version is None:
        raise OracleUnavailable("no FlashInfer installed and no flashinfer_version given")
    family = family_of(version)
    notes: list[str] = []
    oracle, how = _sizing_method(version, installed, family, use_oracle, notes)
    results = route_results(heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim,
                            head_dim_vo=head_dim_vo, num_sm=num_sm, envelope=envelope,
                            routes=routes, decode_tensor_cores=decode_tensor_cores, family=family,
                            heads_q_decode=heads_q_decode,
                            decode_blocks_per_sm=decode_blocks_per_sm,
                            compute_capability=compute_capability, kv_dtype_bytes=kv_dtype_bytes)
    sized: dict[str, RouteSizing] = {}
    for res in results:
        sized[res.route] = _route_sizing(res, envelope, oracle)
        notes.extend(sized[res.route].notes)
    worst = max(sized.values(), key=lambda r: (r.float_bytes, r.route)) if sized else None
    float_bytes = worst.float_bytes if worst else 0
    int_bytes = max((r.int_bytes for r in sized.values()), default=0)
    if int_bytes > DEFAULT_INT_WORKSPACE:
        notes.append(f"int workspace needs {int_bytes} bytes > FlashInfer's 8 MiB default")
    # Exactness is about the binding route; other routes may be bounds that lie below it.
    exact = worst is not None and worst.exact and all(
        r.exact or r.float_bytes < float_bytes for r in sized.values())
    confirmed_all = oracle is not None and worst is not None and worst.confirmed_by_oracle
    return SizingResult(
        float_bytes=float_bytes,
        int_bytes=int_bytes,
        worst_batch=worst.worst_batch if worst else None,
        method="oracle" if confirmed_all else "analytic",
        exact=exact,
        flashinfer_version=version,
        num_sm=num_sm,
        heads_q=heads_q,
        heads_kv=heads_kv,
        routes=sized,
        notes=tuple(notes),
        worst_route=worst.route if worst else "",
        gap_bytes=worst.gap_bytes if worst else 0,
        kv_dtype_bytes=kv_dtype_bytes,
        method_reason=how.reason if confirmed_all or oracle is None else
        f"{how.reason}; but the oracle did not confirm the worst batch (see notes)",
    )


def required_workspace(*, heads_q: int, heads_kv: int, head_dim: int,
                       head_dim_vo: int | None = None, num_sm: int, envelope: PlanEnvelope,
                       routes: tuple[str, ...] = ("prefill", "decode"),
                       decode_tensor_cores: bool = True, flashinfer_version: str | None = None,
                       use_oracle: bool | None = None, heads_q_decode: int | None = None,
                       decode_blocks_per_sm: int | None = None,
                       compute_capability: tuple[int, int] = (9, 0), kv_dtype_bytes: int = 2) -> SizingResult:
    """Worst-case float/int workspace over ``envelope`` for one rank's wrappers.

    ``heads_q``/``heads_kv`` are per rank; ``heads_q_decode`` is the decode wrapper's query heads
    when it differs (DCP: ``heads_q * dcp``). ``use_oracle``: None uses the oracle when it can be
    built for ``flashinfer_version`` (default: the installed one; another version's headers are read from
    ``$KVPROFILE_FLASHINFER_HEADERS/<version>``), True requires it, False never builds it. ``method`` and
    ``method_reason`` say which sized it and why (``sizing_method``). ``kv_dtype_bytes`` is
    ``sizeof(DTypeKV)`` of the KV cache the wrappers plan for (fp8: 1). Results are cached per argument tuple.
    """
    return _required(heads_q, heads_kv, head_dim, head_dim_vo, num_sm, envelope, tuple(routes),
                     decode_tensor_cores, flashinfer_version, use_oracle, heads_q_decode,
                     decode_blocks_per_sm, tuple(compute_capability), kv_dtype_bytes)
