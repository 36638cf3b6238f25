"""The memory tier (P16): snapshots into RAM-backed slots with verified copies on other failure domains, one commit
sequence with the other tiers, and restores that never load a torn, mixed, damaged or foreign step.

Worlds of 4 ranks as 2 simulated nodes (failure domains nodeA/nodeB), each node's memory path on its own tmpfs,
the durable root on disk.  A *wiped node* is its memory path emptied between two worlds.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import random
import shutil
import subprocess
import threading

import pytest
import torch

from dcp_atomic.memory import SlotRecord
from testbed.memory_campaign import PHASES
from tests.fault_fixtures import small_tmpfs_ctx
from tests.harness import assert_all_ok
from tests.helpers.fsdp_app import _train_step
from tests.helpers.memory import full_state, memory_manager, state_of, trained
from tests.helpers.tiers import RUN, _flip_byte, _Lines, _node_env, _run, WORLD


def _train_and_snapshot(ctx, model, optim, manager, first, last, durable=()):
    """Steps ``first..last``: train, snapshot (waited for), and ``save`` the steps in ``durable``."""
    for step in range(first, last + 1):
        _train_step(model, optim, step)
        assert manager.snapshot(step, state_of(model, optim, step)).result() == step
        if step in durable:
            manager.save(step, state_of(model, optim, step))


def _snapshot_steps(ctx, last, durable=()):
    model, optim = trained(WORLD, 0)
    with memory_manager(ctx) as manager:
        _train_and_snapshot(ctx, model, optim, manager, 1, last, durable)


def _exact_at(model, optim, step) -> bool:
    """This job's state is exactly the reference run's after ``step`` steps (collectives: every rank alike)."""
    got = full_state(model, optim)
    want = full_state(*trained(WORLD, step))
    return got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def _restore(ctx, root=None):
    """A fresh job: load() with no step; (step, tier, exact against the reference run's state of that step)."""
    model, optim = trained(WORLD, 0, seed=7)
    with memory_manager(ctx, **({"root": root} if root else {})) as manager:
        step = manager.load(state_of(model, optim, 0))
        tier = (manager.restored_from or {}).get("tier")
    return step, tier, _exact_at(model, optim, step)


def _mem(nodes, node):
    return os.path.join(nodes[node], "mem")


def _record_of(nodes, node, rank, step) -> str:
    """The commit record of ``rank``'s share of ``step`` on ``node``'s memory path."""
    for path in glob.glob(os.path.join(_mem(nodes, node), RUN, f"r{rank}", "slot*.commit")):
        with open(path, "rb") as f:
            if SlotRecord.from_bytes(f.read(), path).step == step:
                return path
    raise AssertionError(f"no record of rank {rank} step {step} on node {node}")


def _reseal(path, **changes):
    """Rewrite a record with ``changes``, sealed properly: only a check of its content can catch it."""
    with open(path, "rb") as f:
        record = SlotRecord.from_bytes(f.read(), path)
    with open(path, "wb") as f:
        f.write(dataclasses.replace(record, **changes).to_bytes())


@pytest.fixture
def pristine(nodes):
    """Put both nodes' memory paths back as a snapshot world left them (``save()`` first, then ``reset()``)."""
    saved = []

    class Copies:
        def save(self):
            for node in range(2):
                shutil.copytree(_mem(nodes, node), _mem(nodes, node) + ".orig")
            saved.append(True)

        def reset(self):
            for node in range(2):
                shutil.rmtree(_mem(nodes, node))
                shutil.copytree(_mem(nodes, node) + ".orig", _mem(nodes, node))

    return Copies()


# -- snapshots and restores ----------------------------------------------------------------------------------


def test_a_fresh_job_restores_the_newest_snapshot_from_memory_exactly(root, nodes):
    assert_all_ok(_run(_snapshot_steps, root, nodes, 4))
    outcomes = assert_all_ok(_run(_restore, root, nodes))
    assert outcomes == [(4, "memory", True)] * WORLD, outcomes


def test_a_wiped_node_restores_from_replicas_and_no_memory_left_restores_the_durable_root(root, nodes):
    assert_all_ok(_run(_snapshot_steps, root, nodes, 4, (2,)))
    shutil.rmtree(os.path.join(_mem(nodes, 1), RUN))  # node B replaced: its RAM is empty
    outcomes = assert_all_ok(_run(_restore, root, nodes))
    assert outcomes == [(4, "memory-replica", True)] * WORLD, outcomes
    for node in range(2):
        shutil.rmtree(os.path.join(_mem(nodes, node), RUN), ignore_errors=True)
    outcomes = assert_all_ok(_run(_restore, root, nodes))
    assert outcomes == [(2, "durable", True)] * WORLD, outcomes  # the durable root served in memory's place


def _restore_then_fail_the_next_snapshot(ctx, damaged):
    """Restore, then snapshot the next step with rank ``damaged``'s new slot damaged before it is sent: its holder
    refuses the copy, so that snapshot fails on every rank.  (step, tier, the failure's type)."""
    from dcp_atomic._base import failpoints
    from dcp_atomic.errors import CheckpointError

    def damage(rank, step):
        if rank == damaged:
            own = glob.glob(os.path.join(_mem(ctx.extra["nodes"], rank // 2), RUN, f"r{rank}", "slot*.data"))
            _flip_byte(max(own, key=os.path.getmtime))

    model, optim = trained(WORLD, 0, seed=7)
    with memory_manager(ctx) as manager:
        step = manager.load(state_of(model, optim, 0))
        tier = manager.restored_from["tier"]
        failpoints.arm("memory.replica_send", damage)
        _train_step(model, optim, step + 1)
        try:
            manager.snapshot(step + 1, state_of(model, optim, step + 1)).result()
        except CheckpointError as e:
            return step, tier, type(e).__name__
    return step, tier, None


@pytest.mark.parametrize("lost", ["node B's memory", "rank 0 before its record"])
def test_a_share_restored_from_its_replica_survives_a_failed_next_snapshot(root, nodes, lost):
    """Step 3 is restored with a share from its holder's copy (node B wiped; or rank 0 killed after the sequence,
    before its own record).  The next snapshot must not take that share's slot: when it fails, step 3 is still the
    newest memory-committed step (before, the holder retired its copy of step 3 to receive step 4, and the restart
    found no checkpoint)."""
    if lost == "rank 0 before its record":
        def rank_env(rank):
            return {**_node_env(rank), "DCP_ATOMIC_FAILPOINTS": "memory.before_record#3=kill" if rank == 0 else None}

        assert _run(_snapshot_steps, root, nodes, 3, rank_env=rank_env)[0].killed
    else:
        assert_all_ok(_run(_snapshot_steps, root, nodes, 3))
        shutil.rmtree(os.path.join(_mem(nodes, 1), RUN))
    damaged = 0 if lost == "rank 0 before its record" else 2
    outcomes = assert_all_ok(_run(_restore_then_fail_the_next_snapshot, root, nodes, damaged))
    assert outcomes == [(3, "memory-replica", "StorageError")] * WORLD, outcomes
    outcomes = assert_all_ok(_run(_restore, root, nodes))
    assert outcomes == [(3, "memory", True)] * WORLD, outcomes


def test_a_durable_save_after_the_newest_snapshot_is_newer_by_commit_sequence_and_wins(root, nodes):
    """By commit sequence, not step: the durable save of step 3, after the snapshot of step 3, is the newer commit."""
    assert_all_ok(_run(_snapshot_steps, root, nodes, 3, (3,)))
    assert assert_all_ok(_run(_restore, root, nodes)) == [(3, "durable", True)] * WORLD


def _with_local_tier(ctx, first):
    """Memory and a local tier.  The first job (``first``): snapshots 1-2, a local save of 2, snapshot 3, a local save
    of 3 (the newest commit: it must number above the snapshot made since the last local save).  The next: restore,
    then snapshot 4 (the newest).  Returns what was restored."""
    from dcp_atomic import LocalTierOptions

    local = LocalTierOptions(os.path.join(ctx.extra["nodes"][ctx.rank // 2], "local"), replicas=1,
                             durable_every=None)
    model, optim = trained(WORLD, 0, seed=0 if first else 7)
    with memory_manager(ctx, local=local) as manager:
        if first:
            _train_and_snapshot(ctx, model, optim, manager, 1, 2)
            manager.save(2, state_of(model, optim, 2))
            _train_and_snapshot(ctx, model, optim, manager, 3, 3)
            manager.save(3, state_of(model, optim, 3))
            return None
        step = manager.load(state_of(model, optim, 0))
        restored = (step, manager.restored_from["tier"], _exact_at(model, optim, step))
        if step == 3:
            _train_and_snapshot(ctx, model, optim, manager, 4, 4)
    return restored


def test_memory_and_local_commits_share_one_sequence_and_the_newer_is_restored(root, nodes):
    assert_all_ok(_run(_with_local_tier, root, nodes, True))
    assert assert_all_ok(_run(_with_local_tier, root, nodes, False)) == [(3, "local", True)] * WORLD
    assert assert_all_ok(_run(_with_local_tier, root, nodes, False)) == [(4, "memory", True)] * WORLD


def test_damaged_slots_are_served_around_from_replicas_never_loaded(root, nodes, pristine):
    assert_all_ok(_run(_snapshot_steps, root, nodes, 4))
    pristine.save()
    record = _record_of(nodes, 0, 0, 4)
    _flip_byte(record.replace(".commit", ".data"), offset=200)  # rank 0's own slot on node A
    outcomes = assert_all_ok(_run(_restore, root, nodes))
    assert outcomes == [(4, "memory-replica", True)] * WORLD, outcomes
    pristine.reset()
    data = _record_of(nodes, 1, 3, 4).replace(".commit", ".data")
    os.truncate(data, os.path.getsize(data) // 2)  # rank 3's own slot on node B
    outcomes = assert_all_ok(_run(_restore, root, nodes))
    assert outcomes == [(4, "memory-replica", True)] * WORLD, outcomes


def test_resealed_records_and_another_lineage_are_refused_by_name(root, nodes, pristine):
    assert_all_ok(_run(_snapshot_steps, root, nodes, 4))
    pristine.save()
    for node, rank in ((0, 0), (1, 0)):  # both copies of rank 0's step 4 now claim step 9 at its sequence
        _reseal(_record_of(nodes, node, rank, 4), step=9)
    outcomes = assert_all_ok(_run(_restore, root, nodes))
    assert outcomes == [(3, "memory", True)] * WORLD, outcomes  # the records of sequence 4 disagree: step 3
    pristine.reset()
    with open(_record_of(nodes, 1, 2, 4), "rb") as f:
        sequence = SlotRecord.from_bytes(f.read(), "").sequence
    _reseal(_record_of(nodes, 1, 2, 4), sequence=sequence + 50)  # rank 2 alone at a later sequence: incomplete
    outcomes = assert_all_ok(_run(_restore, root, nodes))
    assert outcomes == [(4, "memory-replica", True)] * WORLD, outcomes  # rank 2's share of 4: its copy on node A
    pristine.reset()
    outcomes = assert_all_ok(_run(_restore_for_another_root, root, nodes))
    assert [error for error, _ in outcomes] == ["CheckpointNotFoundError"] * WORLD, outcomes
    assert outcomes[0][1], outcomes  # rank 0 names the foreign slots


def _restore_for_another_root(ctx):
    """A job of the same run id on the same nodes for another durable root: another lineage."""
    lines = _Lines("dcp_atomic.memory")
    try:
        _restore(ctx, root=os.path.join(ctx.root, "another"))
    except Exception as e:
        return type(e).__name__, [line for line in lines.lines if "another run or lineage" in line]
    return "loaded", []


# -- configuration -----------------------------------------------------------------------------------------------


def _refusals(ctx, readonly):
    """What a budget too small, a missing path (rank 3) and a read-only one (rank 1) make every rank raise."""
    from dcp_atomic.errors import ConfigurationError

    seen = []
    model, optim = trained(WORLD, 0)
    with memory_manager(ctx, budget_bytes=1000) as manager:
        try:
            manager.snapshot(1, state_of(model, optim, 1))
        except ConfigurationError as e:
            seen.append(str(e))
    for path in (os.path.join(ctx.root, "missing") if ctx.rank == 3 else None, readonly if ctx.rank == 1 else None):
        try:
            memory_manager(ctx, path=path).close()
        except ConfigurationError as e:
            seen.append(str(e))
    return seen


def test_a_budget_too_small_and_a_path_that_cannot_hold_the_tier_are_refused_on_every_rank(root, nodes):
    with small_tmpfs_ctx(size_kib=1024) as fs:
        subprocess.run(["mount", "-o", "remount,ro", fs.path], check=True)
        outcomes = assert_all_ok(_run(_refusals, root, nodes, fs.path))
    for budget, missing, readonly in outcomes:
        assert "over budget_bytes=1000" in budget and "needs" in budget and "bytes" in budget, budget
        assert "rank 3" in missing and "missing does not exist" in missing, missing
        assert "rank 1" in readonly and fs.path in readonly and "not writable" in readonly, readonly


def _snapshot_while_one_is_in_flight(ctx):
    """Rank 0 holds snapshot 1 before its copies move (so every rank's is in flight); 2 is due meanwhile."""
    from dcp_atomic._base import failpoints

    held = threading.Event()
    failpoints.arm("memory.replica_send", lambda rank, step: step == 1 and rank == 0 and held.wait(20))
    model, optim = trained(WORLD, 0)
    with memory_manager(ctx) as manager:
        first = manager.snapshot(1, state_of(model, optim, 1))
        second = manager.snapshot(2, state_of(model, optim, 2))
        skipped = (second.skipped, second.result(), manager.snapshots_skipped)
        held.set()
        done = first.result()
        third = manager.snapshot(3, state_of(model, optim, 3))
        return skipped, done, third.result(), manager.snapshots_skipped


def test_a_snapshot_due_while_one_is_in_flight_is_skipped_and_counted(root, nodes):
    outcomes = assert_all_ok(_run(_snapshot_while_one_is_in_flight, root, nodes))
    assert outcomes == [((True, None, 1), 1, 3, 1)] * WORLD, outcomes


def _snapshot_every_second_call(ctx):
    model, optim = trained(WORLD, 0)
    with memory_manager(ctx, every=2) as manager:
        taken = []
        for step in (1, 2, 3):
            future = manager.snapshot(step, state_of(model, optim, step))
            taken.append((future.skipped, future.result()))  # waited for: none is in flight at the next call
        return taken, manager.snapshots_skipped


def test_every_second_call_snapshots_and_the_others_are_not_counted_as_skipped_in_flight(root, nodes):
    outcomes = assert_all_ok(_run(_snapshot_every_second_call, root, nodes))
    assert outcomes == [([(False, 1), (True, None), (False, 3)], 0)] * WORLD, outcomes


# -- kills --------------------------------------------------------------------------------------------------------


def _resume_then_die(ctx, expected, last):
    """Restore (``expected``: the step it must be, None for a first job), check it exactly, then snapshot every
    step up to ``last`` until the armed failpoint kills a rank."""
    from dcp_atomic.exchange import file_transfer

    model, optim = trained(WORLD, 0, seed=0 if expected is None else 7)  # the reference run's start, or a restore's
    with memory_manager(ctx, timeout=5) as manager:
        file_transfer.DIRECT_CHUNK_BYTES = 128  # this small model's shares land in several chunks: a half exists
        start = 0
        if expected is not None:
            start = manager.load(state_of(model, optim, 0))
            assert (start, _exact_at(model, optim, start)) == (expected, True), (start, expected)
        _train_and_snapshot(ctx, model, optim, manager, start + 1, last)
    return start


@pytest.mark.slow
def test_a_rank_or_a_node_killed_at_any_phase_restores_the_newest_memory_committed_step_exactly(root, nodes):
    chooser = random.Random(43)
    expected, step = None, 0
    for phase in PHASES:
        victims = chooser.choice([[chooser.randrange(WORLD)], [2, 3], [0, 1]])
        step += chooser.randint(1, 3)
        taken = step - (expected or 0)  # the killing step is this world's taken-th snapshot
        spec = f"memory.{phase}#{taken}=kill"

        def rank_env(rank, spec=spec, victims=victims):
            return {**_node_env(rank), "DCP_ATOMIC_FAILPOINTS": spec if rank in victims else None}

        outcomes = _run(_resume_then_die, root, nodes, expected, step + 5, rank_env=rank_env)
        assert all(outcomes[v].killed for v in victims), (phase, victims, step, outcomes)
        survivors = [o for o in outcomes if o.rank not in victims]
        # typed on every survivor (a lost peer, or a collective the dead rank left), and named: a survivor that judges
        # after rank 0 has exited with its own error may find the store gone and name rank 0 instead
        assert all(o.error_type in ("PeerLost", "RankFailureError", "CollectiveFailed") for o in survivors), outcomes
        assert any(f"rank(s): {v}" in o.error for v in victims for o in survivors), [
            (phase, victims, o.error[o.error.find("ilent"):][:200]) for o in survivors]
        expected = step if PHASES[phase] else step - 1
    assert assert_all_ok(_run(_restore, root, nodes)) == [(expected, "memory", True)] * WORLD


def _snapshot_until_frozen(ctx):
    """Step 1 snapshotted; step 2's snapshot while rank 3 freezes (SIGSTOP) about to send its replica: what each
    other rank's future raised, and how fast.  No close(): a peer is frozen."""
    import time

    from tests.helpers.read_once import _survivors_barrier

    model, optim = trained(WORLD, 0)
    manager = memory_manager(ctx, timeout=5)
    _train_and_snapshot(ctx, model, optim, manager, 1, 1)
    _train_step(model, optim, 2)
    started = time.monotonic()
    try:
        manager.snapshot(2, state_of(model, optim, 2)).result()
        seen = {"error": None}
    except Exception as e:  # noqa: BLE001 - the test reads the failure
        seen = {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - started}
    _survivors_barrier(ctx, [0, 1, 2])  # rank 0 hosts the store: it outlives the others' verdicts
    return seen


def _restore_until_frozen(ctx):
    """A fresh job's load() while rank 1 freezes (SIGSTOP) before the check of the copies chosen: what each other
    rank raised, and how fast.  No close(): a peer is frozen."""
    import time

    from tests.helpers.read_once import _survivors_barrier

    model, optim = trained(WORLD, 0, seed=7)
    manager = memory_manager(ctx, timeout=5)
    started = time.monotonic()
    try:
        seen = {"error": None, "step": manager.load(state_of(model, optim, 0))}
    except Exception as e:  # noqa: BLE001 - the test reads the failure
        seen = {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - started}
    _survivors_barrier(ctx, [0, 2, 3])
    return seen


@pytest.mark.slow
def test_a_rank_frozen_mid_snapshot_or_mid_restore_is_named_by_every_other_rank_and_the_previous_snapshot_restores(
        root, nodes):
    """Every other rank waits on the frozen one somewhere else (its replica's receiver, the sequence's gather): each
    must give up within a few liveness timeouts, typed and naming rank 3, not at the group's timeout."""
    from testbed.worlds import run_world

    def env(rank):
        return {**_node_env(rank), "DCP_ATOMIC_FAILPOINTS": "memory.replica_send#2=stop" if rank == 3 else None}

    outcomes = run_world(_snapshot_until_frozen, WORLD, root, rank_env=env, extra={"nodes": nodes}, timeout=120,
                         pg_timeout=5, wait_for=[0, 1, 2])
    for out in assert_all_ok(outcomes[:3]):
        assert out["error"] in ("PeerLost", "RankFailureError", "CollectiveFailed"), out
        assert "rank(s): 3" in out["message"] and out["seconds"] < 60, out

    # the restore's agreement on the chosen copies: rank 1 frozen there is named, typed, by the others
    for done in glob.glob(os.path.join(root, ".done.*")):  # the first world's survivors' marks
        os.remove(done)
    def frozen_in_restore(rank):
        return {**_node_env(rank), "DCP_ATOMIC_FAILPOINTS": "memory.restore_check#1=stop" if rank == 1 else None}

    outcomes = run_world(_restore_until_frozen, WORLD, root, rank_env=frozen_in_restore, extra={"nodes": nodes},
                         timeout=120, pg_timeout=5, wait_for=[0, 2, 3])
    for out in assert_all_ok([outcomes[r] for r in (0, 2, 3)]):
        assert out["error"] in ("PeerLost", "RankFailureError", "CollectiveFailed"), out
        assert "rank(s): 1" in out["message"] and out["seconds"] < 60, out
    assert assert_all_ok(_run(_restore, root, nodes)) == [(1, "memory", True)] * WORLD


def test_one_process_restores_top_level_objects_into_the_callers_state_dict(tmp_path):
    """One process, no replicas: tensors are copied in place and objects (top-level and nested) are put back into
    the state dict the caller passed, as ``dcp.load`` does (a top-level int stayed at its old value before)."""
    from dcp_atomic import CheckpointManager, MemoryTier

    memory = tmp_path / "shm"
    memory.mkdir()
    state = {"w": torch.arange(8.0), "step": 0, "nested": {"epoch": 0}}
    with CheckpointManager(str(tmp_path / "ckpt"), RUN, memory=MemoryTier(str(memory), replicas=0)) as manager:
        for step in (1, 2, 3):
            state["w"] += 1
            state["step"], state["nested"]["epoch"] = step, step
            assert manager.snapshot(step, state).result() == step
    fresh = {"w": torch.zeros(8), "step": -1, "nested": {"epoch": -1}}
    with CheckpointManager(str(tmp_path / "ckpt"), RUN, memory=MemoryTier(str(memory), replicas=0)) as manager:
        assert manager.load(fresh) == 3 and manager.restored_from["tier"] == "memory"
    assert torch.equal(fresh["w"], torch.arange(8.0) + 3) and fresh["step"] == 3 and fresh["nested"] == {"epoch": 3}
