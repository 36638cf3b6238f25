"""The memory tier across a job's whole life: a restart that snapshots without (or before) a restore, a second
``load()`` in one process, another experiment of the same run id on the same memory path, settings that differ
between ranks, and the memory path itself (created on a RAM-backed parent, warned about on a disk).

Worlds of 4 ranks as 2 simulated nodes (failure domains nodeA/nodeB), each node's memory path on its own tmpfs,
the durable root on disk; every restore compared exactly with the reference run's state on every rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import shutil
import stat

from dcp_atomic.memory import SlotRecord
from tests.harness import assert_all_ok
from tests.helpers.fsdp_app import _train_step
from tests.helpers.memory import full_state, memory_manager, state_of, trained
from tests.helpers.tiers import RUN, WORLD, _Lines, _run


def _exact_at(model, optim, step) -> bool:
    """This job's state is exactly the reference run's after ``step`` steps (collectives: every rank alike)."""
    import torch

    got, want = full_state(model, optim), full_state(*trained(WORLD, step))
    return got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def _snapshots_from(ctx, first, last, root=None):
    """A job that never loads: the reference run's state after ``first - 1`` steps, then ``first..last`` snapshotted
    (each waited for)."""
    model, optim = trained(WORLD, first - 1)
    with memory_manager(ctx, **({"root": root} if root else {})) as manager:
        for step in range(first, last + 1):
            _train_step(model, optim, step)
            assert manager.snapshot(step, state_of(model, optim, step)).result() == step


def _load_twice(ctx):
    """One job, two ``load()`` calls: (step, tier, exact) each."""
    model, optim = trained(WORLD, 0, seed=7)
    seen = []
    with memory_manager(ctx) as manager:
        for _ in range(2):
            step = manager.load(state_of(model, optim, 0))
            seen.append((step, manager.restored_from["tier"], _exact_at(model, optim, step)))
    return seen


def _records(nodes, node, rank):
    found = []
    for path in glob.glob(os.path.join(nodes[node], "mem", RUN, f"r{rank}", "slot*.commit")):
        with open(path, "rb") as f:
            found.append((path, SlotRecord.from_bytes(f.read(), path)))
    return found


def test_a_restart_that_snapshots_without_a_restore_numbers_above_the_slots_left_and_a_second_load_takes_memory(
        root, nodes):
    assert_all_ok(_run(_snapshots_from, root, nodes, 1, 3))  # job 1: memory only, no durable commit at all
    assert_all_ok(_run(_snapshots_from, root, nodes, 4, 6))  # job 2: a restart from scratch, no load()
    newest = {record.step: record.sequence for _, record in _records(nodes, 0, 0)}
    assert newest == {5: 5, 6: 6}, newest  # job 2 numbered 4, 5, 6 above job 1's 1, 2, 3
    # rank 2's own copy of step 6 now claims a later sequence alone: an incomplete newer snapshot, as a rank killed
    # between its slot and its record leaves one (its replica on node A still completes step 6)
    path, record = next((p, r) for p, r in _records(nodes, 1, 2) if r.step == 6)
    with open(path, "wb") as f:
        f.write(dataclasses.replace(record, sequence=record.sequence + 50).to_bytes())
    outcomes = assert_all_ok(_run(_load_twice, root, nodes))
    # the first restore kept rank 2's share as its own slot again: the second reads it from its own node
    assert outcomes == [[(6, "memory-replica", True), (6, "memory", True)]] * WORLD, outcomes


def _another_experiment_restores(ctx):
    """Experiment B: the same run id and memory path, its own durable root (another lineage); it saves step 4 there
    and restores it.  What it loaded, and what its memory tier said of experiment A's slots."""
    lines = _Lines("dcp_atomic.memory")
    model, optim = trained(WORLD, 4)
    with memory_manager(ctx, root=os.path.join(ctx.root, "experiment-b")) as manager:
        manager.save(4, state_of(model, optim, 4))
        step = manager.load(state_of(model, optim, 0))
        tier = manager.restored_from["tier"]
    return step, tier, any("another lineage" in line and "kept" in line for line in lines.lines)


def _restore(ctx):
    model, optim = trained(WORLD, 0, seed=7)
    with memory_manager(ctx) as manager:
        step = manager.load(state_of(model, optim, 0))
        return step, manager.restored_from["tier"], _exact_at(model, optim, step)


def test_another_experiments_restore_of_an_older_step_keeps_this_experiments_newer_snapshots(root, nodes):
    assert_all_ok(_run(_snapshots_from, root, nodes, 1, 6))
    outcomes = assert_all_ok(_run(_another_experiment_restores, root, nodes))
    assert [o[:2] for o in outcomes] == [(4, "durable")] * WORLD, outcomes
    assert outcomes[0][2] and outcomes[2][2], outcomes  # each node's leader names the slots it kept
    assert assert_all_ok(_run(_restore, root, nodes)) == [(6, "memory", True)] * WORLD


def _settings_and_paths(ctx):
    """What each rank saw: settings that differ (rank 2 keeps no replica), a missing memory path whose parent is a
    tmpfs, and a memory path on disk."""
    from dcp_atomic.errors import ConfigurationError

    seen = {}
    try:
        memory_manager(ctx, replicas=0 if ctx.rank == 2 else 1).close()
    except ConfigurationError as e:
        seen["differ"] = str(e)
    created = os.path.join(ctx.extra["nodes"][ctx.rank // 2], "created-by-the-tier")
    model, optim = trained(WORLD, 1)
    with memory_manager(ctx, path=created) as manager:
        seen["created"] = (manager.snapshot(1, state_of(model, optim, 1)).result(),
                           stat.S_IMODE(os.stat(created).st_mode))
    lines = _Lines("dcp_atomic.memory")
    on_disk = os.path.join(ctx.root, f"disk-{ctx.rank // 2}")
    os.makedirs(on_disk, exist_ok=True)
    memory_manager(ctx, path=on_disk).close()
    seen["warned"] = any("not RAM-backed" in line and on_disk in line for line in lines.lines)
    return seen


def test_differing_settings_are_refused_by_name_a_missing_path_on_ram_is_created_and_a_disk_path_is_warned(
        root, nodes):
    outcomes = assert_all_ok(_run(_settings_and_paths, root, nodes))
    for seen in outcomes:
        assert "replicas" in seen["differ"] and "rank 2 has 0" in seen["differ"], seen
        assert seen["created"] == (1, 0o700), seen
        assert seen["warned"], seen



def _snapshots_on_small_nodes(ctx, slots):
    """A world of 2 (one rank per node), each node's memory path a tmpfs of 4.5 shares: what ``slots`` snapshots
    of a 256 KiB share do (their steps, or the error and whether it names the peak)."""
    import torch

    from dcp_atomic import CheckpointManager, MemoryTier
    from dcp_atomic.errors import ConfigurationError

    state = {"w": torch.arange(65536.0) + ctx.rank}
    path = os.path.join(ctx.extra["nodes"][ctx.rank], "mem")
    os.makedirs(path, exist_ok=True)
    with CheckpointManager(ctx.root, RUN, memory=MemoryTier(path, slots=slots, replicas=1), timeout=10) as manager:
        taken = []
        for step in range(1, 5):
            state["w"] += 1
            try:
                taken.append(manager.snapshot(step, state).result())
            except ConfigurationError as e:
                return "ConfigurationError", "peak" in str(e) and "needs" in str(e)
        return taken


def test_the_budget_counts_a_snapshots_peak_a_node_that_passes_never_fills_up_later(root):
    """Each node holds its own slots and its replica slots; a replica lands in place in the slot it replaces, so the
    peak is that count: a node of 4.6 shares takes every snapshot with 2 slots (4 shares) and never fills up later
    (before replicas landed in place, a new replica arrived beside the old one and 2 slots needed 5), and 3 slots
    (6 shares) are refused at the first snapshot by name on both ranks."""
    from tests.fault_fixtures import small_tmpfs_ctx
    from tests.helpers.memory import two_nodes_env

    with small_tmpfs_ctx(size_kib=1180) as a, small_tmpfs_ctx(size_kib=1180) as b:
        refused = assert_all_ok(_run(_snapshots_on_small_nodes, root, [a.path, b.path], 3, world=2,
                                     rank_env=two_nodes_env))
        shutil.rmtree(os.path.join(a.path, "mem"))
        shutil.rmtree(os.path.join(b.path, "mem"))
        taken = assert_all_ok(_run(_snapshots_on_small_nodes, root, [a.path, b.path], 2, world=2,
                                   rank_env=two_nodes_env))
    assert refused == [("ConfigurationError", True)] * 2, refused
    assert taken == [[1, 2, 3, 4]] * 2, taken


def _snapshots_while_node_b_fills_up(ctx):
    """A world of 2 (one rank per node): steps 1-2 snapshotted; at step 3 rank 0's state grows (an optimizer's state
    created late), and node B's memory path is filled by another tenant after the budget check, just before rank 0's
    grown replica lands there; what snapshots 3 and 4 raise on each rank, and whether step 5 is taken once the room
    is back.  (Slots that keep their size are rewritten in place and need no new room.)"""
    import torch
    import torch.distributed as dist

    from dcp_atomic import CheckpointManager, MemoryTier
    from dcp_atomic._base import failpoints

    state = {"w": torch.arange(65536.0) + ctx.rank}
    node = ctx.extra["nodes"][ctx.rank]
    path = os.path.join(node, "mem")
    os.makedirs(path, exist_ok=True)
    ballast = os.path.join(node, "ballast")

    def fill(rank, step):  # another tenant of node B's RAM takes all of it
        if step == 3 and not os.path.exists(ballast):
            with open(ballast, "wb") as f:
                with contextlib.suppress(OSError):
                    while True:
                        f.write(b"\0" * (1 << 16))

    seen = []
    with CheckpointManager(ctx.root, RUN, memory=MemoryTier(path, slots=2, replicas=1), timeout=10) as manager:
        for step in (1, 2):
            manager.snapshot(step, state).result()
        if ctx.rank == 0:
            state["moments"] = torch.zeros(65536)
        else:
            failpoints.arm("memory.replica_send", fill)
        for step in (3, 4):
            try:
                manager.snapshot(step, state).result()
                seen.append(step)
            except Exception as e:
                seen.append((type(e).__name__, str(e)))
        dist.barrier()
        if ctx.rank == 1:
            os.unlink(ballast)
        dist.barrier()
        seen.append(manager.snapshot(5, state).result())
    return seen


def test_a_full_node_is_one_typed_error_on_every_rank_naming_it_and_the_next_snapshots_go_on(root):
    """Node B's memory path full while it receives rank 0's grown replica: before, node B said "No space left" and
    rank 0 blamed a live rank 1 as lost (PeerLost), and the next snapshot broke the group; now every rank raises the
    same StorageError naming rank 1, its node and the cause, for each snapshot the node cannot hold (never a SIGBUS
    from a slot mapped over pages the node could not give), and once the room is back the next one is taken."""
    from tests.fault_fixtures import small_tmpfs_ctx
    from tests.helpers.memory import two_nodes_env

    with small_tmpfs_ctx(size_kib=8192) as a, small_tmpfs_ctx(size_kib=8192) as b:
        outcomes = assert_all_ok(_run(_snapshots_while_node_b_fills_up, root, [a.path, b.path], world=2,
                                      rank_env=two_nodes_env))
    assert outcomes[0] == outcomes[1], outcomes  # the same error on every rank
    for kind, message in outcomes[0][:2]:
        assert kind == "StorageError" and "rank 1 (B," in message and "No space left" in message, message
    assert outcomes[0][2] == 5, outcomes


def _restore_on_small_nodes(ctx):
    """A world of 2 (one rank per node): load() from the memory tier; (step, tier, exact) or the error's type and
    message."""
    import torch

    from dcp_atomic import CheckpointManager, MemoryTier

    path = os.path.join(ctx.extra["nodes"][ctx.rank], "mem")
    os.makedirs(path, exist_ok=True)
    state = {"w": torch.zeros(65536)}
    try:
        with CheckpointManager(ctx.root, RUN, memory=MemoryTier(path, slots=2, replicas=1), timeout=10) as manager:
            step = manager.load(state)
            return step, manager.restored_from["tier"], torch.equal(state["w"], torch.arange(65536.0) + ctx.rank + 2)
    except Exception as e:
        return type(e).__name__, str(e)


def _two_snapshots(ctx):
    import torch

    from dcp_atomic import CheckpointManager, MemoryTier

    path = os.path.join(ctx.extra["nodes"][ctx.rank], "mem")
    os.makedirs(path, exist_ok=True)
    state = {"w": torch.arange(65536.0) + ctx.rank}
    with CheckpointManager(ctx.root, RUN, memory=MemoryTier(path, slots=2, replicas=1), timeout=10) as manager:
        for step in (1, 2):
            state["w"] += 1
            manager.snapshot(step, state).result()


def test_a_restore_into_a_full_node_is_one_typed_error_on_every_rank_and_restores_once_there_is_room(root):
    """Node B's RAM was wiped and is full of something else: its rank must receive its share from node A, and
    cannot keep it.  Every rank raises the same StorageError naming rank 1 and the cause at once (before: rank 1
    alone raised, rank 0 waited in the next collective); with the room back the replica restores exactly."""
    from tests.fault_fixtures import small_tmpfs_ctx
    from tests.helpers.memory import two_nodes_env

    with small_tmpfs_ctx(size_kib=8192) as a, small_tmpfs_ctx(size_kib=8192) as b:
        assert_all_ok(_run(_two_snapshots, root, [a.path, b.path], world=2, rank_env=two_nodes_env))
        shutil.rmtree(os.path.join(b.path, "mem", RUN))  # node B replaced: its RAM is empty...
        b.fill_bytes(leave=64 << 10)  # ...and another tenant takes nearly all of it
        refused = assert_all_ok(_run(_restore_on_small_nodes, root, [a.path, b.path], world=2,
                                     rank_env=two_nodes_env))
        b.release()
        restored = assert_all_ok(_run(_restore_on_small_nodes, root, [a.path, b.path], world=2,
                                      rank_env=two_nodes_env))
    assert refused[0] == refused[1], refused
    kind, message = refused[0]
    assert kind == "StorageError" and "rank 1 (B," in message and "No space left" in message, message
    assert restored == [(2, "memory-replica", True)] * 2, restored


def _empty_share_then_restore(ctx):
    """A world of 2 (one rank per node) where rank 1 holds no state at all (a stage with nothing to keep): steps 1-3
    snapshotted; node B's memory path is wiped (a replaced node); a fresh manager restores (step, tier, rank 0's
    values exact, files of rank 1's share on node B afterwards)."""
    import torch
    import torch.distributed as dist

    from dcp_atomic import CheckpointManager, MemoryTier

    path = os.path.join(ctx.extra["nodes"][ctx.rank], "mem")
    os.makedirs(path, exist_ok=True)

    def state(step):
        return {"w": torch.arange(4096.0) + step} if ctx.rank == 0 else {}

    with CheckpointManager(ctx.root, RUN, memory=MemoryTier(path, slots=2, replicas=1), timeout=10) as manager:
        for step in (1, 2, 3):
            manager.snapshot(step, state(step)).result()
    dist.barrier()
    if ctx.rank == 1:
        shutil.rmtree(os.path.join(path, RUN))
    dist.barrier()
    target = state(0)
    with CheckpointManager(ctx.root, RUN, memory=MemoryTier(path, slots=2, replicas=1), timeout=10) as manager:
        step = manager.load(target)
        tier = manager.restored_from["tier"]
    exact = torch.equal(target["w"], state(3)["w"]) if ctx.rank == 0 else target == {}
    return step, tier, exact, sorted(os.listdir(os.path.join(path, RUN, "r1"))) if ctx.rank == 1 else None


def test_an_empty_share_travels_inline_lands_as_an_empty_slot_and_restores_from_its_holder(root, tmp_path):
    """An empty share has no bytes to send in place: it travels inline in both directions (to its holder at each
    snapshot, back to its owner at the restore after its node was wiped), and its owner keeps it as its own slot."""
    from tests.helpers.memory import two_nodes_env

    nodes = [str(tmp_path / "A"), str(tmp_path / "B")]
    outcomes = assert_all_ok(_run(_empty_share_then_restore, root, nodes, world=2, rank_env=two_nodes_env))
    assert [o[:3] for o in outcomes] == [(3, "memory-replica", True)] * 2, outcomes
    assert outcomes[1][3] == ["slot0.commit", "slot0.data"], outcomes  # step 3's slot, kept as its own again
