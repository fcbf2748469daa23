"""KV capacity per case: what the engine sizes with the released builder, what really fits once the memory that
appeared after KV sizing is there, and what a reserving builder sizes (``results/vllm-capacity.md``; read in
``docs/vllm-results.md``, "Capacity").

Read from lifecycle records only (``LifecycleResult``), with the same arithmetic the verdict's and the summary's
legacy cost use (``checks/post_kv_cost.py``), so the table and the verdict carry the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from pytest_kvprofile.checks.post_kv_cost import post_kv_cost
from pytest_kvprofile.lifecycle.record import LifecycleResult
from pytest_kvprofile.units import MiB

__all__ = ["CapacityCell", "capacity_cell", "capacity_table"]


@dataclass(frozen=True)
class CapacityCell:
    """One backend on one case.

    ``kv_tokens``: what KV sizing gave (the engine's figure). ``post_kv_bytes``/``post_kv_tokens``: the device
    memory the builders allocated after KV sizing and kept, and the KV tokens it is worth (the verdict's
    ``legacy_cost``). ``fits_tokens``: the KV tokens that fit under total x gmu once that memory is there
    (``kv_tokens - post_kv_tokens``): the engine overcommits by ``post_kv_tokens``. ``overrun_bytes``: the
    post-KV peak above total x gmu. ``outcome``: ``ran``, or the first error (phase and type: a simulated OOM
    is the overcommit running out of device memory).
    """

    backend: str
    case: str
    path: str
    kv_tokens: int | None
    post_kv_bytes: int
    post_kv_tokens: int
    overrun_bytes: int
    outcome: str

    @property
    def fits_tokens(self) -> int | None:
        return None if self.kv_tokens is None else self.kv_tokens - self.post_kv_tokens

    @property
    def oom(self) -> bool:
        return "OutOfMemory" in self.outcome


def _outcome(result: LifecycleResult) -> str:
    errors = [e for e in result.errors if not e.injected and e.phase != "teardown"]
    if not errors:
        return "ran"
    first = errors[0]
    return f"{first.exc_type} in {first.phase}"


def capacity_cell(backend: str, result: LifecycleResult) -> CapacityCell:
    """The capacity figures of one finished run."""
    cost = post_kv_cost(result)
    budget = result.budget
    return CapacityCell(
        backend=backend, case=result.case.id, path=result.path,
        kv_tokens=budget.kv_tokens if budget is not None else None,
        post_kv_bytes=cost.nbytes if cost is not None else 0,
        post_kv_tokens=cost.kv_tokens if cost is not None else 0,
        overrun_bytes=cost.overrun_bytes if cost is not None else 0,
        outcome=_outcome(result),
    )


def _tokens(n: int | None) -> str:
    return "-" if n is None else str(n)


def _legacy(cell: CapacityCell | None) -> list[str]:
    if cell is None:
        return ["-", "-", "-"]
    note = " (OOM in " + cell.outcome.split(" in ")[-1] + ")" if cell.oom else ""
    if cell.outcome != "ran" and not cell.oom:
        note = f" ({cell.outcome})"
    return [_tokens(cell.kv_tokens), f"{cell.post_kv_bytes / MiB:.1f}", _tokens(cell.fits_tokens) + note]


def _reserving(cell: CapacityCell | None) -> str:
    if cell is None:
        return "-"
    note = "" if cell.outcome == "ran" else f" ({cell.outcome})"
    return _tokens(cell.kv_tokens) + note


def capacity_table(cells: dict[tuple[str, str], CapacityCell], cases: list[str], v1: str, v2: str, reserving: str,
                   exact: str) -> list[str]:
    """A Markdown table, one row per case id: the released builder's V1 and V2 integrations (KV tokens sized,
    post-KV MiB, tokens that fit) against the reserving builder's KV tokens at both arenas."""
    lines = [
        f"| case | {v1} KV tokens | post-KV MiB | fits | {v2} KV tokens | post-KV MiB | fits | {reserving} | {exact} |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for case in cases:
        row = [case, *_legacy(cells.get((v1, case))), *_legacy(cells.get((v2, case))),
               _reserving(cells.get((reserving, case))), _reserving(cells.get((exact, case)))]
        lines.append("| " + " | ".join(row) + " |")
    return lines
