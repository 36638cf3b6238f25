"""The README is the short front door, and its code blocks run, so it cannot rot.

Its blocks follow the rules of every page (``tests/helpers/markdown_blocks.py``); the pages of the site run in
``tests/guards/test_docs_site.py``.
"""

from __future__ import annotations

import os

import pytest

from dcp_atomic import list_steps
from tests.helpers.markdown_blocks import REPO, bash_scripts, blocks, console_commands, run_page

pytestmark = pytest.mark.slow

README = os.path.join(REPO, "README.md")
FRONT_DOOR_LINES = 250  # what it is, the two commands, a quick start, the features, links: the rest is on the site


def test_the_readme_stays_a_front_door():
    with open(README) as f:
        lines = f.read().count("\n")
    assert lines <= FRONT_DOOR_LINES, f"README.md has {lines} lines (at most {FRONT_DOOR_LINES}): move detail to docs/"


def test_the_two_commands_are_what_a_fresh_clone_and_ci_run():
    (bash,) = [block for block in blocks(README) if block.language == "bash"]
    assert bash_scripts(bash) == ["scripts/demo.sh", "scripts/test.sh"]
    with open(os.path.join(REPO, ".ci", "run")) as f:
        assert "bash scripts/test.sh" in f.read()


@pytest.mark.timeout(300)
def test_python_and_console_blocks_run_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    found = blocks(README)
    assert any(block.language == "python" for block in found), "README.md has no quick start"
    commands = [command for block in found if block.language == "console" for command, _ in console_commands(block)]
    assert any(command.startswith("dcp-atomic") for command in commands), commands
    run_page(README)
    assert list_steps("ckpt", "quickstart") == [10, 20]  # what the console block's comment says ls shows
    restarted = run_page(README)  # the job restarts: it resumes after the latest committed step, verified
    assert restarted["start"] == 21 and list_steps("ckpt", "quickstart") == [10, 20]

