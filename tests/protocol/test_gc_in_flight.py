"""`gc` never deletes under a committing save: a save held between its manifest and its marker while gc (lease 0)
plans and deletes its attempt either commits whole (gc re-read the marker and left the attempt) or fails typed with
``LATEST`` and the newest step untouched; it never reports success for an attempt whose files are gone."""

from __future__ import annotations

import json
import os
import threading

import torch

from dcp_atomic import CheckpointManager, StorageError, list_steps
from dcp_atomic._base import failpoints
from dcp_atomic.tools.cli import main
from dcp_atomic.stores.backends import open_storage
from dcp_atomic.format.layout import RunLayout
from dcp_atomic.protocol.retention import apply_gc, plan_gc

RUN = "exp"


def _state(step: int) -> dict:
    return {"w": torch.arange(64.0) + step, "progress": {"step": step}}


def _held_save(root: str, step: int):
    """A save of ``step`` stopped after its manifest, before its marker, until the returned event is set:
    (thread, box with its result, event)."""
    reached, release, box = threading.Event(), threading.Event(), {}

    def hold(rank, _step):
        reached.set()
        assert release.wait(30), "the test never released the held save"
    failpoints.arm("commit.after_manifest", hold)

    def save():
        try:
            with CheckpointManager(root, RUN, timeout=2) as manager:  # a failed save waits for its marker this long
                manager.save(step, _state(step))
            box["result"] = "committed"
        except BaseException as e:  # noqa: BLE001 - the test reads it
            box["result"], box["error"] = f"{type(e).__name__}: {e}", e
    thread = threading.Thread(target=save)
    thread.start()
    assert reached.wait(30), "the save never reached its manifest"
    return thread, box, release


def _latest(root: str) -> int:
    return json.load(open(os.path.join(root, RUN, "LATEST")))["step"]


def _loads_exactly(root: str, step: int) -> None:
    with CheckpointManager(root, RUN, timeout=5) as manager:
        target = _state(-1)
        assert manager.load(target) == step
    assert torch.equal(target["w"], _state(step)["w"]) and target["progress"]["step"] == step


def test_gc_that_planned_before_the_marker_leaves_the_attempt_the_marker_now_names(tmp_path):
    """gc planned while the save sat between manifest and marker (its attempt uncommitted, lease 0), the save then
    committed, then gc applied its plan: it re-reads the marker before deleting and leaves the committed attempt."""
    root = str(tmp_path)
    with CheckpointManager(root, RUN, timeout=10) as manager:
        manager.save(1, _state(1))
    layout = RunLayout(open_storage(root), RUN)
    try:
        thread, box, release = _held_save(root, 2)
        plan = plan_gc(layout, 5, lease_seconds=0)
        assert [step for step, _ in plan.delete_attempts] == [2], plan  # the attempt in flight, as gc saw it
        release.set()
        thread.join(30)
        assert box["result"] == "committed", box
        apply_gc(layout, plan)
    finally:
        failpoints.disarm_all()
    assert list_steps(root, RUN) == [1, 2] and _latest(root) == 2
    _loads_exactly(root, 2)


def test_a_save_whose_attempt_gc_deleted_before_its_marker_fails_typed_and_latest_stays(tmp_path, capsys):
    """A real `dcp-atomic gc --lease-hours 0` deletes the attempt of a save held between manifest and marker: the
    save fails with StorageError naming gc, nothing of it is committed, and LATEST and load() stay on step 1."""
    root = str(tmp_path)
    with CheckpointManager(root, RUN, timeout=10) as manager:
        manager.save(1, _state(1))
    try:
        thread, box, release = _held_save(root, 2)
        assert main(["gc", root, RUN, "--keep-last", "5", "--lease-hours", "0"]) == 0
        assert "abandoned attempt" in capsys.readouterr().out
        release.set()
        thread.join(30)
    finally:
        failpoints.disarm_all()
    assert isinstance(box.get("error"), StorageError), box
    assert "`dcp-atomic gc` with a lease" in box["result"] and "withdrawn" in box["result"], box
    assert list_steps(root, RUN) == [1] and _latest(root) == 1
    _loads_exactly(root, 1)


def test_a_save_whose_manifest_was_deleted_under_it_with_its_claim_left_fails_typed(tmp_path):
    """A deletion that took the attempt's files but not yet its claim (a gc mid-way, an older gc, a tool): the
    committer checks the manifest its marker names as well, so the save fails instead of reporting success."""
    root = str(tmp_path)
    with CheckpointManager(root, RUN, timeout=10) as manager:
        manager.save(1, _state(1))
    try:
        thread, box, release = _held_save(root, 2)
        step_dir = os.path.join(root, RUN, f"step_{2:010d}")
        (attempt,) = os.listdir(step_dir)
        for name in os.listdir(os.path.join(step_dir, attempt)):
            if name != "ATTEMPT":
                os.remove(os.path.join(step_dir, attempt, name))
        release.set()
        thread.join(30)
    finally:
        failpoints.disarm_all()
    assert isinstance(box.get("error"), StorageError) and "withdrawn" in box["result"], box
    assert list_steps(root, RUN) == [1] and _latest(root) == 1
    _loads_exactly(root, 1)


def test_gc_whose_steps_the_savers_own_retention_removed_after_it_planned_finishes_without_error(tmp_path):
    """gc racing the saver's retention: every step it planned to delete (and an abandoned attempt) was removed by
    the time it applies the plan; it ends as if it had removed them itself (a raw FileNotFoundError before)."""
    root = str(tmp_path / "ckpt")
    with CheckpointManager(root, RUN) as manager:
        for step in (1, 2, 3, 4):
            manager.save(step, _state(step))
    layout = RunLayout(open_storage(root), RUN)
    os.makedirs(os.path.join(layout.step_dir(4), "20000101T000000Z-deadbeef"))  # an abandoned attempt, long ago
    plan = plan_gc(layout, 1, lease_seconds=0)
    assert plan.delete_steps == [1, 2, 3] and plan.delete_attempts, plan
    for step in (1, 2, 3):  # the saver's own retention, between gc's plan and its deletes
        layout.storage.remove(layout.step_dir(step))
    for save_id_dir in [os.path.join(layout.step_dir(4), s) for _, s in plan.delete_attempts]:
        layout.storage.remove(save_id_dir)
    apply_gc(layout, plan)
    assert list_steps(root, RUN) == [4]
    assert main(["gc", root, RUN, "--keep-last", "1", "--lease-hours", "0"]) == 0
