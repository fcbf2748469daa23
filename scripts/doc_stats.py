#!/usr/bin/env python3
"""Measure the prose of docs/*.md: words per page, median sentence, longest paragraph.

Usage::

    scripts/doc_stats.py [PAGE ...] [--check]

Prose is what is left after code blocks, tables and headings are dropped. A paragraph is a run of
lines between blank lines; each list item is a paragraph of its own. A sentence ends at ``.``, ``!``
or ``?`` followed by a space or a line end. ``--check`` exits 1 when a page has a median sentence
over 20 words or a paragraph over 120 words.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

MEDIAN_SENTENCE_LIMIT = 20
PARAGRAPH_LIMIT = 120

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_ITEM = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s+")


@dataclass(frozen=True)
class PageStats:
    """One page's numbers; ``words`` counts everything, ``prose_words`` only paragraphs."""

    name: str
    words: int
    prose_words: int
    median_sentence: float
    longest_paragraph: int

    @property
    def problems(self) -> list[str]:
        out = []
        if self.median_sentence > MEDIAN_SENTENCE_LIMIT:
            out.append(f"median sentence {self.median_sentence:g} words (limit {MEDIAN_SENTENCE_LIMIT})")
        if self.longest_paragraph > PARAGRAPH_LIMIT:
            out.append(f"a paragraph of {self.longest_paragraph} words (limit {PARAGRAPH_LIMIT})")
        return out


def paragraphs(text: str) -> list[str]:
    """The prose paragraphs of a Markdown page: no code blocks, tables or headings."""
    out: list[str] = []
    current: list[str] = []
    fenced = False

    def close() -> None:
        if current:
            out.append(" ".join(current))
            current.clear()

    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith(("```", "~~~")):
            fenced = not fenced
            close()
            continue
        if fenced or not stripped or stripped.startswith(("|", "#")) or line.startswith("    "):
            close()
            continue
        if _ITEM.match(line):
            close()
            stripped = _ITEM.sub("", line).strip()
        out_line = stripped[2:] if stripped.startswith("> ") else stripped
        current.append(out_line)
    close()
    return out


def sentences(paragraph: str) -> list[str]:
    return [s for s in _SENTENCE_END.split(paragraph) if s.split()]


def measure(path: Path) -> PageStats:
    text = path.read_text()
    paras = paragraphs(text)
    lengths = [len(s.split()) for p in paras for s in sentences(p)]
    return PageStats(
        name=path.name,
        words=len(text.split()),
        prose_words=sum(len(p.split()) for p in paras),
        median_sentence=statistics.median(lengths) if lengths else 0.0,
        longest_paragraph=max((len(p.split()) for p in paras), default=0),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pages", nargs="*", type=Path)
    parser.add_argument("--check", action="store_true", help="exit 1 when a page is over a limit")
    args = parser.parse_args(argv)
    pages = args.pages or sorted((Path(__file__).resolve().parents[1] / "docs").glob("*.md"))
    stats = [measure(p) for p in pages]
    print(f"{'page':24} {'words':>6} {'prose':>6} {'median':>6} {'longest':>7}")
    for s in stats:
        flag = "  OVER" if s.problems else ""
        print(f"{s.name:24} {s.words:6} {s.prose_words:6} {s.median_sentence:6g} {s.longest_paragraph:7}{flag}")
    print(f"{'total':24} {sum(s.words for s in stats):6} {sum(s.prose_words for s in stats):6}")
    over = [f"{s.name}: {p}" for s in stats for p in s.problems]
    for line in over:
        print(line, file=sys.stderr)
    return 1 if args.check and over else 0


if __name__ == "__main__":
    sys.exit(main())
