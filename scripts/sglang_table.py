#!/usr/bin/env python
"""The tables of results/sglang-ci.md (read in docs/sglang-results.md): per case of a matrix, SGLang's own
FlashInferAttnBackend on both of SGLang's
paths (``pytest_kvprofile.engines.sglang.memory``). The static path: what it makes after KV sizing, its waste against
FlashInfer's exact need, what ``mem_fraction_static`` must leave for it, whether SGLang's default heuristic covers it.
The post-capture path (``SGLANG_ENABLE_POST_CAPTURE_KV_SIZING=1``): the contract's checks at SGLang's sizing point,
what is made after it, the waste, the serving headroom used and whether SGLang's post-capture default leaves it.

    scripts/install_sglang_cpu.sh .venv
    .venv/bin/python scripts/sglang_table.py --matrix matrices/ci.yaml --json /tmp/sglang.jsonl --out /tmp/sglang.md

Each case runs ``run_lifecycle`` once per path, one after another in this process. With ``--json FILE`` every row (or
refusal) is appended to FILE as it finishes (with ``seconds``), and a run given a FILE that already holds rows
resumes: the rows found there are not run again, so a run killed part-way is finished by running the same command.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def read_rows(path: Path) -> tuple[dict, dict, dict]:
    """The static rows, refusals and post-capture rows of a ``--json`` file, by case; a later line wins, a line cut
    short is ignored (a line without ``path`` is a static one: journals of the first release)."""
    from pytest_kvprofile.engines.sglang.memory import PostCaptureRow, SglangCostRow
    from pytest_kvprofile.report.journal import journal_rows

    rows: dict = {}
    refused: dict = {}
    post: dict = {}
    for raw in journal_rows(path):
        kind = raw.pop("path", "static")
        if "refused" in raw:
            refused[raw["case"]] = raw["refused"]
        elif kind == "post_capture":
            post[raw["case"]] = PostCaptureRow(**dict(raw, failed=tuple(raw.get("failed", ()))))
        else:
            rows[raw["case"]] = SglangCostRow(**raw)
    return rows, refused, post


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--matrix", default=str(ROOT / "matrices" / "ci.yaml"))
    parser.add_argument("--out", default="-", help="Markdown output (- for stdout)")
    parser.add_argument("--json", default=None, help="also write every row here, one JSON object a line, as each "
                                                      "case finishes; a file that holds rows resumes")
    parser.add_argument("--from-json", default=None, help="render the table from such a file; run nothing")
    args = parser.parse_args(argv)

    from pytest_kvprofile.engines.sglang.memory import post_capture_table, sglang_table

    if args.from_json:
        rows, refused, post = read_rows(Path(args.from_json))
    else:
        rows, refused, post = run(args.matrix, Path(args.json) if args.json else None)
    lines = [*sglang_table(list(rows.values()), refused), "", "Post-capture path:", "",
             *post_capture_table(list(post.values()))]
    text = "\n".join(lines) + "\n"
    if args.out == "-":
        sys.stdout.write(text)
    else:
        Path(args.out).write_text(text)
    return 0


def run(matrix: str, journal: Path | None) -> tuple[dict, dict, dict]:
    from pytest_kvprofile.contract.backends import layout_refusal
    from pytest_kvprofile.engines.sglang.flashinfer import SGLANG_BACKENDS
    from pytest_kvprofile.engines.sglang.memory import cost_row, default_mem_fraction, post_capture_row
    from pytest_kvprofile.engines.sglang.post_capture import SGLANG_POST_CAPTURE_BACKENDS
    from pytest_kvprofile.engines.sglang.trtllm_mha import ATTENTION_BACKEND, SGLANG_TRTLLM_MHA_BACKENDS
    from pytest_kvprofile.engines.sglang.trtllm_mla import ATTENTION_BACKEND as MLA_ATTENTION_BACKEND
    from pytest_kvprofile.engines.sglang.trtllm_mla import SGLANG_TRTLLM_MLA_BACKENDS
    from pytest_kvprofile.lifecycle.driver import close_parts, run_lifecycle
    from pytest_kvprofile.matrix.schema import load_matrix
    from pytest_kvprofile.report.journal import append_row, open_for_append

    done = read_rows(journal) if journal and journal.exists() else ({}, {}, {})
    if journal:
        open_for_append(journal)
    rows: dict = {}
    refused: dict = {}
    post: dict = {}
    started = time.monotonic()

    def record(entry: dict, since: float) -> None:
        if journal:
            append_row(journal, entry, since)

    for case in load_matrix(matrix).cases:
        if case.id in done[1]:
            refused[case.id] = done[1][case.id]
            continue
        case_started = time.monotonic()
        # SGLang's default attention backend for the case: on Blackwell (SM10x) trtllm_mha for MHA, trtllm_mla for
        # MLA, elsewhere its FlashInfer backend; the first of them SGLang accepts (the plugin's own refusal: the
        # engine's, else the suite's unsized layouts, on every backend), the FlashInfer backend's reason otherwise
        flashinfer = (SGLANG_BACKENDS[0], "flashinfer")
        trtllm = [(SGLANG_TRTLLM_MHA_BACKENDS[0], ATTENTION_BACKEND),
                  (SGLANG_TRTLLM_MLA_BACKENDS[0], MLA_ATTENTION_BACKEND)]
        order = [*trtllm, flashinfer] if case.gpu.compute_capability[0] == 10 else [flashinfer, *trtllm]
        reason = case.skip_reason or layout_refusal(flashinfer[0], case)
        backend, attention = flashinfer
        if case.skip_reason is None:
            chosen = next(((b, a) for b, a in order if layout_refusal(b, case) is None), None)
            if chosen is not None:
                (backend, attention), reason = chosen, None
        if reason is not None:
            refused[case.id] = reason
            record({"case": case.id, "refused": reason}, case_started)
            continue
        if case.id in done[0]:
            rows[case.id] = done[0][case.id]
        else:
            result = run_lifecycle(backend, case)  # an OOM once its memory is there is part of the row
            row = cost_row(result, backend.name, default_mem_fraction(case, attention_backend=attention))
            close_parts(result)
            del result
            gc.collect()
            if row is None:
                raise SystemExit(f"{case.id}: the run never reached KV sizing")
            rows[case.id] = row
            record(dict(dataclasses.asdict(row), path="static"), case_started)
        if case.id in done[2]:
            post[case.id] = done[2][case.id]
        else:
            path_started = time.monotonic()
            post_backend = next(b for b in SGLANG_POST_CAPTURE_BACKENDS if b.name.startswith(backend.name + "-"))
            result = run_lifecycle(post_backend, case)
            fraction = default_mem_fraction(case, post_capture=True, attention_backend=attention)
            post_row = post_capture_row(result, fraction)
            close_parts(result)
            del result
            gc.collect()
            post[case.id] = post_row
            record(dict(dataclasses.asdict(post_row), path="post_capture"), path_started)
        print(f"{case.id}: {time.monotonic() - case_started:.1f} s, {time.monotonic() - started:.0f} s in all",
              file=sys.stderr, flush=True)
    return rows, refused, post


if __name__ == "__main__":
    raise SystemExit(main())
