"""Backends: a named factory of builders for one model, plus how the engine integrates them.

Where backends come from (entry points, ``--kvprofile-backend``, the hook, the built-ins) is
:mod:`pytest_kvprofile.registry`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Literal, Protocol, Sequence

if TYPE_CHECKING:
    from pytest_kvprofile.contract.budget import BudgetArithmetic
    from pytest_kvprofile.contract.protocol import Builder
    from pytest_kvprofile.contract.resources import PersistentResource
    from pytest_kvprofile.contract.workspace import ArenaManager, ManagerKind
    from pytest_kvprofile.matrix.cases import Case
    from pytest_kvprofile.matrix.engine_facts import EngineFacts

REQUIRED_BUILDER_ATTRS = ("name",)

KvSizingRule = Literal["profile", "post_capture", "post_warmup"]
"""How an engine's memory budget reads ``gmu``, which the closing measurement sizes KV from.

Both size KV as ``total x gmu - non_kv - graph estimate``. ``profile`` (vLLM's ``gpu_memory_utilization``):
``total x gmu`` caps the engine, nothing after KV sizing may exceed it. ``post_capture`` (SGLang's
``mem_fraction_static`` under ``SGLANG_ENABLE_POST_CAPTURE_KV_SIZING``, measured after the decode and breakable
prefill graphs are captured, which the window's peak stands for): ``total x gmu`` is the static share and the rest
of the device, ``total x (1 - gmu)``, the headroom serving steps take their own tensors from, so nothing after KV
sizing may exceed the device. ``post_warmup`` (vLLM 0.34's extensible KV cache): the cache is measured after kernel
warmup and CUDA-graph capture, which the window then holds; the profiled activation peak stays free as headroom, there
is no separate CUDA-graph estimate, and ``total x gmu`` caps the engine as under ``profile``."""


@dataclass(frozen=True)
class KvSizingMode:
    """Where and how an engine sizes the KV cache on one case, and why there (the verdict names it per case).

    ``name``: what a reviewer reads (``profile window``, ``extensible (after warmup and capture)``, ...);
    ``rule``: the budget arithmetic the lifecycle applies; ``reason``: the engine's own reason for this mode on this
    case (for example why vLLM turned its extensible KV cache off), empty when it is the engine's default.
    """

    name: str
    rule: KvSizingRule = "profile"
    reason: str = ""


@dataclass(frozen=True)
class Provenance:
    """What a verdict names about the engine a backend was judged on.

    ``engine``: the engine's distribution name (``vllm``, ``sglang``), empty for the harness's own reference
    engine; ``engine_version``: its installed version; ``runner``: how that engine integrates the builders (vLLM's
    ``V1`` or ``V2`` model runner, SGLang's ``ModelRunner``); ``flashinfer``: the FlashInfer version the engine's
    builders ran (empty: the installed one); ``notes``: anything else the reviewer must know to read the verdict.
    """

    engine: str = ""
    engine_version: str = ""
    runner: str = ""
    flashinfer: str = ""
    notes: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


class BackendError(ValueError):
    """A backend cannot be used; the message names it and what is missing."""


@dataclass(frozen=True)
class EnginePolicy:
    """How the engine integrates the backend; the correct values are the defaults.

    ``warmup_in_window``: None means "each part where its engine warms it": inside the window the parts whose
    ``warmup_materializes_persistent`` says so, the others first after KV sizing; True warms every part inside the
    window, False none. ``graph_estimate`` (one of ``GRAPH_ESTIMATES``): "high_water" (the pool's full high-water mark),
    "gross_minus_retained" (the older accounting that omits live reserved pages) or "none" (CUDA graphs not
    accounted at all: an old vLLM default; the whole pool is invisible to KV sizing, a cost the checks report);
    any other value is a usage error (``BackendError``). ``profile_max_split_mib``:
    the caching allocator's ``max_split_size_mb`` while weights load and the profile runs (vLLM 0.33 scopes it to
    20, so large freed blocks stay releasable at the closing measurement); None leaves the allocator unlimited.
    ``workspace_manager``: the shared arena's manager, "harness" (``contract/workspace.py``) or "vllm" (vLLM's own
    ``WorkspaceManager``, ``engines/vllm/workspace.py``; set by ``--kvprofile-workspace-manager``), and
    ``manager_factory`` what makes it for a run (``(run, device, num_ubatches) -> manager``; None: the engine's
    own), set with the name by ``registry.with_workspace_manager`` so the engine imports no adapter.
    ``kv_sizing``: how the engine's budget reads gmu (``KvSizingRule``: vLLM's cap, or SGLang's post-capture
    static share with the rest of the device as serving headroom); ``kv_sizing_for(case)``, where the engine decides
    per case (vLLM 0.34's extensible KV cache, on by default and off under a few settings), the mode and why.
    ``gate(case)``: the engine's own reason to keep a case on the legacy path even when every builder opts in
    (vLLM's runner: speculative decoding, elastic EP), or None; None (the default) gates nothing.
    ``budget``: what makes the engine's own KV budget arithmetic for a run (``contract/budget.py``: its terms, each
    counting between two of the lifecycle's snapshots), which ``budget_counts_every_byte`` reads against the ledger;
    None: the harness's own (``ProfileWindow.terms``), which counts every byte from the fresh device on.
    """

    warmup_in_window: bool | None = None
    replay_after_warmup: bool = True
    graph_estimate: str = "high_water"
    profile_max_split_mib: int | None = 20
    workspace_manager: str = "harness"
    manager_factory: Callable[..., ArenaManager] | None = None
    gate: Callable[[Case], str | None] | None = None
    kv_sizing: KvSizingRule = "profile"
    kv_sizing_for: Callable[[Case], KvSizingMode] | None = None
    budget: Callable[[], BudgetArithmetic] | None = None

    def __post_init__(self) -> None:
        if self.graph_estimate not in GRAPH_ESTIMATES:
            raise BackendError(
                f"EnginePolicy(graph_estimate={self.graph_estimate!r}): unknown CUDA-graph pool accounting; the "
                f"known ones are {', '.join(repr(g) for g in GRAPH_ESTIMATES)} (pytest_kvprofile.contract.backends."
                "GRAPH_ESTIMATES). Name the one the engine uses")


GRAPH_ESTIMATES: tuple[str, ...] = ("high_water", "gross_minus_retained", "none")
"""How an engine accounts the CUDA-graph pool in KV sizing (``EnginePolicy.graph_estimate``): its full high-water
mark (correct), gross minus retained (omits live reserved pages), or not at all (an old vLLM default)."""


def kv_sizing_mode(policy: EnginePolicy, case: Case) -> KvSizingMode:
    """Where the engine sizes the KV cache on ``case``: ``EnginePolicy.kv_sizing_for`` when the engine decides per
    case (vLLM 0.34's extensible KV cache), else the policy's one rule."""
    if policy.kv_sizing_for is not None:
        return policy.kv_sizing_for(case)
    return KvSizingMode(_RULE_NAMES[policy.kv_sizing], policy.kv_sizing)


_RULE_NAMES: dict[str, str] = {"profile": "profile window", "post_capture": "post-capture",
                               "post_warmup": "after warmup and capture"}


def engine_gate(policy: EnginePolicy, case: Case) -> str | None:
    """The engine's reason to keep ``case`` off the profiling path (``EnginePolicy.gate``), or None."""
    if policy.gate is None:
        return None
    reason = policy.gate(case)
    return str(reason) if reason else None


@dataclass(frozen=True)
class Backend:
    """A named builder set and the engine policy it is integrated with.

    ``make_builders(case)`` returns fresh builder instances for one case. ``expected_failures``
    maps check names to reasons; those checks become strict xfails and block the opt-in.

    ``refuses_layout(case)`` returns the engine's own reason when the engine itself refuses the case's
    layout (vLLM rejects DCP unless TP is above the KV heads), else None: such a pair is listed as skipped
    with that reason at collection and is not part of the backend's matrix in the verdict. It is asked
    before any builder is made; a factory that raises on a layout the backend accepts is a failure.
    ``requires`` names the top-level modules the backend's engine needs; when one is not installed the
    run is a usage error naming ``install_hint``, before collection.
    """

    name: str
    make_builders: Callable[[Case], Iterable[Builder]]
    policy: EnginePolicy = field(default_factory=EnginePolicy)
    version: str = ""
    description: str = ""
    expected_failures: tuple[tuple[str, str], ...] = ()
    origin: str = ""  # where it was registered from; filled in by the registry
    torch_mode: bool = False  # builders allocate with plain torch "cuda" calls, served by the simulated device
    make_resources: Callable[[Case], Iterable[PersistentResource]] | None = None  # None: the resources the case carries
    refuses_layout: Callable[[Case], str | None] | None = None
    requires: tuple[str, ...] = ()
    install_hint: str = ""
    provenance: Callable[[], Provenance] | None = None  # None: the harness's own reference engine

    @property
    def xfails(self) -> dict[str, str]:
        return dict(self.expected_failures)


def coerce_backend(obj: object, origin: str) -> Backend:
    """Turn what a factory or hook returned into a Backend, or say precisely what is wrong."""
    if isinstance(obj, Backend):
        return obj if obj.origin else dataclasses.replace(obj, origin=origin)
    if isinstance(obj, dict):
        try:
            name = obj["name"]
            make = obj["make_builders"]
        except KeyError as exc:
            raise BackendError(f"backend from {origin}: mapping lacks the key {exc.args[0]!r}") from None
        if not callable(make):
            raise BackendError(f"backend {name!r} from {origin}: make_builders is not callable")
        policy = obj.get("policy") or EnginePolicy()
        xfail = obj.get("expected_failures") or {}
        return Backend(
            name=str(name), make_builders=make, policy=policy, version=str(obj.get("version", "")),
            description=str(obj.get("description", "")), expected_failures=tuple(sorted(dict(xfail).items())),
            origin=origin, torch_mode=bool(obj.get("torch_mode", False)),
            refuses_layout=obj.get("refuses_layout"), requires=_names(obj.get("requires", ())),
            install_hint=str(obj.get("install_hint", "")),
        )
    if obj is None:
        raise BackendError(f"backend from {origin}: the factory returned nothing (expected a Backend)")
    raise BackendError(
        f"backend from {origin}: the factory returned {type(obj).__name__}, expected a "
        "pytest_kvprofile.Backend or a mapping with 'name' and 'make_builders'"
    )


def _names(value: str | Iterable[str]) -> tuple[str, ...]:
    """One module name or several (a mapping's ``requires``)."""
    return (value,) if isinstance(value, str) else tuple(str(v) for v in value)


def validate_builders(backend: Backend, builders: Sequence[Builder]) -> None:
    """A builder set must be non-empty and every builder must name itself."""
    if not builders:
        raise BackendError(f"backend {backend.name!r}: make_builders() returned no builders")
    names = []
    for i, b in enumerate(builders):
        missing = [attr for attr in REQUIRED_BUILDER_ATTRS if not getattr(b, attr, None)]
        if missing:
            raise BackendError(
                f"backend {backend.name!r}: builder #{i} ({type(b).__name__}) lacks the protocol attribute "
                f"{', '.join(missing)}"
            )
        names.append(b.name)
    if len(set(names)) != len(names):
        raise BackendError(f"backend {backend.name!r}: builder names are not unique: {names}")


def layout_refusal(backend: Backend, case: Case) -> str | None:
    """Why ``case`` is not run on ``backend``, or None when it is: the engine's own reason
    (``Backend.refuses_layout``), else the case's own (``Case.unsized_reason``: routes this suite cannot size).

    A ``refuses_layout`` that raises refuses nothing: the factory then runs, and its error is a failure.
    """
    if case.skip_reason is not None:
        return None
    reason = None
    if backend.refuses_layout is not None:
        try:
            reason = backend.refuses_layout(case)
        except Exception:  # noqa: BLE001 - the backend's own factory reports the error per case
            reason = None
    if reason:
        return str(reason)
    unsized = getattr(case, "unsized_reason", None)
    return str(unsized) if unsized else None


def check_requirements(backend: Backend) -> None:
    """Raise BackendError naming the install when a module the backend's engine needs is not importable."""
    missing = [name for name in backend.requires if not _importable(name)]
    if missing:
        how = f"; install it with {backend.install_hint}" if backend.install_hint else ""
        raise BackendError(f"backend {backend.name!r} needs {', '.join(missing)}, which is not installed{how}")


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module made unimportable in sys.modules
        return False


class BackendRegistrar(Protocol):
    """What a ``pytest_kvprofile_register`` hook implementation adds backends, shared arena managers and an engine's
    facts through (the plugin's ``Registry``): the built-ins (``builtin/``, ``engines/``) register through it as a
    third party does."""

    def add_backends(self, *backends: Backend, group: str | None = None, default: bool = False) -> None: ...
    def add_workspace_manager(self, kind: ManagerKind) -> None: ...
    def add_engine_facts(self, facts: EngineFacts) -> None: ...
