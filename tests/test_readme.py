"""The README's code blocks run, so the front page cannot rot.

Python blocks run in order in one namespace, in a scratch directory (they use relative roots such as
``ckpt``); console blocks then run each ``$ `` command there with this venv first on ``PATH`` and must exit 0;
the bash block names the two scripts a fresh clone runs (``tests/test_demo.py`` runs the demo, ``.ci/run``
the tests); text blocks are layouts and sample output, not code.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(HERE, "README.md")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def blocks() -> list[tuple[str, str]]:
    with open(README) as f:
        return FENCE.findall(f.read())


EXAMPLE_FILE = re.compile(r"# (examples/\w+\.py)\b")


def console_commands() -> list[tuple[str, list[str]]]:
    """Each ``$ `` command of the console blocks, with the output lines the README shows under it."""
    commands: list[tuple[str, list[str]]] = []
    for language, body in blocks():
        if language != "console":
            continue
        for line in body.splitlines():
            if line.startswith("$ "):
                commands.append((line[2:], []))
            elif line.strip() and commands:
                commands[-1][1].append(line.strip())
    return commands


# Examples whose command writes only under the directory it names: each runs as its own test (beside the rest of
# the README, which shares one scratch directory), so the suite's workers run them in parallel.
SELF_CONTAINED = ("examples/lightning_quickstart.py", "examples/two_tiers.py", "examples/accelerate_quickstart.py")


def _self_contained(command: str) -> bool:
    return command.startswith("torchrun") and any(f" {example} " in command for example in SELF_CONTAINED)


def _run_command(command: str, expected: list[str]) -> None:
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
               PYTHONPATH=HERE)
    command = command.replace(" examples/", f" {os.path.join(HERE, 'examples')}/")
    done = subprocess.run(command, shell=True, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"$ {command}\nexit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    for line in expected:  # the output the README promises
        assert line in done.stdout, f"$ {command}\ndid not print {line!r}:\n{done.stdout[-2000:]}"


def test_every_block_declares_a_language_the_test_knows():
    languages = [language for language, _ in blocks()]
    assert languages, "README has no code blocks"
    assert set(languages) <= {"python", "console", "bash", "text"}, languages


def test_the_two_commands_are_what_a_fresh_clone_and_ci_run():
    (bash,) = [body for language, body in blocks() if language == "bash"]
    scripts = re.findall(r"^bash (scripts/\S+)", bash, re.M)
    assert scripts == ["scripts/demo.sh", "scripts/test.sh"]
    for script in scripts:
        assert os.access(os.path.join(HERE, script), os.X_OK), script
    with open(os.path.join(HERE, ".ci", "run")) as f:
        assert "bash scripts/test.sh" in f.read()


@pytest.mark.timeout(600)
def test_python_and_console_blocks_run_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "readme"}
    python = [body for language, body in blocks() if language == "python"]
    assert len(python) >= 3
    for number, body in enumerate(python):
        shown = EXAMPLE_FILE.match(body)
        if shown:  # a whole example file, run by a console block below: the README shows exactly that file
            with open(os.path.join(HERE, shown.group(1))) as f:
                assert f.read() == body, f"README.md shows {shown.group(1)} other than it is; copy the file in"
            continue
        exec(compile(body, f"README.md python block {number}", "exec"), namespace)  # noqa: S102
    commands = [(c, expected) for c, expected in console_commands() if not _self_contained(c)]
    assert any(c.startswith("torchrun") for c, _ in commands) and any(c.startswith("dcp-atomic") for c, _ in commands)
    for command, expected in commands:
        _run_command(command, expected)
    assert os.path.exists("model.pt") and os.path.exists(os.path.join("hf-model", "model.safetensors.index.json"))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("example", SELF_CONTAINED)
def test_a_self_contained_example_prints_what_the_readme_shows(example, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    [(command, expected)] = [(c, e) for c, e in console_commands() if _self_contained(c) and f" {example} " in c]
    assert expected, f"the README shows no output for {example}"
    _run_command(command, expected)
