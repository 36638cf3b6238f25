"""A tier restore moves only what each rank reads (P13, docs/guarantees.md).

World 4 as 2 simulated nodes (``tests.helpers.tiers``: each node's ``local_root`` its own tmpfs, node B
replaced by emptying its root).  After the choice each rank plans its own load and receives into its root, itself,
the files (or, of another rank's file, the items) it reads that its root lacks; the bytes are checked by the
receiver.  What each rank received is asserted against the step's manifest, file by file.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil

import pytest
import torch

from tests.harness import assert_all_ok
from tests.helpers.tiers import RUN, WORLD, _flip_byte, _manager, _run

ROWS, COLS = 256, 64  # "w": 64 rows of 64 fp32 per rank, 16 KiB


def _state(ctx, seed: int, replicated: bool = False) -> dict:
    """``w`` sharded by rows over the 4 ranks; with ``replicated``, first a Replicate DTensor ``rep`` and an
    object, which DCP saves once, on one rank (the first plan: rank 0), and every rank reads."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (ctx.world_size,))
    g = torch.Generator().manual_seed(seed)
    state = {}
    if replicated:
        state["rep"] = distribute_tensor(torch.randn(COLS, generator=g), mesh, [Replicate()])
        state["meta"] = {"epoch": seed}
    state["w"] = distribute_tensor(torch.randn(ROWS, COLS, generator=g), mesh, [Shard(0)])
    return state


def _locals(state) -> dict:
    return {k: v.to_local().clone() if hasattr(v, "to_local") else v for k, v in state.items()}


def _save(ctx, steps, replicated=False, durable=()):
    """Save each of ``steps`` (state seeded by the step) to the local tier; ``durable`` ones are also drained."""
    saved = {}
    with _manager(ctx) as manager:
        for step in steps:
            state = _state(ctx, step, replicated)
            manager.save(step, state, durable=step in durable)
            saved[step] = _locals(state)
        manager.wait()
    return saved


def _load(ctx, replicated=False, step=None, spoil=None):
    """A fresh job's load; ``spoil``: (rank, path) where that rank flips a byte of a source file right after the
    restore's plan was made (after the scan verified it: only the receiver's check stands between it and a load)."""
    from dcp_atomic import Callbacks
    from dcp_atomic.tiers import tier_restore

    if spoil is not None and ctx.rank in (spoil[0] if isinstance(spoil[0], tuple) else (spoil[0],)):
        planned = tier_restore.plan_fetches

        def plan_then_spoil(*args, **kwargs):
            fetches = planned(*args, **kwargs)
            if len(spoil) > 2 and spoil[2] == "unlink":
                with contextlib.suppress(FileNotFoundError):  # every rank of the root unlinks it before it sends
                    os.unlink(spoil[1])
            else:
                _flip_byte(spoil[1], offset=os.path.getsize(spoil[1]) // 2)
            return fetches

        tier_restore.plan_fetches = plan_then_spoil
    state = _state(ctx, 0, replicated)
    for value in state.values():
        if hasattr(value, "to_local"):
            value.to_local().zero_()
    stats = []
    with _manager(ctx, callbacks=Callbacks(on_loaded=stats.append)) as manager:
        loaded = manager.load(state, step=step)
        served = manager.restored_from
    return {"step": loaded, "local": _locals(state), "served": served, "stats": stats}


def _manifest(node_root, step):
    from dcp_atomic.tiers.local_tier import local_markers, open_local, read_manifest

    layout = open_local(node_root, RUN)
    [marker] = [m for m in local_markers(layout) if m.step == step]
    return layout, read_manifest(layout, marker)


def _attempt(node_root, step):
    [attempt] = glob.glob(os.path.join(node_root, RUN, f"step_{step:010d}", "*", "manifest.json"))
    return os.path.dirname(attempt)


def _data_files(node_root, step):
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(_attempt(node_root, step), "__*_*.distcp")))


def _control_bytes(node_root, step):
    attempt = _attempt(node_root, step)
    names = [os.path.join(os.path.dirname(attempt), "COMMITTED")] + [
        os.path.join(attempt, n) for n in ("manifest.json", ".metadata", "ranks.json")]
    return sum(os.path.getsize(p) for p in names if os.path.exists(p))


def _exact_locals(got, want):
    for key in want:
        if isinstance(want[key], torch.Tensor):
            assert torch.equal(got[key], want[key]), key
        else:
            assert got[key] == want[key], key


@pytest.mark.slow
def test_each_rank_of_a_replaced_node_receives_only_its_own_files_about_half_the_step(root, nodes):
    saved = assert_all_ok(_run(_save, root, nodes, [10]))
    shutil.rmtree(os.path.join(nodes[1], RUN))  # node B replaced
    restored = assert_all_ok(_run(_load, root, nodes))
    for rank, out in enumerate(restored):
        assert out["served"]["tier"] == "local" and out["step"] == 10
        _exact_locals(out["local"], saved[rank][10])
    _, manifest = _manifest(nodes[0], 10)
    size = {f.name: f.size for f in manifest.files}
    shard = {s.rank: s.size for s in manifest.shards}
    # Each of node B's ranks received its own shard and data file, itself; node B's leader the control files and
    # the other ranks' manifest shards too (small: what a later restore and `dcp-atomic show` read there).
    expected = [0, 0, size["__2_0.distcp"] + shard[2] + _control_bytes(nodes[0], 10) + shard[0] + shard[1],
                size["__3_0.distcp"] + shard[3]]
    assert [out["served"]["bytes_fetched"] for out in restored] == expected
    assert [out["served"]["ranks_fetched"] for out in restored] == [0, 0, 1, 1]
    assert [out["stats"][0]["bytes_from_replicas"] for out in restored] == expected  # LoadStats, per rank alike
    assert _data_files(nodes[1], 10) == ["__2_0.distcp", "__3_0.distcp"]  # half the step, not all of it
    assert size["__2_0.distcp"] + size["__3_0.distcp"] <= 0.55 * manifest.total_bytes
    # The partly assembled root is seen for what it holds: ranks 2 and 3 whole, nothing damaged.
    from dcp_atomic.tiers.local_tier import ANY_LINEAGE, scan_root

    layout, _ = _manifest(nodes[1], 10)
    [held] = scan_root(layout, lineage=ANY_LINEAGE)
    assert held.ranks == [2, 3] and held.damaged == {} and held.control and held.shards == [0, 1, 2, 3]
    assert held.intact == {"__2_0.distcp": 2, "__3_0.distcp": 3}
    from dcp_atomic.tools import cli  # `dcp-atomic show` on node B's disk reads every shard: there, and says what it is

    assert cli.main(["show", root, RUN, "10", "--local-root", nodes[1], "--json"]) == 0


@pytest.mark.slow
def test_a_replicated_item_another_rank_wrote_reaches_every_rank_that_reads_it_once_per_root(root, nodes):
    saved = assert_all_ok(_run(_save, root, nodes, [10], True))
    _, manifest = _manifest(nodes[0], 10)
    shared = {}  # data file -> the once-saved items every rank reads there
    for entry in _entries(nodes[0], manifest):
        for item in entry.items:
            if item.key in ("rep", "meta.epoch"):
                shared.setdefault(entry.name, (entry, []))[1].append(item)
    assert sum(len(items) for _, items in shared.values()) == 2
    # DCP saved them on node A: node B reads them there
    assert {entry.rank for entry, _ in shared.values()} <= {0, 1}, shared
    shutil.rmtree(os.path.join(nodes[1], RUN))
    restored = assert_all_ok(_run(_load, root, nodes, True))
    for rank, out in enumerate(restored):
        assert out["served"]["tier"] == "local"
        _exact_locals(out["local"], saved[rank][10])
        assert torch.equal(out["local"]["rep"], saved[0][10]["rep"]) and out["local"]["meta"] == {"epoch": 10}
    # Node B's ranks both read those items: each file's items came to node B once, by one rank, not the files.
    got = [out["served"]["ranks_fetched"] for out in restored]
    assert got[:2] == [0, 0] and sum(got[2:]) == 2 + len(shared), got
    size = {f.name: f.size for f in manifest.files}
    shard = {s.rank: s.size for s in manifest.shards}
    received_on_b = sum(out["served"]["bytes_fetched"] for out in restored[2:]) - _control_bytes(nodes[0], 10)
    assert received_on_b == (size["__2_0.distcp"] + size["__3_0.distcp"] + sum(shard.values())
                             + sum(i.length for _, items in shared.values() for i in items))
    attempt = _attempt(nodes[1], 10)
    from dcp_atomic.tiers.local_tier import ANY_LINEAGE, scan_root

    [held] = scan_root(_manifest(nodes[1], 10)[0], lineage=ANY_LINEAGE)
    assert held.ranks == [2, 3] and held.damaged == {}
    for entry, items in shared.values():
        assert sum(i.length for i in items) < entry.size / 2
        assert os.path.exists(os.path.join(attempt, f"{entry.name}.partial"))  # a partial copy, said so
        assert os.stat(os.path.join(attempt, entry.name)).st_mode & 0o222 == 0  # read-only, as every file of a step
        assert entry.name not in held.intact  # ... which the scan does not count as held, nor as damage
    # `dcp-atomic verify` on node B's disk says the same: partial copies, not damage (it used to fail the step)
    import contextlib
    import io

    from dcp_atomic.tools import cli

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert cli.main(["verify", nodes[1], RUN, "10", "--local"]) == 0, printed.getvalue()
    assert "step 10: OK, partial copies" in printed.getvalue(), printed.getvalue()
    for entry, items in shared.values():
        assert f"{entry.name}: a partial copy a tier restore kept for this node's ranks ({len(items)} of " \
               f"{len(entry.items)} items here, each verified)" in printed.getvalue(), printed.getvalue()
    # A second restore on the partly assembled roots moves nothing and loads the same values.
    again = assert_all_ok(_run(_load, root, nodes, True))
    for rank, out in enumerate(again):
        assert out["served"]["bytes_fetched"] == 0
        _exact_locals(out["local"], saved[rank][10])


def _entries(node_root, manifest):
    """Every data file's entry with its items, from the ranks' shards (verified against the manifest)."""
    from dcp_atomic.tiers.local_tier import check_shard
    from dcp_atomic.format.manifest import shard_name

    attempt = _attempt(node_root, manifest.step)
    return [entry for rank in range(manifest.world_size) for entry in check_shard(
        manifest, rank, open(os.path.join(attempt, shard_name(rank)), "rb").read(), attempt).files]


@pytest.mark.slow
def test_a_flipped_byte_in_a_primary_is_received_by_the_rank_that_reads_it_from_the_replica(root, nodes):
    saved = assert_all_ok(_run(_save, root, nodes, [10]))
    _flip_byte(os.path.join(_attempt(nodes[0], 10), "__0_0.distcp"))
    restored = assert_all_ok(_run(_load, root, nodes))
    for rank, out in enumerate(restored):
        _exact_locals(out["local"], saved[rank][10])
    _, manifest = _manifest(nodes[1], 10)
    size = {f.name: f.size for f in manifest.files}
    shard = {s.rank: s.size for s in manifest.shards}
    # rank 0 reads __0_0 and took it from node B; rank 1 (same root) does not read it and received nothing
    assert [out["served"]["bytes_fetched"] for out in restored] == [size["__0_0.distcp"] + shard[0], 0, 0, 0]


@pytest.mark.slow
def test_a_source_copy_damaged_after_the_scan_is_refused_by_the_receiver_then_passed_over(root, nodes):
    assert_all_ok(_run(_save, root, nodes, [10]))
    shutil.rmtree(os.path.join(nodes[1], RUN))
    source = os.path.join(_attempt(nodes[0], 10), "__2_0.distcp")
    outcomes = _run(_load, root, nodes, False, None, (0, source))
    for out in outcomes:  # never wrong values: the receiver's check fails the restore on every rank, typed
        assert out.error_type == "StorageError", out
        assert "restoring local step 10" in out.error and "__2_0.distcp" in out.error and "rank 2" in out.error
        assert "block" in out.error, out.error
    # Restarted: the scan now finds node A's copy damaged, and no root holds another: a typed error naming it.
    outcomes = _run(_load, root, nodes)
    for out in outcomes:
        assert out.error_type == "CheckpointNotFoundError", out
        assert "rank 2 (__2_0.distcp)" in out.error and "does not match its digest" in out.error, out.error


@pytest.mark.slow
def test_a_source_file_gone_after_the_scan_fails_every_rank_typed_and_in_bounded_time(root, nodes):
    assert_all_ok(_run(_save, root, nodes, [10]))
    shutil.rmtree(os.path.join(nodes[1], RUN))
    source = os.path.join(_attempt(nodes[0], 10), "__3_0.distcp")
    # Both of node A's ranks remove it right after planning, so whichever sends it finds it gone (an unlink by the
    # other rank alone could come after the sender opened the file, which then still reads whole and loads).
    outcomes = _run(_load, root, nodes, False, None, ((0, 1), source, "unlink"))
    for out in outcomes:  # the sender's stream still runs (its target waits for it), then every rank fails alike
        assert out.error_type == "StorageError", out
        assert "restoring local step 10" in out.error and "__3_0.distcp" in out.error, out.error


@pytest.mark.slow
def test_after_a_partial_restore_losing_the_other_node_falls_back_to_durable_and_the_next_save_heals(root, nodes):
    saved = assert_all_ok(_run(_save, root, nodes, [10, 20], False, (10,)))
    shutil.rmtree(os.path.join(nodes[1], RUN))
    first = assert_all_ok(_run(_load, root, nodes))
    assert {out["served"]["step"] for out in first} == {20}
    shutil.rmtree(os.path.join(nodes[0], RUN))  # now node A is replaced: node B holds only ranks 2 and 3 of step 20
    second = assert_all_ok(_run(_load, root, nodes))
    for rank, out in enumerate(second):
        assert (out["served"]["tier"], out["step"]) == ("durable", 10)
        _exact_locals(out["local"], saved[rank][10])
    # and with no durable step either (the run's lineage kept: a new durable root would make step 20 another
    # experiment's, dcp_atomic/protocol/lineage.py): a typed error naming what is lost
    shutil.rmtree(os.path.join(root, RUN, "step_0000000010"))
    os.unlink(os.path.join(root, RUN, "LATEST"))
    outcomes = _run(_load, root, nodes)
    for out in outcomes:
        assert out.error_type == "CheckpointNotFoundError", out
        assert "local step 20" in out.error and "rank 0 (__0_0.distcp), rank 1 (__1_0.distcp)" in out.error, out.error


def _restore_then_save(ctx):
    """A replaced node's job restores step 10, trains on and saves step 20: both roots hold all of step 20 again."""
    first = _load(ctx)
    with _manager(ctx) as manager:
        state = _state(ctx, 20)
        manager.save(20, state)
    return {"first": first["served"], "saved": _locals(state)}


@pytest.mark.slow
def test_the_next_save_after_a_partial_restore_is_replicated_whole(root, nodes):
    assert_all_ok(_run(_save, root, nodes, [10]))
    shutil.rmtree(os.path.join(nodes[1], RUN))
    outs = assert_all_ok(_run(_restore_then_save, root, nodes))
    assert outs[2]["first"]["tier"] == "local"
    everyone = [f"__{r}_0.distcp" for r in range(WORLD)]
    assert _data_files(nodes[0], 20) == everyone and _data_files(nodes[1], 20) == everyone
    shutil.rmtree(os.path.join(nodes[0], RUN))  # node A lost now: step 20 restores from node B alone
    restored = assert_all_ok(_run(_load, root, nodes))
    for rank, out in enumerate(restored):
        assert (out["served"]["tier"], out["step"]) == ("local", 20)
        _exact_locals(out["local"], outs[rank]["saved"])


@pytest.mark.slow
@pytest.mark.parametrize("missing", ["metadata"])
def test_a_root_whose_control_file_is_damaged_gets_it_again(root, nodes, missing):
    saved = assert_all_ok(_run(_save, root, nodes, [10]))
    with open(os.path.join(_attempt(nodes[1], 10), ".metadata"), "r+b") as f:
        f.write(b"\0")
    restored = assert_all_ok(_run(_load, root, nodes))
    for rank, out in enumerate(restored):
        assert out["served"]["tier"] == "local"
        _exact_locals(out["local"], saved[rank][10])
    assert restored[2]["served"]["bytes_fetched"] > 0 and restored[0]["served"]["bytes_fetched"] == 0
    assert json.loads(open(os.path.join(_attempt(nodes[1], 10), "manifest.json")).read())["step"] == 10


def test_the_spool_files_a_killed_restore_left_are_swept_and_nothing_in_use(tmp_path):
    """A restore killed midway leaves a held-back marker and a partial copy of a process that is gone; the root's
    leader removes them before the next restore scans, and leaves a live process's files and transfers' own."""
    import subprocess

    from dcp_atomic.tiers.local_tier import open_local, spool_dir, sweep_spool

    layout = open_local(str(tmp_path), RUN)
    spool = spool_dir(layout)
    os.makedirs(spool)
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that no longer runs
    names = ["marker-10-save1", f"partial-{gone.pid}-__0_0.distcp", f"partial-{os.getpid()}-__1_0.distcp",
             "r2-from0-0001"]
    for name in names:
        open(os.path.join(spool, name), "wb").close()
    assert sorted(sweep_spool(layout)) == sorted(names[:2])
    assert sorted(os.listdir(spool)) == sorted(names[2:])
    assert sweep_spool(open_local(str(tmp_path / "none"), RUN)) == []  # no spool yet: nothing to do
