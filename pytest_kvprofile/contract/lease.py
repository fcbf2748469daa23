"""A lease keeps a builder's persistent workspace alive from reservation to the closing measurement."""

from __future__ import annotations

from typing import Callable, Iterable, TypeVar

Held = TypeVar("Held")  # what Lease.hold keeps, handed back as it came


class LeaseReleasedError(RuntimeError):
    """The lease was used after it was released."""


class Lease:
    """Holds references to persistent resources so that the allocator cannot reclaim them.

    Release is idempotent: the engine releases every lease at one point (after the closing
    measurement), and a builder that also releases its own must not double-free.
    """

    def __init__(self, owner: str, resources: Iterable[object] = (), on_release: Callable[[], None] | None = None):
        self.owner = owner
        self._resources: list[object] | None = list(resources)
        self._on_release = on_release
        self.release_count = 0

    @property
    def released(self) -> bool:
        return self._resources is None

    @property
    def resources(self) -> list[object]:
        if self._resources is None:
            raise LeaseReleasedError(f"lease of {self.owner!r} was used after release")
        return self._resources

    def hold(self, resource: Held) -> Held:
        self.resources.append(resource)
        return resource

    def release(self) -> None:
        self.release_count += 1
        if self._resources is None:
            return
        self._resources = None
        callback, self._on_release = self._on_release, None
        if callback is not None:
            callback()

    def __repr__(self) -> str:
        state = "released" if self.released else f"{len(self._resources or ())} resources"
        return f"Lease({self.owner!r}, {state})"
