"""Running a Markdown page's code blocks as written, so that neither the README nor a page of the site can rot.

The rules, for every page alike: python blocks run in order in one namespace per page, in a scratch directory (they
use relative roots such as ``ckpt``); each ``$ `` line of a console block runs there, when the page reaches it, with
this venv first on ``PATH``, must exit 0 and print every line shown under it; a python block that opens with
``# examples/NAME.py`` is that file, shown whole, so it must equal it (a console block below runs it); a bash block
names the scripts a fresh clone runs; text blocks are layouts, sample output and sketches.  A block that cannot run
here (another machine's endpoint, several nodes) carries ``<!-- not run: REASON -->`` on the line before it, and the
reason must be one the caller accepts.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LANGUAGES = {"python", "console", "bash", "text"}
_FENCE = re.compile(r"^(?:<!-- not run: (?P<reason>[^>]*?) -->\n)?```(?P<language>\w*)\n(?P<body>.*?)^```", re.M | re.S)
_EXAMPLE_FILE = re.compile(r"# (examples/\w+\.py)\b")


@dataclass(frozen=True)
class Block:
    language: str
    body: str
    not_run: str | None  # the reason given in ``<!-- not run: ... -->``, or None: the block runs


def blocks(path: str) -> list[Block]:
    """The page's fenced blocks at the start of a line (a fence indented into a list item is sample output)."""
    with open(path) as f:
        return [Block(m["language"], m["body"], m["reason"]) for m in _FENCE.finditer(f.read())]


def console_commands(block: Block) -> list[tuple[str, list[str]]]:
    """Each ``$ `` command of a console block, with the output lines shown under it."""
    commands: list[tuple[str, list[str]]] = []
    for line in block.body.splitlines():
        if line.startswith("$ "):
            commands.append((line[2:], []))
        elif line.strip() and commands:
            commands[-1][1].append(line.strip())
    return commands


def run_command(command: str, expected: list[str]) -> None:
    """Run one console command in the current directory (examples from the repository); it must exit 0 and print
    ``expected``."""
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
               PYTHONPATH=REPO)
    command = command.replace(" examples/", f" {os.path.join(REPO, 'examples')}/")
    done = subprocess.run(command, shell=True, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"$ {command}\nexit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    for line in expected:
        assert line in done.stdout, f"$ {command}\ndid not print {line!r}:\n{done.stdout[-2000:]}"


def shown_example(block: Block) -> str | None:
    """The repository path of the example file a python block shows whole, or None."""
    match = _EXAMPLE_FILE.match(block.body)
    return match.group(1) if match else None


def bash_scripts(block: Block) -> list[str]:
    """The ``bash scripts/...`` lines of a bash block: the commands a fresh clone runs (too long to run here; the
    scripts' own tests run them)."""
    return re.findall(r"^bash (scripts/\S+)", block.body, re.M)


def run_page(path: str, accepted_reasons: tuple[str, ...] = ()) -> dict:
    """Run every block of the page at ``path`` in order, in the current directory; returns the python namespace."""
    name = os.path.relpath(path, REPO)
    namespace: dict = {"__name__": "docs"}
    for number, block in enumerate(blocks(path)):
        where = f"{name} block {number} ({block.language})"
        assert block.language in LANGUAGES, f"{where}: a language the test does not know; use one of {LANGUAGES}"
        if block.not_run is not None:
            assert block.not_run in accepted_reasons, \
                f"{where}: 'not run: {block.not_run}' is not an accepted reason {accepted_reasons}: make it run"
            continue
        if block.language == "python":
            example = shown_example(block)
            if example:  # run by a console block below: the page must show exactly that file
                with open(os.path.join(REPO, example)) as f:
                    assert f.read() == block.body, f"{where} shows {example} other than it is; copy the file in"
                continue
            exec(compile(block.body, where, "exec"), namespace)  # noqa: S102
        elif block.language == "console":
            for command, expected in console_commands(block):
                run_command(command, expected)
        elif block.language == "bash":
            scripts = bash_scripts(block)
            assert scripts, f"{where}: a bash block names the scripts a fresh clone runs"
            for script in scripts:
                assert os.access(os.path.join(REPO, script), os.X_OK), f"{where}: {script} is not an executable script"
    return namespace
