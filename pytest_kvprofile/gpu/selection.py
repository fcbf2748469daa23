"""Which matrix cases the GPU tier runs on the GPU under test, and why it skips the rest.

Why: sizing is per SM count and memory is per device, so a case written for another GPU (a B200
case on an H200) or one whose weights alone overflow this GPU (a 70B model at TP1) proves nothing
here and would run for hours or run out of memory. The default matrix is mostly such cases. The
decision is a pure function of the cases and the device's facts, so it is tested on CPU with fake
topologies; ``plugin/gpu.py`` applies it at configure time from NVML (no CUDA context).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pytest_kvprofile.units import GiB

if TYPE_CHECKING:
    from pytest_kvprofile.gpu.topology import GpuTopology
    from pytest_kvprofile.matrix.cases import Case

__all__ = ["CaseSelection", "DeviceFacts", "device_facts", "select_cases"]

OTHER_SM_COUNT = "other SM count"
WEIGHTS_DO_NOT_FIT = "weights do not fit"


@dataclass(frozen=True)
class DeviceFacts:
    """What the selection needs to know about the GPU under test."""

    name: str
    num_sm: int
    memory_bytes: int


@dataclass(frozen=True)
class CaseSelection:
    """The cases to run and, for every other one, the kind of reason and the reason."""

    device: DeviceFacts
    run: tuple[Case, ...]
    skipped: tuple[tuple[Case, str, str], ...]  # (case, kind, reason)

    def summary(self) -> list[str]:
        """One line for the run and one per kind of skip, with a few examples."""
        d = self.device
        lines = [f"kvprofile-gpu: running {len(self.run)} of {len(self.run) + len(self.skipped)} cases on "
                 f"{d.name} ({d.num_sm} SMs, {d.memory_bytes / GiB:.1f} GiB)"]
        kinds = Counter(kind for _, kind, _ in self.skipped)
        for kind, count in sorted(kinds.items()):
            examples = [reason for _, k, reason in self.skipped if k == kind][:3]
            more = f"; ... {count - len(examples)} more" if count > len(examples) else ""
            lines.append(f"kvprofile-gpu: skipped {count} cases ({kind}): " + "; ".join(examples) + more)
        return lines

    def as_dict(self) -> dict[str, object]:
        return {
            "device": {"name": self.device.name, "num_sm": self.device.num_sm,
                       "memory_bytes": self.device.memory_bytes},
            "run": [c.id for c in self.run],
            "skipped": [{"case": c.id, "kind": kind, "reason": reason} for c, kind, reason in self.skipped],
        }


def _skip_reason(case: Case, device: DeviceFacts) -> tuple[str, str] | None:
    if case.gpu.num_sm != device.num_sm:
        return OTHER_SM_COUNT, (f"{case.id}: sized for {case.gpu.name} ({case.gpu.num_sm} SMs), this GPU has "
                                f"{device.num_sm}")
    usable = int(device.memory_bytes * case.gmu)
    need = case.weights_bytes + case.nontorch_bytes
    if need >= usable:
        return WEIGHTS_DO_NOT_FIT, (f"{case.id}: weights {case.weights_bytes / GiB:.1f} GiB per rank + non-torch "
                                    f"{case.nontorch_bytes / GiB:.1f} GiB >= {case.gmu:g} x "
                                    f"{device.memory_bytes / GiB:.1f} GiB")
    return None


def select_cases(cases: Iterable[Case], device: DeviceFacts) -> CaseSelection:
    """Keep the cases sized for this GPU's SM count whose per-rank weights and non-torch memory fit
    in ``gmu`` of its memory; every other case comes back with its reason."""
    run, skipped = [], []
    for case in cases:
        why = _skip_reason(case, device)
        if why is None:
            run.append(case)
        else:
            skipped.append((case, *why))
    return CaseSelection(device, tuple(run), tuple(skipped))


def device_facts(topology: GpuTopology) -> DeviceFacts:
    """The first visible GPU's facts: SM count measured by torch when known, else the catalog's.

    Raises TopologyError for a GPU outside the catalog whose SM count was not measured (the
    controller never asks torch): generate a matrix for it with ``matrix_gen --torch`` instead."""
    from pytest_kvprofile.gpu.topology import TopologyError

    visible = topology.visible
    if not visible:
        raise TopologyError("no GPU is visible to this process (check CUDA_VISIBLE_DEVICES)")
    dev = visible[0]
    if dev.num_sm is not None:
        return DeviceFacts(dev.name, dev.num_sm, dev.total_memory)
    cat = dev.catalog
    if cat is None:
        raise TopologyError(
            f"{dev.name!r} is not in the GPU catalog and its SM count is unknown without CUDA; run "
            "`python -m pytest_kvprofile.gpu.matrix_gen --torch` and pass the matrix it writes")
    return DeviceFacts(dev.name, cat.num_sm, dev.total_memory)
