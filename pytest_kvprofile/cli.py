"""The ``kvprofile`` console script.

Subcommands register themselves in ``_SUBCOMMANDS``; ``size`` answers "how much FlashInfer
workspace does this layout need on this GPU, and for which batch" on a CPU machine; ``verdict merge``
combines the verdicts of several runners of one matrix into one.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable, NoReturn, Sequence

from pytest_kvprofile.units import MiB

if TYPE_CHECKING:
    from pytest_kvprofile.attention.trtllm import TrtllmCarve
    from pytest_kvprofile.checks.base import JsonObject
    from pytest_kvprofile.matrix.cases import Case, Envelope, Matrix
    from pytest_kvprofile.sizing.requirement import SizingResult


def _default_matrix() -> Path:
    from pytest_kvprofile.matrix.schema import packaged_matrix

    return packaged_matrix("default")


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


def _fail(message: str) -> NoReturn:
    """A one-line usage error with argparse's exit status."""
    print(f"kvprofile size: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _add_size(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "size", help="exact FlashInfer workspace requirement for a layout",
        description="What workspace_covers_planner demands for one case: the worst-case FlashInfer float/int "
                    "workspace over the envelope, for the per-rank heads of the layout on that GPU (SM count "
                    "and compute capability). The envelope comes from --matrix (default: the packaged "
                    "default matrix) unless overridden.")
    p.add_argument("--heads-q", type=_positive, help="query heads of the whole model")
    p.add_argument("--heads-kv", type=_positive, help="KV heads of the whole model")
    p.add_argument("--head-dim", type=_positive)
    p.add_argument("--head-dim-vo", type=_positive)
    p.add_argument("--model", help="a model name from --matrix (sets the head layout)")
    p.add_argument("--matrix", type=Path, default=None,
                   help="matrix YAML whose models and envelope are used (default: the packaged default.yaml)")
    p.add_argument("--sm", type=_positive, help="SM count (with --gpu: overrides the catalog's)")
    p.add_argument("--gpu", help="a catalog GPU name (sets the SM count and compute capability)")
    p.add_argument("--tp", type=_positive, default=1)
    p.add_argument("--dcp", type=_positive, default=1)
    p.add_argument("--mtp", type=_non_negative, default=0)
    p.add_argument("--page-size", type=_positive, default=None)
    p.add_argument("--kv-dtype", choices=_kv_dtype_names(), default=None,
                   help="the KV cache's dtype (default: the model's in --matrix, else bf16); FlashInfer plans with "
                        "sizeof(DTypeKV), so fp8 can need a different workspace")
    p.add_argument("--max-num-seqs", type=_positive, default=None)
    p.add_argument("--max-num-batched-tokens", type=_positive, default=None)
    p.add_argument("--max-model-len", type=_positive, default=None)
    p.add_argument("--cuda-graph-sizes", type=str, default=None,
                   help="comma-separated CUDA-graph capture sizes in tokens (a decode capture of S tokens plans "
                        "S // (1 + mtp) requests)")
    p.add_argument("--no-cuda-graph", action="store_true", help="size without CUDA graphs")
    p.add_argument("--routes", type=str, default=None,
                   help="comma-separated routes the builder plans natively into the float workspace (prefill, "
                        "decode); the others go to trtllm-gen and need none here (default: every route of the case). "
                        "An MLA case's decode is trtllm-gen's (FlashInfer's MLA planner is not FA2)")
    p.add_argument("--trtllm", type=str, default=None,
                   help="comma-separated routes on trtllm-gen, sized as its launcher carves their workspace (LSE slab "
                        "under DCP, multi-CTA KV scratch); default: the routes --routes leaves, and an MLA decode")
    p.add_argument("--no-oracle", action="store_true", help="analytic model only")
    p.add_argument("--report", type=Path, metavar="MATRIX", help="sizing report for a matrix file")
    p.add_argument("--plot", type=Path, metavar="PNG", help="with --report: plot (needs matplotlib)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_size, parser=p)


def _kv_dtype_names() -> tuple[str, ...]:
    from pytest_kvprofile.matrix.kv_dtypes import kv_dtype_names

    return kv_dtype_names()


def _envelope(args: argparse.Namespace, base: Envelope) -> Envelope:
    """The matrix's envelope with the command line's overrides."""
    import dataclasses

    from pytest_kvprofile.matrix.schema import MatrixError, parse_envelope

    raw: dict[str, object] = {}
    for key in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "page_size"):
        value = getattr(args, key)
        raw[key] = value if value is not None else getattr(base, key)
    if args.no_cuda_graph:
        raw["cuda_graph_sizes"] = []
    elif args.cuda_graph_sizes is not None:
        try:
            raw["cuda_graph_sizes"] = [int(s) for s in args.cuda_graph_sizes.split(",") if s.strip()]
        except ValueError:
            _fail(f"--cuda-graph-sizes: expected comma-separated integers, got {args.cuda_graph_sizes!r}")
    else:
        raw["cuda_graph_sizes"] = list(base.cuda_graph_sizes)
    try:
        env = parse_envelope("command line", raw)
    except MatrixError as exc:
        _fail(f"bad envelope: {exc}")
    return dataclasses.replace(env, num_ubatches=base.num_ubatches, nontorch_mib=base.nontorch_mib)


@functools.lru_cache(maxsize=8)
def _load_matrix(path: str, mtime_ns: int, size: int) -> Matrix:
    """A matrix loaded once per file version (callers that size many cases in one process)."""
    from pytest_kvprofile.matrix.schema import load_matrix

    return load_matrix(path)


def _case(args: argparse.Namespace) -> Case:
    """The case the check would size: model, GPU and layout from the arguments, envelope from the matrix."""
    import dataclasses

    from pytest_kvprofile.matrix.cases import layout_case
    from pytest_kvprofile.matrix.gpus import GpuSpec, lookup_gpu
    from pytest_kvprofile.matrix.models import ModelSpec, impossible_layout
    from pytest_kvprofile.matrix.schema import MatrixError

    path = args.matrix or _default_matrix()
    try:
        stat = Path(path).stat()
        matrix = _load_matrix(str(Path(path).resolve()), stat.st_mtime_ns, stat.st_size)
    except OSError as exc:
        _fail(f"{path}: cannot read: {exc.strerror or exc}")
    except MatrixError as exc:
        _fail(str(exc))
    base = matrix.cases[0].envelope if matrix.cases else None
    if base is None:
        _fail(f"{path}: the matrix has no cases to take an envelope from")
    if args.gpu:
        try:
            gpu = lookup_gpu(args.gpu)
        except KeyError as exc:
            _fail(str(exc.args[0]))
        if args.sm:
            gpu = dataclasses.replace(gpu, num_sm=args.sm)
    elif args.sm:
        gpu = GpuSpec(f"{args.sm}-SM GPU", args.sm, 0, "pcie")
    else:
        _fail("one of --sm or --gpu is required")
    if args.model:
        if args.model not in matrix.models:
            _fail(f"unknown model {args.model!r} in {path}; known: {', '.join(matrix.models)}")
        model = matrix.models[args.model]
        if args.head_dim_vo is not None:
            model = dataclasses.replace(model, head_dim_vo=args.head_dim_vo)
    else:
        missing = [f for f in ("heads_q", "heads_kv", "head_dim") if getattr(args, f) is None]
        if missing:
            _fail("--model or all of --heads-q/--heads-kv/--head-dim are required "
                  f"(missing {', '.join('--' + m.replace('_', '-') for m in missing)})")
        model = ModelSpec(name="cli", heads_q=args.heads_q, heads_kv=args.heads_kv,
                          head_dim=args.head_dim, num_layers=1, head_dim_vo=args.head_dim_vo)
    if args.kv_dtype is not None:
        model = dataclasses.replace(model, kv_dtype=args.kv_dtype)
    from pytest_kvprofile.matrix.schema import kv_dtype_refusal

    reason = impossible_layout(model, args.tp, args.dcp, args.mtp) or kv_dtype_refusal(model, gpu)
    if reason:
        _fail(reason)
    return layout_case(model, gpu, args.tp, args.dcp, args.mtp, _envelope(args, base), matrix="cli")


def _cmd_size(args: argparse.Namespace) -> int:
    """``kvprofile size``: one case's float, int and trtllm-gen workspaces, as JSON or a table.
    Long because its JSON document is written out key by key, one per line."""
    if args.report is not None:
        return _cmd_report(args)
    from pytest_kvprofile.attention.oracle import OracleError
    from pytest_kvprofile.sizing.case import (
        compute_capability,
        decode_tensor_cores,
        for_case,
        need_for_routes,
        plan_envelope,
        routes,
    )

    case = _case(args)
    heads, model = case.heads, case.model
    try:
        res = for_case(case, use_oracle=False if args.no_oracle else None)
    except (OracleError, ValueError) as exc:
        print(f"kvprofile size: error: {exc}", file=sys.stderr)
        return 1
    native, trt, mla_decode = _size_routes(args, case)
    from pytest_kvprofile.sizing.trtllm import trtllm_carve, trtllm_need

    float_bytes, sized = need_for_routes(case, native)
    int_bytes = max((res.routes[r].int_bytes for r in sized), default=0)
    trtllm_bytes, trtllm_worst = trtllm_need(case, trt)
    carves = {r: trtllm_carve(case, r) for r in trt}
    env = plan_envelope(case)
    qo, kv, graph = res.worst_batch if res.worst_batch else ((), (), False)
    out = {
        "case": case.id,
        "float_workspace_bytes": float_bytes,
        "int_workspace_bytes": int_bytes,
        "native_routes": list(native),
        "trtllm_routes": [r for r in routes(case) if r not in native],
        "trtllm_workspace_bytes": trtllm_bytes,
        "trtllm_worst_route": trtllm_worst.route if trtllm_worst is not None else None,
        "trtllm": {r: {"workspace_bytes": c.total_bytes, "lse_slab_bytes": c.slab_bytes,
                       "scratch_bytes": c.scratch_bytes, "lse": c.lse, "num_qo_heads": c.num_qo_heads,
                       "batch_size": c.batch_size, "max_q_len": c.max_q_len, "head_dim_v": c.head_dim_v}
                   for r, c in carves.items()},
        "sized_routes": list(sized),
        "worst_batch": {"qo_lens": list(qo), "kv_lens": list(kv), "cuda_graph": graph},
        "worst_route": res.worst_route,
        "method": res.method,
        "method_reason": res.method_reason,
        "exact": res.exact,
        "gap_bytes": res.gap_bytes,
        "flashinfer_version": res.flashinfer_version,
        "num_sm": case.gpu.num_sm,
        "compute_capability": list(compute_capability(case)),
        "heads_q": heads.heads_q,
        "heads_kv": heads.heads_kv,
        "heads_q_decode": heads.heads_q_decode,
        "head_dim": model.head_dim,
        "head_dim_vo": model.dim_vo,
        "kv_dtype": model.kv_dtype,
        "kv_dtype_bytes": res.kv_dtype_bytes,
        "decode_tensor_cores": decode_tensor_cores(case),
        "envelope": {k: (list(v) if isinstance(v, tuple) else v) for k, v in env.__dict__.items()},
        "routes": {name: {"float_workspace_bytes": r.float_bytes, "int_workspace_bytes": r.int_bytes,
                          "exact": r.exact, "confirmed_by_oracle": r.confirmed_by_oracle}
                   for name, r in res.routes.items()},
        "notes": list(res.notes),
    }
    if args.json:
        print(json.dumps(out))
        return 0
    _print_size(case, res, sized, float_bytes, int_bytes, carves, trtllm_bytes, mla_decode)
    return 0


def _size_routes(args: argparse.Namespace, case: Case) -> tuple[tuple[str, ...], tuple[str, ...], bool]:
    """The routes ``kvprofile size`` sizes: the case's native routes asked (``--routes``), its trtllm-gen routes
    (``--trtllm``, else those the engine sends there) and whether an MLA decode was asked (sized as trtllm-gen's)."""
    from pytest_kvprofile.sizing.case import routes
    from pytest_kvprofile.sizing.trtllm import ROUTES as TRTLLM_ROUTES
    from pytest_kvprofile.sizing.trtllm import trtllm_routes

    asked = routes(case) if args.routes is None else tuple(r.strip() for r in args.routes.split(",") if r.strip())
    mla_decode = case.model.attention == "mla" and "decode" in asked
    unknown = [r for r in asked if r not in routes(case) and not (r == "decode" and mla_decode)]
    if unknown:
        _fail(f"--routes: {', '.join(unknown)} is not a route of the case (its routes: {', '.join(routes(case))})")
    native = tuple(r for r in asked if r in routes(case))
    trt = trtllm_routes(case, native) if args.trtllm is None else \
        tuple(r.strip() for r in args.trtllm.split(",") if r.strip())
    bad = [r for r in trt if r not in TRTLLM_ROUTES]
    if bad:
        _fail(f"--trtllm: {', '.join(bad)} is not a trtllm-gen route (known: {', '.join(TRTLLM_ROUTES)})")
    return native, trt, mla_decode


def _print_size(case: Case, res: SizingResult, sized: tuple[str, ...], float_bytes: int, int_bytes: int,
                carves: dict[str, TrtllmCarve], trtllm_bytes: int, mla_decode: bool) -> None:
    """``kvprofile size``'s table: per route, the required line, trtllm-gen's carves, the notes."""
    from pytest_kvprofile.sizing.case import compute_capability

    heads, model = case.heads, case.model
    qo, _, graph = res.worst_batch if res.worst_batch else ((), (), False)
    print(f"FlashInfer {res.flashinfer_version}, {case.gpu.num_sm} SMs "
          f"(sm_{''.join(map(str, compute_capability(case)))}), "
          f"per rank {heads.heads_q} q / {heads.heads_kv} kv heads, head_dim {model.head_dim}/{model.dim_vo}, "
          f"KV {model.kv_dtype} ({res.kv_dtype_bytes} B to the planner) "
          f"({res.method}, {'exact' if res.exact else 'upper bound'})")
    print(f"{'route':<24}{'float MiB':>12}{'int KiB':>10}  exact  sized")
    for name, r in res.routes.items():
        print(f"{name:<24}{r.float_bytes / MiB:>12.2f}{r.int_bytes / 1024:>10.1f}  {r.exact!s:<5}  "
              f"{'yes' if name in sized else 'no (trtllm-gen)'}")
    worst = f"worst: {res.worst_route}, {len(qo)} requests, {sum(qo)} tokens, cuda_graph={graph}" \
        if sized == tuple(res.routes) else f"routes sized: {', '.join(sized) or 'none'}"
    print(f"{'required':<24}{float_bytes / MiB:>12.2f}{int_bytes / 1024:>10.1f}  ({worst})")
    for name, c in carves.items():
        print(f"{'trtllm-gen ' + name:<24}{c.total_bytes / MiB:>12.2f}{'':>10}  ({c.formula()})")
    if carves:
        print(f"{'trtllm-gen required':<24}{trtllm_bytes / MiB:>12.2f}  (FlashInfer's trtllm-gen launcher, "
              "csrc/trtllm_fmha_kernel_launcher.cu)")
    if mla_decode:
        print("note: an MLA case's decode is sized as trtllm-gen's (FlashInfer's MLA planner is not FA2)")
    for note in res.notes:
        print(f"note: {note}")



def _cmd_report(args: argparse.Namespace) -> int:
    from pytest_kvprofile.sizing import OracleError
    from pytest_kvprofile.sizing.comparison import (
        format_report,
        report_for_matrix,
        report_headline,
        unsized_for_matrix,
    )

    try:
        rows = report_for_matrix(str(args.report), use_oracle=False if args.no_oracle else None)
        unsized = unsized_for_matrix(str(args.report))
    except (OracleError, OSError, ValueError) as exc:
        print(f"kvprofile size: error: {exc}", file=sys.stderr)
        return 1
    if args.plot is not None:
        from pytest_kvprofile.sizing.plot import plot_requirement

        try:
            plot_requirement(rows, args.plot)
        except ModuleNotFoundError as exc:  # matplotlib, imported by the plot alone
            print(f"kvprofile size: error: --plot needs {exc.name or 'matplotlib'}: pip install "
                  "'pytest-kvprofile[plot]'", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps({"rows": rows, "headline": report_headline(rows), "unsized": unsized}))
    else:
        print(format_report(rows))
        for row in unsized:
            print(f"not sized: {row['case']}: {row['reason']}")
    return 0


def _add_verdict(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("verdict", help="work with opt-in verdict documents",
                       description="Combine the verdicts (--kvprofile-verdict) of several runners of one matrix.")
    actions = p.add_subparsers(dest="verdict_command", required=True)
    merge = actions.add_parser(
        "merge", help="merge the verdicts of several runners of one matrix digest and backend version",
        description="One verdict from several runners of one matrix (xdist shards, the CPU tier, each GPU "
                    "runner). A backend may opt in only when the union of the runners' results covers every case "
                    "of its matrix and nothing failed. Different matrix digests, backend versions, engine versions "
                    "(vLLM 0.33 and 0.34) or FlashInfer versions are an error (exit code 2).")
    merge.add_argument("verdicts", nargs="+", metavar="VERDICT.json")
    merge.add_argument("-o", "--output", required=True, metavar="OUT.json", help="where to write the merged verdict")
    merge.set_defaults(func=_cmd_verdict_merge)


def _cmd_verdict_merge(args: argparse.Namespace) -> int:
    from pytest_kvprofile.report.documents import MergeError, merge_verdicts

    docs: dict[str, JsonObject] = {}  # parsed JSON
    for path in args.verdicts:
        try:
            doc = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            return _verdict_error(f"cannot read the verdict {path}: {exc}")
        if not isinstance(doc, dict) or "backends" not in doc:
            return _verdict_error(f"{path} is not a kvprofile verdict (no 'backends')")
        docs[path] = doc
    try:
        merged = merge_verdicts(docs)
    except MergeError as exc:
        return _verdict_error(str(exc))
    from pytest_kvprofile.report.files import write_json_atomic

    try:
        out = write_json_atomic(args.output, merged)
    except OSError as exc:
        return _verdict_error(f"cannot write {args.output}: {exc}")
    from pytest_kvprofile.checks.catalog import CHECKS
    from pytest_kvprofile.report.summary import verdict_line

    print(f"merged verdict written to {out}")
    order = [c.name for c in CHECKS]
    for b in merged["backends"]:
        print(verdict_line(b, order) + "".join(f"\n    - {r}" for r in [*b["reasons"], *b.get("notices", [])]))
    return 0


def _verdict_error(message: str) -> int:
    print(f"kvprofile verdict merge: error: {message}", file=sys.stderr)
    return 2


def _add_list(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("list", help="the backends --kvprofile-backend can name, by group",
                       description="Every registered backend, by group, then the installed entry points.")
    p.add_argument("--group", help="only this group's backends")
    p.set_defaults(func=_run_list)


def _run_list(args: argparse.Namespace) -> int:
    from importlib.metadata import entry_points

    from pytest_kvprofile.registry import ENTRY_POINT_GROUP, builtin_registry

    registry = builtin_registry()
    if args.group is not None and args.group not in registry.groups:
        print(f"kvprofile list: error: no group {args.group!r} (groups: {', '.join(registry.groups)})", file=sys.stderr)
        return 2
    grouped = {name for group in registry.groups for name in (b.name for b in registry.group(group))}
    sections = [(g, [b.name for b in registry.group(g)]) for g in registry.groups]
    sections.append(("ungrouped", [n for n in registry.backends if n not in grouped]))
    for group, names in sections:
        if names and args.group in (None, group):
            print(f"{group} ({len(names)}):")
            for name in names:
                print(f"  {name}")
    points = sorted(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))
    if points and args.group is None:
        print(f"installed entry points ({len(points)}):")
        for name in points:
            print(f"  {name}")
    return 0


_SUBCOMMANDS: list[Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None]] = [
    _add_size, _add_verdict, _add_list]


def package_version() -> str:
    """The installed pytest-kvprofile's version (its metadata), or ``unknown`` for a source tree not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pytest-kvprofile")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvprofile", description="pytest-kvprofile tools")
    parser.add_argument("--version", action="version", version=f"kvprofile (pytest-kvprofile) {package_version()}")
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
