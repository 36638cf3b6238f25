"""Observability: every dict the manager's callbacks receive matches docs/statistics.md (names and
types), for a save, an async save, a load and failed saves, in a real gloo world of two ranks; the
TensorBoard example runs and writes event files."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import re
import subprocess
import sys
import typing

import torch

from tests.harness import assert_all_ok, run_world
from tests.helpers.stats import REPO, _schema_problems, _table

RUN = "exp"


def test_the_documented_schema_is_the_dataclasses_schema():
    from dcp_atomic._base import stats

    for prefix, cls in [("Save", stats.SaveStats), ("Per rank", stats.RankSaveStats), ("Load", stats.LoadStats),
                        ("Failure", stats.FailureStats), ("Drain", stats.DrainStats), ("Snapshot", stats.SnapshotStats)]:
        hints = typing.get_type_hints(cls)
        declared = {f.name: str(hints[f.name]).replace("typing.", "").replace("dcp_atomic._base.stats.", "")
                    for f in dataclasses.fields(cls)}
        declared = {name: re.sub(r"<class '(\w+)'>", r"\1", kind) for name, kind in declared.items()}
        assert declared == _table(prefix), (prefix, declared)
    assert stats.SCHEMA_VERSION == 1


# -- a real world: every callback, every field ----------------------------------------------------------


def _state(rank: int, step: int) -> dict:
    return {f"r{rank}": torch.full((8,), float(step)), "shared": torch.arange(4.0) * step}


def _observed_job(ctx):
    from dcp_atomic import Callbacks, CheckpointManager
    from dcp_atomic._base import failpoints

    seen: dict = {"saved": [], "loaded": [], "failed": []}

    def loaded(stats):
        seen["loaded"].append(stats)
        raise RuntimeError("a broken metrics exporter")

    def failed(stats):
        seen["failed"].append(stats)
        raise RuntimeError("a broken metrics exporter")

    callbacks = Callbacks(on_saved=seen["saved"].append, on_loaded=loaded, on_failed=failed)
    with CheckpointManager(ctx.root, RUN, timeout=20, thread_count=1, callbacks=callbacks) as manager:
        manager.save(1, _state(ctx.rank, 1))
        manager.async_save(2, _state(ctx.rank, 2)).result()
        target = {k: torch.zeros_like(v) for k, v in _state(ctx.rank, 0).items()}
        seen["load_returned"] = manager.load(target)
        try:
            if ctx.rank == 1:
                failpoints.arm("write.mid_data", "raise", rank=1)
            try:
                manager.save(3, _state(ctx.rank, 3))
            except Exception as e:  # noqa: BLE001 - the type is what the test asserts
                seen["save_raised"] = type(e).__name__
            future = manager.async_save(4, _state(ctx.rank, 4))
            concurrent.futures.wait([future], timeout=60)
            seen["async_raised"] = type(future.exception()).__name__
        finally:
            failpoints.disarm_all()
        seen["callback_failures"] = manager.callback_failures
    return seen


def _save_ids(root: str, steps: tuple[int, ...]) -> dict[int, str]:
    from dcp_atomic.protocol.commit import read_marker
    from dcp_atomic.format.layout import RunLayout
    from dcp_atomic._base.retry import Deadline
    from dcp_atomic.stores.backends import open_storage

    layout = RunLayout(open_storage(root), RUN)
    return {step: read_marker(layout, step, Deadline(5)).save_id for step in steps}


def test_callbacks_deliver_the_documented_schema_for_saves_loads_and_failures(root):
    results = assert_all_ok(run_world(_observed_job, 2, root, timeout=120))
    save_ids = _save_ids(root, (1, 2))
    saves, loads, failures = _table("Save"), _table("Load"), _table("Failure")

    assert results[1]["saved"] == [], "save statistics are delivered on rank 0 only"
    saved = results[0]["saved"]
    assert [(s["step"], s["asynchronous"]) for s in saved] == [(1, False), (2, True)], saved
    for s in saved:
        assert _schema_problems(s, saves) == [], (s, _schema_problems(s, saves))
        assert (s["kind"], s["schema_version"], s["run_id"], s["world_size"]) == ("save", 1, RUN, 2), s
        assert s["save_id"] == save_ids[s["step"]], s
        assert [r["rank"] for r in s["ranks"]] == [0, 1], s
        assert s["bytes"] == sum(r["bytes"] for r in s["ranks"]) > 0, s
        assert s["gb_per_s"] == s["bytes"] / s["seconds"] / 1e9, s
        assert s["seconds"] >= s["commit_seconds"] > 0 and s["retention_error"] is None, s
    assert saved[0]["stage_seconds"] == 0.0 < saved[1]["stage_seconds"] <= saved[1]["seconds"], saved

    for rank, seen in enumerate(results):
        (load,) = seen["loaded"]
        assert _schema_problems(load, loads) == [], (load, _schema_problems(load, loads))
        assert (load["kind"], load["step"], load["save_id"], load["rank"], load["world_size"]) == \
            ("load", 2, save_ids[2], rank, 2), load
        expected_bytes = sum(t.nbytes for t in _state(rank, 2).values())  # raw, uncompressed: stored == nbytes
        assert load["bytes"] == expected_bytes and load["files"] >= 1, (load, expected_bytes)
        assert seen["load_returned"] == 2, seen  # the raising on_loaded did not fail the load

        assert [(f["operation"], f["step"]) for f in seen["failed"]] == [("save", 3), ("async_save", 4)], seen
        for failure in seen["failed"]:
            assert _schema_problems(failure, failures) == [], (failure, _schema_problems(failure, failures))
            assert failure["error_type"] == "StorageError" and "injected I/O error" in failure["message"], failure
            assert (failure["ranks"], failure["rank"], failure["world_size"]) == ([1], rank, 2), failure
            assert failure["seconds"] > 0 and failure["kind"] == "failure", failure
        # the raising on_failed did not replace the typed error; each callback failure was counted
        assert (seen["save_raised"], seen["async_raised"]) == ("StorageError", "StorageError"), seen
        assert seen["callback_failures"] == 3, seen


def _snapshotting_job(ctx):
    """Rank r alone on simulated node r, one replica on the other: three snapshots, their statistics."""
    from dcp_atomic import Callbacks, CheckpointManager, MemoryTier

    path = os.path.join(ctx.extra["nodes"][ctx.rank], "mem")
    os.makedirs(path, exist_ok=True)
    seen: list = []
    with CheckpointManager(ctx.root, RUN, timeout=20, memory=MemoryTier(path, replicas=1, slots=2),
                           callbacks=Callbacks(on_snapshot=seen.append)) as manager:
        for step in (1, 2, 3):
            assert manager.snapshot(step, _state(ctx.rank, step)).result() == step
        return {"snapshots": seen, "skipped": manager.snapshots_skipped}


def test_every_rank_receives_each_memory_committed_snapshots_documented_statistics(root, nodes):
    from tests.helpers.memory import one_node_per_rank
    from tests.helpers.tiers import _run

    results = assert_all_ok(_run(_snapshotting_job, root, nodes, world=2, rank_env=one_node_per_rank))
    documented = _table("Snapshot")
    shares = []
    for rank, seen in enumerate(results):
        snapshots = seen["snapshots"]
        assert [s["step"] for s in snapshots] == [1, 2, 3], snapshots
        for s in snapshots:
            assert _schema_problems(s, documented) == [], (s, _schema_problems(s, documented))
            assert (s["kind"], s["rank"], s["world_size"], s["run_id"]) == ("snapshot", rank, 2, RUN), s
            assert s["bytes"] >= sum(t.nbytes for t in _state(rank, 1).values()) and s["replica_bytes_sent"] == \
                s["bytes"], s  # one replica
            assert s["committed_seconds"] >= s["call_seconds"] > 0, s
            assert s["snapshots_skipped"] == seen["skipped"] == 0, s
        assert [s["sequence"] for s in snapshots] == sorted({s["sequence"] for s in snapshots}), snapshots
        shares.append(snapshots[-1])
    assert shares[0]["replica_bytes_received"] == shares[1]["bytes"] > 0, shares  # each holds the other's copy
    assert shares[1]["replica_bytes_received"] == shares[0]["bytes"], shares
    assert shares[0]["sequence"] == shares[1]["sequence"], shares


def _confirmed_from_marker_job(ctx):
    """DCP reports a failure after rank 0's marker is visible (LATEST fails): the save committed."""
    from dcp_atomic import Callbacks, CheckpointManager
    from dcp_atomic._base import failpoints

    saved: list = []
    with CheckpointManager(ctx.root, RUN, timeout=20, thread_count=1,
                           callbacks=Callbacks(on_saved=saved.append)) as manager:
        if ctx.rank == 0:
            failpoints.arm("commit.after_marker", "raise", rank=0)
        try:
            returned = manager.save(1, _state(ctx.rank, 1))
        finally:
            failpoints.disarm_all()
    return {"returned": returned, "saved": saved}


def test_a_save_confirmed_from_the_marker_still_delivers_the_documented_schema(root):
    results = assert_all_ok(run_world(_confirmed_from_marker_job, 2, root, timeout=90))
    assert [r["returned"] for r in results] == [1, 1], results
    (stats,) = results[0]["saved"]
    assert _schema_problems(stats, _table("Save")) == [], (stats, _schema_problems(stats, _table("Save")))
    assert stats["save_id"] == _save_ids(root, (1,))[1] and stats["bytes"] is None and stats["ranks"] == [], stats


# -- the example -------------------------------------------------------------------------------------------


def test_the_tensorboard_example_writes_the_statistics_as_event_files(root):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logdir = os.path.join(root, "tb")
    done = subprocess.run([sys.executable, os.path.join(REPO, "examples", "tensorboard_stats.py"),
                           "--root", os.path.join(root, "ckpt"), "--logdir", logdir, "--steps", "3"],
                          capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": REPO})  # this checkout, installed or not
    assert done.returncode == 0 and "failed as intended: CommitConflictError" in done.stdout, (done.stdout, done.stderr)
    events = EventAccumulator(logdir)
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in ("checkpoint/save/seconds", "checkpoint/save/bytes", "checkpoint/save/gb_per_s",
                "checkpoint/load/seconds", "checkpoint/load/bytes", "checkpoint/failures"):
        assert tag in tags, (tag, sorted(tags))
    assert [e.step for e in events.Scalars("checkpoint/save/seconds")] == [10, 20, 30]
    assert all(e.value > 0 for e in events.Scalars("checkpoint/save/bytes"))
    assert [e.step for e in events.Scalars("checkpoint/load/bytes")] == [30]
    assert [(e.step, e.value) for e in events.Scalars("checkpoint/failures")] == [(30, 1.0)]  # re-saved step 30
    assert "checkpoint/save/schema_version" not in tags
