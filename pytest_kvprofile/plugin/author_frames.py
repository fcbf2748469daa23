"""An error raised in the author's code, shown from the author's frames, under pytest's ``--tb``.

The lifecycle records a builder's exception as text (``PhaseError.traceback``): the harness's driver frames, then
the author's. A failure shows the author's frames only (the harness's left out: ``pytest_kvprofile`` itself, its
built-in backends excepted, and the standard library), as pytest's ``--tb`` asks: ``long``/``auto``/``native`` with
the source lines, ``short`` one line per frame, ``line`` the innermost frame's place, ``no`` nothing.
"""

from __future__ import annotations

import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

_FRAME = re.compile(r'^  File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<func>.+)$')
_CHAINS = ("\nThe above exception was the direct cause of the following exception:\n",
           "\nDuring handling of the above exception, another exception occurred:\n")


@dataclass(frozen=True)
class Frame:
    path: str
    line: int
    func: str
    source: str

    @property
    def place(self) -> str:
        return f"{self.path}:{self.line}"


def _harness_roots() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(paths that are the harness, paths under them that are backends: the author's code of the built-ins)."""
    package = Path(__file__).resolve().parent.parent
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    return (str(package) + "/", str(stdlib) + "/"), (str(package / "builtin") + "/",)


def is_author_frame(path: str) -> bool:
    harness, backends = _harness_roots()
    resolved = str(Path(path).resolve()) if not path.startswith("<") else path
    if "site-packages" in resolved and not resolved.startswith(harness[0]):
        return True
    return resolved.startswith(backends) or not resolved.startswith(harness)


def parse(text: str) -> tuple[list[Frame], str]:
    """The frames of the exception that ends ``text`` (``traceback.format_exception``'s), and its last line."""
    block = text
    for sep in _CHAINS:
        block = block.rsplit(sep, 1)[-1]
    lines = block.rstrip("\n").splitlines()
    frames: list[Frame] = []
    for i, line in enumerate(lines):
        m = _FRAME.match(line)
        if m:
            nxt = lines[i + 1] if i + 1 < len(lines) else ""
            source = nxt.strip() if nxt.startswith("    ") and not _FRAME.match(nxt) else ""
            frames.append(Frame(m["path"], int(m["line"]), m["func"], source))
    last = lines[-1] if lines else ""
    return frames, last


def author_frames(text: str) -> tuple[list[Frame], str]:
    """The author's frames of the recorded traceback ``text`` (outermost first) and the exception's line."""
    frames, last = parse(text)
    return [f for f in frames if is_author_frame(f.path)], last


def render(text: str, style: str) -> tuple[str | None, str]:
    """(the innermost author frame's ``file:line (in func)``, or None; the traceback as ``--tb`` ``style`` shows it,
    '' for ``line`` and ``no``)."""
    frames, last = author_frames(text)
    if not frames:
        return None, ""
    where = f"{frames[-1].place} (in {frames[-1].func})"
    if style in ("no", "line"):
        return where, ""
    head = "traceback into your code (the harness's frames left out; --tb=short shortens it, --tb=no hides it):"
    if style == "short":
        body = [f"  {f.place}: in {f.func}" + (f"\n    {f.source}" if f.source else "") for f in frames]
    else:
        body = [f'  File "{f.path}", line {f.line}, in {f.func}' + (f"\n    {f.source}" if f.source else "")
                for f in frames]
    return where, "\n".join([head, *body, last])
