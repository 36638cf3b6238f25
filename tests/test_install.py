"""A newcomer's install, exactly as "Install into your own environment" (docs/getting-started.md) shows it: into a
fresh venv, from this clone (a built wheel, not the editable checkout), then the command line and the README's quick
start run from a directory outside the clone, so a module or file missing from the package fails here."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.helpers.markdown_blocks import blocks

pytestmark = pytest.mark.slow

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCH = "torch==2.13.0"  # "your build": the one this machine holds (a bare `torch` would download a CUDA build)


def _clean_copy(destination) -> str:
    """The clone as a user's is: its tracked and unignored files only (an in-tree build leaves ``build/`` behind,
    whose stale modules would go into the wheel and hide a package the build leaves out)."""
    listed = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=HERE, check=True,
                            capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        if os.path.isfile(os.path.join(HERE, name)):
            os.makedirs(os.path.dirname(os.path.join(destination, name)) or destination, exist_ok=True)
            shutil.copy2(os.path.join(HERE, name), os.path.join(destination, name))
    return str(destination)


def _install_commands(clone: str) -> list[str]:
    [block] = [b.body for b in blocks(os.path.join(HERE, "docs", "getting-started.md"))
               if b.language == "text" and b.body.startswith("pip install torch")]
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]
    return [TORCH.join(c.rsplit("torch", 1)) if c == "pip install torch" else c.replace("/path/to/dcp_atomic", clone)
            for c in commands]


def _run(command: str, venv: str, cwd: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=os.path.join(venv, "bin") + os.pathsep + os.environ["PATH"], VIRTUAL_ENV=venv)
    env.pop("PYTHONPATH", None)
    done = subprocess.run(command, shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"$ {command}\nexit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.mark.timeout(1200)
def test_the_readme_install_into_a_fresh_venv_gives_a_working_cli_and_quick_start(tmp_path):
    commands = _install_commands(_clean_copy(tmp_path / "clone"))
    assert commands[0] == f"pip install {TORCH}" and commands[-1] == "dcp-atomic --help", commands
    venv, elsewhere = str(tmp_path / "venv"), tmp_path / "project"
    elsewhere.mkdir()
    subprocess.run([sys.executable, "-m", "venv", venv], check=True, timeout=120)
    for command in commands:  # torch first, then the package with its extras, torchtitan, the CLI's help
        # --no-compile: the same files, without byte-compiling torch's thousands of modules at install time
        done = _run(command.replace("pip install", "pip install -q --disable-pip-version-check --no-compile", 1),
                    venv, str(elsewhere))
    assert "usage: dcp-atomic" in done.stdout
    where = _run('python -c "import dcp_atomic, dcp_atomic.integrations, s3fs; print(dcp_atomic.__file__)"', venv,
                 str(elsewhere)).stdout
    assert where.strip().startswith(venv), f"imported from {where.strip()}, not the installed package"
    quick_start = next(b.body for b in blocks(os.path.join(HERE, "README.md")) if b.language == "python")
    (elsewhere / "quick_start.py").write_text(quick_start)
    _run("python quick_start.py", venv, str(elsewhere))
    listed = _run("dcp-atomic ls ckpt quickstart", venv, str(elsewhere)).stdout
    assert "20" in listed, listed  # the README's quick start keeps steps 10 and 20
