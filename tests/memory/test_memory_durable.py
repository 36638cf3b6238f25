"""Durable copies of memory-committed snapshots (``MemoryTier(durable_every=N)``): every N-th memory-committed
snapshot becomes a durable step of the same number, saved from its slot's bytes while training goes on, its slot
pinned until that save is done; a restore orders the copy by its snapshot's sequence.

Worlds of 4 ranks as 2 simulated nodes (failure domains nodeA/nodeB), each node's memory path on its own tmpfs, the
durable root on disk.
"""

from __future__ import annotations

import os
import shutil
import threading

import pytest
import torch
import torch.distributed as dist

from dcp_atomic.memory import SlotRecord
from dcp_atomic.protocol import read_committed, scan_markers
from dcp_atomic._base.retry import Deadline
from dcp_atomic.format import RunLayout
from dcp_atomic.stores import open_storage
from tests.harness import assert_all_ok
from tests.helpers.fsdp_app import _train_step
from tests.helpers.memory import full_state, memory_manager, memory_path, state_of, trained
from tests.helpers.tiers import RUN, WORLD, _flip_byte, _run


def _exact_at(model, optim, step) -> bool:
    """This job's state is exactly the reference run's after ``step`` steps (collectives: every rank alike)."""
    got, want = full_state(model, optim), full_state(*trained(WORLD, step))
    return got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def _durable_steps(root) -> list[int]:
    return [marker.step for marker in scan_markers(RunLayout(open_storage(root), RUN))]


def _copied_sequences(root) -> dict[int, tuple[int | None, dict | None]]:
    """Each durable step's (manifest's ``copy_of_sequence``, user metadata): the order is the protocol's field."""
    layout = RunLayout(open_storage(root), RUN)
    found = {}
    for marker in scan_markers(layout):
        manifest = read_committed(layout, marker.step, Deadline(10)).manifest
        found[marker.step] = (manifest.copy_of_sequence, manifest.user_metadata)
    return found


def _own_slot_steps(ctx) -> list[int]:
    """The steps this rank's own slots hold (their commit records, on its node's memory path)."""
    rank_dir = os.path.join(memory_path(ctx), RUN, f"r{ctx.rank}")
    steps = []
    for name in sorted(os.listdir(rank_dir)):
        if name.endswith(".commit"):
            with open(os.path.join(rank_dir, name), "rb") as f:
                steps.append(SlotRecord.from_bytes(f.read(), name).step)
    return sorted(steps)


def _snapshot_every_step(ctx, last):
    """Snapshot steps 1..``last`` with ``durable_every=2``; training changes the tensors right after each
    ``snapshot()`` returns, so a durable copy (started at the next call) finds the live state a step ahead.  The
    copy of 6 is held for a second (its write), so it commits after the snapshot of 7 is memory-committed."""
    from dcp_atomic._base import failpoints

    failpoints.arm("write.before_data#3", "sleep:1")  # the 3rd durable write: the copy of 6
    model, optim = trained(WORLD, 0)
    future = None
    with memory_manager(ctx, durable_every=2) as manager:
        for step in range(1, last + 1):
            _train_step(model, optim, step)  # the live tensors move on while the previous snapshot commits
            if future is not None:
                assert future.result() == step - 1
            future = manager.snapshot(step, state_of(model, optim, step))
            if step % 2:  # the copy of step - 1 started in this call: done before a later call needs its slot
                manager.wait()
        assert future.result() == last
        return manager.snapshots_skipped


def _restore_then_wipe_then_restore(ctx):
    """With memory intact: the newest snapshot; every node's memory wiped: the newest durable copy; then each
    durable step by number.  (step, tier, exact) each."""
    model, optim = trained(WORLD, 0, seed=7)
    seen = []
    with memory_manager(ctx) as manager:
        step = manager.load(state_of(model, optim, 0))
        seen.append((step, manager.restored_from["tier"], _exact_at(model, optim, step)))
        dist.barrier()
        if ctx.rank % 2 == 0:  # each node's first rank empties its memory path: the node lost its RAM
            shutil.rmtree(os.path.join(memory_path(ctx), RUN))
        dist.barrier()
        step = manager.load(state_of(model, optim, 0))
        seen.append((step, manager.restored_from["tier"], _exact_at(model, optim, step)))
        for older in (4, 2):
            step = manager.load(state_of(model, optim, 0), step=older)
            seen.append((step, manager.restored_from["tier"], _exact_at(model, optim, step)))
    return seen


def test_durable_every_2_copies_the_even_snapshots_from_their_slots_and_a_wiped_memory_restores_the_newest(
        root, nodes):
    assert assert_all_ok(_run(_snapshot_every_step, root, nodes, 7)) == [0] * WORLD
    assert _durable_steps(root) == [2, 4, 6]
    # each copy names its snapshot's sequence in the manifest's protocol field, never in the user's metadata
    copies = _copied_sequences(root)
    assert [metadata for _, metadata in copies.values()] == [None] * 3, copies
    sequences = [sequence for sequence, _ in copies.values()]
    assert all(isinstance(n, int) for n in sequences) and sequences == sorted(sequences), copies
    outcomes = assert_all_ok(_run(_restore_then_wipe_then_restore, root, nodes))
    # memory's 7 is newer than the copy of 6 that committed after it; the copies hold their own steps' state
    assert outcomes == [[(7, "memory", True), (6, "durable", True), (4, "durable", True),
                         (2, "durable", True)]] * WORLD, outcomes


def _snapshots_past_a_slow_copy(ctx):
    """The copy of step 2 held in its write until released while snapshots 3, 4 and 5 are taken (``slots=2``)."""
    from dcp_atomic._base import failpoints

    released = threading.Event()
    failpoints.arm("write.before_data", lambda rank, step: released.wait(30))
    model, optim = trained(WORLD, 0)
    with memory_manager(ctx, durable_every=2, slots=2) as manager:
        taken = []
        for step in range(1, 6):
            _train_step(model, optim, step)
            future = manager.snapshot(step, state_of(model, optim, step))
            taken.append(future.result())
        held = _own_slot_steps(ctx)
        durable_before = manager.steps(tier="durable")
        released.set()
        manager.wait()
        _train_step(model, optim, 6)
        after = manager.snapshot(6, state_of(model, optim, 6)).result()
        skipped = manager.snapshots_skipped
    failpoints.disarm("write.before_data")
    with memory_manager(ctx) as manager:
        fresh, fresh_optim = trained(WORLD, 0, seed=7)
        manager.load(state_of(fresh, fresh_optim, 0), step=2)
        exact = _exact_at(fresh, fresh_optim, 2)
    return taken, skipped, held, durable_before, after, exact


def test_a_slow_durable_copy_never_makes_a_snapshot_skip_its_pinned_slot_is_one_outside_the_rotation(root, nodes):
    outcomes = assert_all_ok(_run(_snapshots_past_a_slow_copy, root, nodes))
    # every snapshot taken while the copy of 2 is held: the pinned slot of 2 is the extra one, 3 gave way to 5 and
    # 1 to 4; the copy of 2 exact; wait() then saves the copy due at 5, and 6 is taken
    assert outcomes == [([1, 2, 3, 4, 5], 0, [2, 4, 5], [], 6, True)] * WORLD, outcomes
    assert _durable_steps(root) == [2, 5]


def _flip_a_weight_byte_of_step_2(ctx):
    """On rank 2: a byte inside the first weight (a tensor, not an encoded object) of its own slot of step 2."""
    if ctx.rank != 2:
        return
    rank_dir = os.path.join(memory_path(ctx), RUN, "r2")
    for name in os.listdir(rank_dir):
        if name.endswith(".commit"):
            with open(os.path.join(rank_dir, name), "rb") as f:
                record = SlotRecord.from_bytes(f.read(), name)
            if record.step == 2:
                item = next(i for i in record.items if i.kind != "object" and i.key.endswith("weight"))
                _flip_byte(os.path.join(rank_dir, name.replace(".commit", ".data")), item.offset + 5)


def _a_copy_that_fails(ctx, harm):
    """Steps 1 and 2 snapshotted with ``durable_every=2``, then the copy of step 2 (started by ``wait()``) meets
    ``harm``: ``"write"``, an injected I/O error in its write; ``"slot"``, a byte of rank 2's slot of step 2 flipped
    after its snapshot committed.  What ``wait()`` raised (its type, whether it names what it should), what
    ``on_failed`` heard, and what a fresh job restores."""
    from dcp_atomic import Callbacks
    from dcp_atomic._base import failpoints

    failed = []
    model, optim = trained(WORLD, 0)
    with memory_manager(ctx, durable_every=2, callbacks=Callbacks(on_failed=failed.append)) as manager:
        for step in (1, 2):
            _train_step(model, optim, step)
            assert manager.snapshot(step, state_of(model, optim, step)).result() == step
        if harm == "write":
            failpoints.arm("write.before_data", "raise")
        else:
            _flip_a_weight_byte_of_step_2(ctx)
            dist.barrier()
        names = ("step 2",) if harm == "write" else ("step 2", "rank 2", "weight")
        try:
            manager.wait()  # starts the copy of 2 that is due, and waits for it
            raised = None
        except Exception as e:
            raised = (type(e).__name__, all(name in str(e) for name in names))
        failpoints.disarm("write.before_data")
    restored, restored_optim = trained(WORLD, 0, seed=7)
    with memory_manager(ctx) as manager:
        step = manager.load(state_of(restored, restored_optim, 0))
        served = (step, manager.restored_from["tier"], _exact_at(restored, restored_optim, step))
    return raised, [(f["operation"], f["step"]) for f in failed], served


def test_a_failed_durable_copy_reaches_wait_on_every_rank_and_the_snapshot_stays_restorable(root, nodes):
    outcomes = assert_all_ok(_run(_a_copy_that_fails, root, nodes, "write"))
    raised = outcomes[0][0]
    assert raised is not None and raised[1], outcomes
    assert outcomes == [(raised, [("async_save", 2)], (2, "memory", True))] * WORLD, outcomes
    assert _durable_steps(root) == []


def test_a_slot_damaged_before_its_durable_copy_is_refused_on_every_rank_never_sealed(root, nodes):
    """The copy verifies the slot against its record first: a flipped byte never becomes a durable step that
    verifies; every rank raises the same failure (one rank refusing alone would leave the others in its save), and
    the restore serves rank 2's share from its replica."""
    outcomes = assert_all_ok(_run(_a_copy_that_fails, root, nodes, "slot"))
    assert outcomes == [(("CorruptCheckpointError", True), [("async_save", 2)], (2, "memory-replica", True))] * WORLD, \
        outcomes
    assert _durable_steps(root) == []


def _snapshots_past_a_failed_copy(ctx, late_rank=None):
    """Snapshots with ``durable_every=2`` while the first durable copy (of step 2) fails in its write, until a call
    raises (it fails in the background: however long that takes, the calls meanwhile snapshot): what each call
    returned (its step, or the error it raised and whether it names step 2), the skipped count, what ``wait()``
    raised, and what a fresh job restores from the durable root once memory is gone.  ``late_rank``: that rank's
    copy reports its failure 3 s after the others' (a loaded rank's save thread)."""
    from dcp_atomic._base import failpoints

    writes = []

    def fail_the_first(rank, step):
        writes.append(step)
        if len(writes) == 1:
            raise RuntimeError("injected: the durable store refused the copy")

    failpoints.arm("write.before_data", fail_the_first)
    model, optim = trained(WORLD, 0)
    outcomes = []
    with memory_manager(ctx, durable_every=2) as manager:
        if ctx.rank == late_rank:
            report, late = manager._reports.failure, threading.Event()
            manager._reports.failure = lambda *a: (late.wait(3), report(*a))  # before the copy's future fails
        for step in range(1, 201):
            if step <= 4:
                _train_step(model, optim, step)
            try:
                outcomes.append(manager.snapshot(step, state_of(model, optim, step)).result())
            except Exception as e:
                outcomes.append((type(e).__name__, "step 2" in str(e)))
                break
        for step in (step + 1, step + 2):  # the snapshots go on; the next copy is started and commits
            outcomes.append(manager.snapshot(step, state_of(model, optim, step)).result())
        try:
            manager.wait()
            waited = None
        except Exception as e:
            waited = f"{type(e).__name__}: {e}"
        return outcomes, manager.snapshots_skipped, waited


@pytest.mark.parametrize("late_rank", [None, 3], ids=["together", "rank-3-late"])
def test_a_failed_durable_copy_is_raised_by_the_next_snapshot_on_every_rank_once_and_no_snapshot_is_skipped(
        root, nodes, late_rank):
    """Once, on every rank, at the same call; also when one rank learns of the failure after the others (it used to
    drop its copy unreported and raise it alone from its next save, the others waiting for it there)."""
    outcomes = assert_all_ok(_run(_snapshots_past_a_failed_copy, root, nodes, late_rank))
    assert all(o == outcomes[0] for o in outcomes), outcomes  # every rank alike, at the same call
    calls, skipped, waited = outcomes[0]
    raised = [c for c in calls if isinstance(c, tuple)]
    assert len(raised) == 1 and raised[0][1], calls[-5:]
    at = calls.index(raised[0]) + 1
    assert [c for c in calls if not isinstance(c, tuple)] == [s for s in range(1, at + 3) if s != at], calls[-5:]
    assert skipped == 0 and waited is None, outcomes  # raised once: not again by wait()
    durable = _durable_steps(root)
    assert 2 not in durable and durable and max(durable) > 2, durable  # a later copy committed


def _with_a_local_tier(ctx, first):
    """The first job snapshots 1-5 with a local tier (no drain of its own saves): the copies of 2 and 4 are local
    saves drained to the durable root, the copy of 4 committed after snapshot 5.  The next restores the newest step,
    then step 4 by number: (step, tier, exact) each."""
    from dcp_atomic import LocalTierOptions

    local = LocalTierOptions(os.path.join(ctx.extra["nodes"][ctx.rank // 2], "local"), replicas=1,
                             durable_every=None)
    model, optim = trained(WORLD, 0, seed=0 if first else 7)
    with memory_manager(ctx, local=local, durable_every=2) as manager:
        if first:
            for step in range(1, 6):
                _train_step(model, optim, step)
                assert manager.snapshot(step, state_of(model, optim, step)).result() == step
                if step % 2:  # the copy of step - 1 started in this call, after the snapshot of step committed
                    manager.wait()
            return manager.steps(tier="local")
        seen = []
        for step in (None, 4):
            loaded = manager.load(state_of(model, optim, 0), step=step)
            seen.append((loaded, manager.restored_from["tier"], _exact_at(model, optim, loaded)))
        return seen


def test_with_a_local_tier_the_copies_drain_to_the_durable_root_and_memory_still_wins_for_a_newer_step(root, nodes):
    assert assert_all_ok(_run(_with_a_local_tier, root, nodes, True)) == [[2, 4]] * WORLD
    assert _durable_steps(root) == [2, 4]
    outcomes = assert_all_ok(_run(_with_a_local_tier, root, nodes, False))
    assert outcomes == [[(5, "memory", True), (4, "local", True)]] * WORLD, outcomes
