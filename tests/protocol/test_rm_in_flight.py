"""`rm` never races a save into a lie: a save in flight (its ATTEMPT claim inside the lease) is left by `rm`, and
a save whose attempt is removed under it while it commits fails and withdraws its marker, never reporting success
over files that are gone."""

from __future__ import annotations

import os
import shutil
import threading
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_atomic import AtomicStorageReader, AtomicStorageWriter, StorageError, list_steps
from dcp_atomic._base import failpoints
from dcp_atomic.tools.cli import main

RUN = "exp"


def _state(step):
    return {"w": torch.arange(64.0) + step}


def _save(root, step, **kwargs):
    dcp.save(_state(step), storage_writer=AtomicStorageWriter(root, RUN, step, timeout=10, **kwargs), no_dist=True)


def _in_flight(root, step):
    """A save of ``step`` (overwrite=True) stopped after its data and manifest, before its marker: (thread, box)."""
    box = {}

    def save():
        try:
            _save(root, step, overwrite=True)
            box["result"] = "committed"
        except BaseException as e:  # noqa: BLE001 - DCP wraps it: the test reads the text
            box["result"] = f"{type(e).__name__}: {e}"
    failpoints.arm("commit.after_manifest", "sleep:3")
    thread = threading.Thread(target=save)
    thread.start()
    deadline = time.monotonic() + 20
    step_dir = os.path.join(root, RUN, f"step_{step:010d}")
    while time.monotonic() < deadline:  # the new attempt's manifest is written: it sleeps before its marker
        if sum(os.path.exists(os.path.join(step_dir, a, "manifest.json")) for a in os.listdir(step_dir)) == 2:
            break
        time.sleep(0.05)
    return thread, box


def test_rm_of_a_step_leaves_the_attempt_of_a_save_in_flight_which_then_commits_and_loads(tmp_path, capsys):
    root = str(tmp_path)
    for step in (1, 2):
        _save(root, step)
    try:
        thread, box = _in_flight(root, 2)
        assert main(["rm", root, RUN, "2", "--yes"]) == 0  # the committed step 2 goes; the save in flight stays
        thread.join(30)
    finally:
        failpoints.disarm_all()
    assert box["result"] == "committed", box
    assert list_steps(root, RUN) == [1, 2]
    target = {"w": torch.zeros(64)}
    dcp.load(target, storage_reader=AtomicStorageReader(root, RUN, 2), no_dist=True)
    assert torch.equal(target["w"], _state(2)["w"])
    assert main(["verify", root, RUN, "2"]) == 0


def test_a_save_whose_attempt_is_removed_under_it_fails_and_leaves_nothing_committed(tmp_path):
    root = str(tmp_path)
    _save(root, 1)
    try:
        thread, box = _in_flight(root, 1)
        step_dir = os.path.join(root, RUN, f"step_{1:010d}")
        for attempt in os.listdir(step_dir):  # what `rm -rf` (or a tool ignoring leases) does: everything
            shutil.rmtree(os.path.join(step_dir, attempt), ignore_errors=True)
        os.remove(os.path.join(step_dir, "COMMITTED")) if os.path.exists(os.path.join(step_dir, "COMMITTED")) else None
        thread.join(30)
    finally:
        failpoints.disarm_all()
    assert "was removed while it committed" in box["result"] and "withdrawn" in box["result"], box
    assert list_steps(root, RUN) == [], "a save reported over files that were removed under it"


def test_rm_of_a_step_that_a_save_in_flight_commits_meanwhile_says_so_first_and_exits_1(tmp_path, capsys, monkeypatch):
    """A save (a drain, say) in flight commits the step while `rm` runs: rm's first line says the step is committed
    again, naming the new save, not "removed"."""
    from dcp_atomic.tools.cli import commands

    root = str(tmp_path)
    for step in (1, 2):
        _save(root, step)
    release, box = threading.Event(), {}
    failpoints.arm("commit.after_manifest", lambda rank, step=None: release.wait(20))

    def save():
        try:
            _save(root, 2, overwrite=True)
            box["result"] = "committed"
        except BaseException as e:  # noqa: BLE001 - the test reads it
            box["result"] = f"{type(e).__name__}: {e}"
    thread = threading.Thread(target=save)
    step_dir = os.path.join(root, RUN, f"step_{2:010d}")
    remove_step = commands.remove_step

    def remove_then_commit(layout, step, **kwargs):  # the save commits between rm's removal and its report
        left = remove_step(layout, step, **kwargs)
        release.set()
        thread.join(30)
        return left
    monkeypatch.setattr(commands, "remove_step", remove_then_commit)
    try:
        thread.start()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and sum(
                os.path.exists(os.path.join(step_dir, a, "manifest.json")) for a in os.listdir(step_dir)) < 2:
            time.sleep(0.02)  # the new attempt's manifest is written: it waits before its marker
        assert main(["rm", root, RUN, "2", "--yes"]) == 1
    finally:
        release.set()
        failpoints.disarm_all()
    assert box["result"] == "committed", box
    first = capsys.readouterr().out.splitlines()[0]
    new_save = AtomicStorageReader(root, RUN, 2).resolve().save_id
    assert first.startswith("step 2 of run 'exp' is committed again") and f"(save {new_save})" in first, first
    assert list_steps(root, RUN) == [1, 2]
