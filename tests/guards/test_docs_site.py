"""The documentation site builds strictly and every code block of every page runs as written.

The build is ``mkdocs build --strict`` (``mkdocs.yml``): a broken link, a page left out of the navigation or an API
reference that no longer resolves fails it, as it fails ``scripts/test.sh``.  Each page's blocks run on their own, in
a scratch directory of their own, by the rules of ``tests/helpers/markdown_blocks.py``.
"""

from __future__ import annotations

import glob
import importlib
import importlib.util
import os
import re
import subprocess
import sys

import pytest

import dcp_atomic
from tests.helpers.markdown_blocks import REPO, run_page

DOCS = os.path.join(REPO, "docs")
PAGES = sorted(os.path.relpath(path, DOCS) for path in glob.glob(os.path.join(DOCS, "**", "*.md"), recursive=True))
# Why a block may stay unrun: it needs what this machine cannot have.  Keep this short.
ACCEPTED_REASONS = ("needs an S3 endpoint",)


def build_site(config: str, site_dir: str) -> subprocess.CompletedProcess:
    assert importlib.util.find_spec("mkdocs") and importlib.util.find_spec("mkdocstrings"), (
        f"{sys.executable} has no mkdocs/mkdocstrings: install the test extra (pip install -e '.[test]')")
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", config,
                           "-d", site_dir], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))


def test_the_site_builds_strictly_works_offline_and_its_extra_brings_only_the_site(tmp_path):
    """Built strictly; no page asks a font CDN for anything (the site is served offline on clusters); serving it
    needs the ``docs`` extra alone: mkdocs and its plugins, nothing of the test extra."""
    import tomllib

    site = str(tmp_path / "site")
    done = build_site(os.path.join(REPO, "mkdocs.yml"), site)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert os.path.exists(tmp_path / "site" / "reference" / "index.html")
    for top, _, names in os.walk(site):
        for name in names:
            if name.endswith((".html", ".css")):
                with open(os.path.join(top, name), encoding="utf-8", errors="replace") as f:
                    assert "fonts.googleapis.com" not in f.read(), os.path.join(top, name)
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert sorted(r.split(">")[0].split("[")[0] for r in extras["docs"]) == ["mkdocs", "mkdocs-material",
                                                                          "mkdocstrings"], extras["docs"]


def test_a_broken_link_fails_the_build(tmp_path):
    """Strict means strict: the same site with one link to a page that does not exist is refused, naming it
    (``--quiet`` would hide the warning from strict mode: the build must not pass it)."""
    docs = tmp_path / "docs"
    subprocess.run(["cp", "-r", DOCS, str(docs)], check=True)
    with open(docs / "index.md", "a") as f:
        f.write("\nSee [a page that is not there](no-such-page.md).\n")
    with open(os.path.join(REPO, "mkdocs.yml")) as f:
        config = f.read().replace("docs_dir: docs", f"docs_dir: {docs}").replace("paths: [.]", f"paths: [{REPO}]")
        config = config.replace("- scripts/", f"- {REPO}/scripts/")  # the hooks
    (tmp_path / "mkdocs.yml").write_text(config)
    done = build_site(str(tmp_path / "mkdocs.yml"), str(tmp_path / "site"))
    assert done.returncode != 0 and "no-such-page.md" in done.stdout + done.stderr, done.stderr[-3000:]


def test_the_generated_reference_covers_every_public_name():
    with open(os.path.join(DOCS, "reference.md")) as f:
        shown = re.findall(r"^::: ([\w.]+)$", f.read(), re.M)
    public = {name for name in dcp_atomic.__all__ if name != "__version__"}
    by_name = {}
    for path in shown:
        module, _, name = path.rpartition(".")
        assert getattr(importlib.import_module(module), name) is getattr(dcp_atomic, name, None), \
            f"docs/reference.md: {path} is not dcp_atomic.{name}"
        by_name[name] = path
    assert set(by_name) == public, f"missing: {sorted(public - set(by_name))}; not public: {sorted(set(by_name) - public)}"


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("page", PAGES)
def test_every_code_block_of_the_page_runs_as_written(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_page(os.path.join(DOCS, page), ACCEPTED_REASONS)

