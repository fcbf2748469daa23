"""The reservation contract as an engine's builder class carries it: which revision of the API its method names
are, what its declaration answers (mapped to ``ProfilingSupport``), and a clear refusal for a class that looks taught
but cannot be driven (``UnusableContract``). ``adapter.ReservingAdapter`` drives what this finds.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Mapping, Sequence

from pytest_kvprofile.contract.backends import BackendError
from pytest_kvprofile.contract.support import ProfilingSupport

__all__ = ["CONTRACT_DECLARATION", "CONTRACT_LOOKING", "CONTRACT_RESERVATION", "ReservationApi", "UnusableContract",
           "contract_methods", "declared_support", "find_revision", "map_support", "reservation_api"]

CONTRACT_DECLARATION = "get_persistent_workspace_memory_profiling_support"
CONTRACT_RESERVATION = "reserve_persistent_workspace"


def map_support(answer: object) -> object:
    """An engine's answer as a ProfilingSupport: an enum member by name, or ``True`` (REQUIRED), ``False``
    (NEUTRAL), ``None`` (UNSUPPORTED), as vLLM's pull request answers. Anything else is passed through for the
    harness to reject."""
    name = getattr(answer, "name", None)
    if isinstance(name, str) and name in ProfilingSupport.__members__:
        return ProfilingSupport[name]
    if answer is True:
        return ProfilingSupport.REQUIRED
    if answer is False:
        return ProfilingSupport.NEUTRAL
    if answer is None:
        return ProfilingSupport.UNSUPPORTED
    return answer


def declared_support(builder_cls: type, names: Sequence[str], args: Callable[[], Sequence[object]],
                     default: object) -> object:
    """What ``builder_cls``'s first declaration classmethod of ``names`` answers on ``args()`` (mapped by
    :func:`map_support`), or ``default`` when the class declares nothing."""
    declare = next((getattr(builder_cls, n) for n in names if callable(getattr(builder_cls, n, None))), None)
    if declare is None:
        return default
    return map_support(declare(*args()))


@dataclasses.dataclass(frozen=True)
class ReservationApi:
    """The names one revision of an engine's reservation API gives a builder class, and how its runner calls them.

    ``calls``: the reservation method's calls, in order, by their arguments; each call goes to every builder before
    the next (the pull request's two-pass API: ``prepare_workspace_for_profiling(False)`` on all, then ``(True)``).
    ``rebind``: called on every builder after all of them reserved. ``capture_reservation``: what the runner calls
    again before CUDA-graph capture (vLLM's ``reserve_workspace_for_cudagraph_capture``). ``revision``: its name in
    the verdict."""

    declaration: str
    reservation: str
    rebind: str | None  # re-attach after the reservation (vLLM's pull request: rebind_workspace_after_reservation)
    calls: tuple[tuple[object, ...], ...] = ((),)
    revision: str = ""
    capture_reservation: str | None = None

    def describe(self) -> str:
        names = [f"{self.declaration}()", f"{self.reservation}()"]
        names += [f"{n}()" for n in (self.rebind, self.capture_reservation) if n]
        return f"{self.revision or 'reservation API'}: {', '.join(names)}"


class UnusableContract(BackendError):
    """A builder class carries reservation-contract methods the adapter cannot drive: a usage error naming them
    (never the legacy path in silence)."""


CONTRACT_LOOKING = re.compile(r"persistent_workspace|workspace_for_|_for_(memory_)?profiling|workspace_after_|"
                              r"workspace_profiling|rebind_workspace")
"""What a reservation-contract method's name looks like, in any revision seen (public names only)."""


def contract_methods(builder_cls: type) -> list[str]:
    """The public methods of ``builder_cls`` whose names look like a reservation contract's."""
    return sorted(n for n in dir(builder_cls)
                  if not n.startswith("_") and CONTRACT_LOOKING.search(n) and callable(getattr(builder_cls, n, None)))


def reservation_api(builder_cls: type, declarations: Sequence[str] = (CONTRACT_DECLARATION,),
                    reservations: Sequence[str] = (CONTRACT_RESERVATION,), rebinds: Sequence[str] = (),
                    calls: Mapping[str, tuple[tuple[object, ...], ...]] | None = None) -> ReservationApi | None:
    """What ``builder_cls`` declares (the first callable of each list), or None: then the adapter declares nothing.
    ``calls`` gives a reservation method's calls by name (default: one call, no arguments)."""
    declaration = next((n for n in declarations if callable(getattr(builder_cls, n, None))), None)
    reservation = next((n for n in reservations if callable(getattr(builder_cls, n, None))), None)
    if declaration is None or reservation is None:
        return None
    rebind = next((n for n in rebinds if callable(getattr(builder_cls, n, None))), None)
    return ReservationApi(declaration, reservation, rebind, (calls or {}).get(reservation, ((),)))


def find_revision(builder_cls: type, revisions: Sequence[ReservationApi], label: str,
                  declared: Callable[[str], object]) -> ReservationApi | None:
    """The revision of ``revisions`` ``builder_cls`` carries: its declaration and its reservation callable (a class
    mixing two revisions' names is driven with its reservation's revision). None when it carries no contract
    method at all (a released engine): the adapter declares nothing.

    Raises :class:`UnusableContract` naming the methods found when the class looks taught but cannot be driven: a
    reservation without a declaration, a contract-looking method of no known revision, or a declaration answering
    REQUIRED (``declared(name)``, the declaration's answer on the case) with no reservation to call."""
    def has(name: str | None) -> bool:
        return name is not None and callable(getattr(builder_cls, name, None))

    declaration = next((r.declaration for r in revisions if has(r.declaration)), None)
    api = next((r for r in revisions if has(r.reservation)), None)
    found = contract_methods(builder_cls)
    known = ", ".join(r.describe() for r in revisions)
    if declaration is not None and api is not None:
        if declaration == api.declaration:
            return api
        return dataclasses.replace(api, declaration=declaration,
                                   revision=f"{api.revision} (declared with {declaration}())")
    if declaration is not None and map_support(declared(declaration)) is not ProfilingSupport.REQUIRED:
        return None  # declares itself off the path, and has nothing to reserve
    if declaration is None and not found:
        return None
    what = (f"declares REQUIRED with {declaration}() but has no reservation method to call"
            if declaration is not None else
            "carries reservation-contract methods but no declaration the adapter knows" if api is not None else
            "carries methods that look like a reservation contract the adapter does not know")
    raise UnusableContract(
        f"{label} {builder_cls.__module__}.{builder_cls.__qualname__} {what}: found {', '.join(found) or 'none'}. "
        f"The adapter drives these revisions: {known}. Implement one of them whole (declaration and reservation), "
        "or none (the legacy path)")
