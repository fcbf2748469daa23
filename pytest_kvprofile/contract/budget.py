"""The engine's KV budget as terms: what each term counts, and the snapshots it counts between.

An engine sizes the KV cache as ``total x gmu`` minus its non-KV terms. Each term that counts persistent memory
counts what was made after one snapshot and is still alive at a later one. Memory made before the earliest such
snapshot, and alive at the closing measurement, is in no term: the KV cache is sized over it.

The lifecycle takes the snapshots at named points (``SNAPSHOT_POINTS``, in the order they happen) and gives them to
the engine's arithmetic (``BudgetArithmetic``, made by ``EnginePolicy.budget``). The arithmetic measures where its
engine measures, and names its terms after the engine's own fields. ``budget_counts_every_byte`` reads the terms
against the ledger.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal, Protocol, runtime_checkable

from pytest_kvprofile.contract.device import Device

SnapshotPoint = Literal["device_start", "before_instance", "after_init", "after_weights", "baseline", "closing"]

SNAPSHOT_POINTS: Final[tuple[SnapshotPoint, ...]] = (
    "device_start", "before_instance", "after_init", "after_weights", "baseline", "closing")
"""Where the lifecycle offers a snapshot, in order: the fresh device; before the engine instance constructs its parts
(vLLM's ``init_device`` snapshot); after the parts' constructors ran (a model runner's ``__init__``); after the
weights loaded; the profiling window's baseline (cache emptied, peaks reset); the closing measurement."""

POINT_TEXT: Final[dict[SnapshotPoint, str]] = {
    "device_start": "on the fresh device",
    "before_instance": "before the parts were constructed",
    "after_init": "after the parts' constructors ran (setup)",
    "after_weights": "after the weights loaded",
    "baseline": "at the profiling window's baseline",
    "closing": "at the closing measurement",
}


@dataclass(frozen=True)
class BudgetTerm:
    """One term of the engine's non-KV bytes.

    ``since`` and ``until``: the term counts the persistent memory made after the ``since`` snapshot and alive at the
    ``until`` one. Both None: the term counts no persistent memory (a transient peak's headroom, an estimate).
    ``formula``: how the engine computes it, with its source (``vllm/utils/mem_utils.py: ...``).
    """

    name: str
    nbytes: int
    since: SnapshotPoint | None = None
    until: SnapshotPoint | None = None
    formula: str = ""

    def __post_init__(self) -> None:
        if (self.since is None) != (self.until is None):
            raise ValueError(f"budget term {self.name!r}: since and until are both set or both None")
        if self.since is not None and self.until is not None and \
                SNAPSHOT_POINTS.index(self.since) >= SNAPSHOT_POINTS.index(self.until):
            raise ValueError(f"budget term {self.name!r}: counts from {self.since!r}, not before {self.until!r}")

    @property
    def persistent(self) -> bool:
        return self.since is not None


@dataclass(frozen=True)
class EngineTerms:
    """The engine's budget as its arithmetic computed it: who computed it (``engine``) and its terms."""

    engine: str
    terms: tuple[BudgetTerm, ...]

    @property
    def non_kv(self) -> int:
        return sum(t.nbytes for t in self.terms)


@runtime_checkable
class BudgetArithmetic(Protocol):
    """An engine's own KV budget arithmetic, fed the lifecycle's snapshots (``EnginePolicy.budget`` makes one a
    run)."""

    name: str

    def snapshot(self, point: SnapshotPoint, device: Device) -> None:
        """The lifecycle reached ``point`` on ``device``: measure here if the engine measures here."""

    def terms(self) -> EngineTerms:
        """After the ``closing`` snapshot: the engine's non-KV terms."""
