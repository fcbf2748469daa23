"""Synthetic matrices of a chosen size, for the scaling benchmark.

Every size repeats the same unit (the default matrix's five model templates on the same GPUs and
layouts), so the mix of cases is identical at 100 and at 10,000 and time per case is comparable.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from pytest_kvprofile.matrix.schema import load_matrix, packaged_matrix

GPUS = ["L40S", "H200"]
TP = [2, 4]
DCP = [1]
MTP = [0, 1]
GMU = [0.90]
CASES_PER_MODEL = len(GPUS) * len(TP) * len(DCP) * len(MTP) * len(GMU)


def _templates() -> tuple[dict, dict, list]:
    """The default matrix's envelope, models and resources, so synthetic cases stay realistic. A model listing
    several KV dtypes keeps its first: a --baseline tree older than the KV-dtype axis reads one dtype per model,
    and both trees then time the same cases."""
    data = yaml.safe_load(Path(packaged_matrix("default")).read_text(encoding="utf-8"))
    models = {name: {**m, "kv_dtype": _listed(m["kv_dtype"])[0]} if "kv_dtype" in m else m
              for name, m in data["models"].items()}
    return data["envelope"], models, data.get("resources", [])


def matrix_data(cases: int) -> dict:
    """A matrix dict with at least ``cases`` cases: model templates cycled under distinct names."""
    envelope, models, resources = _templates()
    names = list(models)
    n_models = max(1, -(-cases // CASES_PER_MODEL))
    if n_models >= len(names):
        n_models = -(-n_models // len(names)) * len(names)
    synthetic = {f"{names[i % len(names)]}-r{i // len(names)}": models[names[i % len(names)]] for i in range(n_models)}
    return {"name": f"synthetic-{cases}", "envelope": envelope, "models": synthetic, "gpus": GPUS,
            "tp": TP, "dcp": DCP, "mtp": MTP, "gmu": GMU, "resources": resources}


def write_matrix(directory: str | Path, cases: int) -> Path:
    """Write a synthetic matrix of about ``cases`` cases into ``directory``; return its path."""
    path = Path(directory) / f"synthetic-{cases}.yaml"
    path.write_text(yaml.safe_dump(matrix_data(cases), sort_keys=False), encoding="utf-8")
    return path


def default_matrix() -> Path:
    """The packaged default matrix."""
    return Path(packaged_matrix("default"))


def subset_matrix(directory: str | Path, models: int) -> Path:
    """The default matrix restricted to its first ``models`` models (same GPUs and layouts)."""
    data = yaml.safe_load(Path(packaged_matrix("default")).read_text(encoding="utf-8"))
    data["models"] = dict(list(data["models"].items())[:models])
    data["name"] = f"default-{models}models"
    # exclusions of KV dtypes no kept model lists select nothing here, and a tree older than the KV-dtype axis
    # (a --baseline) could not read them
    kept = {d for m in data["models"].values() for d in _listed(m.get("kv_dtype", "bf16"))}
    data["exclude"] = [e for e in data.get("exclude", []) if "kv_dtype" not in e or kept & set(_listed(e["kv_dtype"]))]
    if not data["exclude"]:
        del data["exclude"]
    path = Path(directory) / f"default-{models}models.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def _listed(value: object) -> list[object]:
    return list(value) if isinstance(value, list) else [value]


if __name__ == "__main__":
    import sys
    import tempfile

    d = tempfile.mkdtemp()
    for n in map(int, sys.argv[1:] or ["100"]):
        p = write_matrix(d, n)
        m = load_matrix(p)
        print(p, len(m.cases), sum(c.skip_reason is None for c in m.cases))
