"""Lineage from a job's first moment (P13, dcp_atomic/protocol/lineage.py): a durable root that refuses writes when
the job starts (a read-only mount; an S3 bucket refusing PUTs) leaves the job's local steps a provisional lineage,
recorded with the root it is for; once the store heals, the next job of the same experiment (same root, run id,
nodes) restores them -- the newest and an older one by number -- instead of training from scratch.

Worlds of ``tests/helpers/tiers.py``: 4 ranks as 2 simulated nodes, each node's ``local_root`` its own tmpfs.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess

import pytest

from tests.fault_fixtures import small_tmpfs_ctx
from tests.harness import assert_all_ok
from tests.helpers.fsdp_app import _fsdp_app, _full, _train_step
from tests.helpers.tiers import RUN, _exact, _Lines, _manager, _run, _state


@contextlib.contextmanager
def _read_only_root():
    """A durable root on its own tmpfs, mounted read-only (EROFS for every write, as root too); ``heal()`` makes it
    writable again."""
    with small_tmpfs_ctx(size_kib=65536) as fs:
        subprocess.run(["mount", "-o", "remount,ro", fs.path], check=True, capture_output=True)
        yield fs.path, lambda: subprocess.run(["mount", "-o", "remount,rw", fs.path], check=True, capture_output=True)


def _save_local_steps(ctx, steps, options=None):
    """Every step saved to the local tier only (the durable root refuses writes); each step's full weights."""
    lines = _Lines("dcp_atomic")
    model, optim = _fsdp_app(ctx.world_size, 0)
    saved = {}
    with _manager(ctx, keep_local=len(steps), storage_options=options) as manager:
        for step in steps:
            _train_step(model, optim, step)
            manager.save(step, _state(model, optim, step), durable=False)
            saved[step] = _full(model)
    return {"saved": saved, "lines": lines.lines}


def _restore_newest_and_older(ctx, older, options=None):
    """The next job of the experiment: restores the newest step, then ``older`` by number."""
    lines = _Lines("dcp_atomic")
    model, optim = _fsdp_app(ctx.world_size, 42)
    state = _state(model, optim, -1)
    with _manager(ctx, storage_options=options) as manager:
        newest = manager.load(state)
        newest_full, newest_tier = _full(model), manager.restored_from["tier"]
        loaded_older = manager.load(state, step=older)
        older_full = _full(model)
    return {"newest": newest, "newest_full": newest_full, "tier": newest_tier, "older": loaded_older,
            "older_full": older_full, "progress": state["progress"]["step"], "lines": lines.lines}


def _marker_lineages(nodes, steps):
    """(lineage, provisional_for) of each step's local marker on every node."""
    found = set()
    for node_root in nodes:
        for step in steps:
            with open(os.path.join(node_root, RUN, f"step_{step:010d}", "COMMITTED")) as f:
                marker = json.load(f)
            found.add((marker.get("lineage"), marker.get("provisional_for")))
    return found


def _check_restored(restored, saved, newest, older):
    for out in restored:
        assert (out["newest"], out["tier"], out["older"], out["progress"]) == (newest, "local", older, older), out
        _exact(out["newest_full"], saved[newest])
        _exact(out["older_full"], saved[older])
        assert not any("another durable root" in line for line in out["lines"]), out["lines"]


@pytest.mark.slow
def test_local_steps_saved_while_the_durable_root_was_read_only_are_restored_after_it_heals(nodes):
    with _read_only_root() as (durable, heal):
        first = assert_all_ok(_run(_save_local_steps, durable, nodes, [10, 20, 30]))
        told = [line for line in first[0]["lines"] if "cannot be written" in line]
        assert len(told) == 1 and "Read-only file system" in told[0], first[0]["lines"]
        assert os.path.join(durable, RUN, "LINEAGE") in told[0] and "provisional" in told[0], told
        [(lineage, provisional_for)] = _marker_lineages(nodes, [10, 20, 30])
        assert lineage is not None and provisional_for == durable, (lineage, provisional_for)
        heal()
        restored = assert_all_ok(_run(_restore_newest_and_older, durable, nodes, 10))
        _check_restored(restored, first[0]["saved"], 30, 10)
        with open(os.path.join(durable, RUN, "LINEAGE")) as f:
            assert json.load(f)["lineage"] == lineage  # adopted, not invented
        adopted = [line for line in restored[0]["lines"] if "did not exist; created it with lineage" in line]
        assert len(adopted) == 1 and lineage in adopted[0] and "[10, 20, 30]" in adopted[0], restored[0]["lines"]


def _heal_then_drain(ctx):
    """Step 10 local while the durable root is read-only; rank 0 heals it; step 20 drains."""
    import torch.distributed as dist

    model, optim = _fsdp_app(ctx.world_size, 0)
    saved = {}
    with _manager(ctx, keep_local=2) as manager:
        for step in (10, 20):
            if step == 20:
                if ctx.rank == 0:
                    subprocess.run(["mount", "-o", "remount,rw", ctx.root], check=True, capture_output=True)
                dist.barrier()
            _train_step(model, optim, step)
            manager.save(step, _state(model, optim, step), durable=step == 20)
            saved[step] = _full(model)
        manager.wait()
        durable = manager.steps(tier="durable")
    return {"saved": saved, "durable": durable}


@pytest.mark.slow
def test_the_first_drain_that_reaches_a_healed_root_creates_its_lineage_with_the_jobs_provisional_one(nodes):
    with _read_only_root() as (durable, _):
        first = assert_all_ok(_run(_heal_then_drain, durable, nodes))
        assert all(out["durable"] == [20] for out in first), first
        [(lineage, provisional_for)] = _marker_lineages(nodes, [10])
        assert provisional_for == durable, provisional_for
        with open(os.path.join(durable, RUN, "LINEAGE")) as f:
            assert json.load(f)["lineage"] == lineage  # created by the job itself, at its drain
        restored = assert_all_ok(_run(_restore_newest_and_older, durable, nodes, 10))
        _check_restored(restored, first[0]["saved"], 20, 10)
        assert not any("did not exist" in line for line in restored[0]["lines"])  # nothing left to adopt


def _heal_into_another_jobs_lineage(ctx):
    """Step 10 local while the durable root is read-only; rank 0 heals it and, as another job of this run id started
    while it was read-only would at its first drain, creates ``LINEAGE`` with that job's lineage; step 20 is saved
    for the drain.  What ``wait()`` raised on this rank, the durable steps, and what this job then restores."""
    import torch.distributed as dist

    from dcp_atomic.format import RunLayout
    from dcp_atomic.protocol.lineage import create_lineage, new_lineage
    from dcp_atomic.stores import open_storage

    model, optim = _fsdp_app(ctx.world_size, 0)
    saved, other = {}, None
    with _manager(ctx, keep_local=2) as manager:
        for step in (10, 20):
            if step == 20:
                if ctx.rank == 0:
                    subprocess.run(["mount", "-o", "remount,rw", ctx.root], check=True, capture_output=True)
                    other = create_lineage(RunLayout(open_storage(ctx.root), RUN), new_lineage())
                dist.barrier()
            _train_step(model, optim, step)
            manager.save(step, _state(model, optim, step), durable=step == 20)
            saved[step] = _full(model)
        try:
            manager.wait()
            raised = None
        except Exception as e:  # noqa: BLE001 - the test reads it
            raised = (type(e).__name__, str(e), dict(getattr(e, "details", {})))
        durable = manager.steps(tier="durable")
        fresh, fresh_optim = _fsdp_app(ctx.world_size, 42)
        state = _state(fresh, fresh_optim, -1)
        restored = (manager.load(state), manager.restored_from["tier"])
        _exact(_full(fresh), saved[20])  # the values of this job's step 20, on every rank
    return {"raised": raised, "durable": durable, "restored": restored, "other": other}


@pytest.mark.slow
def test_a_job_whose_provisional_lineage_lost_the_healed_root_to_another_job_commits_nothing_there(nodes):
    """Two jobs of one run id and durable root, both started while it could not be written: the second to reach it
    after it heals must not commit into the first one's lineage (its restart would then take the other job's steps
    for its own): refused by name on every rank, nothing committed, its local steps still restored by it."""
    with _read_only_root() as (durable, _):
        outcomes = assert_all_ok(_run(_heal_into_another_jobs_lineage, durable, nodes))
        other = outcomes[0]["other"]
        with open(os.path.join(durable, RUN, "LINEAGE")) as f:
            assert json.load(f)["lineage"] == other
        for out in outcomes:
            kind, message, details = out["raised"]
            assert kind == "CommitConflictError" and other in message and "LINEAGE" in message, out["raised"]
            assert details["lineage"] == other and details["own_lineage"] != other, details
            assert out["durable"] == [] and out["restored"] == (20, "local"), out
        assert not os.path.exists(os.path.join(durable, RUN, "step_0000000020")), os.listdir(os.path.join(durable, RUN))


@pytest.mark.slow
def test_local_steps_saved_while_an_s3_bucket_refused_every_put_are_restored_after_it_heals(nodes, s3_moto):
    """The S3 form of a read-only root (403 AccessDenied to every PUT): the manager starts as on POSIX."""
    options = s3_moto.options()
    refusal = s3_moto.proxy.fail(op="PUT", status=403, code="AccessDenied")
    first = assert_all_ok(_run(_save_local_steps, s3_moto.root, nodes, [10, 20], options))
    told = [line for line in first[0]["lines"] if "cannot be written" in line]
    assert len(told) == 1 and "403 AccessDenied" in told[0] and f"/{RUN}/LINEAGE" in told[0], told
    assert refusal.hits > 0 and s3_moto.keys(RUN) == []
    [(lineage, provisional_for)] = _marker_lineages(nodes, [10, 20])
    assert provisional_for == s3_moto.root, provisional_for
    s3_moto.proxy.reset()  # the bucket takes writes again
    restored = assert_all_ok(_run(_restore_newest_and_older, s3_moto.root, nodes, 10, options))
    _check_restored(restored, first[0]["saved"], 20, 10)
    assert json.loads(s3_moto.get(f"{RUN}/LINEAGE"))["lineage"] == lineage
