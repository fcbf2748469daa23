"""The docs list every shipped check and the public API, the README stays a ten-minute read that points at every doc,
and its two commands are the ones .ci/run uses."""

import re
from pathlib import Path

from pytest_kvprofile.checks.catalog import CHECKS

ROOT = Path(__file__).resolve().parents[2]


def test_the_checks_doc_lists_every_check_with_its_bug_classes():
    doc = (ROOT / "docs" / "checks.md").read_text()
    for check in CHECKS:
        row = next((ln for ln in doc.splitlines() if ln.startswith(f"| `{check.name}` |")), None)
        assert row is not None, f"docs/checks.md has no row for {check.name}"
        assert ", ".join(map(str, check.bugs)) in row, row


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = next(ln.strip() for ln in readme.splitlines() if 'pip install torch==2.13.0 -e ".[test]"' in ln)
    assert test_command in ci


def test_architecture_names_every_module():
    """docs/architecture.md visits every module of the package (a new module needs its paragraph)."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    package = ROOT / "pytest_kvprofile"
    missing = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package)
        if rel.name == "__init__.py" and rel.parent.name not in ("plugin",):
            continue
        inner = "/".join(rel.parts[1:])  # within its package's section: `vllm/flashinfer.py` under engines/
        if f"`{rel.name}`" not in doc and rel.as_posix() not in doc and not (inner and f"`{inner}`" in doc):
            missing.append(rel.as_posix())
    assert not missing, f"docs/architecture.md does not mention {missing}"


def test_the_gpu_table_in_docs_matches_the_catalog():
    from pytest_kvprofile.matrix.gpus import GPU_CATALOG

    doc = (ROOT / "docs" / "contract.md").read_text()
    for gpu in GPU_CATALOG.values():
        cc = ".".join(map(str, gpu.compute_capability))
        row = next((ln for ln in doc.splitlines()
                    if ln.startswith(f"| {gpu.name} ") or ln.startswith(f"| {gpu.name} (")), None)
        assert row is not None, gpu.name
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1] == str(gpu.num_sm) and cells[2] == f"{gpu.memory_bytes // 10**9} GB" and cells[4] == cc, row


def test_the_reference_lists_the_public_api():
    import pytest_kvprofile

    doc = (ROOT / "docs" / "reference.md").read_text()
    table = doc[doc.index("## Public API"):]
    missing = [name for name in pytest_kvprofile.__all__ if name != "__version__" and f"`{name}`" not in table]
    assert not missing, f"docs/reference.md's public API table lacks {missing}"


def test_the_readme_is_a_ten_minute_read_that_points_at_every_doc():
    """What the suite proves, the two commands, pointing it at your builders, the verdict: the reference lives in
    docs/, each page named in the README's map, and every page the README names exists."""
    readme = (ROOT / "README.md").read_text()
    words = len(readme.split())
    assert words <= 2200, f"README has {words} words: about {words // 220} minutes; move reference material to docs/"
    named = set(re.findall(r"`(docs/[a-z0-9-]+\.md)`", readme))
    pages = {p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")}
    assert named <= pages, f"the README names missing pages {sorted(named - pages)}"
    assert pages <= named, f"the README's map lacks {sorted(pages - named)}"


def test_the_reference_lists_every_option_with_its_ini_twin():
    """docs/reference.md's option table has a row for every --kvprofile-* option the plugin adds, and every ini key."""
    import importlib.util
    import re

    from pytest_kvprofile.plugin import pytest_addoption

    spec = importlib.util.spec_from_file_location("generate_catalogs", ROOT / "scripts" / "generate_catalogs.py")
    assert spec is not None and spec.loader is not None
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    parser = generator._Options()  # the recorder the option table is generated with
    pytest_addoption(parser)
    options, inis = sorted(name for name, _metavar, _help in parser.options), sorted(parser.inis)
    doc = (ROOT / "docs" / "reference.md").read_text()
    rows = [line for line in doc.splitlines() if line.startswith("| `--kvprofile")]
    missing = [o for o in options if not any(re.match(rf"\| `{re.escape(o)}[ `]", r) for r in rows)]
    assert not missing, f"docs/reference.md's option table lacks {missing}"
    assert options and not [k for k in inis if f"`{k}`" not in doc], "an ini key is missing from docs/reference.md"
