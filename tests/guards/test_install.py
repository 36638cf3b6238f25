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

HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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


def _link_torch(venv: str) -> bool:
    """torch as ``pip install torch`` leaves it in ``venv`` (its packages and dist-info), as hard links to this
    venv's files of the same pinned release: the docs' ``pip install torch`` then finds "your build" installed and
    adds only its small dependencies, instead of unpacking the 190 MB wheel (the slowest step of this test, and not
    this project's: the package's own install, extras and CLI are what the test proves).  False (nothing linked)
    where this venv holds another torch or hard links fail (another filesystem): pip installs torch as before."""
    from importlib.metadata import distribution

    torch = distribution("torch")
    if torch.version.split("+")[0] != TORCH.split("==")[1]:
        return False
    source = str(torch.locate_file(""))
    target = subprocess.run([os.path.join(venv, "bin", "python"), "-c",
                             "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                            check=True, capture_output=True, text=True).stdout.strip()
    tops = {name.split("/")[0] for name in (f.as_posix() for f in torch.files) if not name.startswith("..")}
    try:
        for top in sorted(tops):
            shutil.copytree(os.path.join(source, top), os.path.join(target, top), copy_function=os.link)
    except OSError:
        for top in tops:
            shutil.rmtree(os.path.join(target, top), ignore_errors=True)
        return False
    return True


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
    _link_torch(venv)
    for command in commands:  # torch first, then the package with its extras, torchtitan, the CLI's help
        # --no-compile: the same files, without byte-compiling torch's thousands of modules at install time
        done = _run(command.replace("pip install", "pip install -q --disable-pip-version-check --no-compile", 1),
                    venv, str(elsewhere))
        if command == commands[0]:
            installed = _run("pip list --format=freeze", venv, str(elsewhere)).stdout.lower()
            assert "torch==2.13.0" in installed and "sympy==" in installed, installed  # torch and its dependencies
    assert "usage: dcp-atomic" in done.stdout
    where = _run('python -c "import dcp_atomic, dcp_atomic.integrations, s3fs; print(dcp_atomic.__file__)"', venv,
                 str(elsewhere)).stdout
    assert where.strip().startswith(venv), f"imported from {where.strip()}, not the installed package"
    quick_start = next(b.body for b in blocks(os.path.join(HERE, "README.md")) if b.language == "python")
    (elsewhere / "quick_start.py").write_text(quick_start)
    _run("python quick_start.py", venv, str(elsewhere))
    listed = _run("dcp-atomic ls ckpt quickstart", venv, str(elsewhere)).stdout
    assert "20" in listed, listed  # the README's quick start keeps steps 10 and 20
