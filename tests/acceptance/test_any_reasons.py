"""Each remaining ``Any`` says why: the package's own types (``Case``, ``Builder``, ``Device``...) where the type is
known, and ``Any`` only where it must stay (a torch tensor or module imported lazily, a third-party object without
types, a pytest internal, a value of a duck-typed protocol), with its reason written next to it.

Read from the source with ``ast``: every use of the name ``Any`` (``Any``, ``typing.Any``, inside a subscript such
as ``dict[str, Any]``, in ``cast(Any, ...)``) is either

* on the right-hand side of a module-level alias (``Tensor: TypeAlias = Any  # why``, ``Raw = dict[str, Any]  # why``)
  whose lines, or the comment lines right above it, carry a ``#`` comment of a few words: the reason, written once,
  and the alias used in its place; or
* on a line that carries ``# Any: <reason>``, or right below comment lines that do.
"""

from __future__ import annotations

import ast
import fnmatch
import io
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path

import pytest_kvprofile

PACKAGE = Path(pytest_kvprofile.__file__).resolve().parent
MIN_WORDS = 3  # a reason is a few words, not a bare "#" or "# todo"
ANY_REASON = re.compile(r"#.*\bAny:\s*(?P<reason>.*)")

# Modules (fnmatch patterns, relative to the package) whose bare Anys are not fixed yet, each with why; an entry
# that matches no module with a bare Any fails (the list stays true).
PENDING: dict[str, str] = {}


@dataclass(frozen=True)
class Use:
    path: str
    line: int
    reason: str | None  # None: a bare Any

    def __str__(self) -> str:
        return f"{self.path}:{self.line}"


def _comments(source: str) -> tuple[dict[int, str], set[int]]:
    """The ``#`` comment on each line that has one, and the lines that hold nothing else."""
    out, alone = {}, set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string
            if not tok.line[:tok.start[1]].strip():
                alone.add(tok.start[0])
    return out, alone


def _words(comment: str) -> int:
    return len(re.findall(r"[A-Za-z][\w.'`-]*", comment))


def _is_any(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "Any") or (
        isinstance(node, ast.Attribute) and node.attr == "Any" and isinstance(node.value, ast.Name)
        and node.value.id == "typing")


def _string_annotation_anys(node: ast.AST) -> int:
    """``Any`` inside a string annotation (``x: "dict[str, Any]"``, ``cast("Any", v)``)."""
    if not (isinstance(node, ast.Constant) and isinstance(node.value, str) and re.search(r"\bAny\b", node.value)):
        return 0
    try:
        parsed = ast.parse(node.value, mode="eval")
    except SyntaxError:
        return 0  # prose, not an annotation
    return sum(1 for sub in ast.walk(parsed) if _is_any(sub))


def _annotation_strings(tree: ast.AST) -> list[ast.Constant]:
    """String constants in annotation positions (argument, return and variable annotations, ``cast``'s type)."""
    spots: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.annotation is not None:
            spots.append(node.annotation)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns is not None:
            spots.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            spots.append(node.annotation)
        elif isinstance(node, ast.Call) and node.args and (
                (isinstance(node.func, ast.Name) and node.func.id == "cast")
                or (isinstance(node.func, ast.Attribute) and node.func.attr == "cast")):
            spots.append(node.args[0])
    return [sub for spot in spots for sub in ast.walk(spot) if isinstance(sub, ast.Constant)]


def _alias_lines(tree: ast.Module, comments: dict[int, str], alone: set[int]) -> dict[int, str]:
    """Lines of module-level alias assignments (``X: TypeAlias = ...``, ``X = ...``) that carry a reason, mapped to
    it; also under a module-level ``if TYPE_CHECKING:``/``else:``. The reason is the comment on the assignment's
    lines, or the comment lines right above it."""
    out = {}
    body = list(tree.body)
    for node in tree.body:
        if isinstance(node, ast.If):
            body += node.body + node.orelse
    for node in body:
        if isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets):
            value = node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            value = node.value
        else:
            continue
        above = node.lineno
        while above - 1 in alone:
            above -= 1
        lines = range(above, (node.end_lineno or node.lineno) + 1)
        reason = " ".join(comments[n].lstrip("#").strip() for n in lines if n in comments)
        if _words(reason) >= MIN_WORDS:
            out.update({n: reason for n in range(value.lineno, (value.end_lineno or value.lineno) + 1)})
    return out


def any_uses(source: str, path: str = "<source>") -> list[Use]:
    """Every use of ``Any`` in ``source``, each with the reason it carries (None: bare)."""
    tree = ast.parse(source)
    comments, alone = _comments(source)
    aliases = _alias_lines(tree, comments, alone)
    uses = []

    def reason_at(line: int) -> str | None:
        above = [line]  # the line, then the comment lines right above it
        while above[-1] - 1 in alone:
            above.append(above[-1] - 1)
        for n in above:
            match = ANY_REASON.search(comments.get(n, ""))
            if match and _words(match["reason"]) >= MIN_WORDS:
                return match["reason"].strip()
        return aliases.get(line)

    for node in ast.walk(tree):
        if _is_any(node):
            uses.append(Use(path, node.lineno, reason_at(node.lineno)))
    for const in _annotation_strings(tree):
        uses += [Use(path, const.lineno, reason_at(const.lineno))] * _string_annotation_anys(const)
    return sorted(uses, key=lambda u: u.line)


def _package_uses() -> list[Use]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        out += any_uses(path.read_text(), str(path.relative_to(PACKAGE)))
    return out


def _pending(path: str, pending: dict[str, str]) -> bool:
    return any(fnmatch.fnmatchcase(path, pattern) for pattern in pending)


def verdict(uses: list[Use], pending: dict[str, str] | None = None) -> str | None:
    """None when every use of ``Any`` outside ``pending``'s modules says why; else what fails, with the counts."""
    pending = PENDING if pending is None else pending
    bare = [u for u in uses if u.reason is None and not _pending(u.path, pending)]
    reasoned = sum(u.reason is not None for u in uses)
    summary = (f"{len(uses)} uses of Any left: {reasoned} with a reason, {len(uses) - reasoned} bare "
               f"({len(bare)} outside PENDING)")
    if bare:
        return (f"{summary}. Use the real type (Case, Builder, Device, Allocation, object, ...) or say why it must "
                f"stay Any (an alias with a comment, or `# Any: <reason>` on the line):\n" + "\n".join(map(str, bare)))
    still = {u.path for u in uses if u.reason is None}
    done = {pattern for pattern in pending if not any(fnmatch.fnmatchcase(path, pattern) for path in still)}
    if done:
        return f"{summary}. PENDING lists modules with no bare Any left: {sorted(done)}"
    return None


def test_every_any_in_the_package_says_why():
    failure = verdict(_package_uses())
    assert failure is None, failure


def test_a_bare_any_fails_and_a_reasoned_one_passes():
    source = (
        "from __future__ import annotations\n"
        "import typing\n"
        "from typing import Any, TypeAlias, cast\n"
        "Tensor: TypeAlias = Any  # a torch.Tensor: torch is imported lazily\n"
        "Raw = dict[str, Any]  # parsed YAML, checked field by field\n"
        "Terse = Any  # why\n"
        "def f(x: Any, y: dict[str, Any]) -> list[Any]:\n"
        "    return cast(Any, x)\n"
        "def g(x: Any) -> typing.Any:  # Any: pytest's internal object, untyped\n"
        "    z: 'Any' = x\n"
        "    return z\n"
        "def h(t: Tensor, r: Raw) -> None:  # Any:\n"
        "    pass\n"
        "# a FlashInfer loader's argument, read by position\n"
        "Arg: TypeAlias = Any\n"
        "x = 1  # a comment after code is no reason for the next line\n"
        "Bare: TypeAlias = Any\n"
        "def k() -> None:\n"
        "    # Any: SimDevice's allocator, read where it has the method\n"
        "    allocator: Any = None\n"
        "    x = 1  # Any: a comment after code says nothing of the next line\n"
        "    y: Any = x\n"
    )
    uses = any_uses(source)
    assert [(u.line, u.reason is not None) for u in uses] == [
        (4, True), (5, True), (6, False), (7, False), (7, False), (7, False), (8, False), (9, True), (9, True),
        (10, False), (15, True), (17, False), (20, True), (22, False),
    ]
    assert "torch is imported lazily" in str(uses[0].reason)
    failure = verdict(uses, pending={})
    assert failure is not None
    assert failure.startswith("14 uses of Any left: 6 with a reason, 8 bare (8 outside PENDING)"), failure
    assert "<source>:6\n" in failure and failure.endswith("<source>:22")
    assert verdict([u for u in uses if u.reason], pending={}) is None
    assert verdict(uses, pending={"<sou*": "being written"}) is None  # every bare one is in a pending module
    stale = verdict([u for u in uses if u.reason], pending={"<sou*": "being written"})
    assert stale is not None and stale.endswith("PENDING lists modules with no bare Any left: ['<sou*']"), stale


def test_an_alias_inside_a_function_is_no_reason():
    """Only a module-level alias names a reason once; one inside a function needs its own ``# Any:``."""
    source = "from typing import Any\ndef f() -> None:\n    X = Any  # a torch tensor, imported lazily\n"
    assert [u.reason for u in any_uses(source)] == [None]
