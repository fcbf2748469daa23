"""The ``kvprofile`` console script.

Subcommands register themselves in ``_SUBCOMMANDS``; ``size`` answers "how much FlashInfer
workspace does this layout need on this GPU, and for which batch" on a CPU machine.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

MIB = 1 << 20


def _default_matrix() -> Path:
    return Path(__file__).resolve().parent / "matrices" / "default.yaml"


def _load_models(path: Path) -> dict[str, Any]:
    """Model specs of a matrix file: the lead's loader when present, else its ``models:`` map."""
    try:
        from pytest_kvprofile.matrix.schema import load_matrix
    except ImportError:
        load_matrix = None
    if load_matrix is not None:
        return dict(load_matrix(path).models)
    import yaml

    from pytest_kvprofile.matrix.models import ModelSpec

    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    models = data.get("models") or {}
    fields = set(ModelSpec.__dataclass_fields__) - {"name"}
    return {name: ModelSpec(name=name, **{k: v for k, v in (raw or {}).items() if k in fields})
            for name, raw in models.items()}


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def _fail(message: str) -> None:
    """A one-line usage error with argparse's exit status."""
    print(f"kvprofile size: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _add_size(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("size", help="exact FlashInfer workspace requirement for a layout",
                       description="Worst-case FlashInfer float/int workspace over an envelope.")
    p.add_argument("--heads-q", type=_positive, help="query heads of the whole model")
    p.add_argument("--heads-kv", type=_positive, help="KV heads of the whole model")
    p.add_argument("--head-dim", type=_positive)
    p.add_argument("--head-dim-vo", type=_positive)
    p.add_argument("--model", help="a model name from --matrix (sets the head layout)")
    p.add_argument("--matrix", type=Path, default=None, help="matrix YAML (default: packaged)")
    p.add_argument("--sm", type=_positive, help="SM count")
    p.add_argument("--gpu", help="a catalog GPU name (sets --sm)")
    p.add_argument("--tp", type=_positive, default=1)
    p.add_argument("--dcp", type=_positive, default=1)
    p.add_argument("--mtp", type=_non_negative, default=0)
    p.add_argument("--page-size", type=_positive, default=16)
    p.add_argument("--max-num-seqs", type=_positive, default=256)
    p.add_argument("--max-num-batched-tokens", type=_positive, default=8192)
    p.add_argument("--max-model-len", type=_positive, default=32768)
    p.add_argument("--cuda-graph", action="store_true", help="plan for CUDA graphs")
    p.add_argument("--cuda-graph-sizes", type=str, default="",
                   help="comma-separated capture sizes in tokens (implies --cuda-graph)")
    p.add_argument("--cuda-core-decode", action="store_true",
                   help="decode with the CUDA-core planner instead of tensor cores")
    p.add_argument("--decode-blocks-per-sm", type=_positive, default=None)
    p.add_argument("--no-oracle", action="store_true", help="analytic model only")
    p.add_argument("--report", type=Path, metavar="MATRIX", help="sizing report for a matrix file")
    p.add_argument("--plot", type=Path, metavar="PNG", help="with --report: plot (needs matplotlib)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_size, parser=p)


def _cmd_size(args: argparse.Namespace) -> int:
    if args.report is not None:
        return _cmd_report(args)
    from pytest_kvprofile.matrix.models import ModelSpec, impossible_layout, rank_heads
    from pytest_kvprofile.sizing import Envelope, OracleError, required_workspace
    from pytest_kvprofile.matrix.gpus import lookup_gpu

    if args.gpu:
        try:
            gpu = lookup_gpu(args.gpu)
        except KeyError as exc:
            _fail(str(exc.args[0]))
        num_sm = args.sm or gpu.num_sm
    elif args.sm:
        num_sm = args.sm
    else:
        _fail("one of --sm or --gpu is required")
    if args.model:
        path = args.matrix or _default_matrix()
        try:
            models = _load_models(path)
        except (OSError, ValueError) as exc:
            _fail(f"cannot read models from {path}: {exc}")
        if args.model not in models:
            _fail(f"unknown model {args.model!r} in {path}; known: {', '.join(models)}")
        model = models[args.model]
    else:
        missing = [f for f in ("heads_q", "heads_kv", "head_dim") if getattr(args, f) is None]
        if missing:
            _fail("--model or all of --heads-q/--heads-kv/--head-dim are required "
                         f"(missing {', '.join('--' + m.replace('_', '-') for m in missing)})")
        model = ModelSpec(name="cli", heads_q=args.heads_q, heads_kv=args.heads_kv,
                          head_dim=args.head_dim, num_layers=1, head_dim_vo=args.head_dim_vo)
    if args.head_dim_vo is not None and args.model:
        model = ModelSpec(**{**model.__dict__, "head_dim_vo": args.head_dim_vo})
    reason = impossible_layout(model, args.tp, args.dcp, args.mtp)
    if reason:
        _fail(reason)
    heads = rank_heads(model, args.tp, args.dcp)
    try:
        sizes = tuple(int(s) for s in args.cuda_graph_sizes.split(",") if s.strip())
        env = Envelope(max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens,
                       max_model_len=args.max_model_len, page_size=args.page_size,
                       cuda_graph=args.cuda_graph or bool(sizes), cuda_graph_sizes=sizes,
                       mtp=args.mtp)
    except ValueError as exc:
        _fail(f"bad envelope: {exc}")
    try:
        res = required_workspace(
            heads_q=heads.heads_q, heads_kv=heads.heads_kv, head_dim=model.head_dim,
            head_dim_vo=model.head_dim_vo, num_sm=num_sm, envelope=env,
            decode_tensor_cores=not args.cuda_core_decode,
            use_oracle=False if args.no_oracle else None,
            heads_q_decode=heads.heads_q_decode if args.dcp > 1 else None,
            decode_blocks_per_sm=args.decode_blocks_per_sm)
    except (OracleError, ValueError) as exc:
        print(f"kvprofile size: error: {exc}", file=sys.stderr)
        return 1
    qo, kv, graph = res.worst_batch if res.worst_batch else ((), (), False)
    out = {
        "float_workspace_bytes": res.float_bytes,
        "int_workspace_bytes": res.int_bytes,
        "worst_batch": {"qo_lens": list(qo), "kv_lens": list(kv), "cuda_graph": graph},
        "worst_route": res.worst_route,
        "method": res.method,
        "exact": res.exact,
        "gap_bytes": res.gap_bytes,
        "flashinfer_version": res.flashinfer_version,
        "num_sm": num_sm,
        "heads_q": heads.heads_q,
        "heads_kv": heads.heads_kv,
        "heads_q_decode": heads.heads_q_decode,
        "head_dim": model.head_dim,
        "head_dim_vo": model.dim_vo,
        "envelope": {k: (list(v) if isinstance(v, tuple) else v) for k, v in env.__dict__.items()},
        "routes": {name: {"float_workspace_bytes": r.float_bytes, "int_workspace_bytes": r.int_bytes,
                          "exact": r.exact, "confirmed_by_oracle": r.confirmed_by_oracle}
                   for name, r in res.routes.items()},
        "notes": list(res.notes),
    }
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"FlashInfer {res.flashinfer_version}, {num_sm} SMs, per rank {heads.heads_q} q / "
          f"{heads.heads_kv} kv heads, head_dim {model.head_dim}/{model.dim_vo} ({res.method}, "
          f"{'exact' if res.exact else 'upper bound'})")
    print(f"{'route':<24}{'float MiB':>12}{'int KiB':>10}  exact")
    for name, r in res.routes.items():
        print(f"{name:<24}{r.float_bytes / MIB:>12.2f}{r.int_bytes / 1024:>10.1f}  {r.exact}")
    print(f"{'required':<24}{res.float_bytes / MIB:>12.2f}{res.int_bytes / 1024:>10.1f}  "
          f"(worst: {res.worst_route}, {len(qo)} requests, {sum(qo)} tokens, cuda_graph={graph})")
    for note in res.notes:
        print(f"note: {note}")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from pytest_kvprofile.sizing import OracleError
    from pytest_kvprofile.sizing.comparison import format_report, report_for_matrix, report_headline

    try:
        rows = report_for_matrix(str(args.report), use_oracle=False if args.no_oracle else None)
    except (OracleError, OSError, ValueError) as exc:
        print(f"kvprofile size: error: {exc}", file=sys.stderr)
        return 1
    if args.plot is not None:
        try:
            from pytest_kvprofile.sizing.plot import plot_requirement
        except ImportError as exc:
            print(f"kvprofile size: error: --plot needs matplotlib "
                  f"(`pip install pytest-kvprofile[plot]`): {exc}", file=sys.stderr)
            return 1
        plot_requirement(rows, args.plot)
    if args.json:
        print(json.dumps({"rows": rows, "headline": report_headline(rows)}))
    else:
        print(format_report(rows))
    return 0


_SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_add_size]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvprofile", description="pytest-kvprofile tools")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in _SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code (2 for bad arguments)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code) if isinstance(exc.code, int) else 2
    try:
        return int(args.func(args))
    except SystemExit as exc:
        return int(exc.code) if isinstance(exc.code, int) else 2


if __name__ == "__main__":
    sys.exit(main())
