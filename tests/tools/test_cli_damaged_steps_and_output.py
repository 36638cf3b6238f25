"""The CLI on damaged steps and its output, and safe decoding (G13, G16): typed refusals, JSON, damaged markers."""

from __future__ import annotations

import datetime
import io
import json
import os
import pickle
import shutil
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import dcp_atomic
from dcp_atomic import AtomicStorageReader, AtomicStorageWriter, ConfigurationError, CorruptCheckpointError
from dcp_atomic.tools.cli import main

RUN = "exp"


def _save(root, step, run=RUN, state=None):
    state = {"w": torch.arange(16.0), "meta": {"step": step}} if state is None else state
    dcp.save(state, storage_writer=AtomicStorageWriter(root, run, step))


def _marker(root, step, run=RUN):
    return os.path.join(root, run, f"step_{step:010d}", "COMMITTED")


# -- a refused non-tensor item is a policy refusal, not corruption ------------------------------------


def test_refused_item_is_unsafe_item_error_not_corruption(root):
    from dcp_atomic.format.safe_pickle import safe_byte_item

    buffer = io.BytesIO()
    torch.save({"when": datetime.datetime(2024, 1, 1)}, buffer)
    with pytest.raises(dcp_atomic.UnsafeItemError) as info:
        safe_byte_item(buffer.getvalue(), key="clock", where="/ckpt/__0_0.distcp")
    error = info.value
    assert isinstance(error, ConfigurationError) and not isinstance(error, CorruptCheckpointError)
    assert "'clock'" in str(error) and "datetime" in str(error) and "add_safe_globals" in str(error)
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is dcp_atomic.UnsafeItemError and copy.message == error.message
    assert "UnsafeItemError" in dcp_atomic.__all__

    _save(root, 1, state={"w": torch.ones(2), "clock": datetime.datetime(2024, 1, 1)})
    with pytest.raises(CheckpointException) as wrapped:
        dcp.load({"w": torch.zeros(2), "clock": None}, storage_reader=AtomicStorageReader(root, RUN, 1, timeout=2))
    assert "UnsafeItemError" in str(wrapped.value) and "CorruptCheckpointError" not in str(wrapped.value)
    with torch.serialization.safe_globals([datetime.datetime]):  # the documented opt-in still works
        target = {"w": torch.zeros(2), "clock": None}
        dcp.load(target, storage_reader=AtomicStorageReader(root, RUN, 1, timeout=2))
    assert target["clock"] == datetime.datetime(2024, 1, 1)


# -- --json is kept everywhere -----------------------------------------------------------------------


def test_json_export_prints_json(root, capsys):
    _save(root, 2)
    out = os.path.join(root, "out.pt")
    assert main(["--json", "export", root, RUN, "2", out]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["step"] == 2 and report["out"] == out and report["save_id"]
    assert torch.equal(torch.load(out, weights_only=True)["w"], torch.arange(16.0))


def test_global_options_are_accepted_after_the_subcommand(root, capsys):
    _save(root, 1)
    assert main(["ls", root, RUN, "--json"]) == 0
    assert [s["step"] for s in json.loads(capsys.readouterr().out)["steps"]] == [1]
    assert main(["verify", root, RUN, "1", "--json", "--timeout", "2"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["problems"] == []
    assert main(["show", root, RUN, "9", "--json"]) == 1  # errors too
    assert json.loads(capsys.readouterr().out)["error"]["type"] == "CheckpointNotFoundError"
    assert main(["--json", "ls", root, RUN]) == 0  # before the subcommand, as before
    assert json.loads(capsys.readouterr().out)["latest"] == 1
    assert main(["ls", root, RUN]) == 0  # an option given nowhere keeps its default
    assert "committed" in capsys.readouterr().out


def test_gc_json_prints_one_object_even_when_deleting_fails(root, capsys, monkeypatch):
    from dcp_atomic.tools.cli import commands

    for step in (1, 2):
        _save(root, step)

    def disk_error(layout, plan):
        raise OSError(5, "Input/output error", _marker(root, 1))

    monkeypatch.setattr(commands, "apply_gc", disk_error)
    assert main(["--json", "gc", root, RUN, "--keep-last", "1"]) == 1
    out = capsys.readouterr().out
    report = json.loads(out)  # exactly one JSON document: a second one would not parse
    assert report["delete_steps"] == [1] and "Input/output error" in report["error"]["message"]
    assert report["error"]["type"] == "OSError"


# -- the CLI shows damaged markers ------------------------------------------------------------------


def _damaged_run(root):
    """Step 1's marker is garbage; step 2 holds another run's (well-sealed) marker; step 3 is intact."""
    for step in (1, 2, 3):
        _save(root, step)
    _save(root, 2, run="other")
    open(_marker(root, 1), "wb").write(b"\x00garbage, not a marker")
    shutil.copy(_marker(root, 2, run="other"), _marker(root, 2))


def test_ls_shows_damaged_markers(root, capsys):
    _damaged_run(root)
    assert main(["--json", "ls", root, RUN]) == 0
    rows = {row["step"]: row for row in json.loads(capsys.readouterr().out)["steps"]}
    assert rows[3]["committed"] and "marker_error" not in rows[3]
    for step in (1, 2):
        assert not rows[step]["committed"] and rows[step]["marker_error"], rows[step]
    assert "belongs to run 'other'" in rows[2]["marker_error"]
    assert main(["ls", root, RUN]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert "damaged" in lines["1"] and "damaged" in lines["2"] and "partial" not in lines["1"] + lines["2"]
    assert "committed" in lines["3"]
    assert main(["--json", "ls", root]) == 0
    runs = {row["run"]: row for row in json.loads(capsys.readouterr().out)["runs"]}
    assert runs[RUN]["damaged_markers"] == 2 and runs["other"]["damaged_markers"] == 0


def test_verify_all_reports_damaged_markers_as_failed(root, capsys):
    _damaged_run(root)
    assert main(["--json", "verify", root, RUN, "--all"]) == 1
    reports = {r["step"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(reports) == {1, 2, 3}
    assert reports[3]["problems"] == []
    assert reports[1]["problems"] and reports[2]["problems"]
    assert any("other" in p for p in reports[2]["problems"])
    os.remove(_marker(root, 3))  # no valid marker left: the damaged steps are still reported, not "not found"
    assert main(["--json", "verify", root, RUN, "--all"]) == 1
    assert {r["step"] for r in json.loads(capsys.readouterr().out)} == {1, 2}
    assert main(["verify", root, RUN]) == 1  # "the latest" cannot be told while markers are damaged
    out = capsys.readouterr().out
    assert "step 1: FAILED" in out and "step 2: FAILED" in out


def test_gc_does_not_claim_to_keep_a_step_it_cannot_validate(root, capsys):
    _damaged_run(root)
    shutil.rmtree(os.path.join(root, RUN, "step_0000000003"))  # LATEST still names step 3; keep it out of the way
    os.remove(os.path.join(root, RUN, "LATEST"))
    for step in (1, 2):  # re-save both steps so that LATEST names step 2, then damage them as before
        shutil.rmtree(os.path.join(root, RUN, f"step_{step:010d}"))
        _save(root, step)
    open(_marker(root, 1), "wb").write(b"\x00garbage, not a marker")
    shutil.copy(_marker(root, 2, run="other"), _marker(root, 2))
    assert json.load(open(os.path.join(root, RUN, "LATEST")))["step"] == 2
    assert main(["--json", "gc", root, RUN, "--keep-last", "1", "--dry-run"]) == 1
    plan = json.loads(capsys.readouterr().out)
    assert {step for step, _ in plan["unreadable_steps"]} == {1, 2}
    assert plan["kept_steps"] == [], plan
    assert main(["gc", root, RUN, "--keep-last", "1", "--dry-run"]) == 1
    captured = capsys.readouterr()
    kept_line = next(line for line in captured.out.splitlines() if line.startswith("keeping"))
    assert kept_line.startswith("keeping committed steps []"), kept_line
    assert "step 1: its marker exists" in captured.err and "step 2: its marker exists" in captured.err


def test_verify_of_an_uncommitted_step_waits_once(root, capsys):
    _save(root, 1)
    os.makedirs(os.path.join(root, RUN, "step_0000000009", "20260101T000000Z-deadbeef"))
    started = time.monotonic()
    assert main(["--json", "--timeout", "3", "verify", root, RUN, "9"]) == 1
    elapsed = time.monotonic() - started
    report = json.loads(capsys.readouterr().out)
    assert report[0]["step"] == 9 and "not committed" in report[0]["problems"][0]
    assert elapsed < 5.0, f"verify waited {elapsed:.1f}s for a --timeout of 3s"


def test_verify_of_an_uncommitted_step_says_nothing_was_read_never_save_none(root, capsys):
    _save(root, 1)
    os.makedirs(os.path.join(root, RUN, "step_0000000009", "20260101T000000Z-deadbeef"))
    assert main(["--timeout", "3", "verify", root, RUN, "9"]) == 1
    first = capsys.readouterr().out.splitlines()[0]
    assert first == "step 9: FAILED (nothing read: no committed save)", first
