"""``scripts/seed_venv.sh``: a second venv hard-linked from the first, less the distributions named, the first intact.

The vLLM 0.34 and no-engine venvs of the README's test command and ``.ci/run`` are made this way, so that the CI
machine's small disk holds them (a CI run once ran out of space installing the second venv)."""

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SEED = ROOT / "scripts" / "seed_venv.sh"
SITE = Path("lib") / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="a bash script")


def _fake_distribution(site: Path, name: str) -> Path:
    """An installed distribution as pip leaves it: the package, its dist-info and a RECORD listing both."""
    (site / name).mkdir()
    module = site / name / "__init__.py"
    module.write_text(f"NAME = {name!r}\n")
    info = site / f"{name}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "INSTALLER").write_text("pip\n")
    rows = [f"{name}/__init__.py,,", f"{info.name}/METADATA,,", f"{info.name}/INSTALLER,,", f"{info.name}/RECORD,,"]
    (info / "RECORD").write_text("\n".join(rows) + "\n")
    return module


def _seed(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SEED), *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with pip (the seed uninstalls through it) and two small distributions."""
    src = tmp_path_factory.mktemp("seed") / "src"
    venv.EnvBuilder(with_pip=True).create(src)
    _fake_distribution(src / SITE, "kept_pkg")
    _fake_distribution(src / SITE, "dropped_pkg")
    return src


def test_the_seed_links_what_it_keeps_drops_what_is_named_and_leaves_the_source_whole(source: Path, tmp_path: Path):
    dst = tmp_path / "dst"
    proc = _seed(str(source), str(dst), "dropped_pkg")
    assert proc.returncode == 0, proc.stderr
    assert "linked from" in proc.stdout
    kept = dst / SITE / "kept_pkg" / "__init__.py"
    assert os.stat(kept).st_ino == os.stat(source / SITE / "kept_pkg" / "__init__.py").st_ino  # a link, not a copy
    assert not (dst / SITE / "dropped_pkg").exists()
    assert not list((dst / SITE).glob("dropped_pkg-*.dist-info"))
    assert (source / SITE / "dropped_pkg" / "__init__.py").read_text() == "NAME = 'dropped_pkg'\n"
    run = subprocess.run([str(dst / "bin" / "python"), "-c", "import kept_pkg, importlib.util as u;"
                          " print(kept_pkg.NAME, u.find_spec('dropped_pkg'))"], capture_output=True, text=True)
    assert run.stdout.split() == ["kept_pkg", "None"], run.stderr


def test_a_file_written_again_in_the_seeded_venv_leaves_the_source_alone(source: Path, tmp_path: Path):
    """pip and Python replace a file (a new inode); they do not write into one. So the venvs stay apart."""
    dst = tmp_path / "dst"
    assert _seed(str(source), str(dst)).returncode == 0
    replaced = dst / SITE / "kept_pkg" / "__init__.py"
    fresh = replaced.with_suffix(".new")
    fresh.write_text("NAME = 'changed'\n")
    fresh.replace(replaced)
    assert (source / SITE / "kept_pkg" / "__init__.py").read_text() == "NAME = 'kept_pkg'\n"


@pytest.mark.parametrize("case", ["no source", "destination exists"])
def test_the_seed_makes_nothing_where_it_cannot_and_says_so_by_its_exit(source: Path, tmp_path: Path, case: str):
    dst = tmp_path / "dst"
    src = tmp_path / "missing" if case == "no source" else source
    if case == "destination exists":
        dst.mkdir()
        (dst / "mine").write_text("kept")
    proc = _seed(str(src), str(dst))
    assert proc.returncode == 1
    if case == "destination exists":
        assert (dst / "mine").read_text() == "kept"  # never overwritten
    else:
        assert not dst.exists()
