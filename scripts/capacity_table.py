#!/usr/bin/env python
"""The capacity table of docs/vllm-results.md: per case of a matrix and per micro-batch count, the KV tokens vLLM's
released FlashInfer builder gets from KV sizing (V1 and V2 integrations), what fits once the memory it allocates
after KV sizing is there, and the KV tokens of the reserving builder (examples/vllm-flashinfer-reserving) at vLLM's
default arena and at the sizing module's exact arena.

    PYTHONPATH=.:examples/vllm-flashinfer-reserving .venv/bin/python scripts/capacity_table.py \\
        --matrix matrices/ci.yaml --ubatches 1,2 --out /tmp/capacity.md

Each (backend, case) runs ``run_lifecycle`` once, one after another in this process; the figures come from the
records (``pytest_kvprofile.report.capacity``), with the verdict's arithmetic. Cases vLLM refuses are left out.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "vllm-flashinfer-reserving"

V1, V2, RESERVING, EXACT = ("vllm-flashinfer", "vllm-flashinfer-v2", "vllm-flashinfer-reserving",
                            "vllm-flashinfer-reserving-exact")


def backends() -> dict:
    from pytest_kvprofile.registry import builtin_backends

    try:
        import vllm_flashinfer_reserving
    except ImportError:
        sys.path.insert(0, str(EXAMPLE))
        import vllm_flashinfer_reserving
    catalog = builtin_backends()
    out = {V1: catalog[V1], V2: catalog[V2]}
    out.update({b.name: b for b in vllm_flashinfer_reserving.backends()})
    return out


def cases(matrix: str, ubatches: list[int]) -> list:
    """The matrix's runnable cases, once per micro-batch count, id'd as a matrix listing the axis ids them."""
    from pytest_kvprofile.matrix.schema import load_matrix, ubatch_case_id

    out = []
    for case in load_matrix(matrix).cases:
        if case.skip_reason:
            continue
        for ub in ubatches:
            env = dataclasses.replace(case.envelope, num_ubatches=ub)
            out.append(dataclasses.replace(case, id=ubatch_case_id(case.id, ub), envelope=env))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--matrix", default=str(ROOT / "matrices" / "ci.yaml"))
    parser.add_argument("--ubatches", default="1,2", help="micro-batch counts, comma-separated")
    parser.add_argument("--out", default="-", help="Markdown output (- for stdout)")
    parser.add_argument("--gmu", default=None, help="only cases at these gmu values, comma-separated")
    parser.add_argument("--json", default=None, help="also write every cell here, one JSON object a line, as each "
                                                      "case finishes")
    parser.add_argument("--from-json", default=None, help="render the table from such a file; run nothing")
    args = parser.parse_args(argv)

    from pytest_kvprofile.contract.backends import layout_refusal
    from pytest_kvprofile.lifecycle.driver import close_parts, run_lifecycle
    from pytest_kvprofile.report.capacity import CapacityCell, capacity_cell, capacity_table

    cells: dict = {}
    ids: list[str] = []
    if args.from_json:
        for line in Path(args.from_json).read_text().splitlines():
            raw = json.loads(line)
            raw.pop("fits_tokens", None)
            cell = CapacityCell(**raw)
            cells[(cell.backend, cell.case)] = cell
            if cell.case not in ids:
                ids.append(cell.case)
    else:
        chosen = backends()
        ubatches = [int(u) for u in args.ubatches.split(",") if u.strip()]
        gmus = [float(g) for g in args.gmu.split(",")] if args.gmu else None
        started = time.monotonic()
        for case in cases(args.matrix, ubatches):
            if layout_refusal(chosen[V1], case) or (gmus and not any(abs(case.gmu - g) < 1e-9 for g in gmus)):
                continue
            ids.append(case.id)
            for name in (V1, V2, RESERVING, EXACT):
                result = run_lifecycle(chosen[name], case)
                cells[(name, case.id)] = cell = capacity_cell(name, result)
                close_parts(result)
                del result
                gc.collect()
                if args.json:
                    with open(args.json, "a") as out:
                        out.write(json.dumps(dict(dataclasses.asdict(cell), fits_tokens=cell.fits_tokens)) + "\n")
            print(f"{case.id}: {time.monotonic() - started:.0f} s", file=sys.stderr)
    lines = capacity_table(cells, ids, V1, V2, RESERVING, EXACT)
    text = "\n".join(lines) + "\n"
    if args.out == "-":
        sys.stdout.write(text)
    else:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
