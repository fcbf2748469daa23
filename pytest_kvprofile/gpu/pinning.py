"""One xdist worker per GPU: CUDA_VISIBLE_DEVICES chosen from the worker's index before CUDA starts.

Memory figures are per device: two workers on one GPU would see each other's allocations in
``mem_get_info`` and the non-torch baseline, so a worker count above the GPU count is refused
rather than shared. The mapping is pure so that it is tested on CPU.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

__all__ = ["PinningError", "WorkerPin", "apply_pinning", "plan_pinning", "worker_index"]

_WORKER_RE = re.compile(r"^gw(\d+)$")


class PinningError(RuntimeError):
    """The worker cannot be given a GPU of its own; the message says why and what to do."""


@dataclass(frozen=True)
class WorkerPin:
    """What one worker's environment should say."""

    worker: str
    index: int
    device: str  # the CUDA_VISIBLE_DEVICES token this worker gets (an index or a UUID)
    env: tuple[tuple[str, str], ...]


def worker_index(worker_id: str | None) -> int | None:
    """0 for "gw0", 3 for "gw3", None outside xdist (or for "master")."""
    if not worker_id:
        return None
    m = _WORKER_RE.match(worker_id.strip())
    return int(m.group(1)) if m else None


def plan_pinning(env: Mapping[str, str], device_count: int) -> WorkerPin | None:
    """The pin for this process, or None when it is not an xdist worker.

    ``device_count`` is what NVML counts. An existing CUDA_VISIBLE_DEVICES is respected: worker i
    gets its i-th token, so ``CUDA_VISIBLE_DEVICES=2,3 pytest -n 2`` uses GPUs 2 and 3.
    """
    worker = env.get("PYTEST_XDIST_WORKER")
    index = worker_index(worker)
    if index is None:
        return None
    existing = env.get("CUDA_VISIBLE_DEVICES")
    if existing is not None:
        tokens = [t.strip() for t in existing.split(",") if t.strip()]
    else:
        tokens = [str(i) for i in range(device_count)]
    if not tokens:
        raise PinningError(
            f"xdist worker {worker}: no GPU to pin to (NVML counts {device_count}, "
            f"CUDA_VISIBLE_DEVICES={existing!r})"
        )
    workers = env.get("PYTEST_XDIST_WORKER_COUNT")
    if workers is not None and workers.isdigit() and int(workers) > len(tokens):
        raise PinningError(
            f"-n {workers} starts more GPU-tier workers than the {len(tokens)} GPU(s) available "
            f"({', '.join(tokens)}); two workers on one GPU would mix their memory figures. "
            f"Use -n {len(tokens)} or fewer."
        )
    if index >= len(tokens):
        raise PinningError(f"xdist worker {worker} has no GPU of its own: "
                           f"only {len(tokens)} GPU(s) ({', '.join(tokens)})")
    device = tokens[index]
    pin_env = (("CUDA_VISIBLE_DEVICES", device), ("CUDA_DEVICE_ORDER", "PCI_BUS_ID"))
    return WorkerPin(worker or "", index, device, pin_env)


def apply_pinning(env: MutableMapping[str, str], device_count: int, cuda_initialized: bool = False) -> WorkerPin | None:
    """Plan and write the pin into ``env`` (``os.environ`` in a worker). Refuses once CUDA is up,
    because CUDA reads CUDA_VISIBLE_DEVICES only when it initializes."""
    pin = plan_pinning(env, device_count)
    if pin is None:
        return None
    if cuda_initialized:
        current = env.get("CUDA_VISIBLE_DEVICES")
        if current == pin.device:
            return pin
        raise PinningError(
            f"xdist worker {pin.worker}: CUDA was initialized before the GPU tier could pin this worker to "
            f"GPU {pin.device}; something imported at collection time touched torch.cuda"
        )
    for key, value in pin.env:
        env[key] = value
    return pin
