"""The package's shape: no import cycle, dependencies in the documented order, heavy imports lazy and listed,
one definition per concept, units in one module.

Read from the source with ``ast``, so a cycle hidden behind import order (one that only works
because some module happens to be imported first) is found too. The module-level cycle check reads
top-level imports (what runs at import); the layering reads every import, inside functions and under
``TYPE_CHECKING`` too, because a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest_kvprofile

PACKAGE = Path(pytest_kvprofile.__file__).resolve().parent
UNIT_NAMES = {"KiB", "MiB", "GiB", "GB", "MIB", "GIB", "KIB"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _target(name: str, attr: str | None) -> str | None:
    if attr and f"{name}.{attr}" in MODULES:
        return f"{name}.{attr}"
    return name if name in MODULES else None


def _top_level_imports(path: Path) -> set[str]:
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            out.update(t for a in node.names if (t := _target(a.name, None)))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                if t := _target(node.module, alias.name):
                    out.add(t)
    return out


def _graph() -> dict[str, set[str]]:
    graph = {}
    for name, path in MODULES.items():
        deps = _top_level_imports(path)
        parts = name.split(".")
        # importing a.b.c runs a/__init__ and a/b/__init__ first
        deps |= {".".join(parts[:i]) for i in range(1, len(parts))}
        graph[name] = {d for d in deps if d != name and not name.startswith(d + ".")}
    return graph


# The dependency order of docs/architecture.md, lowest first: a package imports only itself and packages of lower
# layers, packages of one layer never import each other. ``pytest_kvprofile`` is the package's own ``__init__``
# (the public API, re-exporting from below); ``units``, ``registry`` and ``cli`` are the top-level modules.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("units",),
    ("matrix",),
    ("attention",),  # FlashInfer's home: its facts, planner, host build, host modules, reference, every call into it
    ("contract", "sizing"),  # the contract a backend implements; the sizing model (FlashInfer's planners)
    ("memory",),  # the device model, torch mode, simulated_gpu (serving FlashInfer's loaders from sizing's host plans)
    ("lifecycle",),  # the reference engine (and the resources a matrix names)
    ("checks",),
    ("builtin", "engines", "gpu", "report"),  # backends and devices plugged in through contract and memory; reports
    ("registry",),  # finding backends (the built-in catalogs included)
    ("cli",),  # the command line (its `list` reads the registry)
    ("plugin",),
    ("suite", "gpu_suite"),  # the packaged test modules
    ("pytest_kvprofile",),
)
LAYER_OF = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}

HEAVY = ("torch", "flashinfer", "vllm", "sglang", "pynvml", "numpy", "matplotlib")

# Every module that imports a heavy third-party module inside a function, and why it may. A module not listed
# here that does fails; so does an entry whose module no longer does (the list stays true).
LAZY_HEAVY: dict[str, str] = {
    "pytest_kvprofile.builtin.flashinfer_real": "the `flashinfer` backend's builders make FlashInfer wrappers on "
                                                "torch tensors when built; the catalog lists it without either",
    "pytest_kvprofile.builtin.mutants": "torch-mode mutants allocate with torch when built, not when listed",
    "pytest_kvprofile.builtin.mutants_field": "field mutants allocate with torch when built, not when listed",
    "pytest_kvprofile.builtin.mutants_workspaces": "torch-mode mutants allocate with torch when built, not when listed",
    "pytest_kvprofile.builtin.process_state": "its builders keep torch tensors per process, made when built",
    "pytest_kvprofile.builtin.stubs": "torch-mode stubs allocate with torch when built, not when listed",
    "pytest_kvprofile.contract.workspace": "an arena is a torch tensor only on a device in torch mode",
    "pytest_kvprofile.engines.vllm.config": "vLLM is imported by make_builders only, never at plugin import",
    "pytest_kvprofile.engines.vllm.selector": "vLLM's backend classes are asked by refuses_layout only",
    "pytest_kvprofile.engines.vllm.release": "the installed vLLM's config fields, asked by a worker's run only",
    "pytest_kvprofile.engines.vllm.flashinfer": "vLLM is imported by make_builders only, never at plugin import",
    "pytest_kvprofile.engines.vllm.pull_request": "vLLM's builder class is subclassed when a backend first makes "
                                                  "builders; torch inside its methods",
    "pytest_kvprofile.engines.vllm.memory": "vLLM's memory_profiling runs around the window of a vLLM backend only",
    "pytest_kvprofile.engines.sglang.budget": "SGLang's get_available_gpu_memory runs at the snapshots of an SGLang "
                                              "post-capture backend only",
    "pytest_kvprofile.engines.vllm.standins": "the CPU stand-ins patch vLLM and torch only for a vLLM backend's run",
    "pytest_kvprofile.engines.vllm.gdn": "vLLM's GDN builder is imported by the hybrid backend's make_builders only",
    "pytest_kvprofile.engines.vllm.workspace": "vLLM's WorkspaceManager only under --kvprofile-workspace-manager vllm",
    "pytest_kvprofile.engines.sglang.flashinfer": "SGLang is imported by make_builders and refuses_layout only, never "
                                                  "at plugin import",
    "pytest_kvprofile.engines.sglang.case_config": "SGLang's ServerArgs and ModelConfig, made in a case's run or "
                                                   "refusal only",
    "pytest_kvprofile.engines.sglang.runner": "SGLang's pools and kernels, made when an SGLang adapter runs only",
    "pytest_kvprofile.engines.sglang.memory": "SGLang's default mem_fraction_static, resolved by SGLang when a row "
                                              "is made (scripts/sglang_table.py), never at plugin import",
    "pytest_kvprofile.engines.sglang.post_capture": "SGLang's post_capture_kv_sizing_planned answers the engine's "
                                                    "gate when a case is run, never at plugin import",
    "pytest_kvprofile.engines.sglang.trtllm_mha": "SGLang's trtllm_mha backend module is patched and its class made "
                                                  "when a case is run, never at plugin import",
    "pytest_kvprofile.engines.sglang.trtllm_mla": "SGLang's trtllm_mla backend module is patched and its class made "
                                                  "when a case is run, never at plugin import",
    "pytest_kvprofile.engines.sglang.standins": "the CPU stand-ins patch SGLang and torch only for an SGLang backend's "
                                                "run",
    "pytest_kvprofile.gpu.cuda_device": "the GPU tier only: the CPU tier and plugin import never load CUDA",
    "pytest_kvprofile.gpu.nvml": "counts GPUs through NVML only when asked (--kvprofile-gpu, pinning)",
    "pytest_kvprofile.attention.reference": "the GPU tier's float32 reference, run on CUDA only",
    "pytest_kvprofile.gpu.sizing_probe": "plans on a real GPU, GPU tier only",
    "pytest_kvprofile.gpu.topology": "describes real devices (NVML, torch.cuda), GPU tier only",
    "pytest_kvprofile.attention.wrappers": "every call into FlashInfer on a real GPU, GPU tier only",
    "pytest_kvprofile.gpu_suite.test_gpu_tier": "the GPU tier's test module, collected only with --kvprofile-gpu",
    "pytest_kvprofile.memory.simulated_gpu": "torch.version and FlashInfer are patched on entering simulated_gpu only",
    "pytest_kvprofile.memory.torch_mode": "torch mode is torch; loaded only by what enters it",
    "pytest_kvprofile.attention.host_plan": "host modules run on simulated tensors; the sizing model needs neither",
    "pytest_kvprofile.attention.host_cutlass": "numpy schedules the simulated plan, inside simulated_gpu only",
    "pytest_kvprofile.attention.host_packbits": "numpy packs the simulated tensors' bits, inside simulated_gpu only",
    "pytest_kvprofile.sizing.plot": "the sizing figure only (matplotlib is optional)",
}

# Modules that import a heavy module at import time: they are themselves only ever imported lazily
# (tests/acceptance/test_lazy_imports.py checks the plugin loads none of them).
EAGER_HEAVY: dict[str, str] = {
    "pytest_kvprofile.memory.torch_mode": "serves torch \"cuda\" calls: it subclasses torch's TorchFunctionMode",
    "pytest_kvprofile.memory.torch_dispatch": "torch mode's TorchFunctionMode; imported by torch_mode only",
    "pytest_kvprofile.memory.cuda_standins": "torch mode's torch.cuda stand-ins; imported by torch_mode only",
}


def _package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


_STRING_IMPORTERS = {"import_module", "__import__"}


def _string_import(node: ast.AST, constants: dict[str, str]) -> str | None:
    """The module an ``importlib.import_module(...)`` or ``__import__(...)`` call names, as a string literal or a
    module-level string constant; None for any other node (or a name computed at run time)."""
    if not isinstance(node, ast.Call) or not node.args:
        return None
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if called not in _STRING_IMPORTERS:
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    return constants.get(arg.id) if isinstance(arg, ast.Name) else None


def _module_constants(tree: ast.Module) -> dict[str, str]:
    return {t.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
            for t in node.targets if isinstance(t, ast.Name)}


def _all_imports(path: Path) -> list[tuple[str, int, bool]]:
    """Every import of the module, anywhere in it: ``(imported module, line, at module level)``; a
    ``from a import b`` names ``a.b`` when that is a module; ``importlib.import_module("a.b")`` (or a module-level
    constant naming it) counts as an import of ``a.b``. Imports under ``if TYPE_CHECKING:`` count."""
    tree = ast.parse(path.read_text())
    in_function = {id(sub) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for sub in ast.walk(fn)}
    constants = _module_constants(tree)
    out = []
    for node in ast.walk(tree):
        at_top = id(node) not in in_function
        named = _string_import(node, constants)
        if named is not None:
            out.append((named, node.lineno, at_top))
        elif isinstance(node, ast.Import):
            out += [(a.name, node.lineno, at_top) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}:{node.lineno}: relative import (write the absolute one)"
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                out.append((name if name in MODULES else node.module, node.lineno, at_top))
    return out


def _type_checking_lines(path: Path) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                lines.update(range(sub.lineno, (sub.end_lineno or sub.lineno) + 1))
    return lines


def test_every_package_is_placed_in_the_documented_order():
    placed = {_package_of(name) for name in MODULES}
    assert placed <= set(LAYER_OF), f"place {sorted(placed - set(LAYER_OF))} in LAYERS and docs/architecture.md"
    assert set(LAYER_OF) <= placed, f"LAYERS names packages that no longer exist: {sorted(set(LAYER_OF) - placed)}"


def test_dependencies_follow_the_documented_order():
    """Every import between packages, at module level or inside a function, points down the layers."""
    wrong = []
    for name, path in MODULES.items():
        src = _package_of(name)
        for target, line, _ in _all_imports(path):
            if target != "pytest_kvprofile" and not target.startswith("pytest_kvprofile."):
                continue
            dst = _package_of(target)
            if dst != src and LAYER_OF[dst] >= LAYER_OF[src]:
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {src} imports {target} ({dst} is not "
                             f"below {src} in docs/architecture.md's order)")
    assert not wrong, "\n".join(wrong)


def test_heavy_imports_are_lazy_and_listed_with_a_reason():
    lazy: dict[str, set[str]] = defaultdict(set)
    eager: dict[str, set[str]] = defaultdict(set)
    for name, path in MODULES.items():
        typing_only = _type_checking_lines(path)
        for target, line, at_top in _all_imports(path):
            root = target.split(".")[0]
            if root in HEAVY and line not in typing_only:
                (eager if at_top else lazy)[name].add(f"{root} (line {line})")
    unlisted = {m: sorted(v) for m, v in lazy.items() if m not in LAZY_HEAVY}
    assert not unlisted, f"lazy heavy imports in modules not in LAZY_HEAVY (add each with its reason): {unlisted}"
    assert not set(LAZY_HEAVY) - set(lazy), f"LAZY_HEAVY lists modules that no longer import one lazily: " \
                                           f"{sorted(set(LAZY_HEAVY) - set(lazy))}"
    unlisted = {m: sorted(v) for m, v in eager.items() if m not in EAGER_HEAVY}
    assert not unlisted, f"heavy imports at module level (make them lazy, or list them in EAGER_HEAVY): {unlisted}"
    assert not set(EAGER_HEAVY) - set(eager), sorted(set(EAGER_HEAVY) - set(eager))
    assert all(reason.strip() for reason in (*LAZY_HEAVY.values(), *EAGER_HEAVY.values()))


def test_string_imports_are_counted():
    """``importlib.import_module`` with a literal or a module-level constant is an import like any other."""
    found = {(t, top) for t, _, top in _all_imports(PACKAGE / "engines" / "vllm" / "workspace.py")}
    assert ("vllm.v1.worker.workspace", False) in found
    tree = ast.parse("import importlib\nM = 'torch.cuda'\ndef f():\n    importlib.import_module(M)\n"
                     "__import__('flashinfer')\n")
    assert {_string_import(n, _module_constants(tree)) for n in ast.walk(tree)} - {None} == {"torch.cuda",
                                                                                         "flashinfer"}


def test_module_level_imports_form_no_cycle():
    graph, state, stack = _graph(), {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                cycle = stack[stack.index(dep):] + [dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name)


def test_importing_the_package_alone_works_in_a_fresh_interpreter():
    for name in ("pytest_kvprofile", "pytest_kvprofile.plugin", "pytest_kvprofile.sizing", "pytest_kvprofile.cli"):
        subprocess.run([sys.executable, "-c", f"import {name}"], check=True, capture_output=True)


def test_every_public_class_is_defined_once():
    where = defaultdict(list)
    for name, path in MODULES.items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                where[node.name].append(name)
    twice = {cls: mods for cls, mods in where.items() if len(mods) > 1}
    assert not twice, f"one concept, two definitions: {twice}"


def test_units_are_defined_only_in_units():
    for name, path in MODULES.items():
        if name == "pytest_kvprofile.units":
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign):
                names = {t.id for t in node.targets if isinstance(t, ast.Name)}
                assert not names & UNIT_NAMES, f"{name} defines {names & UNIT_NAMES}: import them from units"


def test_docstrings_point_inside_the_repository():
    """Design notes the code relies on live in docs/; no reference to files outside the repo."""
    root = PACKAGE.parent
    for name, path in MODULES.items():
        text = path.read_text()
        assert "DESIGN.md" not in text, name
        for ref in {w.strip("`'\"(),.:;") for w in text.split() if w.strip("`'\"(),.:;").startswith("docs/")}:
            assert (root / ref).exists(), f"{name} points to {ref}, which does not exist"


def test_the_tests_mirror_the_packages():
    """``tests/<package>/`` per package, ``tests/acceptance/`` for end-to-end runs (architecture.md, "The tests")."""
    tests = PACKAGE.parent / "tests"
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    packages |= {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    dirs = {d.name for d in tests.iterdir() if d.is_dir() and d.name != "__pycache__"}
    assert dirs - packages <= {"acceptance"}, f"test directories that mirror no package: {sorted(dirs - packages)}"
    loose = sorted(p.name for p in tests.glob("test_*.py"))
    assert not loose, f"tests outside a package's directory: {loose}"


MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 60
# a function over MAX_FUNCTION_LINES says why in its docstring: "Long because ..."
LONG_REASON = re.compile(r"\bLong because\b")


def long_modules(modules: dict[str, Path]) -> list[str]:
    """The modules over ``MAX_MODULE_LINES`` lines, with their length."""
    return [f"{name}: {n} lines" for name, path in sorted(modules.items())
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES]


def long_functions_without_a_reason(modules: dict[str, Path]) -> list[str]:
    """The functions over ``MAX_FUNCTION_LINES`` lines whose docstring does not say why ("Long because ...")."""
    found = []
    for name, path in sorted(modules.items()):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES and not LONG_REASON.search(ast.get_docstring(node) or ""):
                    found.append(f"{name}.{node.name} (line {node.lineno}): {length} lines")
    return found


def test_no_module_is_over_600_lines():
    assert not long_modules(MODULES), "split these by what they hold (docs/architecture.md)"


def test_a_function_over_60_lines_says_why():
    assert not long_functions_without_a_reason(MODULES), 'shorten these, or say why in the docstring: "Long because"'


def test_the_size_rules_fail_on_a_long_module_and_an_unexplained_function(tmp_path: Path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    unexplained = tmp_path / "unexplained.py"
    unexplained.write_text(f'def f():\n    """Does much."""\n{body}\n')
    explained = tmp_path / "explained.py"
    explained.write_text(f'def f():\n    """Does much. Long because it is one table."""\n{body}\n')
    padded = tmp_path / "padded.py"
    padded.write_text("\n" * MAX_MODULE_LINES + "x = 1\n")
    assert long_functions_without_a_reason({"unexplained": unexplained}) == ["unexplained.f (line 1): 62 lines"]
    assert long_functions_without_a_reason({"explained": explained}) == []
    assert long_modules({"padded": padded}) == [f"padded: {MAX_MODULE_LINES + 1} lines"]
    assert long_modules({"explained": explained}) == []


# module names that more than one package uses, each the same idea in parallel packages: what each copy is
SHARED_NAMES: dict[str, str] = {
    "budget": "the KV budget: its terms (contract), its arithmetic (memory), its checks, SGLang's own",
    "device": "the device: the protocol a builder sees (contract), the simulated GPU (memory)",
    "facts": "fixed sizes: FlashInfer's (attention; sizing re-exports them), each engine's own",
    "flashinfer": "each engine's FlashInfer backends",
    "memory": "each engine's memory arithmetic",
    "resources": "non-builder resources: the protocol, the built-in one, what a matrix names, their check",
    "standins": "what each engine lacks on a CPU-only machine",
    "support": "the support declaration and its checks",
    "trtllm": "trtllm-gen: the launcher's carve (attention), a case's routes (sizing), its check",
    "workspace": "the shared arena: the reference manager (contract), vLLM's, the sizing check",
}


def shared_module_names(modules: dict[str, Path]) -> dict[str, list[str]]:
    """Module file names (``__init__`` aside) that more than one package uses, with the packages."""
    by_name: dict[str, list[str]] = defaultdict(list)
    for name in modules:
        parts = name.split(".")
        if len(parts) > 2 and parts[-1] != "__init__":
            by_name[parts[-1]].append(".".join(parts[:-1]))
    return {n: sorted(p) for n, p in by_name.items() if len(p) > 1}


def test_no_two_modules_share_a_name_unless_the_same_idea():
    shared = shared_module_names(MODULES)
    unexplained = {n: p for n, p in shared.items() if n not in SHARED_NAMES}
    assert not unexplained, f"rename these, or say in SHARED_NAMES what idea they share: {unexplained}"
    gone = sorted(set(SHARED_NAMES) - set(shared))
    assert not gone, f"SHARED_NAMES lists names no longer shared; delete them: {gone}"


def test_a_new_shared_name_is_caught(tmp_path: Path):
    planted = {"pytest_kvprofile.lifecycle.engine": tmp_path / "a.py",
               "pytest_kvprofile.report.engine": tmp_path / "b.py"}
    assert shared_module_names(planted) == {"engine": ["pytest_kvprofile.lifecycle", "pytest_kvprofile.report"]}
