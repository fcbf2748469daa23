"""What GPUs this machine has: NVML for names, memory, driver and links; torch for SMs and capability.

NVML answers without creating a CUDA context, so it is safe anywhere; ``torch.cuda`` is asked only
when ``use_torch`` is true, which the GPU tier does in the test process (a worker under xdist),
never in the controller. Both are injectable so that the pure logic is tested with fakes on CPU.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, TypeAlias

from pytest_kvprofile.matrix.gpus import (
    ALIASES,
    GPU_CATALOG,
    GpuSpec,
    lookup_gpu,
    slugify,
)

# the pynvml module (it ships no types), or a test's stand-in for it: read by attribute
NvmlModule: TypeAlias = Any
# torch.cuda, or a test's stand-in for it (the CPU tests describe made-up machines): read by attribute
TorchCuda: TypeAlias = Any

__all__ = [
    "GpuDevice",
    "GpuLink",
    "GpuTopology",
    "TopologyError",
    "detect_topology",
    "match_catalog",
    "visible_nvml_indices",
]

MEMORY_TOLERANCE = 0.10  # NVML reports GiB-ish totals a few percent off the marketed GB figure
_VENDOR_WORDS = ("nvidia", "geforce", "tesla", "quadro")
_NVML_LEVELS = {0: "internal", 10: "single-switch", 20: "multi-switch", 30: "host-bridge", 40: "numa-node",
                50: "system"}


class TopologyError(RuntimeError):
    """NVML (or torch) could not describe the devices; the message says which call and why."""


@dataclass(frozen=True)
class GpuDevice:
    """One GPU as NVML (and, when visible to this process, torch) describes it."""

    index: int  # NVML index (PCI bus order)
    name: str
    uuid: str
    total_memory: int
    nvlink_active: int = 0  # NVLinks NVML reports enabled on this device
    cuda_index: int | None = None  # torch's index for it in this process, None when hidden
    num_sm: int | None = None
    compute_capability: tuple[int, int] | None = None

    @property
    def catalog(self) -> GpuSpec | None:
        return match_catalog(self.name, self.total_memory)


@dataclass(frozen=True)
class GpuLink:
    """How two devices reach each other: ``kind`` is "nvlink", "pcie" or "unknown"."""

    a: int
    b: int
    kind: str
    detail: str = ""


@dataclass(frozen=True)
class GpuTopology:
    """Every device NVML sees, the links between them, and what this process may use."""

    driver_version: str
    devices: tuple[GpuDevice, ...]
    links: tuple[GpuLink, ...] = ()
    cuda_visible_devices: str | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def count(self) -> int:
        return len(self.devices)

    @property
    def visible(self) -> tuple[GpuDevice, ...]:
        """The devices this process's CUDA sees, in torch's order."""
        return tuple(sorted((d for d in self.devices if d.cuda_index is not None), key=lambda d: d.cuda_index or 0))

    def link(self, a: int, b: int) -> GpuLink | None:
        for ln in self.links:
            if {ln.a, ln.b} == {a, b}:
                return ln
        return None

    def interconnect(self, index: int) -> str:
        """"nvlink" when the device has an NVLink peer (or, alone, active NVLinks), else "pcie"."""
        peers = [ln for ln in self.links if index in (ln.a, ln.b)]
        if any(ln.kind == "nvlink" for ln in peers):
            return "nvlink"
        if not peers and self.devices[index].nvlink_active > 0:
            return "nvlink"
        return "pcie"

    def spec(self, device: GpuDevice) -> GpuSpec:
        """A GpuSpec for sizing: the catalog entry when the name matches, else one built from what was measured.

        The catalog entry wins because matrices and the oracle are written against it; the measured
        SM count is checked against it by :meth:`mismatches`.
        """
        cat = device.catalog
        if cat is not None:
            return cat
        if device.num_sm is None:
            raise TopologyError(
                f"GPU {device.index} ({device.name!r}) is not in the catalog and its SM count is unknown "
                "(torch.cuda was not asked); detect with use_torch=True in the test process"
            )
        return GpuSpec(device.name, device.num_sm, device.total_memory, self.interconnect(device.index),
                       device.compute_capability or (0, 0))

    def mismatches(self, device: GpuDevice) -> list[str]:
        """Where the measured device disagrees with its catalog entry (SM count, capability)."""
        cat = device.catalog
        out: list[str] = []
        if cat is None:
            return out
        if device.num_sm is not None and device.num_sm != cat.num_sm:
            out.append(f"{device.name}: {device.num_sm} SMs measured, catalog {cat.name} says {cat.num_sm}")
        cc = device.compute_capability
        if cc is not None and cat.compute_capability != (0, 0) and cc != cat.compute_capability:
            out.append(f"{device.name}: compute capability {cc}, catalog {cat.name} says {cat.compute_capability}")
        return out

    def as_dict(self) -> dict[str, object]:
        doc = asdict(self)
        for dev, raw in zip(self.devices, doc["devices"]):
            cat = dev.catalog
            raw["catalog"] = cat.name if cat is not None else None
            raw["interconnect"] = self.interconnect(dev.index)
        return doc

    def describe(self) -> str:
        parts = []
        for d in self.devices:
            sm = f", {d.num_sm} SMs" if d.num_sm is not None else ""
            cc = f", sm_{d.compute_capability[0]}{d.compute_capability[1]}" if d.compute_capability else ""
            vis = f" (cuda:{d.cuda_index})" if d.cuda_index is not None else ""
            parts.append(f"{d.index}: {d.name}{vis}, {d.total_memory / (1 << 30):.1f} GiB{sm}{cc}")
        return f"driver {self.driver_version}; " + "; ".join(parts)


def _catalog_keys() -> list[tuple[str, GpuSpec]]:
    keys = [(slug, spec) for slug, spec in GPU_CATALOG.items()]
    keys += [(alias, GPU_CATALOG[target]) for alias, target in ALIASES.items()]
    return sorted(keys, key=lambda kv: len(kv[0]), reverse=True)


def match_catalog(name: str, memory_bytes: int | None = None) -> GpuSpec | None:
    """The catalog GPU an NVML name denotes, or None.

    NVML names carry a vendor prefix and suffixes ("NVIDIA H100 80GB HBM3", "NVIDIA RTX PRO 6000
    Blackwell Server Edition"): the vendor words are dropped and the longest catalog name that is a
    whole-word prefix wins. With ``memory_bytes``, a candidate whose memory differs by more than 10%
    is rejected (an "H100 NVL" is not the catalog's 80 GB H100).
    """
    words = [w for w in slugify(name).split("-") if w not in _VENDOR_WORDS]
    slug = "-".join(words)
    if not slug:
        return None
    try:
        spec: GpuSpec | None = lookup_gpu(slug)
    except KeyError:
        spec = None
        for key, candidate in _catalog_keys():
            if slug.startswith(key + "-"):
                spec = candidate
                break
    if spec is None:
        return None
    if memory_bytes is not None and abs(memory_bytes - spec.memory_bytes) > MEMORY_TOLERANCE * spec.memory_bytes:
        return None
    return spec


def visible_nvml_indices(cuda_visible: str | None, uuids: list[str]) -> list[int]:
    """NVML indices of the devices CUDA exposes, in CUDA's order, for a CUDA_VISIBLE_DEVICES value.

    Integers are taken as PCI-bus-order indices (the pinning sets CUDA_DEVICE_ORDER=PCI_BUS_ID so
    that they agree with NVML's); ``GPU-...`` tokens match a UUID prefix. Like CUDA, the list stops
    at the first token that names no device; MIG instances are not supported.
    """
    n = len(uuids)
    if cuda_visible is None:
        return list(range(n))
    out: list[int] = []
    for raw in cuda_visible.split(","):
        token = raw.strip()
        if not token:
            break
        if token.lstrip("-").isdigit():
            idx = int(token)
            if not 0 <= idx < n or idx in out:
                break
            out.append(idx)
            continue
        matches = [i for i, u in enumerate(uuids) if u.startswith((token, "GPU-" + token))]
        if len(matches) != 1 or matches[0] in out:
            break
        out.append(matches[0])
    return out


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _nvml_links(nvml: NvmlModule, handles: list[object]) -> list[GpuLink]:
    links = []
    nvlink_cap = getattr(nvml, "NVML_P2P_CAPS_INDEX_NVLINK", 2)
    status_ok = getattr(nvml, "NVML_P2P_STATUS_OK", 0)
    for a in range(len(handles)):
        for b in range(a + 1, len(handles)):
            kind, detail = "unknown", ""
            try:
                if nvml.nvmlDeviceGetP2PStatus(handles[a], handles[b], nvlink_cap) == status_ok:
                    kind, detail = "nvlink", "NVML P2P status: NVLink OK"
            except Exception as exc:  # noqa: BLE001 - pynvml raises NVMLError subclasses
                detail = f"P2P status unavailable: {exc}"
            if kind != "nvlink":
                try:
                    level = int(nvml.nvmlDeviceGetTopologyCommonAncestor(handles[a], handles[b]))
                    where = f"common ancestor: {_NVML_LEVELS.get(level, level)}"
                    kind, detail = "pcie", (detail + "; " if detail else "") + where
                except Exception as exc:  # noqa: BLE001
                    detail = (detail + "; " if detail else "") + f"topology unavailable: {exc}"
            links.append(GpuLink(a, b, kind, detail))
    return links


def _nvlink_active(nvml: NvmlModule, handle: object) -> int:
    """Enabled NVLinks over every link index: a link NVML does not report (unpopulated, or
    "not supported" on a PCIe part) is skipped, not taken as the end of the list."""
    active = 0
    enabled = getattr(nvml, "NVML_FEATURE_ENABLED", 1)
    for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))):
        try:
            if nvml.nvmlDeviceGetNvLinkState(handle, link) == enabled:
                active += 1
        except Exception:  # noqa: BLE001 - pynvml raises NVMLError subclasses per link
            continue
    return active


_NvmlDevice: TypeAlias = tuple[int, str, str, int, int]  # NVML index, name, UUID, total memory, active NVLinks


def _read_nvml(nvml: NvmlModule) -> tuple[str, list[_NvmlDevice], list[GpuLink]]:
    """The driver version, each device and the links between them, as NVML answers; TopologyError when it cannot."""
    if nvml is None:
        try:
            import pynvml

            nvml = pynvml
        except ImportError as exc:
            raise TopologyError("the nvidia-ml-py package (module pynvml) is not installed") from exc
    try:
        nvml.nvmlInit()
    except Exception as exc:
        raise TopologyError(f"NVML could not be initialized: {exc}") from exc
    try:
        driver = _text(nvml.nvmlSystemGetDriverVersion())
        count = int(nvml.nvmlDeviceGetCount())
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        raw: list[_NvmlDevice] = []
        for i, h in enumerate(handles):
            raw.append((i, _text(nvml.nvmlDeviceGetName(h)), _text(nvml.nvmlDeviceGetUUID(h)),
                        int(nvml.nvmlDeviceGetMemoryInfo(h).total), _nvlink_active(nvml, h)))
        links = _nvml_links(nvml, handles)
    except TopologyError:
        raise
    except Exception as exc:
        raise TopologyError(f"NVML could not describe the devices: {exc}") from exc
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 - shutdown failures change nothing for the answer
            pass
    return driver, raw, links


def _torch_properties(torch_cuda: TorchCuda, visible: list[int], cuda_visible: str | None,
                      notes: list[str]) -> dict[int, tuple[int, tuple[int, int]]]:
    """SM count and compute capability per NVML index, from torch for the devices this process sees."""
    props: dict[int, tuple[int, tuple[int, int]]] = {}
    if torch_cuda is None:
        import torch

        torch_cuda = torch.cuda
    seen = int(torch_cuda.device_count())
    if seen != len(visible):
        notes.append(f"torch sees {seen} devices, CUDA_VISIBLE_DEVICES={cuda_visible!r} names {len(visible)}")
    for j in range(min(seen, len(visible))):
        p = torch_cuda.get_device_properties(j)
        props[visible[j]] = (int(p.multi_processor_count), (int(p.major), int(p.minor)))
    return props


def detect_topology(nvml: NvmlModule = None, torch_cuda: TorchCuda = None, *, use_torch: bool = False,
                    env: Mapping[str, str] | None = None) -> GpuTopology:
    """Describe the machine's GPUs.

    ``nvml`` defaults to the ``pynvml`` module; ``torch_cuda`` (``torch.cuda`` when ``use_torch``
    and not given) supplies SM counts and compute capability for the devices this process sees.
    Passing ``torch_cuda`` implies ``use_torch``. Raises TopologyError when NVML cannot answer.
    """
    env = os.environ if env is None else env
    driver, raw, links = _read_nvml(nvml)
    cuda_visible = env.get("CUDA_VISIBLE_DEVICES")
    visible = visible_nvml_indices(cuda_visible, [r[2] for r in raw])
    cuda_index = {nv: j for j, nv in enumerate(visible)}
    notes: list[str] = []
    props = _torch_properties(torch_cuda, visible, cuda_visible, notes) if torch_cuda is not None or use_torch else {}
    devices = tuple(
        GpuDevice(
            index=i, name=name, uuid=uuid, total_memory=total, nvlink_active=nvl,
            cuda_index=cuda_index.get(i),
            num_sm=props[i][0] if i in props else None,
            compute_capability=props[i][1] if i in props else None,
        )
        for i, name, uuid, total, nvl in raw
    )
    return GpuTopology(driver, devices, tuple(links), cuda_visible, tuple(notes))
