"""The GPU catalog: SM count, memory and interconnect of the GPUs the matrices name.

Figures are the vendor's (docs/contract.md, "GPUs"). B300 and GB200 are left out because their figures
are unverified. A matrix may also describe a GPU inline; this catalog only resolves names.
"""

from __future__ import annotations

from dataclasses import dataclass

from pytest_kvprofile.units import GB


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model as the harness sees it: what sizing and the simulated device need."""

    name: str
    num_sm: int
    memory_bytes: int
    interconnect: str  # "nvlink" or "pcie"
    compute_capability: tuple[int, int] = (0, 0)

    @property
    def slug(self) -> str:
        return slugify(self.name)


def slugify(name: str) -> str:
    """Lower-case id fragment: 'RTX PRO 6000 Blackwell' -> 'rtx-pro-6000-blackwell'."""
    out = []
    for ch in name.strip().lower():
        out.append(ch if ch.isalnum() or ch == "." else "-")
    return "-".join(part for part in "".join(out).split("-") if part)


# Memory figures are the marketed capacity in GB (10^9), as NVML reports them within a few percent.
GPU_CATALOG: dict[str, GpuSpec] = {
    spec.slug: spec
    for spec in (
        GpuSpec("L4", 58, 24 * GB, "pcie", (8, 9)),
        GpuSpec("L40S", 142, 48 * GB, "pcie", (8, 9)),
        GpuSpec("A100", 108, 80 * GB, "nvlink", (8, 0)),
        GpuSpec("H100", 132, 80 * GB, "nvlink", (9, 0)),
        GpuSpec("H100 PCIe", 114, 80 * GB, "pcie", (9, 0)),
        GpuSpec("H200", 132, 141 * GB, "nvlink", (9, 0)),
        GpuSpec("B200", 148, 180 * GB, "nvlink", (10, 0)),
        GpuSpec("RTX PRO 6000 Blackwell", 188, 96 * GB, "pcie", (12, 0)),
        GpuSpec("RTX 5090", 170, 32 * GB, "pcie", (12, 0)),
    )
}

ALIASES = {
    "h100-sxm": "h100",
    "rtx-pro-6000": "rtx-pro-6000-blackwell",
    "rtx6000-pro": "rtx-pro-6000-blackwell",
    "pro6000": "rtx-pro-6000-blackwell",
}


def lookup_gpu(name: str) -> GpuSpec:
    """Resolve a catalog name (case- and punctuation-insensitive); KeyError lists the known ones."""
    key = slugify(name)
    key = ALIASES.get(key, key)
    try:
        return GPU_CATALOG[key]
    except KeyError:
        known = ", ".join(spec.name for spec in GPU_CATALOG.values())
        raise KeyError(f"unknown GPU {name!r}; known: {known}") from None


def smem_optin_for(cc: tuple[int, int]) -> int:
    """Opt-in shared memory per block of a compute capability (``cudaDevAttrMaxSharedMemoryPerBlockOptin``): what
    torch mode's device properties report and what the host planners plan with."""
    return _SMEM_OPTIN.get(cc, _SMEM_OPTIN.get((cc[0], -1), 101376))


_SMEM_OPTIN = {(8, 0): 166912, (8, 7): 166912, (9, -1): 232448, (10, -1): 232448, (11, -1): 232448}
