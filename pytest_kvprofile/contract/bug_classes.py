"""The bug classes the contract forbids: one numbered record each.

Checks name the classes they catch (``Check.bugs``), mutants the class they carry (the number in their name,
``mutant_class``), and the list in ``docs/contract.md`` is generated from this table
(``scripts/generate_catalogs.py``; ``tests/acceptance/test_generated_catalogs.py`` fails on any difference).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["BUG_CLASSES", "BugClass", "bug_class", "mutant_class"]


@dataclass(frozen=True)
class BugClass:
    """One way a backend breaks the contract; ``summary`` is the sentence the docs list."""

    number: int
    summary: str
    safety: bool = True  # False: a cost, refused only over a budget a project sets


BUG_CLASSES: tuple[BugClass, ...] = (
    BugClass(1, "dedicated workspace allocated lazily on first `plan()` after KV sizing"),
    BugClass(2, "lease released inside the profiling block, before the closing measurement"),
    BugClass(3, "lease never released (double count, leak into graph profiling)"),
    BugClass(4, "arena growth after lock; arena reallocated on rebind (stale pointer in a captured graph)"),
    BugClass(5, "micro-batch arenas aliasing each other"),
    BugClass(6, "builder without a declaration treated as supported; an UNSUPPORTED builder acting opted in"),
    BugClass(7, "warmup not idempotent; warmup, or a CUDA-graph capture the engine retries, not retryable after a "
                "failure"),
    BugClass(8, "profile measured once only (persistent baseline and activation peak never seen together), or at "
                "a smaller shape than serving runs (a forward scratch warmed at 64 tokens, met at the largest batch "
                "beside its activations)"),
    BugClass(9, "synthetic workspace allocated during graph capture"),
    BugClass(10, "the engine's KV budget leaves out memory it holds, and overstates KV: the graph pool as "
                 "`gross - retained` (live reserved pages omitted) or not at all, or persistent memory made before the "
                 "snapshot its terms count from (a vLLM fork's model-runner `__init__` buffers)"),
    BugClass(11, "float workspace sized from a decode-shaped heuristic (16-row tiles keyed on max requests) or a "
                 "fixed default, overflowing the prefill split-KV bound on high-SM GPUs or low-KV-head layouts"),
    BugClass(12, "float workspace sized from a formula for the wrong FlashInfer version"),
    BugClass(13, "a persistent resource that is not a builder (DMA workspace, communication buffer) allocated "
                 "lazily, beyond its declared capacity, or during capture"),
    BugClass(14, "device memory kept in process-wide state (module globals, class attributes, caches, closures, "
                 "thread-locals) made after the closing measurement (on first use, as vLLM makes its trtllm-gen "
                 "workspace today), or made again by every engine of the process instead of reused. One buffer per "
                 "process, made by the first engine inside its profiling window and reused by later engines, is "
                 "correct: each case is judged as the first engine of a fresh process, and a second engine in the "
                 "same process must reuse it"),
    BugClass(15, "a wrapper's dedicated int workspace smaller than its plan or its declaration, shared by two "
                 "wrappers or two micro-batches, freed while the wrapper plans, or made again (even at the same "
                 "size) after its CUDA graph was captured, which keeps the old pointer"),
    BugClass(16, "memory used after it was given back: a wrapper that plans into an arena view kept across a "
                 "growth, or into an int workspace a lease release freed (torch mode: a torch call on a freed "
                 "storage)"),
    BugClass(17, "a reservation that fails part-way and leaks what it made, holds more when it is retried, or "
                 "raises an error other than the first one (the open vLLM pull request: \"A reservation that fails "
                 "leaks nothing, and the first error wins\")"),
    BugClass(18, "a part's `close()` that raises, or frees an allocation twice"),
    BugClass(19, "workspace waste over the budget a project sets (`--kvprofile-max-waste`): a cost, never a safety "
                 "failure, so refused only under a budget", safety=False),
)


_MUTANT_NAME = re.compile(r"mutant-(\d+)[a-z]?-[a-z0-9-]+")


def mutant_class(name: str) -> int | None:
    """The bug class a mutant's name carries (``mutant-15j-...`` is class 15); None for a name that is not a mutant's.
    A mutant declares its class once, in its name (``builtin/mutant_declarations.py``)."""
    match = _MUTANT_NAME.fullmatch(name)
    return int(match[1]) if match else None


def bug_class(number: int) -> BugClass:
    """The table's record; a ValueError naming the known numbers otherwise."""
    for record in BUG_CLASSES:
        if record.number == number:
            return record
    raise ValueError(f"unknown bug class {number} (known: 1 to {len(BUG_CLASSES)})")
