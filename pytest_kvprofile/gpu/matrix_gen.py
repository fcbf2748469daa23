"""A one-GPU matrix for the detected device: the base matrix's models and layouts on this GPU.

Why: sizing is per SM count, so the GPU tier's sizing and lifecycle tests only mean something for
cases whose GPU is the one under test. ``run_gpu_tier.sh`` writes this file before running pytest.

    python -m pytest_kvprofile.gpu.matrix_gen --base matrices/ci.yaml --out gpu.yaml [--json topo.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from pytest_kvprofile.gpu.topology import GpuTopology, TopologyError, detect_topology

if TYPE_CHECKING:
    from pytest_kvprofile.matrix.cases import YamlValue

__all__ = ["detected_gpu_entry", "main", "one_gpu_matrix"]


def detected_gpu_entry(topology: GpuTopology) -> str | dict[str, object]:
    """The matrix ``gpus`` entry for this process's first visible device: its catalog name, or an
    inline description (name, SMs, memory, interconnect) when the catalog does not know it."""
    visible = topology.visible
    if not visible:
        raise TopologyError("no GPU is visible to this process (check CUDA_VISIBLE_DEVICES)")
    dev = visible[0]
    if dev.catalog is not None:
        return dev.catalog.name
    spec = topology.spec(dev)
    return {"name": spec.name, "num_sm": spec.num_sm, "memory_gb": round(spec.memory_bytes / 1e9, 3),
            "interconnect": spec.interconnect}


def one_gpu_matrix(base: dict[str, YamlValue], gpu_entry: str | dict[str, object]) -> dict[str, YamlValue]:
    """``base`` with its GPU list replaced by ``gpu_entry`` (exclusions naming other GPUs dropped)."""
    doc = dict(base)
    name = gpu_entry if isinstance(gpu_entry, str) else gpu_entry["name"]
    doc["name"] = f"{base.get('name', 'matrix')}-on-{name}".replace(" ", "-").lower()
    doc["gpus"] = [gpu_entry]
    if "exclude" in doc:
        doc["exclude"] = [e for e in doc["exclude"] if not (isinstance(e, dict) and "gpu" in e)]
    return doc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="matrix YAML whose models and layouts to keep")
    parser.add_argument("--out", required=True, help="where to write the one-GPU matrix")
    parser.add_argument("--json", default=None, help="also write the detected topology as JSON here")
    parser.add_argument("--torch", action="store_true",
                        help="ask torch.cuda for SM counts (needed for GPUs outside the catalog)")
    args = parser.parse_args(argv)
    try:
        topo = detect_topology(use_torch=args.torch)
        entry = detected_gpu_entry(topo)
    except TopologyError as exc:
        print(f"matrix_gen: {exc}", file=sys.stderr)
        return 2
    base = yaml.safe_load(Path(args.base).read_text(encoding="utf-8"))
    Path(args.out).write_text(yaml.safe_dump(one_gpu_matrix(base, entry), sort_keys=False), encoding="utf-8")
    if args.json:
        Path(args.json).write_text(json.dumps(topo.as_dict(), indent=2, default=str) + "\n", encoding="utf-8")
    print(f"matrix_gen: {topo.describe()}; wrote {args.out} for {entry if isinstance(entry, str) else entry['name']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
