"""The docs site builds strictly (mkdocs.yml: a broken link or anchor, or a page missing from
the nav, is a warning, and --strict fails on it; ~2 s), benchmarks/results/ holds only
what the docs show, and the README stays short, its links resolving, each of the pages a
new reader looks for one click away."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from markdown.extensions.toc import slugify

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "results"
# The suite's table: copied into docs/performance.md between the RESULTS markers, not linked.
NOT_LINKED = {"results.md"}


def test_the_docs_build_strictly(tmp_path):
    site = tmp_path / "site"
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=120,
    )
    assert "No module named mkdocs" not in r.stderr, "the docs extra: pip install -e '.[docs]'"
    assert r.returncode == 0, r.stdout + r.stderr
    assert (site / "index.html").is_file() and (site / "results" / "ttft_cdf.png").is_file()


def test_every_result_file_is_shown_by_the_docs():
    """A run that replaces another replaces its files: none stays that no page shows."""
    assert (ROOT / "docs" / "results").resolve() == RESULTS.resolve()
    shown = set()
    for page in (ROOT / "docs").rglob("*.md"):
        shown |= set(re.findall(r"\(results/([^)\s]+)\)", page.read_text()))
    files = {p.name for p in RESULTS.iterdir()} - NOT_LINKED
    assert files - shown == set(), "result files no page shows"
    assert shown - files == set(), "pages show result files that do not exist"


def test_the_readme_is_short_and_its_links_resolve():
    text = README.read_text()
    assert text.count("\n") <= 200
    links = [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in t]
    for target in links:
        path, _, anchor = target.partition("#")
        assert (ROOT / path).exists(), target
        if anchor:
            headings = re.findall(r"^#+ (.+)$", (ROOT / path).read_text(), re.M)
            assert anchor in {slugify(h, "-") for h in headings}, target
    # issue 33's "at most two clicks": own model, API differences, adapter limits and
    # formats, securing inference, ray job submit, the benchmark figures
    for page in ("docs/getting-started.md#serve-your-own-model", "docs/serving/api.md",
                 "docs/serving/adapters.md", "docs/models.md", "docs/serving/tenants.md",
                 "docs/operations/deploy.md", "docs/performance.md"):  # fmt: skip
        assert page in links, page
