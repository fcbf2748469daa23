#!/usr/bin/env python
"""Run one scripted allocation sequence on real ``torch.cuda`` and on the allocator model, and print
both columns of figures with their differences.

The simulated device is only useful if its reserved/allocated bytes match PyTorch's; this is the
check to run on a GPU runner whenever torch is upgraded. Exit status: 0 when every figure matches,
1 when some differ, 2 when no CUDA device is available (``--model-only`` prints the model column
alone and needs no GPU).

    python scripts/compare_allocator_gpu.py [--model-only] [--verbose]
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pytest_kvprofile.memory.device import DeviceOutOfMemory, SimDevice  # noqa: E402
from pytest_kvprofile.units import MiB  # noqa: E402

KiB = 1 << 10

# (op, name, bytes): "alloc" name size | "free" name | "empty_cache" | "reset_peak" |
# "capture_begin" | "capture_end" | "release_graph" | "free_all" | "oom" name size (expect an OOM)
SEQUENCE: list[tuple[Any, ...]] = [
    ("alloc", "one_byte", 1),
    ("alloc", "small_600k_a", 600 * KiB),
    ("alloc", "small_600k_b", 600 * KiB),
    ("alloc", "small_900k", 900 * KiB),
    ("alloc", "mid_1m_plus_1", MiB + 1),
    ("alloc", "mid_8m", 8 * MiB),
    ("alloc", "large_12m_plus_1", 12 * MiB + 1),
    ("alloc", "large_13m_plus_1", 13 * MiB + 1),
    ("alloc", "flashinfer_int_ws", 8 * MiB),
    ("alloc", "float_arena_394m", 394 * MiB),
    ("free", "small_600k_a"),
    ("free", "mid_1m_plus_1"),
    ("alloc", "reuse_mid_4m", 4 * MiB),
    ("free", "large_12m_plus_1"),
    ("alloc", "reuse_large_11m", 11 * MiB),
    ("reset_peak",),
    ("free", "float_arena_394m"),
    ("alloc", "arena_grown_512m", 512 * MiB),
    ("empty_cache",),
    ("capture_begin",),
    ("alloc", "graph_tmp_30m", 30 * MiB),
    ("alloc", "graph_out_1m", MiB),
    ("free", "graph_tmp_30m"),
    ("alloc", "graph_tmp2_20m", 20 * MiB),
    ("free", "graph_tmp2_20m"),
    ("capture_end",),
    ("empty_cache",),
    ("alloc", "after_capture_30m", 30 * MiB),
    ("free", "graph_out_1m"),
    ("release_graph",),
    ("empty_cache",),
    ("free", "after_capture_30m"),
    ("free", "arena_grown_512m"),
    ("empty_cache",),
    ("free_all",),
    ("empty_cache",),
]

FIGURES = (
    "allocated_bytes.all.current",
    "reserved_bytes.all.current",
    "allocated_bytes.all.peak",
    "reserved_bytes.all.peak",
    "segment.all.current",
    "inactive_split_bytes.all.current",
    "num_alloc_retries",
)


def run_model(sequence: list[tuple[Any, ...]], total_memory: int) -> list[dict[str, int]]:
    """The sequence on a SimDevice; one figures row per step."""
    dev = SimDevice(name="model", total_memory=total_memory)
    live: dict[str, Any] = {}
    rows: list[dict[str, int]] = []
    capture = None
    pool = None
    for step in sequence:
        op = step[0]
        if op == "alloc":
            live[step[1]] = dev.allocate(step[2], owner="compare", tag=step[1])
        elif op == "free":
            dev.free(live.pop(step[1]))
        elif op == "free_all":
            for alloc in live.values():
                dev.free(alloc)
            live.clear()
        elif op == "empty_cache":
            dev.empty_cache()
        elif op == "reset_peak":
            dev.reset_peak_memory_stats()
        elif op == "capture_begin":
            dev.empty_cache()  # torch.cuda.graph empties the cache before capture_begin
            capture = dev.graph_capture()
            pool = capture.__enter__()
        elif op == "capture_end":
            assert capture is not None
            capture.__exit__(None, None, None)
        elif op == "release_graph":
            assert pool is not None
            dev.release_graph_pool(pool, lazy=True)  # torch releases the pool at the next empty_cache
        elif op == "oom":
            try:
                dev.allocate(step[2], owner="compare", tag=step[1])
            except DeviceOutOfMemory:
                pass
        stats = dev.memory_stats()
        rows.append({k: stats[k] for k in FIGURES})
    return rows


def run_torch(sequence: list[tuple[Any, ...]]) -> list[dict[str, int]]:
    """The same sequence on the real caching allocator (uint8 tensors of the exact byte sizes)."""
    import torch

    torch.cuda.init()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_stats()
    if base.get("allocated_bytes.all.current", 0) or base.get("reserved_bytes.all.current", 0):
        raise SystemExit("the CUDA caching allocator is not empty at start; run this script in a fresh process")
    live: dict[str, Any] = {}
    rows: list[dict[str, int]] = []
    graph = None
    stream = torch.cuda.Stream()
    capture_ctx = None
    for step in sequence:
        op = step[0]
        if op == "alloc":
            live[step[1]] = torch.empty(step[2], dtype=torch.uint8, device="cuda")
        elif op == "free":
            del live[step[1]]
        elif op == "free_all":
            live.clear()
        elif op == "empty_cache":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        elif op == "reset_peak":
            torch.cuda.reset_peak_memory_stats()
        elif op == "capture_begin":
            graph = torch.cuda.CUDAGraph()
            capture_ctx = torch.cuda.graph(graph, stream=stream)
            capture_ctx.__enter__()
        elif op == "capture_end":
            assert capture_ctx is not None
            # Give the graph one kernel (in place, no allocation) so the capture is not empty.
            next(iter(live.values())).zero_()
            capture_ctx.__exit__(None, None, None)
        elif op == "release_graph":
            # The capture context keeps its own reference to the graph: reset() frees the graph's
            # hold on its private pool now (its segments go at the next empty_cache, as the model
            # says), and both references are dropped so nothing can replay or keep it alive.
            assert graph is not None
            graph.reset()
            graph = capture_ctx = None
        elif op == "oom":
            try:
                torch.empty(step[2], dtype=torch.uint8, device="cuda")
            except torch.cuda.OutOfMemoryError:
                pass
        torch.cuda.synchronize()
        stats = torch.cuda.memory_stats()
        rows.append({k: int(stats.get(k, 0)) for k in FIGURES})
    return rows


def describe(step: tuple[Any, ...]) -> str:
    if step[0] in ("alloc", "oom"):
        return f"{step[0]} {step[1]} ({step[2]} B)"
    return " ".join(str(s) for s in step)


def compare(torch_rows: list[dict[str, int]] | None, model_rows: list[dict[str, int]], verbose: bool,
            out: Callable[[str], None] = print) -> int:
    """Print the figure columns; return the number of differing figures."""
    diffs = 0
    short = {k: k.replace("_bytes", "").replace(".all", "") for k in FIGURES}
    for i, (step, model) in enumerate(zip(SEQUENCE, model_rows)):
        real = torch_rows[i] if torch_rows is not None else None
        bad = [k for k in FIGURES if real is not None and real[k] != model[k]]
        diffs += len(bad)
        if verbose or bad or real is None:
            out(f"{i:2d} {describe(step)}")
            for k in FIGURES:
                if real is None:
                    out(f"     {short[k]:<28} model {model[k]:>12}")
                elif verbose or k in bad:
                    mark = "  DIFF " + f"{model[k] - real[k]:+d}" if k in bad else ""
                    out(f"     {short[k]:<28} torch {real[k]:>12}  model {model[k]:>12}{mark}")
    return diffs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-only", action="store_true", help="print the model column; no GPU needed")
    parser.add_argument("--verbose", action="store_true", help="print every figure of every step")
    args = parser.parse_args(argv)
    if args.model_only:
        compare(None, run_model(SEQUENCE, 80 << 30), verbose=True)
        return 0
    try:
        import torch
    except ImportError:
        print("compare_allocator_gpu: torch is not installed; nothing to compare against", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(
            "compare_allocator_gpu: no CUDA device is available (torch "
            f"{torch.__version__}); run this on a GPU runner, or pass --model-only",
            file=sys.stderr,
        )
        return 2
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if conf:
        print(f"warning: PYTORCH_CUDA_ALLOC_CONF={conf!r}; the model assumes the default configuration")
    free, total = torch.cuda.mem_get_info()
    torch_rows = run_torch(SEQUENCE)
    model_rows = run_model(SEQUENCE, total)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}: {len(SEQUENCE)} steps")
    diffs = compare(torch_rows, model_rows, verbose=args.verbose)
    print(f"{diffs} differing figures" if diffs else "model matches torch on every figure")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
