"""The fail-closed support declaration and how a model's builders compose it
(docs/contract.md, "Support declaration")."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterable

DECLARATION_METHOD = "get_persistent_workspace_memory_profiling_support"


class ProfilingSupport(enum.Enum):
    """What a builder answers about profiling-time persistent workspace reservation.

    REQUIRED: it reserves persistent memory and must do so inside the profiling window.
    NEUTRAL: it reserves nothing of its own but is safe under the common lease (GDN-like).
    UNSUPPORTED: it keeps the whole model on the legacy path (the default for untaught builders).
    """

    REQUIRED = "required"
    NEUTRAL = "neutral"
    UNSUPPORTED = "unsupported"


class DeclarationError(TypeError):
    """A builder answered something other than a ProfilingSupport member."""


def builder_name(builder: object) -> str:
    return str(getattr(builder, "name", None) or type(builder).__name__)


def declared_support(builder: object) -> ProfilingSupport:
    """The builder's declaration; a builder without the method is UNSUPPORTED (fail-closed).

    Any object: the declaration is read by name, so this module needs no ``Builder`` type (``protocol.py`` imports it).

    Anything but a ProfilingSupport member is an error rather than a guess: a builder that answers
    ``True`` or ``"REQUIRED"`` would be taken as supported by a truthiness test, which is exactly the
    fail-open mistake the contract forbids.
    """
    method = getattr(builder, DECLARATION_METHOD, None)
    if method is None:
        return ProfilingSupport.UNSUPPORTED
    answer = method()
    if not isinstance(answer, ProfilingSupport):
        raise DeclarationError(
            f"builder {builder_name(builder)!r}: {DECLARATION_METHOD}() returned {answer!r} "
            f"({type(answer).__name__}); it must return a ProfilingSupport member "
            "(REQUIRED, NEUTRAL or UNSUPPORTED)"
        )
    return answer


@dataclass(frozen=True)
class SupportResolution:
    """Whether a model takes the profiling-time path, and why."""

    enabled: bool
    reason: str
    declarations: tuple[tuple[str, ProfilingSupport], ...]
    engine_gate: str | None = None  # the engine's own reason to keep an opted-in model off the path, if it did

    @property
    def required(self) -> tuple[str, ...]:
        return tuple(n for n, s in self.declarations if s is ProfilingSupport.REQUIRED)


def resolve_support(builders: Iterable[object], engine_gate: str | None = None) -> SupportResolution:
    """Enabled only if every builder is REQUIRED or NEUTRAL and at least one is REQUIRED, and the engine does not
    keep the case off the path anyway (``engine_gate``: its reason, as ``EnginePolicy.gate`` gives it; vLLM's
    runner takes the path without speculative decoding and elastic EP only)."""
    declarations = tuple((builder_name(b), declared_support(b)) for b in builders)
    if not declarations:
        return SupportResolution(False, "the model has no attention metadata builders", declarations)
    for name, support in declarations:
        if support is ProfilingSupport.UNSUPPORTED:
            return SupportResolution(
                False, f"builder {name!r} is UNSUPPORTED, which keeps the model on the legacy path", declarations
            )
    if not any(s is ProfilingSupport.REQUIRED for _, s in declarations):
        return SupportResolution(
            False, "every builder is NEUTRAL; nothing requires a profiling-time reservation", declarations
        )
    names = ", ".join(n for n, s in declarations if s is ProfilingSupport.REQUIRED)
    if engine_gate:
        return SupportResolution(False, f"REQUIRED by {names}, but the engine keeps this case on the legacy path: "
                                 f"{engine_gate}", declarations, engine_gate)
    return SupportResolution(True, f"REQUIRED by {names}", declarations)
