"""``--kvprofile-html PATH`` (issue 52): one self-contained page, opened offline in real headless Chromium.

The browser test needs Debian's ``chromium`` (``scripts/install_chromium.sh``); without /usr/bin/chromium it skips
saying so, and a skip is never a pass.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
BACKENDS = ("--kvprofile-backend", "stub-flashinfer", "--kvprofile-backend", "mutant-01-lazy-workspace")


def _page(pytester: pytest.Pytester, suite_args: list[str], *extra: str) -> tuple[pytest.RunResult, Path]:
    out = pytester.path / "report" / "verdict.html"
    result = pytester.runpytest(*suite_args, *BACKENDS, "-q", "--kvprofile-html", str(out), *extra)
    return result, out


def test_the_page_holds_the_verdict_per_backend_per_case_figures_and_an_inline_plot(pytester, suite_args):
    result, out = _page(pytester, suite_args)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines([f"HTML page written to {out}"])
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page and page.count("<circle") == 6
    assert re.search(r"mutant-01-lazy-workspace</td><td class=\"no\">may NOT opt in</td><td>"
                     r"persistent_memory_visible_at_closing fails on 3 cases", page)
    assert 'stub-flashinfer</td><td class="ok">may opt in</td>' in page
    # per case: the failed check, the KV tokens lost (228: the failure's 32 MiB over the case's KV bytes per token)
    assert re.search(r"qwen3-8b-tp1-dcp1-mtp0-l40s-gmu0.98</td><td class=\"num\">\d+</td><td class=\"no\">"
                     r"persistent_memory_visible_at_closing</td><td class=\"num\">228</td>", page), page
    assert "MiB</td>" in page  # workspace declared and needed
    # nothing fetched: no script, no link, no external source (the SVG namespace is a name, not a fetch)
    assert "<script" not in page and "<link" not in page and " src=" not in page
    assert set(re.findall(r"https?://[^\s\"']+", page)) == {"http://www.w3.org/2000/svg"}


def test_the_ini_twin_writes_it_against_the_ini_files_directory(pytester, suite_args):
    pytester.makeini("[pytest]\nkvprofile_html = pages/v.html\n")
    result = pytester.runpytest(*suite_args, *BACKENDS, "-q")
    assert result.ret == pytest.ExitCode.TESTS_FAILED and (pytester.path / "pages" / "v.html").is_file()


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium: run scripts/install_chromium.sh")
def test_the_page_opens_in_headless_chromium_and_shows_the_verdict(pytester, suite_args, tmp_path):
    from PIL import Image, ImageStat

    _, out = _page(pytester, suite_args)
    shot = tmp_path / "page.png"
    profile = tmp_path / "profile"
    subprocess.run([str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={profile}", f"--screenshot={shot}", "--window-size=1200,900",
                    out.as_uri()], check=True, capture_output=True, timeout=120)
    shutil.rmtree(profile, ignore_errors=True)
    image = Image.open(shot).convert("RGB")
    assert image.size == (1200, 900)
    assert max(ImageStat.Stat(image).var) > 100  # not blank
    colors = {c for _, c in image.getcolors(maxcolors=1 << 20) or []}
    assert (0xdd, 0xff, 0xdd) in colors and (0xff, 0xdd, 0xdd) in colors  # the verdict's cells: opt in, and NOT
