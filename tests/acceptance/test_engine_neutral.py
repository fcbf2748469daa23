"""One package per engine: ``matrix/``, ``attention/`` and ``sizing/`` name no engine, and each engine's package
states its own facts through the plugin's hook (issue 50, "One package per engine").

The engines are the packages under ``engines/`` (a third engine is one more folder, and this test then guards its
name too). Every token of the neutral packages is read, identifiers, strings and comments alike, and the C++ beside
them, so neither code nor prose names an engine.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest_kvprofile
from pytest_kvprofile.matrix.engine_facts import EngineFacts, registered_engines, route_policy
from pytest_kvprofile.registry import builtin_registry

PACKAGE = Path(pytest_kvprofile.__file__).resolve().parent
NEUTRAL = ("matrix", "attention", "sizing")
ENGINES = tuple(sorted(p.parent.name for p in (PACKAGE / "engines").glob("*/__init__.py")))


def _pattern(names: tuple[str, ...]) -> re.Pattern[str]:
    return re.compile("|".join(re.escape(n) for n in names), re.IGNORECASE)


def engine_mentions(text: str, names: tuple[str, ...], suffix: str = ".py") -> list[tuple[int, str, str]]:
    """``(line, kind, token)`` for every token of ``text`` that names one of ``names``: a Python file's names,
    strings and comments; any other file's lines."""
    pattern = _pattern(names)
    if suffix != ".py":
        return [(n, "text", line.strip()) for n, line in enumerate(text.splitlines(), 1) if pattern.search(line)]
    kinds = {tokenize.NAME: "identifier", tokenize.STRING: "string", tokenize.COMMENT: "comment"}
    return [(tok.start[0], kinds[tok.type], tok.string)
            for tok in tokenize.generate_tokens(io.StringIO(text).readline)
            if tok.type in kinds and pattern.search(tok.string)]


def test_the_engines_are_the_packages_under_engines():
    assert ENGINES == ("sglang", "vllm")


def test_the_scan_finds_an_engine_in_code_and_in_prose():
    """The scan can fail: an identifier, a string and a comment naming an engine are each found."""
    source = 'VLLM_BYTES = 1\nname = "sglang"\nx = 2  # as vLLM does\ny = 3\n'
    found = engine_mentions(source, ENGINES)
    assert [(line, kind) for line, kind, _ in found] == [(1, "identifier"), (2, "string"), (3, "comment")]
    assert engine_mentions("// SGLang plans so\nint x;\n", ENGINES, ".cpp") == [(1, "text", "// SGLang plans so")]


def test_matrix_attention_and_sizing_name_no_engine():
    found = []
    for package in NEUTRAL:
        for path in sorted((PACKAGE / package).rglob("*")):
            if path.is_file() and path.suffix in (".py", ".cpp", ".cu", ".cuh", ".h"):
                found += [f"{path.relative_to(PACKAGE.parent)}:{line}: {kind} {token!r}"
                          for line, kind, token in engine_mentions(path.read_text(), ENGINES, path.suffix)]
    assert not found, ("an engine's fact belongs in its package (engines/<name>/facts.py, registered through "
                       "pytest_kvprofile_register); found:\n" + "\n".join(found))


def test_each_engine_package_states_its_facts_through_the_hook():
    """Every engine folder registers an EngineFacts named as the folder, defined in its own facts.py."""
    registry = builtin_registry()
    assert tuple(sorted(registry.engines)) == ENGINES
    for name, facts in registry.engines.items():
        assert isinstance(facts, EngineFacts)
        assert (PACKAGE / "engines" / name / "facts.py").is_file()
        assert facts.kv_cache_dtypes, f"{name} spells no KV dtype"
        assert facts.float_workspaces, f"{name} names no default float workspace"
    assert {f.name for f in registered_engines()} >= set(ENGINES)
    stating = [f.name for f in registry.engines.values() if f.route_policy is not None]
    assert len(stating) == 1 and route_policy() is registry.engines[stating[0]].route_policy
