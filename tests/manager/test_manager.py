"""CheckpointManager on real gloo worlds: async saves, retention, typed failures, resume."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from dcp_atomic import list_steps
from tests.harness import assert_all_ok, run_world
from tests.helpers.fsdp_app import _AppState, _fsdp_app, _full, _train_step

RUN = "exp"


def _read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


class _LatestWrites:
    """Every ``LATEST`` rank 0 writes, checked as it is written: the marker of the step it names must already
    exist and name the same attempt (P3: the marker first, ``LATEST`` last).  A spy on the real storage call."""

    def __init__(self, run_dir):
        from dcp_atomic.stores.storage import LocalStorage

        self.latest = os.path.join(run_dir, "LATEST")
        self.written = []  # (step, save_id, sequence) in write order
        self.early = []  # LATEST contents written while their marker was missing or named another attempt
        self._replace = replace = LocalStorage.replace

        def replace_checked(storage, path, data):
            if os.path.abspath(path) == self.latest:
                latest = json.loads(data)
                marker = _read_json(os.path.join(run_dir, f"step_{latest['step']:010d}", "COMMITTED"))
                if marker is None or marker["save_id"] != latest["save_id"]:
                    self.early.append(latest)
                self.written.append((latest["step"], latest["save_id"], latest["sequence"]))
            return replace(storage, path, data)

        LocalStorage.replace = replace_checked

    def restore(self):
        from dcp_atomic.stores.storage import LocalStorage

        LocalStorage.replace = self._replace


def _train_with_async_saves(ctx, steps, keep_last):
    from dcp_atomic import CheckpointManager

    model, optim = _fsdp_app(ctx.world_size, 0)
    manager = CheckpointManager(ctx.root, RUN, keep_last=keep_last, timeout=30)
    run_dir = os.path.join(ctx.root, RUN)
    spy = _LatestWrites(run_dir) if ctx.rank == 0 else None
    after_issue = []  # (step, what LATEST named right after async_save(step) returned)
    futures = []
    for step in range(1, steps + 1):
        _train_step(model, optim, step)
        if step % 2 == 0:
            futures.append(manager.async_save(step, {"app": _AppState(model, optim), "progress": {"step": step}}))
            latest = _read_json(os.path.join(run_dir, "LATEST"))
            after_issue.append((step, None if latest is None else latest["step"]))
    manager.wait()
    results = [f.result() for f in futures]
    steps_now = manager.steps()
    latest = manager.latest_step()
    manager.close()
    watched = {}
    if spy is not None:
        spy.restore()
        watched = {"written": spy.written, "early": spy.early,
                   "sequences": {s: _read_json(os.path.join(run_dir, f"step_{s:010d}", "COMMITTED"))["sequence"]
                                 for s in steps_now}}
    return {"results": results, "steps": steps_now, "latest": latest, "full": _full(model),
            "after_issue": after_issue, **watched}


def _resume(ctx, expect_step):
    from dcp_atomic import CheckpointManager

    model, optim = _fsdp_app(ctx.world_size, 42)
    with CheckpointManager(ctx.root, RUN, timeout=30) as manager:
        state = {"app": _AppState(model, optim), "progress": {"step": -1}}
        step = manager.load(state)
    assert step == expect_step and state["progress"]["step"] == expect_step, (step, state["progress"])
    return _full(model)


def test_async_saves_commit_in_order_keep_last_and_resume_exactly(root):
    out = assert_all_ok(run_world(_train_with_async_saves, 2, root, args=(8, 2)))
    for rank_out in out:
        assert rank_out["results"] == [2, 4, 6, 8]
        assert rank_out["steps"] == [6, 8] and rank_out["latest"] == 8
    watched = out[0]
    # LATEST never names a step before that step's marker exists (checked at each write, on rank 0) ...
    assert watched["early"] == [], f"LATEST written before its step's marker: {watched['early']}"
    # ... and moves forward only, once per commit, in commit order (P10: sequence numbers increase).
    assert [step for step, _, _ in watched["written"]] == [2, 4, 6, 8], watched["written"]
    sequences = [sequence for _, _, sequence in watched["written"]]
    assert sequences == sorted(set(sequences)), f"commit sequence not increasing: {watched['written']}"
    assert watched["sequences"] == {6: sequences[2], 8: sequences[3]}, (watched["sequences"], sequences)
    # One save in flight: async_save(step) returns only once the previous save committed, so LATEST then
    # names the previous step (or already this one).
    for step, latest in watched["after_issue"]:
        assert latest in ((None, 2) if step == 2 else (step - 2, step)), watched["after_issue"]
    assert list_steps(root, RUN) == [6, 8]
    resumed = assert_all_ok(run_world(_resume, 2, root, args=(8,)))
    for full in resumed:
        for key, value in out[0]["full"].items():
            assert torch.equal(full[key], value), key


def _async_save_then_die(ctx):
    from dcp_atomic import CheckpointManager, RankFailureError

    model, optim = _fsdp_app(ctx.world_size, 0)
    manager = CheckpointManager(ctx.root, RUN, timeout=8)
    manager.save(2, {"app": _AppState(model, optim), "progress": {"step": 2}})
    _train_step(model, optim, 3)
    future = manager.async_save(4, {"app": _AppState(model, optim), "progress": {"step": 4}})
    try:
        future.result(timeout=60)
    except RankFailureError as e:
        return {"error": "RankFailureError", "silent": e.details["silent"], "message": str(e)}
    except Exception as e:  # noqa: BLE001 - report the type to the test
        return {"error": type(e).__name__, "message": str(e)}
    return {"error": None}


@pytest.mark.slow
def test_async_save_racing_a_killed_rank_fails_typed_and_latest_stays_on_the_commit(root):
    outcomes = run_world(_async_save_then_die, 2, root,
                         rank_env=lambda r: {"DCP_ATOMIC_FAILPOINTS": "write.mid_data@1#2=kill"} if r == 1 else {},
                         pg_timeout=8, timeout=90)
    assert outcomes[1].killed
    survivor = outcomes[0].value
    assert outcomes[0].ok, outcomes[0].error
    assert survivor["error"] == "RankFailureError", survivor
    assert survivor["silent"].startswith("1"), survivor
    assert json.load(open(os.path.join(root, RUN, "LATEST")))["step"] == 2
    assert list_steps(root, RUN) == [2]
    assert_all_ok(run_world(_resume, 2, root, args=(2,)))


def _save_with_frozen_peer(ctx):
    from dcp_atomic import CheckpointManager, RankFailureError

    manager = CheckpointManager(ctx.root, RUN, timeout=4)
    started = time.monotonic()
    try:
        manager.save(1, {f"x{ctx.rank}": torch.ones(1000)})
    except RankFailureError as e:
        return {"silent": e.details["silent"], "seconds": time.monotonic() - started}
    return {"silent": None}


@pytest.mark.slow
def test_frozen_rank_surfaces_as_typed_error_naming_it(root):
    outcomes = run_world(_save_with_frozen_peer, 2, root,
                         rank_env=lambda r: {"DCP_ATOMIC_FAILPOINTS": "write.before_data@1=stop"} if r == 1 else {},
                         pg_timeout=60, timeout=90, wait_for=[0])
    assert outcomes[0].ok, outcomes[0].error
    assert outcomes[0].value["silent"] == "1", outcomes[0].value
    assert outcomes[0].value["seconds"] < 30, "bounded by the manager's timeout, not the launcher's"
    assert outcomes[1].error_type == "NotAwaited"
    assert list_steps(root, RUN) == []


def _load_nothing(ctx):
    from dcp_atomic import CheckpointManager, CheckpointNotFoundError

    with CheckpointManager(ctx.root, RUN, timeout=5) as manager:
        try:
            manager.load({"x": torch.zeros(2)})
        except CheckpointNotFoundError as e:
            return str(e)
    return None


def test_load_without_any_checkpoint_raises_not_found_on_every_rank(root):
    for message in assert_all_ok(run_world(_load_nothing, 2, root)):
        assert message and "no committed checkpoint for run 'exp'" in message


def _save_steps(ctx, steps, keep_last, failpoint_step=None):
    from dcp_atomic import CheckpointManager

    with CheckpointManager(ctx.root, RUN, keep_last=keep_last, timeout=20) as manager:
        for step in steps:
            manager.save(step, {f"x{ctx.rank}": torch.full((4,), float(step))})
        return manager.steps()


def test_retention_counts_commit_time_not_step_number_after_a_rollback(root):
    assert_all_ok(run_world(_save_steps, 2, root, args=([10, 20, 30], None)))
    # restart from step 10: the live branch saves 15 and 25 with keep_last=2
    result = assert_all_ok(run_world(_save_steps, 2, root, args=([15, 25], 2)))[0]
    assert result == [15, 25]
    assert list_steps(root, RUN) == [15, 25]


def test_retention_ignores_and_keeps_fresh_partial_attempts(root):
    partial = os.path.join(root, RUN, "step_0000000040", time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-0000beef")
    os.makedirs(partial)
    assert_all_ok(run_world(_save_steps, 2, root, args=([1, 2, 3], 2)))
    assert list_steps(root, RUN) == [2, 3]
    assert os.path.isdir(partial), "an attempt within its lease may be an in-flight save: never deleted"


def _count_marker_scans_per_save(ctx, steps, keep_last):
    from dcp_atomic import CheckpointManager, manager as manager_module
    from dcp_atomic.protocol import catalog, retention

    scans = []

    def counted(*args, **kwargs):
        scans.append(1)
        return catalog.scan_markers(*args, **kwargs)

    manager_module.scan_markers = retention.scan_markers = counted  # every name a commit could scan through
    per_save = []
    with CheckpointManager(ctx.root, RUN, keep_last=keep_last, timeout=20, thread_count=1) as manager:
        for step in steps:
            del scans[:]
            manager.save(step, {"x": torch.full((4,), float(step))})
            per_save.append(len(scans))
        return {"scans": per_save, "steps": manager.steps()}


def test_retention_after_a_commit_does_not_scan_every_marker(root):
    """A save's retention reads a journal and the markers of the steps it deletes, not all of them: a run's
    100,000th commit costs what its 10th did.  Only the first commit (no journal yet) scans."""
    result = assert_all_ok(run_world(_count_marker_scans_per_save, 1, root, args=(list(range(1, 7)), 2)))[0]
    assert result["scans"] == [1, 0, 0, 0, 0, 0], result
    assert result["steps"] == [5, 6] and list_steps(root, RUN) == [5, 6]


def _save_where_finish_fails_after_commit(ctx):
    from dcp_atomic import CheckpointManager

    with CheckpointManager(ctx.root, RUN, timeout=20) as manager:
        return manager.save(5, {f"x{ctx.rank}": torch.ones(3)})


def test_failure_reported_after_the_commit_is_settled_by_the_marker(root):
    results = assert_all_ok(run_world(_save_where_finish_fails_after_commit, 2, root,
                                      env={"DCP_ATOMIC_FAILPOINTS": "commit.after_latest@0=raise"}))
    assert results == [5, 5]
    assert list_steps(root, RUN) == [5]
