#!/usr/bin/env python
"""The table of docs/sglang-results.md: per case of a matrix, what SGLang's own FlashInferAttnBackend makes after KV
sizing on SGLang's static path, its waste against FlashInfer's exact need, what ``mem_fraction_static`` must leave for
it, and whether SGLang's default heuristic covers it (``pytest_kvprofile.engines.sglang_memory``).

    scripts/install_sglang_cpu.sh .venv
    .venv/bin/python scripts/sglang_table.py --matrix matrices/ci.yaml --json /tmp/sglang.jsonl --out /tmp/sglang.md

Each case runs ``run_lifecycle`` once, one after another in this process. With ``--json FILE`` every row (or refusal)
is appended to FILE as it finishes (with ``seconds``), and a run given a FILE that already holds rows resumes: the
cases found there are not run again, so a run killed part-way is finished by running the same command.
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


def read_rows(path: Path) -> tuple[dict, dict]:
    """The rows and refusals of a ``--json`` file, by case; a later line wins, a line cut short is ignored."""
    from pytest_kvprofile.engines.sglang_memory import SglangCostRow

    rows: dict = {}
    refused: dict = {}
    for line in path.read_text().splitlines():
        try:
            raw = json.loads(line)
        except json.JSONDecodeError:
            continue
        raw.pop("seconds", None)
        if "refused" in raw:
            refused[raw["case"]] = raw["refused"]
        else:
            rows[raw["case"]] = SglangCostRow(**raw)
    return rows, refused


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--matrix", default=str(ROOT / "matrices" / "ci.yaml"))
    parser.add_argument("--out", default="-", help="Markdown output (- for stdout)")
    parser.add_argument("--json", default=None, help="also write every row here, one JSON object a line, as each "
                                                      "case finishes; a file that holds rows resumes")
    parser.add_argument("--from-json", default=None, help="render the table from such a file; run nothing")
    args = parser.parse_args(argv)

    from pytest_kvprofile.engines.sglang_memory import sglang_table

    if args.from_json:
        rows, refused = read_rows(Path(args.from_json))
    else:
        rows, refused = run(args.matrix, Path(args.json) if args.json else None)
    text = "\n".join(sglang_table(list(rows.values()), refused)) + "\n"
    if args.out == "-":
        sys.stdout.write(text)
    else:
        Path(args.out).write_text(text)
    return 0


def run(matrix: str, journal: Path | None) -> tuple[dict, dict]:
    from pytest_kvprofile.engines.sglang_flashinfer import BACKEND_NAME, SGLANG_BACKENDS, engine_refusal
    from pytest_kvprofile.engines.sglang_memory import cost_row, default_mem_fraction
    from pytest_kvprofile.lifecycle.driver import close_parts, run_lifecycle
    from pytest_kvprofile.matrix.schema import load_matrix

    done_rows, done_refused = read_rows(journal) if journal and journal.exists() else ({}, {})
    if journal and journal.exists() and not journal.read_text().endswith("\n"):
        with open(journal, "a") as out:  # a line cut short: the next row starts afresh
            out.write("\n")
    rows: dict = {}
    refused: dict = {}
    started = time.monotonic()
    for case in load_matrix(matrix).cases:
        if case.id in done_rows or case.id in done_refused:
            rows.update({case.id: done_rows[case.id]} if case.id in done_rows else {})
            refused.update({case.id: done_refused[case.id]} if case.id in done_refused else {})
            continue
        case_started = time.monotonic()
        reason = case.skip_reason or engine_refusal(case)
        record: dict
        if reason is not None:
            refused[case.id] = reason
            record = {"case": case.id, "refused": reason}
        else:
            result = run_lifecycle(SGLANG_BACKENDS[0], case)  # an OOM once its memory is there is part of the row
            row = cost_row(result, BACKEND_NAME, default_mem_fraction(case))
            close_parts(result)
            del result
            gc.collect()
            if row is None:
                raise SystemExit(f"{case.id}: the run never reached KV sizing")
            rows[case.id] = row
            record = dataclasses.asdict(row)
            print(f"{case.id}: {time.monotonic() - case_started:.1f} s, {time.monotonic() - started:.0f} s in all",
                  file=sys.stderr, flush=True)
        if journal:
            with open(journal, "a") as out:
                out.write(json.dumps(dict(record, seconds=round(time.monotonic() - case_started, 2))) + "\n")
    return rows, refused


if __name__ == "__main__":
    raise SystemExit(main())
