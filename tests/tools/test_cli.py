"""The dcp-atomic command line on a real checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
import torch.distributed.checkpoint as dcp

from dcp_atomic import AtomicStorageWriter
from dcp_atomic.tools.cli import main

RUN = "exp"


def _save(root, step):
    dcp.save({"w": torch.randn(64, 64), "meta": {"step": step}}, storage_writer=AtomicStorageWriter(root, RUN, step))


def test_ls_show_verify_json(root, capsys):
    _save(root, 1)
    _save(root, 2)
    assert main(["--json", "ls", root, RUN]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert listing["latest"] == 2 and [s["step"] for s in listing["steps"]] == [1, 2]
    assert all(s["committed"] for s in listing["steps"])
    assert main(["--json", "show", root, RUN, "1"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 1
    assert main(["--json", "verify", root, RUN, "--all"]) == 0
    assert all(r["problems"] == [] for r in json.loads(capsys.readouterr().out))


def test_verify_names_the_flipped_file_and_exits_nonzero(root, capsys):
    _save(root, 1)
    step_dir = os.path.join(root, RUN, "step_0000000001")
    attempt = os.path.join(step_dir, json.load(open(os.path.join(step_dir, "COMMITTED")))["save_id"])
    victim = max((f for f in os.listdir(attempt) if f.endswith(".distcp")),
                 key=lambda f: os.path.getsize(os.path.join(attempt, f)))
    path = os.path.join(attempt, victim)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x40
    open(path, "wb").write(data)
    assert main(["verify", root, RUN, "1"]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and victim in out and "checksum mismatch" in out


def test_ls_marks_partial_attempts_and_module_entry_point_works(root):
    _save(root, 1)
    os.makedirs(os.path.join(root, RUN, "step_0000000002", "20260101T000000Z-deadbeef"))
    out = subprocess.run([sys.executable, "-m", "dcp_atomic", "ls", root, RUN], capture_output=True, text=True,
                         check=True).stdout
    lines = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert "committed" in lines["1"] and "partial" in lines["2"]


def test_invalid_run_id_is_refused(root, capsys):
    assert main(["ls", root, "../etc"]) == 2
    assert "run_id must be a name matching" in capsys.readouterr().err


def test_gc_dry_run_then_delete_keeps_latest_and_fresh_attempts(root, capsys):
    for step in (1, 2, 3):
        _save(root, step)
    stale = os.path.join(root, RUN, "step_0000000003", "20200101T000000Z-0badc0de")
    fresh = os.path.join(root, RUN, "step_0000000009", time_id())
    os.makedirs(stale)
    os.makedirs(fresh)
    assert main(["--json", "gc", root, RUN, "--keep-last", "1", "--dry-run"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["delete_steps"] == [1, 2] and plan["kept_steps"] == [3]
    assert plan["delete_attempts"] == [[3, "20200101T000000Z-0badc0de"]]
    assert sorted(os.listdir(os.path.join(root, RUN))) == ["LATEST"] + [f"step_{s:010d}" for s in (1, 2, 3, 9)]
    assert main(["gc", root, RUN, "--keep-last", "1"]) == 0
    assert sorted(os.listdir(os.path.join(root, RUN))) == ["LATEST", "step_0000000003", "step_0000000009"]
    assert not os.path.exists(stale) and os.path.exists(fresh)
    assert main(["verify", root, RUN, "3"]) == 0


def time_id() -> str:
    import time

    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-00000001"


def test_export_writes_one_loadable_unsharded_file(root, tmp_path):
    torch.manual_seed(0)
    weights = torch.randn(64, 64)
    dcp.save({"model": {"w": weights}, "meta": {"step": 7}}, storage_writer=AtomicStorageWriter(root, RUN, 7))
    out = tmp_path / "model.pt"
    assert main(["export", root, RUN, "7", str(out)]) == 0
    exported = torch.load(out, weights_only=False)
    assert torch.equal(exported["model"]["w"], weights) and exported["meta"] == {"step": 7}


_NO_TORCH_PROBE = """
import contextlib, io, json, sys
from dcp_atomic.tools.cli import main
out = io.StringIO()
try:
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print(json.dumps({"code": code, "torch": "torch" in sys.modules, "out": out.getvalue()[-300:]}))
"""


def test_help_argument_errors_ls_and_show_answer_without_importing_torch(root):
    """Importing torch takes seconds (a minute on a loaded node): the CLI imports it only for what reads tensors."""
    _save(root, 1)
    for argv, code in ((["--help"], 0), (["verify", "--help"], 0), (["no-such-command"], 2), (["ls", root], 0),
                       (["ls", root, RUN], 0), (["show", root, RUN, "1"], 0), (["--json", "show", root, RUN], 0)):
        probe = subprocess.run([sys.executable, "-c", _NO_TORCH_PROBE, *argv], capture_output=True, text=True,
                               timeout=600)
        result = json.loads(probe.stdout.strip().splitlines()[-1])
        assert result["code"] == code and not result["torch"], (argv, result, probe.stderr[-500:])
    installed = os.path.join(os.path.dirname(sys.executable), "dcp-atomic")  # the command a user runs
    ran = subprocess.run([installed, "--help"], capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0 and "usage: dcp-atomic" in ran.stdout, ran
    import dcp_atomic  # the public names still resolve (imported on first use)

    assert dcp_atomic.AtomicStorageWriter is AtomicStorageWriter and "CheckpointManager" in dir(dcp_atomic)
