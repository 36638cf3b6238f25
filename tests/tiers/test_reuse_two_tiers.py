"""Reuse (P15) through both tiers, on two simulated nodes of two ranks (each node's local root its own tmpfs, the
durable root on disk): each local save hard-links the node's unchanged stable files from the previous local step;
replicas hold whole copies (rot in a node's linked file is served around); the drain links a file of the durable
root's previous step that holds every item a local stable file references (step 1's plain files, which the local
step 2 linked under stable names, included) instead of uploading it again, verified at every link; every step loads
from the durable root alone after every node is replaced and its base is deleted; a job resized to 2 ranks saves in
full, never linking another world's files."""

from __future__ import annotations

import glob
import os
import shutil

import pytest

from tests.harness import assert_all_ok
from tests.helpers.reuse_state import ROWS, COLS, RUN, empty, exact, full, mesh, state
from tests.helpers.tiers import _flip_byte, _manager, _run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

QUARTER = ROWS * COLS * 4 // 4  # one rank's chunk of the frozen base at world 4


def _stable_files(root, step):
    """name -> inode of every stable file of ``step`` under ``root`` (its one committed attempt)."""
    return {os.path.basename(p): os.stat(p).st_ino
            for p in glob.glob(os.path.join(root, RUN, f"step_{step:010d}", "*", "__*_s*.distcp"))}


def _both_tiers(ctx):
    from dcp_atomic import Callbacks

    world = mesh(ctx.world_size)
    drained = []
    with _manager(ctx, reuse=True, keep_local=2, callbacks=Callbacks(on_drained=drained.append)) as manager:
        for step in (1, 2, 3, 4):
            manager.save(step, state(world, step), durable=True)
            manager.wait()  # each drain before the next save: each finds the previous durable step as its base
        loaded = empty(world)
        assert manager.load(loaded) == 4
    return {"exact": exact(full(loaded), full(state(world, 4))),
            "drained": {d["step"]: (d["bytes"], d["bytes_reused"]) for d in drained}}


def _node_root(ctx):
    """Two nodes whatever the world: ranks split evenly over them."""
    return ctx.extra["nodes"][ctx.rank * 2 // ctx.world_size]


def _load_latest(ctx, world_size):
    world = mesh(ctx.world_size)
    with _manager(ctx, local_root=_node_root(ctx)) as manager:
        loaded = empty(world)
        step = manager.load(loaded)
        served = manager.restored_from["tier"]
    assert world_size == ctx.world_size
    return step, served, exact(full(loaded), full(state(world, step)))


def _resized(ctx):
    world = mesh(ctx.world_size)
    with _manager(ctx, reuse=True, keep_local=2, local_root=_node_root(ctx)) as manager:
        manager.save(5, state(world, 5), durable=True)
        manager.wait()
    return True


def test_reuse_through_both_tiers_links_locally_and_in_the_drain_and_each_step_loads_alone(root, nodes):
    values = assert_all_ok(_run(_both_tiers, root, nodes))
    assert all(v["exact"] for v in values), values
    drained = values[0]["drained"]
    assert drained[1][1] == 0  # no base: every file uploaded
    for step in (2, 3, 4):
        bytes_, reused = drained[step]
        assert reused >= 4 * QUARTER and reused <= bytes_, drained  # every rank's stable file linked, not uploaded
    # The durable root: step 2 holds step 1's plain files under stable names (the local save linked them so, and the
    # drain finds the durable step 1's plain file holding every item the local stable file references); steps 3
    # and 4 the same files (hard links: one inode each)
    durable = {step: _stable_files(root, step) for step in (2, 3, 4)}
    assert sorted(durable[2]) == [f"__{r}_s0.distcp" for r in range(4)], durable
    plain = {os.stat(p).st_ino for p in glob.glob(os.path.join(root, RUN, f"step_{1:010d}", "*", "__*.distcp"))}
    assert set(durable[2].values()) <= plain, (durable, plain)
    assert durable[3] == durable[2] and durable[4] == durable[2], durable
    # Each node's local root: its own ranks' stable files linked from the previous local step (keep_local=2: 3, 4)
    for node, own in zip(nodes, ((0, 1), (2, 3))):
        local = {step: _stable_files(node, step) for step in (3, 4)}
        for rank in own:
            name = f"__{rank}_s0.distcp"
            assert local[3][name] == local[4][name], (node, local)
    # Rot in node A's one physical copy of rank 0's stable file (steps 3 and 4 link it): the whole copies elsewhere
    # (node B's replica, the durable root) still serve step 4, exact
    _flip_byte(glob.glob(os.path.join(nodes[0], RUN, f"step_{4:010d}", "*", "__0_s0.distcp"))[0], offset=4096)
    served = assert_all_ok(_run(_load_latest, root, nodes, 4))
    assert all(step == 4 and ok for step, _, ok in served), served
    # Every node replaced (its local disk comes back empty) and step 4's durable base deleted by hand
    for node in nodes:
        shutil.rmtree(os.path.join(node, RUN))
    shutil.rmtree(os.path.join(root, RUN, f"step_{3:010d}"))
    loaded = assert_all_ok(_run(_load_latest, root, nodes, 4))
    assert loaded == [(4, "durable", True)] * 4, loaded
    # The job resized to 2 ranks (one per node): nothing of the 4-rank steps matches its chunks, so it saves in full
    assert_all_ok(_run(_resized, root, nodes, world=2, rank_env=lambda rank: {
        "DCP_ATOMIC_FAILURE_DOMAIN": "nodeAB"[4 + rank], "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
        "GROUP_RANK": str(rank)}))
    resized = _stable_files(root, 5)
    assert not (set(resized.values()) & set(durable[4].values())), "a resized job linked another world's files"
    assert assert_all_ok(_run(_load_latest, root, nodes, 2, world=2, rank_env=lambda rank: {
        "DCP_ATOMIC_FAILURE_DOMAIN": "nodeAB"[4 + rank], "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
        "GROUP_RANK": str(rank)})) == [(5, "local", True)] * 2
