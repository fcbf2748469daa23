"""How a mutant declares itself: one decorator on its builder class names it, and says what it fails.

A mutant's bug class is the number in its name (``mutant-07b-...`` carries bug class 7), so it is written once. Its
description is its builder's docstring. ``catches=`` lists the checks it fails over the default matrix; the catalog
(``builtin/mutants.py``) gathers every declaration into ``MUTANT_BACKENDS`` and ``EXPECTED_CATCHES``.

    @mutant("mutant-01-lazy-workspace", catches=("no_post_kv_overrun", "persistent_memory_visible_at_closing"))
    class LazyWorkspaceBuilder(FlashInferLikeBuilder):
        \"\"\"Bug 1: declares REQUIRED but leaves its wrappers (and int workspaces) to the first plan().\"\"\"
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from pytest_kvprofile.checks.base import CheckOptions, WasteBudget
from pytest_kvprofile.contract.backends import Backend, EnginePolicy
from pytest_kvprofile.contract.bug_classes import mutant_class

if TYPE_CHECKING:
    from pytest_kvprofile.contract.protocol import Builder
    from pytest_kvprofile.contract.resources import PersistentResource
    from pytest_kvprofile.matrix.cases import Case

__all__ = ["DECLARED", "OVERFLOWS_ITS_ARENA", "WASTE_BUDGET", "WASTE_OPTIONS", "Mutant", "bug_class_of", "mutant",
           "resource_mutant"]

T = TypeVar("T", bound=type)

# Waste is refused only over a budget, so the mutants whose bug can be an oversized workspace are judged under one:
# two micro-batch arenas x one 2 MiB caching-allocator block, the slack sizing mutants were judged with before.
WASTE_BUDGET = WasteBudget(4.0)
WASTE_OPTIONS = CheckOptions(max_waste=WASTE_BUDGET)

OVERFLOWS_ITS_ARENA = (
    "arena_not_grown_after_lock", "arena_stable_after_closing", "captured_memory_stays", "int_workspace_per_wrapper",
    "no_post_kv_overrun", "no_synthetic_workspace_in_capture", "no_use_after_free",
    "persistent_memory_visible_at_closing", "resource_capacity_honoured", "ubatch_arenas_disjoint", "warmup_idempotent",
    "workspace_covers_planner",
)
"""What a float workspace sized too small fails: the arena grows when a batch overflows it, so every check of the arena
and of what it holds follows, besides the sizing check."""


@dataclass(frozen=True)
class Mutant:
    """One mutant as declared: its backend, its bug class, what it fails, and the options it is judged under."""

    backend: Backend
    bug_class: int
    catches: frozenset[str]
    options: CheckOptions | None = None  # None: the default options

    @property
    def name(self) -> str:
        return self.backend.name


DECLARED: dict[str, Mutant] = {}
"""Every declared mutant, by name, in declaration order (the catalog sorts them by name)."""


def bug_class_of(name: str) -> int:
    """The bug class a mutant's name carries: ``mutant-15j-...`` is class 15."""
    number = mutant_class(name)
    if number is None:
        raise ValueError(f"mutant name {name!r} is not mutant-<class><letter>-<words>")
    return number


def _declare(backend: Backend, catches: tuple[str, ...], options: CheckOptions | None) -> None:
    if not catches or backend.name in DECLARED:
        raise ValueError(f"mutant {backend.name!r}: no expected catch, or declared twice")
    DECLARED[backend.name] = Mutant(backend, bug_class_of(backend.name), frozenset(catches), options)


def mutant(name: str, *, catches: tuple[str, ...], policy: EnginePolicy | None = None, first: type | None = None,
           extra: tuple[type, ...] = (), options: CheckOptions | None = None) -> Callable[[T], T]:
    """Declare the decorated builder class a mutant: ``name`` (its bug class is the number in it), the checks it fails
    over the default matrix (``catches``), the engine ``policy`` it runs under, and the options it is judged under.

    The backend makes ``first`` (when given), the decorated class, then ``extra``, each for the case. Its description
    is the docstring of the first builder it makes: ``first`` names the correct stub beside a buggy one.
    """

    def declare(cls: T) -> T:
        builders = (*((first,) if first is not None else ()), cls, *extra)
        main = builders[0]

        def make(case: Case) -> list[Builder]:
            return [b(case) for b in builders]

        backend = Backend(name=name, make_builders=make, policy=policy or EnginePolicy(),
                          description=(main.__doc__ or "").strip(), origin="mutant",
                          torch_mode=bool(getattr(main, "torch_mode", False)))
        _declare(backend, catches, options)
        return cls

    return declare


def resource_mutant(name: str, *, catches: tuple[str, ...]) -> Callable[[T], T]:
    """Declare the decorated persistent resource class a mutant: the FlashInfer-like stub beside it, with the case's
    ``dma-output-workspace`` parameters (else the defaults)."""

    def declare(cls: T) -> T:
        from pytest_kvprofile.builtin.stubs import FlashInferLikeBuilder
        from pytest_kvprofile.lifecycle.resources import DEFAULT_PARAMS

        def make(case: Case) -> list[Builder]:
            return [FlashInferLikeBuilder(case)]

        def resources(case: Case) -> list[PersistentResource]:
            carried = [dict(r.params) for r in case.resources if r.kind == "dma-output-workspace"]
            made: Any = cls(case, carried[0] if carried else DEFAULT_PARAMS)  # Any: the class the decorator got
            return [made]

        backend = Backend(name=name, make_builders=make, make_resources=resources,
                          description=(cls.__doc__ or "").strip(), origin="mutant")
        _declare(backend, catches, None)
        return cls

    return declare
