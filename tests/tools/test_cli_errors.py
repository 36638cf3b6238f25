"""The CLI never shows a traceback: a missing extra, missing credentials, a reader that closes the pipe.

Each case runs the real console script in a subprocess, the way an operator meets it, and checks what they see:
one line on stderr, a valid JSON object on stdout with ``--json``, a non-zero exit status.  A missing extra is
made real by a ``sys.meta_path`` finder that refuses the SDK's import before the CLI starts (the SDKs are
installed here).  Also: ``ls ROOT`` lists runs only, and every ``--json`` object carries its schema version.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_atomic import AtomicStorageWriter
from dcp_atomic.tools.cli import JSON_SCHEMA, main

HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLI = os.path.join(os.path.dirname(sys.executable), "dcp-atomic")
RUN = "exp"

_WITHOUT = """
import sys

class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)

sys.meta_path.insert(0, Refuse())
from dcp_atomic.tools.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _run(argv: list[str], *, blocked: set[str] = frozenset(), env: dict | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", _WITHOUT.format(blocked=set(blocked)), *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=120,
                          env={**(env if env is not None else os.environ), "PYTHONPATH": HERE})


def _assert_one_line(done: subprocess.CompletedProcess, *needles: str) -> str:
    assert done.returncode != 0, done
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dcp-atomic: "), done.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _assert_json_error(done: subprocess.CompletedProcess, kind: str, *needles: str) -> dict:
    assert done.returncode != 0, done
    assert "Traceback" not in done.stderr, done.stderr
    reply = json.loads(done.stdout)  # the whole of stdout is one JSON object
    assert reply["schema"] == JSON_SCHEMA and reply["error"]["type"] == kind, reply
    for needle in needles:
        assert needle in reply["error"]["message"], reply
    return reply


@pytest.mark.parametrize("root, sdk, extra", [("gs://some-bucket/ckpt", "gcsfs", "gcs"),
                                              ("s3://some-bucket/ckpt", "s3fs", "s3")])
def test_a_root_whose_sdk_is_not_installed_is_one_line_naming_the_extra(root, sdk, extra):
    fix = f"pip install -e '.[{extra}]' in a clone"  # dcp-atomic is not on PyPI: advice that works without it
    done = _run(["ls", root], blocked={sdk})
    assert done.returncode == 3, done  # a missing extra exits 3, whichever command needs it
    _assert_one_line(done, "MissingDependency", root, fix, f"pip install '{sdk}")
    _assert_json_error(_run(["--json", "show", root, RUN], blocked={sdk}), "MissingDependency", root, fix)


def test_an_s3_root_without_credentials_is_one_line_saying_where_to_put_them(s3_moto):
    s3 = s3_moto
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_SHARED_CREDENTIALS_FILE=os.devnull, AWS_CONFIG_FILE=os.devnull, AWS_EC2_METADATA_DISABLED="true")
    options = json.dumps({"endpoint_url": s3.proxy.url, "anon": False, "client_kwargs": {"region_name": "us-east-1"},
                          "dcp_atomic_max_attempts": 2, "dcp_atomic_backoff_s": 0.01})
    argv = ["--storage-options", options, "ls", s3.root]
    _assert_one_line(_run(argv, env=env), "NoCredentialsError", s3.root, "AWS_ACCESS_KEY_ID", "--storage-options")
    _assert_json_error(_run(["--json", *argv], env=env), "NoCredentialsError", s3.root, "anon")


def test_show_into_a_pipe_that_closes_early_ends_quietly(root):
    keys = {f"layer{i:04d}.some_rather_long_parameter_name.weight": torch.full((2,), float(i)) for i in range(1000)}
    dcp.save(keys, storage_writer=AtomicStorageWriter(root, RUN, 1))  # show prints ~95 KB: more than a pipe holds
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
               PYTHONPATH=HERE)
    for flags, first in (("", f"run {RUN}  step 1"), ("--json", "{")):
        done = subprocess.run(["bash", "-o", "pipefail", "-c", f"dcp-atomic show {flags} '{root}' {RUN} 1 | head -1"],
                              capture_output=True, text=True, timeout=120, env=env)
        assert done.stdout.startswith(first), done.stdout
        assert done.stderr == "", done.stderr  # no BrokenPipeError, no "Exception ignored in ... stdout"
        assert done.returncode == 141, done.returncode  # SIGPIPE's status, as `yes | head -1` gives


def test_ls_of_a_root_lists_runs_only(root, capsys):
    dcp.save({"w": torch.ones(2)}, storage_writer=AtomicStorageWriter(root, RUN, 1))
    os.makedirs(os.path.join(root, "_d0a", RUN, "step_0000000001"))  # a hashed data prefix, as on object stores
    os.makedirs(os.path.join(root, "hf-model"))  # an export someone wrote beside the runs
    with open(os.path.join(root, "hf-model", "model.safetensors.index.json"), "w") as f:
        f.write("{}")
    os.makedirs(os.path.join(root, "empty"))
    with open(os.path.join(root, "notes.txt"), "w") as f:
        f.write("a stray file")
    assert main(["--json", "ls", root]) == 0
    assert [row["run"] for row in json.loads(capsys.readouterr().out)["runs"]] == [RUN]
    assert main(["ls", root]) == 0
    rows = capsys.readouterr().out.splitlines()[1:]
    assert [row.split()[0] for row in rows] == [RUN], rows


def test_every_json_output_carries_the_schema_version(root, tmp_path, capsys):
    state = {"w": torch.arange(4.0), "meta": {"epoch": 1}}
    for step in (1, 2):
        dcp.save(state, storage_writer=AtomicStorageWriter(root, RUN, step))
    stock = str(tmp_path / "stock")
    dcp.save({"w": torch.ones(4)}, storage_writer=dcp.FileSystemWriter(stock))
    commands = {
        "ls root": (["ls", root], 0), "ls run": (["ls", root, RUN], 0), "show": (["show", root, RUN, "1"], 0),
        "gc": (["gc", root, RUN, "--keep-last", "2", "--dry-run"], 0),
        "export torch": (["export", root, RUN, "1", str(tmp_path / "m.pt")], 0),
        "export safetensors": (["export", "--format", "safetensors", root, RUN, "1", str(tmp_path / "hf")], 0),
        "import": (["import", stock, root, "adopted", "1"], 0),
        "rm without --yes": (["rm", root, RUN, "1"], 2), "rm": (["rm", root, RUN, "1", "--yes"], 0),
        "error": (["show", root, RUN, "9"], 1), "usage error": (["ls"], 2),
    }
    for name, (argv, code) in commands.items():
        assert main(["--json", *argv]) == code, name
        reply = json.loads(capsys.readouterr().out)
        assert isinstance(reply, dict) and reply["schema"] == JSON_SCHEMA, (name, reply)
    assert main(["--json", "verify", root, RUN, "--all"]) == 0  # an array, as before: each report versioned
    reports = json.loads(capsys.readouterr().out)
    assert reports and all(r["schema"] == JSON_SCHEMA for r in reports), reports
    with open(os.path.join(HERE, "docs", "cli.md")) as f:
        assert f'`"schema": {JSON_SCHEMA}`' in f.read(), "docs/cli.md documents the version the CLI prints"
