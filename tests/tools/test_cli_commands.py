"""The command line: gc, ls, verify, export, JSON errors and the installed command's exit codes."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import pytest
import torch

from dcp_atomic.tools.cli import main
from tests import manifest_view
from tests.helpers.steps import RUN, _reseal, _save, _step_paths

CLI = os.path.join(os.path.dirname(sys.executable), "dcp-atomic")


def test_gc_reports_unreadable_steps_and_exits_nonzero(root, capsys, monkeypatch):
    """The CLI side alone: a plan carrying unreadable steps is printed and fails the command."""
    from dcp_atomic.protocol.retention import GcPlan
    from dcp_atomic.tools.cli import commands

    _save(root, 1)
    plan = GcPlan(kept_steps=[1])
    plan.unreadable_steps = [(7, "COMMITTED: self-checksum mismatch")]
    monkeypatch.setattr(commands, "plan_gc", lambda *args, **kwargs: plan)
    assert main(["gc", root, RUN, "--keep-last", "1"]) == 1
    captured = capsys.readouterr()
    assert "step 7" in captured.err and "self-checksum mismatch" in captured.err
    assert main(["--json", "gc", root, RUN, "--keep-last", "1"]) == 1
    assert json.loads(capsys.readouterr().out)["unreadable_steps"] == [[7, "COMMITTED: self-checksum mismatch"]]


def test_gc_keeps_and_names_a_step_with_a_damaged_marker(root, capsys):
    """End to end with retention.py's unreadable_steps (G16)."""
    for step in (1, 2, 3):
        _save(root, step)
    step_dir, attempt, _ = _step_paths(root, 1)
    open(os.path.join(step_dir, "COMMITTED"), "ab").write(b"torn")
    assert main(["--json", "gc", root, RUN, "--keep-last", "1", "--lease-hours", "0"]) != 0
    assert [s for s, _ in json.loads(capsys.readouterr().out)["unreadable_steps"]] == [1]
    assert os.path.isdir(attempt), "the data of a step whose marker exists must never be deleted"


def _zstd_state():
    return {"w": torch.arange(300_000, dtype=torch.float32).reshape(600, 500),  # ~1.2 MB: 5 blocks of 256 KiB
            "h": torch.linspace(-2, 2, 400_000).to(torch.bfloat16), "i": torch.arange(100_000), "obj": {"k": 1}}


def _zstd_file_of(root, key):
    _, attempt, _ = _step_paths(root, 1)
    manifest = manifest_view.load(attempt)
    entry, item = next((f, i) for f in manifest["files"] for i in f["items"] if i["key"] == key)
    return os.path.join(attempt, entry["name"]), item


def test_verify_passes_intact_multi_block_zstd_items_and_names_a_flipped_byte(root, capsys):
    _save(root, 1, _zstd_state(), compression="zstd", block_size=256 << 10)
    path, item = _zstd_file_of(root, "w")
    assert item["codec"] == "zstd" and len(item["frames"]) >= 4 and item["length"] < item["logical_length"]
    assert main(["verify", root, RUN, "1"]) == 0, capsys.readouterr()
    capsys.readouterr()
    data = bytearray(open(path, "rb").read())
    data[item["pos"] + item["length"] // 2] ^= 0x10
    open(path, "wb").write(data)
    assert main(["verify", root, RUN, "1"]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and os.path.basename(path) in out and "'w'" in out


def test_verify_decodes_frames_so_it_cannot_pass_what_the_reader_refuses(root, capsys):
    _save(root, 1, _zstd_state(), compression="zstd", block_size=256 << 10)

    def wrong_planes(manifest, attempt):
        item = next(i for f in manifest["files"] for i in f["items"] if i["key"] == "w")
        item["planes"] = 2  # digests still match the stored frames; they no longer decode

    _reseal(root, 1, wrong_planes)
    assert main(["verify", root, RUN, "1"]) == 1
    out = capsys.readouterr().out
    assert "'w'" in out and "cannot be decoded" in out


def test_ls_root_shows_each_run_with_count_latest_size_and_age(root, capsys):
    _save(root, 1)
    _save(root, 2)
    _save(root, 5, run="other")
    os.makedirs(os.path.join(root, "fresh", "step_0000000001", "20260101T000000Z-deadbeef"))
    assert main(["--json", "ls", root]) == 0
    runs = {r["run"]: r for r in json.loads(capsys.readouterr().out)["runs"]}
    assert set(runs) == {RUN, "other", "fresh"}
    assert runs[RUN]["committed_steps"] == 2 and runs[RUN]["latest_step"] == 2
    assert runs["other"]["committed_steps"] == 1 and runs["other"]["latest_step"] == 5
    assert runs[RUN]["bytes"] > runs["other"]["bytes"] > 0 and 0 <= runs[RUN]["age_seconds"] < 600
    assert runs["fresh"]["committed_steps"] == 0 and runs["fresh"]["latest_step"] is None
    assert main(["ls", root]) == 0
    lines = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[1:]}
    assert lines[RUN][1:3] == ["2", "2"] and lines["other"][1:3] == ["1", "5"] and lines["fresh"][1:3] == ["0", "-"]


@pytest.mark.parametrize("keep", ["0", "-1"])
def test_gc_refuses_keep_last_below_one(root, capsys, keep):
    _save(root, 1)
    _save(root, 2)
    assert main(["gc", root, RUN, "--keep-last", keep]) == 2
    assert "--keep-last" in capsys.readouterr().err
    assert main(["--json", "gc", root, RUN, f"--keep-last={keep}"]) == 2
    assert "--keep-last" in json.loads(capsys.readouterr().out)["error"]["message"]
    assert sorted(os.listdir(os.path.join(root, RUN))) == ["LATEST", "step_0000000001", "step_0000000002"]


def test_errors_are_json_on_stdout_with_json_and_never_tracebacks(root, capsys):
    _save(root, 1)
    assert main(["--json", "show", root, RUN, "7"]) == 1
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["type"] == "CheckpointNotFoundError" and "7" in error["message"]
    assert main(["verify", root, RUN, "--threads", "0"]) == 2
    assert "--threads" in capsys.readouterr().err
    missing = os.path.join(root, "nowhere")
    assert main(["ls", missing]) == 1
    assert missing in capsys.readouterr().err
    assert main(["--json", "ls", missing]) == 1
    assert missing in json.loads(capsys.readouterr().out)["error"]["message"]
    assert main(["--json", "--storage-options", "{not json", "ls", root]) == 2
    assert "storage-options" in json.loads(capsys.readouterr().out)["error"]["message"]


def test_export_refuses_a_missing_directory_and_writes_atomically(root, capsys, monkeypatch):
    _save(root, 1, {"w": torch.arange(6.0), "meta": {"step": 1}})
    missing = os.path.join(root, "no", "such", "dir", "out.pt")
    assert main(["export", root, RUN, "1", missing]) == 1
    assert os.path.join(root, "no", "such", "dir") in capsys.readouterr().err
    out_dir = os.path.join(root, "exports")
    os.makedirs(out_dir)
    out = os.path.join(out_dir, "step1.pt")

    def torch_save_dies_half_way(obj, f, *args, **kwargs):
        stream = open(f, "wb") if isinstance(f, (str, os.PathLike)) else f
        stream.write(b"PK\x03\x04 half an archive")
        stream.flush()
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", torch_save_dies_half_way)
    assert main(["export", root, RUN, "1", out]) == 1
    assert "No space left" in capsys.readouterr().err
    assert os.listdir(out_dir) == [], "neither a partial export nor a temp file may remain"
    monkeypatch.undo()
    assert main(["export", root, RUN, "1", out]) == 0
    assert os.listdir(out_dir) == ["step1.pt"]
    assert torch.equal(torch.load(out, weights_only=True)["w"], torch.arange(6.0))


def test_installed_command_exit_codes_end_to_end(root):
    _save(root, 1)
    bad = subprocess.run([CLI, "--json", "gc", root, RUN, "--keep-last", "0"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "--keep-last" in json.loads(bad.stdout)["error"]["message"], bad
    missing = subprocess.run([CLI, "ls", os.path.join(root, "nowhere")], capture_output=True, text=True, timeout=120)
    assert missing.returncode == 1 and "Traceback" not in missing.stderr and "nowhere" in missing.stderr, missing
    assert os.path.isdir(os.path.join(root, RUN, "step_0000000001"))
