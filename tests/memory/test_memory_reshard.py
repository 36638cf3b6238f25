"""A job that comes back at another world size restores the memory tier's newest snapshot, resharded (P16; DESIGN
"Memory tier": "A restore at a different world size may reshard from the memory or local tier's complete copy"),
instead of rolling back to the newest durable step: 4 ranks on 2 simulated nodes (each node's RAM its own tmpfs)
shrink to 2 ranks (one per node), then grow to 3 (uneven shards), every value exact (``torch.equal`` against the full tensors of the
job that took the snapshot); a damaged copy is served around; the holder sending it killed mid-transfer is named
and leaves every slot as it was; per-rank values and a tensor-parallel change without
consent are refused by name on every rank."""

from __future__ import annotations

import glob
import os

import pytest
import torch

from dcp_atomic.memory import SlotRecord
from tests.harness import assert_all_ok
from tests.helpers.fsdp_app import _train_step
from tests.helpers.memory import full_state, memory_manager, one_node_per_rank, state_of, trained
from tests.helpers.tiers import RUN, _flip_byte, _run


def _snapshot(ctx, last, extra=None):
    """Train and snapshot steps 1..last (step 1 also saved durably, unless ``extra`` adds values a durable save
    refuses); the full state after ``last``."""
    model, optim = trained(ctx.world_size, 0)
    with memory_manager(ctx) as manager:
        for step in range(1, last + 1):
            _train_step(model, optim, step)
            state = {**state_of(model, optim, step), **(extra(ctx) if extra else {})}
            assert manager.snapshot(step, state).result() == step
            if step == 1 and extra is None:
                manager.save(step, state)
    return full_state(model, optim)


def _restore_then_snapshot(ctx, next_step=None):
    """A fresh job of this world size loads the newest step; then (``next_step``) snapshots it as that step."""
    model, optim = trained(ctx.world_size, 0, seed=7)
    with memory_manager(ctx) as manager:
        state = state_of(model, optim, 0)
        step = manager.load(state)
        served = dict(manager.restored_from)
        full = full_state(model, optim)
        if next_step is not None:
            assert manager.snapshot(next_step, state_of(model, optim, next_step)).result() == next_step
    return {"step": step, "progress": state["progress"]["step"], "served": served, "full": full}


def _records(nodes):
    found = []
    for path in glob.glob(os.path.join(nodes[0], "mem", RUN, "r*", "slot*.commit")) + glob.glob(
            os.path.join(nodes[1], "mem", RUN, "r*", "slot*.commit")):
        with open(path, "rb") as f:
            found.append(SlotRecord.from_bytes(f.read(), path))
    return found


def _exact(got, want):
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


def _three_ranks(rank: int) -> dict[str, str]:
    """A world of 3: ranks 0 and 1 on node A, rank 2 on node B."""
    node = 0 if rank < 2 else 1
    return {"DCP_ATOMIC_FAILURE_DOMAIN": "node" + "AB"[node], "LOCAL_RANK": str(rank % 2 if node == 0 else 0),
            "LOCAL_WORLD_SIZE": "2" if node == 0 else "1", "GROUP_RANK": str(node)}


def _restore_losing_the_sender(ctx):
    """A resized job's restore in which rank 1 (node B: the holder that sends rank 0 the share its node lost) is
    SIGKILLed as it is about to post its first chunk round; what rank 0 raised, and how fast.  No close()."""
    import time

    model, optim = trained(ctx.world_size, 0, seed=7)
    manager = memory_manager(ctx, timeout=5)
    started = time.monotonic()
    try:
        manager.load(state_of(model, optim, 0))
    except Exception as e:  # noqa: BLE001 - the test reads the failure
        return {"error": type(e).__name__, "silent": getattr(e, "details", {}).get("silent"), "message": str(e),
                "seconds": time.monotonic() - started}
    return {"error": None, "served": dict(manager.restored_from)}


@pytest.mark.slow
def test_a_job_shrunk_to_2_ranks_then_grown_to_3_restores_the_newest_snapshot_resharded_exactly(root, nodes):
    want = assert_all_ok(_run(_snapshot, root, nodes, 3))[0]
    # Node A's own copy of rank 0's share is damaged: that share is served from its replica on node B.
    [damaged] = [p for p in glob.glob(os.path.join(nodes[0], "mem", RUN, "r0", "slot*.data"))
                 if SlotRecord.from_bytes(open(p[:-5] + ".commit", "rb").read(), p).step == 3]
    _flip_byte(damaged, 8)
    held = sorted((r.world_size, r.rank, r.step, r.sequence) for r in _records(nodes))
    # First the sender dies mid-transfer: rank 0 says so, typed and naming it, in seconds; nothing is retired.
    killed = _run(_restore_losing_the_sender, root, nodes, world=2, pg_timeout=5, rank_env=lambda rank: {
        **one_node_per_rank(rank), "DCP_ATOMIC_FAILPOINTS": "transfer.round@1#1=kill" if rank == 1 else None})
    assert killed[1].killed and killed[0].ok, killed
    lost = killed[0].value
    assert lost["error"] in ("PeerLost", "RankFailureError") and lost["silent"] == "1", lost
    assert "nothing was loaded" in lost["message"] and lost["seconds"] < 60, lost
    assert sorted((r.world_size, r.rank, r.step, r.sequence) for r in _records(nodes)) == held
    shrunk = assert_all_ok(_run(_restore_then_snapshot, root, nodes, 4, world=2, rank_env=one_node_per_rank))
    for out in shrunk:
        assert out["step"] == out["progress"] == 3, out["served"]  # not the durable step 1
        assert out["served"]["tier"] == "memory-replica" and out["served"]["resharded_from"] == 4, out["served"]
        _exact(out["full"], want)
    # The resized job's first snapshot is committed: the slots the job of 4 left are gone from both nodes' RAM.
    assert {(r.world_size, r.step) for r in _records(nodes)} == {(2, 4)}, _records(nodes)
    assert not glob.glob(os.path.join(nodes[0], "mem", RUN, "r[23]", "slot*.data"))
    # Grown to 3 ranks (two on node A): uneven shards, the last rank's share of a 4-row layer empty.
    grown = assert_all_ok(_run(_restore_then_snapshot, root, nodes, world=3, rank_env=_three_ranks))
    for out in grown:
        assert out["step"] == 4 and out["served"]["tier"] == "memory" and out["served"]["resharded_from"] == 2
        _exact(out["full"], shrunk[0]["full"])


def _per_rank(ctx):
    return {"noise": torch.full((3,), float(ctx.rank))}


def _restore_refused(ctx, parallelism=None, per_rank=False):
    from dcp_atomic import Parallelism

    model, optim = trained(ctx.world_size, 0, seed=7)
    declared = None if parallelism is None else Parallelism(**parallelism)
    with memory_manager(ctx, parallelism=declared) as manager:
        state = {**state_of(model, optim, 0), **(_per_rank(ctx) if per_rank else {})}
        try:
            manager.load(state)
        except Exception as e:  # noqa: BLE001 - the test reads the refusal
            return f"{type(e).__name__}: {e}"
        return f"loaded step {state['progress']['step']} from {manager.restored_from}"


@pytest.mark.slow
def test_per_rank_values_and_a_tensor_parallel_change_without_consent_are_refused_on_every_rank(root, nodes):
    assert_all_ok(_run(_snapshot, root, nodes, 2, _per_rank))
    refused = assert_all_ok(_run(_restore_refused, root, nodes, None, True, world=2, rank_env=one_node_per_rank))
    for why in refused:
        assert why.startswith("ReshardError") and "'noise' was a per-rank value" in why, why
        assert "world size 4" in why and "Nothing was loaded" in why, why
    refused = assert_all_ok(_run(_restore_refused, root, nodes, {"tp": 2, "dp": 1}, True, world=2,
                                 rank_env=one_node_per_rank))
    for why in refused:
        assert why.startswith("ReshardError") and "tensor_parallel_size=2" in why, why
