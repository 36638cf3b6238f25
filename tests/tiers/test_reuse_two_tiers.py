"""Reuse (P15) through both tiers, on two simulated nodes of two ranks (each node's local root its own tmpfs, the
durable root on disk): each local save hard-links the node's unchanged stable files from the previous local step;
replicas hold whole copies (rot in a node's linked file is served around); the drain links a file of the durable
root's previous step that holds every item a local stable file references (step 1's plain files, which the local
step 2 linked under stable names, included) instead of uploading it again, verified at every link; every step loads
from the durable root alone after every node is replaced and its base is deleted; a job resized to 2 ranks saves in
full, never linking another world's files.  With the durable root on S3 (moto, which reports object checksums), the
drain checks each server-side copy by the checksum the store reported when the drain uploaded its base: not one
byte of the base comes down."""

from __future__ import annotations

import glob
import os
import re
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


DATA_KEY = re.compile(r"/step_(\d{10})/[^/]+/__\d+_s?\d+\.distcp$")  # a rank's data file, plain or stable


def _drains_to_s3(ctx, options):
    """Three reused saves, each drained before the next; two reused saves straight to the durable root; then step 3
    read from the durable root alone."""
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicLoadPlanner, AtomicStorageReader, Callbacks, CheckpointManager

    world = mesh(ctx.world_size)
    drained = []
    with _manager(ctx, reuse=True, keep_local=2, storage_options=options,
                  callbacks=Callbacks(on_drained=drained.append)) as manager:
        for step in (1, 2, 3):
            manager.save(step, state(world, step), durable=True)
            manager.wait()
    with CheckpointManager(ctx.root, RUN, reuse=True, storage_options=options, timeout=20) as direct:
        for step in (4, 5):  # saves straight to S3 on the drained steps
            direct.save(step, state(world, step))
    loaded = empty(world)
    dcp.load(loaded, storage_reader=AtomicStorageReader(ctx.root, run_id=RUN, step=3, storage_options=options),
             planner=AtomicLoadPlanner())
    return {"drained": {d["step"]: (d["bytes"], d["bytes_reused"]) for d in drained},
            "exact": exact(full(loaded), full(state(world, 3)))}


def test_on_s3_the_drain_checks_each_copy_of_its_base_by_the_stores_checksum_and_downloads_none_of_it(s3_moto,
                                                                                                        nodes):
    options = s3_moto.options()
    values = assert_all_ok(_run(_drains_to_s3, s3_moto.root, nodes, options))
    assert all(v["exact"] for v in values), values  # the durable step 3, its stable files server-side copies
    drained = values[0]["drained"]
    for step in (2, 3):
        bytes_, reused = drained[step]
        assert reused >= 4 * QUARTER and reused <= bytes_, drained  # every rank's stable file a server-side copy
    copies = [r for r in s3_moto.proxy.requests("PUT")
              if "x-amz-copy-source" in r.headers and DATA_KEY.search("/" + r.key)]
    assert {int(DATA_KEY.search("/" + r.key).group(1)) for r in copies} == {2, 3, 4, 5}, copies
    records = s3_moto.proxy.requests()

    def read_before(step):
        """Data bytes read before ``step``'s marker, by step read (the load of step 3 comes after step 5)."""
        committed = max(i for i, r in enumerate(records)
                        if r.op == "PUT" and r.key.endswith(f"step_{step:010d}/COMMITTED"))
        read = {}
        for r in records[:committed]:
            if r.op not in ("PUT", "UPLOAD_PART", "HEAD") and (m := DATA_KEY.search("/" + r.key)) and r.reply_bytes:
                read[int(m.group(1))] = read.get(int(m.group(1)), 0) + r.reply_bytes
        return read

    assert read_before(3) == {}  # the drains downloaded no copy to check it (4 x 256 KiB a drain before)
    # A drained step's shards record no store checksum: the first direct save on it checks its copies by download,
    # and records the checksum the store reported for them, so the next save downloads nothing
    assert read_before(4) == {4: 4 * QUARTER} and read_before(5) == {4: 4 * QUARTER}, (read_before(4), read_before(5))
