"""Mutants re-created from incidents of the field (issue 51), each beside the correct twin it differs from.

| mutant | item | mechanism | twin |
|---|---|---|---|
| 16d | 20 | wrappers bound to an arena a later growth gave back, reported honestly, never rebound | rebinds in ``rebind()`` |

``field_mutants(mutant)`` makes the catalog's backends with the catalog's own constructor (``builtin/mutants.py``
passes ``_mutant``), so this module imports nothing of that one; ``FIELD_TWINS`` are the correct twins, which the
tests run on every ci case beside their mutants.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from pytest_kvprofile.builtin.stubs import FlashInferLikeBuilder, Wrapper
from pytest_kvprofile.contract.backends import Backend
from pytest_kvprofile.units import MiB

if TYPE_CHECKING:
    from pytest_kvprofile.contract.lease import Lease
    from pytest_kvprofile.contract.protocol import BuilderContext

# the catalog's constructor: ``_mutant(name, bug class, builder class, *, catches=...)``
MakeMutant = Callable[..., Backend]

GROWTH_BYTES = 2 * MiB  # what the in-window warmup asks beyond the declaration: the growth that retires the arena


# -- item 20: a wrapper bound to an arena a later growth replaced ---------------------------------------------------
class _KeepsWrappersAcrossGrowth(FlashInferLikeBuilder):
    """Its lease keeps the wrappers (the release frees nothing); its in-window warmup asks each arena for 2 MiB more
    than it declared, so the arena grows under the wrappers' views. Its plans are told to the harness for the int
    workspace only: the float workspace a wrapper plans into is the one it is bound to, reported honestly through
    ``bound_workspaces()``."""

    def reserve_persistent_workspace(self, ctx: BuilderContext) -> Lease:
        return ctx.lease(self._materialize(ctx))

    def warmup(self, ctx: BuilderContext) -> None:
        if ctx.profiling and not self.warmed:
            for ub in range(ctx.num_ubatches):
                ctx.get_workspace(self.float_bytes() + GROWTH_BYTES, ub)
        super().warmup(ctx)

    def _plan(self, ctx: BuilderContext, w: Wrapper) -> None:
        ctx.plan_into(w.int_workspace)  # the float plan goes where the wrapper is bound, unannounced


class BoundToReplacedArenaBuilder(_KeepsWrappersAcrossGrowth):
    """Bug 16d (issue 51, item 20): never rebinds, so every wrapper stays bound to the arena the growth gave back and
    plans into freed memory at serving; ``bound_workspaces()`` says so, no ``ctx.plan_into`` does."""


class RebindsAfterGrowthBuilder(_KeepsWrappersAcrossGrowth):
    """Correct twin of 16d: ``rebind()`` points every wrapper at a view of the live arena."""

    def rebind(self, ctx: BuilderContext) -> None:
        for w in self.wrappers.values():
            w.view = ctx.get_workspace(self.float_bytes(), w.ubatch)
            w.float_ptr, w.float_bytes = w.view.ptr, w.view.nbytes
        super().rebind(ctx)


def _twin(name: str, cls: type) -> Backend:
    return Backend(name=name, make_builders=lambda case: [cls(case)], description=(cls.__doc__ or "").strip(),
                   origin="builtin", torch_mode=bool(getattr(cls, "torch_mode", False)))


FIELD_TWINS: tuple[Backend, ...] = (
    _twin("twin-16d-rebinds-after-growth", RebindsAfterGrowthBuilder),
)
"""The correct twin of each field mutant, by the mutant's id (``twin-<id>-...``)."""


def field_mutants(mutant: MakeMutant) -> tuple[Backend, ...]:
    """The field mutants, made with the catalog's constructor (which records their expected catches)."""
    return (
        mutant("mutant-16d-bound-to-replaced-arena", 16, BoundToReplacedArenaBuilder,
               catches=("no_use_after_free",)),
    )
