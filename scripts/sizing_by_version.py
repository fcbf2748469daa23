#!/usr/bin/env python3
"""Print docs/sizing.md's per-version table: float workspace bytes per FlashInfer version, for a few layouts.

    KVPROFILE_FLASHINFER_HEADERS=DIR python scripts/sizing_by_version.py [versions...]

Every version is sized by its own planner (the host oracle compiled from its headers; the installed one from
its wheel) where it can be, and the method column says so (``sizing_method``). Fetch headers with
``scripts/fetch_flashinfer_headers.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, not an installed one

from pytest_kvprofile.attention.oracle_build import cached_versions, flashinfer_install
from pytest_kvprofile.sizing.analytic import PlanEnvelope
from pytest_kvprofile.sizing.requirement import required_workspace, sizing_method
from pytest_kvprofile.units import MiB

# (label, heads_q, heads_kv, head_dim, num_sm, compute capability)
LAYOUTS = (
    ("Qwen3-8B TP1, L40S", 32, 8, 128, 142, (8, 9)),
    ("32q/2kv, L40S", 32, 2, 128, 142, (8, 9)),
    ("64q/8kv, B200", 64, 8, 128, 148, (10, 0)),
)
MTP1 = PlanEnvelope(cuda_graph=True, cuda_graph_sizes=(2, 4, 8, 16, 32, 64, 128, 256, 512), mtp=1)
# (column, envelope, the routes sized, the sub-route reported or "" for the maximum over routes)
ENVELOPES = (
    ("no graph", PlanEnvelope(), ("prefill", "decode"), ""),
    ("graphs to 512 tok", PlanEnvelope(cuda_graph=True, cuda_graph_sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512)),
     ("prefill", "decode"), ""),
    ("MTP-1 decode, graphs to 512 tok", MTP1, ("decode",), "decode_tc_cuda_graph"),
)


def _key(version: str) -> tuple[int, ...]:
    return tuple(int("".join(c for c in p if c.isdigit()) or 0) for p in version.split("."))


def main(argv: list[str]) -> int:
    versions = argv or sorted({*cached_versions(), flashinfer_install().version}, key=_key)
    head = "| version | family | method | " + " | ".join(f"{lab}: {env}" for lab, *_ in LAYOUTS
                                                      for env, *_ in ENVELOPES) + " |"
    print(head)
    print("|" + " --- |" * (3 + len(LAYOUTS) * len(ENVELOPES)))
    for v in versions:
        how = sizing_method(v)
        cells = []
        for _, hq, hkv, d, sm, cc in LAYOUTS:
            for _, env, routes, sub in ENVELOPES:
                r = required_workspace(heads_q=hq, heads_kv=hkv, head_dim=d, num_sm=sm, envelope=env,
                                       routes=routes, flashinfer_version=v, compute_capability=cc)
                nbytes = r.routes[sub].float_bytes if sub else r.float_bytes
                cells.append(f"{nbytes / MiB:.2f}" + ("" if r.method == how.method else f" ({r.method})"))
        print(f"| {v} | {how.family} | {how.method} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
