#!/usr/bin/env python
"""The capacity table of results/vllm-capacity.md (read in docs/vllm-results.md): per case of a matrix and per
micro-batch count, the KV tokens vLLM's
released FlashInfer builder gets from KV sizing (V1 and V2 integrations), what fits once the memory it allocates
after KV sizing is there, and the KV tokens of the reserving builder (examples/vllm-flashinfer-reserving) at vLLM's
default arena and at the sizing module's exact arena.

    PYTHONPATH=.:examples/vllm-flashinfer-reserving .venv/bin/python scripts/capacity_table.py \\
        --matrix matrices/ci.yaml --ubatches 1,2 --out /tmp/capacity.md

Each (backend, case) runs ``run_lifecycle`` once, one after another in this process; the figures come from the
records (``pytest_kvprofile.report.capacity``), with the verdict's arithmetic. Cases vLLM refuses are left out.

With ``--json FILE`` every cell is appended to FILE as it finishes (with ``seconds``, the wall time of its
lifecycle), and a run given a FILE that already holds cells resumes: the (backend, case) pairs found there are
not run again, and the table carries them, so a run killed part-way is finished by running the same command.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
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


def read_cells(path: Path, cell_type) -> dict:
    """The cells of a ``--json`` file, by (backend, case); a later line for the same pair wins, and a last line cut
    short by a killed run is ignored."""
    from pytest_kvprofile.report.journal import journal_rows

    cells: dict = {}
    for raw in journal_rows(path, derived=("fits_tokens",)):
        cell = cell_type(**raw)
        cells[(cell.backend, cell.case)] = cell
    return cells


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
    from pytest_kvprofile.report.journal import append_row, open_for_append

    cells: dict = {}
    ids: list[str] = []
    if args.from_json:
        cells = read_cells(Path(args.from_json), CapacityCell)
        for _, case_id in cells:
            if case_id not in ids:
                ids.append(case_id)
    else:
        done = read_cells(Path(args.json), CapacityCell) if args.json and Path(args.json).exists() else {}
        if done:
            print(f"resuming: {len(done)} cells already in {args.json}", file=sys.stderr)
            open_for_append(Path(args.json))
        chosen = backends()
        ubatches = [int(u) for u in args.ubatches.split(",") if u.strip()]
        gmus = [float(g) for g in args.gmu.split(",")] if args.gmu else None
        started = time.monotonic()
        for case in cases(args.matrix, ubatches):
            if layout_refusal(chosen[V1], case) or (gmus and not any(abs(case.gmu - g) < 1e-9 for g in gmus)):
                continue
            ids.append(case.id)
            case_started = time.monotonic()
            ran = 0
            for name in (V1, V2, RESERVING, EXACT):
                if (name, case.id) in done:
                    cells[(name, case.id)] = done[(name, case.id)]
                    continue
                cell_started = time.monotonic()
                result = run_lifecycle(chosen[name], case)
                cells[(name, case.id)] = cell = capacity_cell(name, result)
                close_parts(result)
                del result
                gc.collect()
                ran += 1
                if args.json:
                    append_row(Path(args.json), dict(dataclasses.asdict(cell), fits_tokens=cell.fits_tokens),
                               cell_started)
            if ran:
                print(f"{case.id}: {time.monotonic() - case_started:.1f} s ({ran} cells), "
                      f"{time.monotonic() - started:.0f} s in all", file=sys.stderr, flush=True)
    lines = capacity_table(cells, ids, V1, V2, RESERVING, EXACT)
    text = "\n".join(lines) + "\n"
    if args.out == "-":
        sys.stdout.write(text)
    else:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
