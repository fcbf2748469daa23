"""What the serving engines state about themselves, filled by each engine's package through the plugin's hook.

Why a registry here, at the bottom: the matrix (which layouts a case can size), the sizing (which planner a route
runs, the fixed sizes the report compares) and the built-in stubs read engine facts, yet name no engine. Each engine
package (``engines/<name>/facts.py``) defines its :class:`EngineFacts` once and adds it in its
``pytest_kvprofile_register`` (``registry.add_engine_facts``); a third engine is one more folder. The plugin
registers at configure in every process. A program without pytest gets the package's own engines on its first
lookup: the package's ``__init__`` installs ``registry.builtin_registry`` as :func:`set_fallback_registration`
(the layer above wires it; this module imports no engine).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

__all__ = [
    "EngineFacts",
    "FloatWorkspaceRule",
    "RoutePolicy",
    "TrtllmOnly",
    "engine_facts",
    "register_engine_facts",
    "set_fallback_registration",
    "registered_engines",
    "route_policy",
    "workspace_rule",
    "workspace_rules",
]

REGISTER_HINT = ("engines state their facts through pytest_kvprofile_register (registry.add_engine_facts); the "
                 "plugin registers them at configure, pytest_kvprofile.registry.builtin_registry() without pytest")


@dataclass(frozen=True)
class FloatWorkspaceRule:
    """A float workspace an engine reserves by default, named as the sizing report names it.

    ``fixed_bytes``, grown to batched tokens x rank query heads x head dim x ``bytes_per_element`` where the engine
    grows it (0: fixed)."""

    name: str
    fixed_bytes: int
    bytes_per_element: int = 0

    def bytes_for(self, tokens: int, heads_q: int, head_dim: int) -> int:
        return max(self.fixed_bytes, tokens * heads_q * head_dim * self.bytes_per_element)


@dataclass(frozen=True)
class TrtllmOnly:
    """A KV dtype the engine runs on FlashInfer's trtllm-gen kernels only, on GPUs of these compute-capability
    majors; ``why``: the engine's own rule, as its refusal says it."""

    cc_majors: tuple[int, ...]
    why: str


@dataclass(frozen=True)
class RoutePolicy:
    """How an engine routes a case onto FlashInfer's planners: the rules a case's sizing follows.

    ``decode_tensor_cores_min_group``: the GQA group from which decode runs the tensor-core (prefill) planner;
    ``decode_tensor_cores_under_mtp``: always under MTP. ``trtllm_only``: per KV dtype name, the GPUs on which no
    FA2 route plans it."""

    decode_tensor_cores_min_group: int
    decode_tensor_cores_under_mtp: bool = True
    trtllm_only: Mapping[str, TrtllmOnly] = field(default_factory=dict)

    def decode_tensor_cores(self, heads_q: int, heads_kv: int, mtp: int) -> bool:
        return (self.decode_tensor_cores_under_mtp and mtp > 0) or heads_q // heads_kv >= \
            self.decode_tensor_cores_min_group

    def trtllm_only_on(self, kv_dtype: str, cc_major: int) -> TrtllmOnly | None:
        rule = self.trtllm_only.get(kv_dtype)
        return rule if rule is not None and cc_major in rule.cc_majors else None


@dataclass(frozen=True)
class EngineFacts:
    """One engine's facts, defined once in its package.

    ``kv_cache_dtypes``: the matrix's KV dtype names to the engine's ``--kv-cache-dtype`` spelling (a name absent:
    the engine's adapter expresses none). ``float_workspaces``: its default float workspaces, for the sizing report
    and the stubs that model them. ``trtllm_workspace_bytes``: the one trtllm-gen workspace it makes per process (0:
    none). ``route_policy``: the rules cases are sized under, where the engine states them (one per run: the
    case's sizing is one computation for every backend). ``flashinfer_pins``: its release to the flashinfer-python
    that release pins."""

    name: str
    kv_cache_dtypes: Mapping[str, str]
    float_workspaces: tuple[FloatWorkspaceRule, ...] = ()
    trtllm_workspace_bytes: int = 0
    route_policy: RoutePolicy | None = None
    flashinfer_pins: Mapping[str, str] = field(default_factory=dict)

    def kv_cache_dtype(self, kv_dtype: str) -> str | None:
        """The engine's spelling of the matrix's KV dtype ``kv_dtype``, or None where it expresses none."""
        return self.kv_cache_dtypes.get(kv_dtype)


_ENGINES: dict[str, EngineFacts] = {}
_FALLBACK: list[Callable[[], object]] = []  # what registers the package's engines when a lookup finds none
_LOADING: list[bool] = []


def set_fallback_registration(register: Callable[[], object] | None) -> None:
    """What a lookup runs when no engine is registered yet (a program without pytest): the package's ``__init__``
    installs ``registry.builtin_registry``, which runs the built-in plugins' ``pytest_kvprofile_register``. None:
    no fallback (a lookup then raises, naming what to do)."""
    _FALLBACK[:] = [] if register is None else [register]


def _registered() -> dict[str, EngineFacts]:
    if not _ENGINES and _FALLBACK and not _LOADING:
        _LOADING.append(True)
        try:
            _FALLBACK[0]()
        finally:
            _LOADING.clear()
    return _ENGINES


def register_engine_facts(facts: EngineFacts) -> None:
    """Add ``facts``; the same facts again is a no-op (configure runs once per pytest run, several in a process).
    A ValueError for another engine's facts under the name, a rule name two engines use, or a second route policy."""
    known = _ENGINES.get(facts.name)
    if known is not None:
        if known != facts:
            raise ValueError(f"two engines state facts as {facts.name!r}, and they differ")
        return
    rules = {r.name: e.name for e in _ENGINES.values() for r in e.float_workspaces}
    for rule in facts.float_workspaces:
        if rule.name in rules:
            raise ValueError(f"engine {facts.name!r} names a float workspace {rule.name!r}, which engine "
                             f"{rules[rule.name]!r} names")
    stated = [e.name for e in _ENGINES.values() if e.route_policy is not None]
    if facts.route_policy is not None and stated:
        raise ValueError(f"engine {facts.name!r} states a route policy, and engine {stated[0]!r} does: cases are "
                         "sized under one")
    _ENGINES[facts.name] = facts


def registered_engines() -> tuple[EngineFacts, ...]:
    """Every engine's facts, in the order they were registered."""
    return tuple(_registered().values())


def engine_facts(name: str) -> EngineFacts:
    try:
        return _registered()[name]
    except KeyError:
        known = ", ".join(_ENGINES) or "none"
        raise LookupError(f"no engine states facts as {name!r} (registered: {known}); {REGISTER_HINT}") from None


def route_policy() -> RoutePolicy:
    """The route policy cases are sized under: the one a registered engine states."""
    for facts in _registered().values():
        if facts.route_policy is not None:
            return facts.route_policy
    raise LookupError(f"no registered engine states a route policy, so no case can be sized; {REGISTER_HINT}")


def workspace_rules() -> tuple[FloatWorkspaceRule, ...]:
    """The engines' default float workspaces, in registration order."""
    return tuple(rule for facts in _registered().values() for rule in facts.float_workspaces)


def workspace_rule(name: str) -> FloatWorkspaceRule:
    for rule in workspace_rules():
        if rule.name == name:
            return rule
    known = ", ".join(r.name for r in workspace_rules()) or "none"
    raise LookupError(f"no engine names a float workspace {name!r} (named: {known}); {REGISTER_HINT}")
