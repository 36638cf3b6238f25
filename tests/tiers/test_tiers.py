"""Two tiers (P13): node-local saves replicated across failure domains, restored from the nearest complete copy.

Worlds of 4 ranks as 2 simulated nodes (``DCP_ATOMIC_FAILURE_DOMAIN`` nodeA/nodeB, torchrun's per-node variables),
each node's ``local_root`` its own tmpfs mount, the durable root on disk.  A *replaced node* is its local root
emptied between two worlds.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil

import pytest
import torch

from dcp_atomic import Callbacks, LocalTierOptions
from dcp_atomic.errors import ConfigurationError
from dcp_atomic.tiers.placement import place_replicas
from dcp_atomic._base import failpoints
from tests.fault_fixtures import small_tmpfs_ctx
from tests.harness import assert_all_ok, run_world
from tests.helpers.fsdp_app import _fsdp_app, _full, _train_step
from tests.helpers.read_once import _survivors_barrier
from tests.helpers.tiers import _exact, _flip_byte, _Lines, _manager, _node_env, _run, RUN, _state, WORLD


# -- placement (pure) ----------------------------------------------------------------------------------------


def test_placement_puts_each_copy_on_another_domain_spread_evenly():
    domains = ["a", "a", "b", "b", "c", "c"]
    for replicas in (1, 2):
        placement = place_replicas(domains, replicas)
        received = [0] * len(domains)
        for rank, holders in enumerate(placement.holders):
            assert len(holders) == replicas
            held_domains = [domains[h] for h in holders]
            assert domains[rank] not in held_domains, (rank, holders)
            assert len(set(held_domains)) == replicas, (rank, holders)  # no domain holds two copies of one rank
            for h in holders:
                received[h] += 1
        assert set(received) == {replicas}, received  # even: every rank keeps as many copies as it sends
        assert placement.held_by(0) == [r for r, hs in enumerate(placement.holders) if 0 in hs]


def test_placement_is_the_same_whatever_rank_computes_it_and_uneven_domains_still_spread():
    domains = ["n1"] * 3 + ["n2"] * 1 + ["n3"] * 2
    first, again = place_replicas(domains, 2), place_replicas(list(domains), 2)
    assert first == again
    for rank, holders in enumerate(first.holders):
        assert domains[rank] not in {domains[h] for h in holders}


def test_a_domain_spanning_hosts_has_a_store_and_a_leader_per_host_even_at_one_local_root_path():
    """A rack as the failure domain: its nodes' disks are mounted at the same path, yet each is its own store."""
    from dcp_atomic.tiers.local_tier import Topology

    domains = ("rackA", "rackA", "rackA", "rackB", "rackB", "rackB")
    hosts = ("h1", "h1", "h2", "h3", "h4", "h4")
    topology = Topology(rank=2, domains=domains, roots=("/nvme/ckpt",) * 6, hosts=hosts,
                        placement=place_replicas(list(domains), 1))
    assert topology.leaders == [0, 2, 3, 4] and topology.is_leader
    assert [topology.leader(r) for r in range(6)] == [0, 0, 2, 3, 4, 4]


def test_fewer_domains_than_replicas_plus_one_is_refused_naming_them():
    with pytest.raises(ConfigurationError) as refused:
        place_replicas(["nodeA", "nodeA", "nodeB", "nodeB"], 2)
    message = str(refused.value)
    assert "replicas=2 needs at least 3 failure domains" in message and "'nodeA' (ranks 0, 1)" in message
    with pytest.raises(ConfigurationError):
        place_replicas(["solo"], 1)
    assert place_replicas(["solo"], 0).holders == ((),)


# -- worlds ----------------------------------------------------------------------------------------------------


def _train_and_save(ctx, steps, asynchronous_last=False, keep_local=2):
    """Train, saving each step in ``steps`` to the local tier; returns the full weights at each saved step."""
    model, optim = _fsdp_app(ctx.world_size, 0)
    saved, stats = {}, []
    with _manager(ctx, keep_local=keep_local, callbacks=Callbacks(on_saved=stats.append)) as manager:
        for i, step in enumerate(steps):
            _train_step(model, optim, step)
            if asynchronous_last and i == len(steps) - 1:
                assert manager.async_save(step, _state(model, optim, step)).result(timeout=60) == step
            else:
                assert manager.save(step, _state(model, optim, step)) == step
            saved[step] = _full(model)
        listed = {tier: manager.steps(tier=tier) for tier in ("local", "durable", None)}
    return {"saved": saved, "listed": listed, "stats": stats}


def _restore(ctx, expect_step=None, step=None, **manager_kwargs):
    model, optim = _fsdp_app(ctx.world_size, 42)
    stats = []
    with _manager(ctx, callbacks=Callbacks(on_loaded=stats.append), **manager_kwargs) as manager:
        state = _state(model, optim, -1)
        loaded = manager.load(state, step=step)
        served = manager.restored_from
    assert expect_step is None or loaded == expect_step, (loaded, expect_step)
    assert state["progress"]["step"] == loaded
    return {"step": loaded, "full": _full(model), "served": served, "stats": stats}


def _data_files(node_root, step):
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(node_root, RUN, f"step_{step:010d}", "*",
                                                                      "__*_*.distcp")))


@pytest.mark.slow
def test_local_round_trip_is_exact_replicated_on_both_nodes_and_keeps_keep_local(root, nodes):
    saved = assert_all_ok(_run(_train_and_save, root, nodes, [10, 20, 30], True))
    assert all(out["listed"] == {"local": [20, 30], "durable": [], None: [20, 30]} for out in saved)
    everyone = ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"]
    for node_root in nodes:  # each rank's own files on its node plus its replica on the other: both hold all 4
        assert _data_files(node_root, 30) == everyone and _data_files(node_root, 20) == everyone
        assert not os.path.exists(os.path.join(node_root, RUN, f"step_{10:010d}"))  # keep_local=2
        assert os.path.exists(os.path.join(node_root, RUN, f"step_{30:010d}", "COMMITTED"))
    # nothing reached the durable root but the run's lineage, written before the first save
    # (dcp_atomic/protocol/lineage.py)
    assert os.listdir(os.path.join(root, RUN)) == ["LINEAGE"]
    restored = assert_all_ok(_run(_restore, root, nodes, 30))
    for out in restored:
        assert out["served"] == {"tier": "local", "step": 30, "save_id": out["served"]["save_id"], "ranks_fetched": 0,
                                 "bytes_fetched": 0}
        _exact(out["full"], saved[0]["saved"][30])
        [loaded] = out["stats"]
        assert loaded["tier"] == "local" and loaded["bytes_from_replicas"] == 0 and loaded["bytes_from_storage"] > 0
    # Rank 0's on_saved says where each step went and what replication cost: every rank's files sent once.
    save_stats = saved[0]["stats"]
    assert [s["step"] for s in save_stats] == [10, 20, 30] and {s["tier"] for s in save_stats} == {"local"}
    for s in save_stats:
        assert s["replica_bytes"] >= s["bytes"] > 0, s  # the data files, plus each rank's manifest shard
        assert 0 < s["local_commit_seconds"] <= s["seconds"]
    assert all(out["stats"] == [] for out in saved[1:])  # on_saved is rank 0's


@pytest.mark.slow
def test_a_replaced_node_is_restored_exactly_from_the_replicas(root, nodes):
    saved = assert_all_ok(_run(_train_and_save, root, nodes, [10, 20]))
    shutil.rmtree(os.path.join(nodes[1], RUN))  # node B replaced: its local disk comes back empty
    restored = assert_all_ok(_run(_restore, root, nodes, 20))
    for out in restored:
        assert out["served"]["tier"] == "local" and out["step"] == 20
        _exact(out["full"], saved[0]["saved"][20])
    # Each of node B's ranks received (at least) its own files itself; node A's ranks nothing.
    assert [out["served"]["ranks_fetched"] >= 1 for out in restored] == [False, False, True, True]
    # The bytes that moved are counted where they arrived, per rank (tests/tiers/test_tier_restore_plan.py: file by file).
    on_b = [out["stats"][0]["bytes_from_replicas"] for out in restored]
    assert on_b == [out["served"]["bytes_fetched"] for out in restored] and on_b[:2] == [0, 0]
    assert on_b[2] + on_b[3] > sum(os.path.getsize(os.path.join(os.path.dirname(p), f"__{r}_0.distcp")) for r in (2, 3)
                                   for p in glob.glob(os.path.join(nodes[1], RUN, f"step_{20:010d}", "*", "manifest.json")))
    assert {"__2_0.distcp", "__3_0.distcp"} <= set(_data_files(nodes[1], 20))  # node B holds its own ranks' files


def _save_durable_then_local(ctx):
    """Step 5 to the durable root (a manager without local_root), then steps 10, 20 to the local tier."""
    from dcp_atomic import CheckpointManager

    model, optim = _fsdp_app(ctx.world_size, 0)
    _train_step(model, optim, 5)
    with CheckpointManager(ctx.root, RUN, timeout=20) as durable:
        durable.save(5, _state(model, optim, 5))
    saved = {5: _full(model)}
    with _manager(ctx) as manager:
        for step in (10, 20):
            _train_step(model, optim, step)
            manager.save(step, _state(model, optim, step))
            saved[step] = _full(model)
        listed = {tier: manager.steps(tier=tier) for tier in ("local", "durable", None)}
    return {"saved": saved, "listed": listed}


@pytest.mark.slow
def test_every_local_root_gone_restores_the_newest_durable_step_and_says_so(root, nodes):
    saved = assert_all_ok(_run(_save_durable_then_local, root, nodes))
    assert saved[0]["listed"] == {"local": [10, 20], "durable": [5], None: [5, 10, 20]}
    for node_root in nodes:
        shutil.rmtree(os.path.join(node_root, RUN))
    restored = assert_all_ok(_run(_restore, root, nodes, 5))
    for out in restored:
        assert out["served"]["tier"] == "durable" and out["step"] == 5
        assert out["stats"][0]["tier"] == "durable" and out["stats"][0]["bytes_from_replicas"] == 0
        _exact(out["full"], saved[0]["saved"][5])


@pytest.mark.slow
def test_a_flipped_byte_in_a_local_primary_is_served_from_the_replica_never_wrong_values(root, nodes):
    saved = assert_all_ok(_run(_train_and_save, root, nodes, [10, 20]))
    [primary] = glob.glob(os.path.join(nodes[0], RUN, f"step_{20:010d}", "*", "__0_0.distcp"))
    _flip_byte(primary)
    restored = assert_all_ok(_run(_restore, root, nodes, 20))
    for out in restored:
        assert out["served"]["tier"] == "local" and out["step"] == 20
        _exact(out["full"], saved[0]["saved"][20])
    assert restored[0]["served"]["ranks_fetched"] == 1  # node A took rank 0's files back from node B's replica
    assert restored[2]["served"]["ranks_fetched"] == 0


@pytest.mark.slow
def test_no_copy_left_is_a_typed_error_naming_the_rank_and_file(root, nodes):
    assert_all_ok(_run(_train_and_save, root, nodes, [10]))
    for node_root in nodes:  # rank 2's files lost on both nodes, nothing durable
        for path in glob.glob(os.path.join(node_root, RUN, f"step_{10:010d}", "*", "__2_0.distcp")):
            os.unlink(path)
    outcomes = _run(_restore, root, nodes)
    for out in outcomes:
        assert out.error_type == "CheckpointNotFoundError", out
        assert "rank 2 (__2_0.distcp)" in out.error and "local step 10" in out.error, out.error


@pytest.mark.slow
def test_an_incomplete_newest_local_step_falls_back_to_the_older_complete_one(root, nodes):
    saved = assert_all_ok(_run(_train_and_save, root, nodes, [10, 20]))
    for node_root in nodes:
        for path in glob.glob(os.path.join(node_root, RUN, f"step_{20:010d}", "*", "__3_0.distcp")):
            _flip_byte(path)
    restored = assert_all_ok(_run(_restore, root, nodes, 10))
    for out in restored:
        assert out["served"]["tier"] == "local"
        _exact(out["full"], saved[0]["saved"][10])


def _one_domain(rank: int) -> dict[str, str]:
    return {"DCP_ATOMIC_FAILURE_DOMAIN": "rack1"}


def _construct(ctx):
    _manager(ctx)


def test_too_few_failure_domains_are_refused_at_construction(root, nodes):
    outcomes = _run(_construct, root, nodes, world=2, rank_env=_one_domain)
    for out in outcomes:
        assert out.error_type == "ConfigurationError", out
        assert "replicas=1 needs at least 2 failure domains" in out.error and "'rack1' (ranks 0, 1)" in out.error


def _save_then_die(ctx):
    """Step 10 local-committed, then step 20, during which rank 0 is SIGKILLed with its manifest published."""
    model, optim = _fsdp_app(ctx.world_size, 0)
    with _manager(ctx) as manager:
        _train_step(model, optim, 10)
        manager.save(10, _state(model, optim, 10))
        full = _full(model)
        if ctx.rank == 1:
            torch.save(full, os.path.join(ctx.root, "expected10.pt"))
        _train_step(model, optim, 20)
        manager.save(20, _state(model, optim, 20))


@pytest.mark.slow
def test_a_kill_before_the_local_commit_leaves_the_previous_local_step(root, nodes):
    def env(rank):
        return {**_node_env(rank), "DCP_ATOMIC_FAILPOINTS": "commit.after_manifest@0#2=kill" if rank == 0 else None}

    outcomes = _run(_save_then_die, root, nodes, rank_env=env)
    assert outcomes[0].killed and not any(out.ok for out in outcomes), outcomes
    for node_root in nodes:  # step 20's files were written, but no root has its marker
        assert not os.path.exists(os.path.join(node_root, RUN, f"step_{20:010d}", "COMMITTED"))
    assert not _data_files(nodes[0], 20) and not _data_files(nodes[1], 20)  # the survivors removed the attempt
    restored = assert_all_ok(_run(_restore, root, nodes, 10))
    for out in restored:
        assert out["served"]["tier"] == "local"
        _exact(out["full"], torch.load(os.path.join(root, "expected10.pt")))


# -- the drain to the durable root -------------------------------------------------------------------------------


def _durable_markers(root):
    return sorted(int(os.path.basename(os.path.dirname(p))[5:])
                  for p in glob.glob(os.path.join(root, RUN, "step_*", "COMMITTED")))


def _marker(root, step):
    import json

    with open(os.path.join(root, RUN, f"step_{step:010d}", "COMMITTED")) as f:
        return json.load(f)


def _save_with_policy(ctx):
    """Steps 10-40 with durable_every=2, then wait(): steps 20 and 40 are drained."""
    model, optim = _fsdp_app(ctx.world_size, 0)
    drained, saved = [], {}
    with _manager(ctx, durable_every=2, keep_local=4, callbacks=Callbacks(on_drained=drained.append)) as manager:
        for step in (10, 20, 30, 40):
            _train_step(model, optim, step)
            manager.save(step, _state(model, optim, step))
            saved[step] = _full(model)
        manager.wait()
        listed = {tier: manager.steps(tier=tier) for tier in ("local", "durable")}
    return {"saved": saved, "listed": listed, "drained": drained}


def _load_durable(ctx, step):
    """Step ``step`` through a plain AtomicStorageReader, and the latest through a manager without local_root."""
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicLoadPlanner, AtomicStorageReader, CheckpointManager

    model, optim = _fsdp_app(ctx.world_size, 42)
    state = _state(model, optim, -1)
    dcp.load(state, storage_reader=AtomicStorageReader(ctx.root, run_id=RUN, step=step), planner=AtomicLoadPlanner())
    plain = {"step": state["progress"]["step"], "full": _full(model)}
    model, optim = _fsdp_app(ctx.world_size, 43)
    state = _state(model, optim, -1)
    with CheckpointManager(ctx.root, RUN, timeout=20) as durable:
        latest = durable.load(state)
    return {"plain": plain, "latest": latest, "full": _full(model)}


@pytest.mark.slow
def test_durable_every_2_drains_every_second_step_bit_exact_for_plain_readers(root, nodes, capsys):
    saved = assert_all_ok(_run(_save_with_policy, root, nodes))
    assert _durable_markers(root) == [20, 40]
    import json

    from dcp_atomic.tools import cli

    capsys.readouterr()
    assert cli.main(["ls", root, RUN, "--json", "--local-root", nodes[1]]) == 0  # the CLI on node B
    listing = json.loads(capsys.readouterr().out)
    assert {row["step"]: row["tiers"] for row in listing["steps"]} == {
        10: ["local"], 20: ["durable", "local"], 30: ["local"], 40: ["durable", "local"]}
    assert cli.main(["ls", root, RUN]) == 0  # without --local-root it sees the durable tier only
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert sorted(lines) == ["20", "40"] and "durable " in lines["20"], lines
    # show: a step's tiers, and where its copies were (each rank's failure domain and its replicas' domains).
    where = "saved through the local tier: A: ranks 0, 1 (replicas on B); B: ranks 2, 3 (replicas on A)"
    for args, tiers in [(["show", root, RUN, "20"], "durable, local"),  # the drained copy keeps ranks.json as is
                        (["show", root, RUN, "30", "--local-root", nodes[1]], "local"),
                        (["show", root, RUN, "40", "--local-root", nodes[0]], "durable, local")]:
        assert cli.main(args if "--local-root" in args else args + ["--local-root", nodes[0]]) == 0
        out = capsys.readouterr().out.splitlines()
        assert out[1:3] == [f"tiers: {tiers}", where], (args, out[:4])
    assert cli.main(["show", root, RUN, "40", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tiers"] == ["durable"]  # without --local-root: the root alone
    # ROOT a node's local root: its steps are that disk's copies, drained or not (10, 30 never were), never durable
    assert cli.main(["ls", nodes[1], RUN, "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert {row["step"]: row["tiers"] for row in listing["steps"]} == {s: ["local"] for s in (10, 20, 30, 40)}
    assert listing["root_tier"] == "local", listing
    for args in (["show", nodes[1], RUN, "30"], ["show", nodes[1], RUN, "30", "--local-root", nodes[1]]):
        assert cli.main(args) == 0
        assert capsys.readouterr().out.splitlines()[1] == "tiers: local", args
    assert all(out["listed"] == {"local": [10, 20, 30, 40], "durable": [20, 40]} for out in saved), saved[0]["listed"]
    for step in (20, 40):  # the step keeps its local commit sequence in the durable root (P10 across tiers)
        local = _marker(nodes[0], step)
        durable = _marker(root, step)
        assert (durable["save_id"], durable["sequence"]) == (local["save_id"], local["sequence"])
    stats = saved[0]["drained"]
    assert [s["step"] for s in stats] == [20, 40] and all(s["kind"] == "drain" and s["attempts"] == 1 for s in stats)
    assert stats[0]["files"] == WORLD and stats[0]["bytes"] > 0 and stats[0]["skipped_steps"] == []
    assert all(out["drained"] == [] for out in saved[1:])  # on_drained: rank 0 only
    from tests.helpers.stats import _schema_problems, _table

    assert _schema_problems(stats[0], _table("Drain")) == []  # as docs/statistics.md documents it
    loaded = assert_all_ok(_run(_load_durable, root, nodes, 20))
    for out in loaded:
        assert out["plain"]["step"] == 20 and out["latest"] == 40
        _exact(out["plain"]["full"], saved[0]["saved"][20])
        _exact(out["full"], saved[0]["saved"][40])


def _hold_the_first_drain(ctx):
    """Step 10 drains, held on rank 0 by an event; steps 20-40 are saved meanwhile (keep_local=1), then released."""
    import threading

    from dcp_atomic.tiers import drain

    release, seen = threading.Event(), {}
    if ctx.rank == 0:
        failpoints.arm("drain.before_upload", lambda rank, step: step == 10 and release.wait(timeout=90))
    lines = _Lines("dcp_atomic.drain")
    model, optim = _fsdp_app(ctx.world_size, 0)
    drained, saved = [], {}
    with _manager(ctx, keep_local=1, callbacks=Callbacks(on_drained=drained.append)) as manager:
        for step in (10, 20, 30, 40):
            _train_step(model, optim, step)
            manager.save(step, _state(model, optim, step), durable=True)  # returns although the drain is held
            saved[step] = _full(model)
        on_disk = sorted(int(n[5:]) for n in os.listdir(os.path.join(ctx.extra["nodes"][ctx.rank // 2], RUN))
                         if n.startswith("step_"))
        seen["durable_while_held"] = _durable_markers(ctx.root)
        release.set()
        manager.wait()
        seen["durable_after"] = _durable_markers(ctx.root)
    return {"saved": saved, "on_disk": on_disk, "lines": lines.lines, "drained": drained, **seen}


@pytest.mark.slow
def test_saves_return_while_a_drain_is_held_the_queue_keeps_the_newest_and_retention_keeps_the_drained(root, nodes):
    outcomes = assert_all_ok(_run(_hold_the_first_drain, root, nodes))
    for out in outcomes:
        assert out["durable_while_held"] == []  # every save returned while step 10's drain had not uploaded a byte
        # keep_local=1 keeps 40 (newest), 10 (in flight) and 30 (waiting when 40 committed); 20 was replaced and removed
        assert out["on_disk"] == [10, 30, 40], out["on_disk"]
        assert out["durable_after"] == [10, 40]
    behind = [line for line in outcomes[0]["lines"] if "is behind" in line]
    assert any("[20]" in line and "by step 30" in line for line in behind), outcomes[0]["lines"]
    assert any("[30]" in line and "by step 40" in line for line in behind), outcomes[0]["lines"]
    assert [(s["step"], s["skipped_steps"]) for s in outcomes[0]["drained"]] == [(10, []), (40, [20, 30])]
    loaded = assert_all_ok(_run(_load_durable, root, nodes, 10))
    for out in loaded:
        _exact(out["plain"]["full"], outcomes[0]["saved"][10])
        _exact(out["full"], outcomes[0]["saved"][40])


def _drain_into_a_full_disk(ctx, ballast):
    """Step 10's drain meets a full durable root (ENOSPC); space comes back; step 20's drain succeeds."""
    import torch.distributed as dist

    from dcp_atomic.tiers import drain

    drain.RETRY_BACKOFF = 0.2
    failures, drained = [], []
    model, optim = _fsdp_app(ctx.world_size, 0)
    with _manager(ctx, callbacks=Callbacks(on_failed=failures.append, on_drained=drained.append)) as manager:
        _train_step(model, optim, 10)
        manager.save(10, _state(model, optim, 10), durable=True)
        try:
            manager.wait()
        except Exception as e:
            raised = (type(e).__name__, str(e))
        else:
            raised = None
        manager.wait()  # raised once
        dist.barrier()
        if ctx.rank == 0:
            shutil.rmtree(ballast)  # space is back
        dist.barrier()
        _train_step(model, optim, 20)
        manager.save(20, _state(model, optim, 20), durable=True)
        manager.wait()
        full = _full(model)
    return {"raised": raised, "failures": failures, "drained": [s["step"] for s in drained], "full": full}


@pytest.mark.slow
def test_a_drain_into_a_full_durable_root_is_reported_and_a_later_drain_succeeds(nodes):
    with small_tmpfs_ctx(size_kib=1024) as durable:
        durable.fill_bytes(leave=0)  # fill the durable root: a real ENOSPC for the uploads
        outcomes = assert_all_ok(_run(_drain_into_a_full_disk, durable.path, nodes, durable.ballast_dir))
        for out in outcomes:
            assert out["raised"] is not None and out["raised"][0] == "StorageError", out["raised"]
            assert "No space left" in out["raised"][1] and "step 10" in out["raised"][1], out["raised"]
            [failure] = out["failures"]
            assert (failure["operation"], failure["step"], failure["error_type"]) == ("drain", 10, "StorageError")
            assert failure["ranks"] == [0, 1, 2, 3] and failure["path"].startswith(durable.path), failure
        assert outcomes[0]["drained"] == [20]
        assert _durable_markers(durable.path) == [20]  # step 10 never became visible
        loaded = assert_all_ok(_run(_load_durable, durable.path, nodes, 20))
        for out in loaded:
            _exact(out["full"], outcomes[0]["full"])


def _drain_then_die_before_the_marker(ctx):
    """Step 10 drained; step 20's drain uploads every rank's files, then rank 0 is SIGKILLed before its marker."""
    import signal

    from dcp_atomic.tiers import drain

    if ctx.rank == 0:
        failpoints.arm("drain.before_marker", lambda rank, step: step == 20 and os.kill(os.getpid(), signal.SIGKILL))
    model, optim = _fsdp_app(ctx.world_size, 0)
    with _manager(ctx) as manager:
        _train_step(model, optim, 10)
        manager.save(10, _state(model, optim, 10), durable=True)
        manager.wait()
        full = _full(model)
        if ctx.rank == 1:
            torch.save(full, os.path.join(ctx.root, "expected10.pt"))
        _train_step(model, optim, 20)
        full = _full(model)  # a collective: every rank
        if ctx.rank == 1:
            torch.save(full, os.path.join(ctx.root, "expected20.pt"))
        manager.save(20, _state(model, optim, 20), durable=True)
        manager.wait()


@pytest.mark.slow
def test_a_kill_before_the_durable_marker_leaves_the_previous_durable_step(root, nodes):
    outcomes = _run(_drain_then_die_before_the_marker, root, nodes)
    assert outcomes[0].killed and not any(out.ok for out in outcomes), outcomes
    for out in outcomes[1:]:  # rank 0 died deciding: its peers cannot know whether it committed, and say so
        assert "may have committed it" in out.error and "dcp-atomic ls" in out.error, out.error
    assert _durable_markers(root) == [10]  # step 20's files were all uploaded, but it is not visible
    assert glob.glob(os.path.join(root, RUN, f"step_{20:010d}", "*", "__3_0.distcp"))
    import json

    with open(os.path.join(root, RUN, "LATEST")) as f:
        assert json.load(f)["step"] == 10
    # load(step=20) is served by the local tier at once: the unmarked durable attempt is no commit to wait for
    # (it used to wait out the timeout on rank 0 while its peers' exchange timed out: RankFailureError)
    for out in assert_all_ok(_run(_restore, root, nodes, 20, 20)):
        assert out["served"]["tier"] == "local"
        _exact(out["full"], torch.load(os.path.join(root, "expected20.pt")))
    expected = torch.load(os.path.join(root, "expected10.pt"))
    for node_root in nodes:  # the durable tier alone: it serves step 10
        shutil.rmtree(os.path.join(node_root, RUN))
    for out in assert_all_ok(_run(_load_durable, root, nodes, 10)):
        assert out["latest"] == 10
        _exact(out["full"], expected)


# -- the kill matrix: a rank SIGKILLed at each point of a two-tier save, then a fresh world ------------------------


def _save_10_then_die_in_20(ctx, drain_kill):
    """Steps 10 and 20 to the local tier, each drained; a failpoint (``DCP_ATOMIC_FAILPOINTS``) or ``drain_kill``
    (hook, rank) SIGKILLs a rank during step 20.  Rank 1 keeps the full weights of both steps for the checks."""
    import signal

    from dcp_atomic.tiers import drain

    if drain_kill is not None and ctx.rank == drain_kill[1]:
        failpoints.arm(f"drain.{drain_kill[0]}", lambda rank, step: step == 20 and os.kill(os.getpid(), signal.SIGKILL))
    model, optim = _fsdp_app(ctx.world_size, 0)
    with _manager(ctx, timeout=5) as manager:  # the survivors of a kill give up after 5 s
        for step in (10, 20):
            _train_step(model, optim, step)
            full = _full(model)
            if ctx.rank == 1:
                torch.save(full, os.path.join(ctx.root, f"expected{step}.pt"))
            manager.save(step, _state(model, optim, step), durable=True)
            manager.wait()


def _attempts(layout, step):
    from dcp_atomic.protocol.retention import plan_gc

    return [s for s, _ in plan_gc(layout, None, lease_seconds=0).delete_attempts if s == step]


KILLS = {  # cell -> (failpoint spec, every point limited to a rank; drain hook; the killed rank; the step restored)
    "local_write": ("write.mid_data@1#2=kill", None, 1, 10),
    "replication_send": ("replicate.send@1#2=kill", None, 1, 10),
    "replication_receive": ("replicate.receive@3#2=kill", None, 3, 10),
    "local_commit_other_root": ("local.before_marker@2#2=kill", None, 2, 20),  # rank 0 decided: its root has it
    "local_commit_rank0": ("local.before_marker@0#2=kill", None, 0, 20),  # rank 0 decided, then died
    # ... while the other root's leader is slow to record its marker: its root's other rank, which has the decision
    # too, must not remove the step's files as a failed attempt meanwhile (it did: the restore fell back to 10)
    "local_commit_rank0_slow_leader": ("local.before_marker@0#2=kill;local.before_marker@2#2=sleep:3", None, 0, 20),
    "drain_upload": (None, ("before_upload", 1), 1, 20),  # local-committed; the durable root keeps step 10
    # the drain's commit, at the committer's own kill point (hits on rank 0: local 10, drain 10, local 20, drain 20)
    "drain_commit": ("commit.after_manifest@0#4=kill", None, 0, 20),
}


@pytest.mark.slow
@pytest.mark.parametrize("cell", sorted(KILLS))
def test_kill_matrix_a_restart_loads_the_newest_local_commit_exactly_and_gc_collects_the_rest(root, nodes, cell):
    from dcp_atomic.protocol.commit import scan_markers
    from dcp_atomic.format.layout import RunLayout
    from dcp_atomic.tiers.local_tier import local_markers, open_local
    from dcp_atomic.protocol.retention import apply_gc, plan_gc
    from dcp_atomic.stores.storage import LocalStorage

    spec, drain_kill, victim, expected = KILLS[cell]

    def env(rank):
        return {**_node_env(rank), "DCP_ATOMIC_FAILPOINTS": spec}

    outcomes = _run(_save_10_then_die_in_20, root, nodes, drain_kill, rank_env=env, pg_timeout=5)  # survivors wait
    assert outcomes[victim].killed and not any(out.ok for out in outcomes), outcomes
    local = [open_local(node_root, RUN) for node_root in nodes]
    committed_on = [20 in [m.step for m in local_markers(layout)] for layout in local]
    if expected == 10:  # killed before rank 0 decided: no root has a marker of step 20, and its files are garbage
        assert committed_on == [False, False]
        # every root has a survivor, and the survivors removed the failed attempt before raising: nothing for gc
        assert not any(_attempts(layout, 20) for layout in local)
        assert not any(os.path.exists(layout.step_dir(20)) for layout in local)
    else:
        assert any(committed_on), (committed_on, outcomes)
    durable = RunLayout(LocalStorage(root), RUN)
    assert [m.step for m in scan_markers(durable)] == [10]  # no durable step half visible
    assert _attempts(durable, 10) == []
    half_drained = cell.startswith("drain")
    if half_drained:
        assert _attempts(durable, 20)  # the half-drained step: files, no marker, collectable
    for layout in [durable, *local]:
        apply_gc(layout, plan_gc(layout, None, lease_seconds=0))
    restored = assert_all_ok(_run(_restore, root, nodes, expected))
    want = torch.load(os.path.join(root, f"expected{expected}.pt"))
    for out in restored:
        assert out["served"]["tier"] == "local", out["served"]
        _exact(out["full"], want)
    for out in assert_all_ok(_run(_load_durable, root, nodes, 10)) if half_drained else ():
        assert out["latest"] == 10
        _exact(out["full"], torch.load(os.path.join(root, "expected10.pt")))


def _restore_killed(ctx):
    try:
        return _restore(ctx, 20, timeout=5)  # the survivors of the kill give up after 5 s (20 s is no more proof)
    except Exception as e:  # the survivors of the killed rank: typed, in bounded time
        return {"error": f"{type(e).__name__}: {e}"}


@pytest.mark.slow
def test_kill_matrix_a_restore_killed_before_its_marker_leaves_no_marker_and_the_next_restore_is_exact(root, nodes):
    """The tier restore's commit goes through the one local-marker record (commit.record_local_marker) and its kill
    point: node B's leader, killed as it is about to record the restored step, leaves node B without a marker
    (nothing half visible); the next restore sweeps the spool and restores the step exactly."""
    saved = assert_all_ok(_run(_train_and_save, root, nodes, [10, 20]))
    shutil.rmtree(os.path.join(nodes[1], RUN))  # node B replaced

    def env(rank):
        return {**_node_env(rank), "DCP_ATOMIC_FAILPOINTS": "local.before_marker@2#1=kill" if rank == 2 else None}

    outcomes = _run(_restore_killed, root, nodes, rank_env=env, pg_timeout=5)
    assert outcomes[2].killed and all(out.ok for r, out in enumerate(outcomes) if r != 2), outcomes
    assert all("error" in outcomes[r].value for r in (0, 1, 3)), [o.value for o in outcomes]
    assert not os.path.exists(os.path.join(nodes[1], RUN, f"step_{20:010d}", "COMMITTED"))
    for out in assert_all_ok(_run(_restore, root, nodes, 20)):
        assert out["served"]["tier"] == "local"
        _exact(out["full"], saved[0]["saved"][20])
    assert os.path.exists(os.path.join(nodes[1], RUN, f"step_{20:010d}", "COMMITTED"))


# -- a peer lost while files move between ranks: the transport's typed error, never gloo's -----------------------


def _lost(ctx, victim, error, started):
    """What a survivor raised, once every survivor has (global rank 0 hosts the rendezvous store: it must outlive
    the others' verdicts, as a job's store does)."""
    import time

    seconds = time.monotonic() - started
    _survivors_barrier(ctx, [r for r in range(ctx.world_size) if r != victim])
    return {"error": type(error).__name__, "silent": getattr(error, "details", {}).get("silent"),
            "message": str(error), "seconds": seconds}


def _save_then_lose_rank3_mid_replication(ctx):
    """Step 1 local-committed; in step 2, rank 3 is SIGKILLed as it is about to post the first chunk round of its
    replica streams (indexes exchanged, peers waiting for its bytes).  No ``close()``: a job whose peer died exits
    (and its heartbeat keeps answering for the others' verdicts)."""
    import time

    model, optim = _fsdp_app(ctx.world_size, 0)
    manager = _manager(ctx, timeout=5)
    _train_step(model, optim, 1)
    manager.save(1, _state(model, optim, 1))
    full = _full(model)  # a collective: every rank gathers
    if ctx.rank == 1:
        torch.save(full, os.path.join(ctx.root, "expected1.pt"))
    if ctx.rank == 3:
        failpoints.arm("transfer.round", "kill")
    _train_step(model, optim, 2)
    started = time.monotonic()
    try:
        manager.save(2, _state(model, optim, 2))
    except Exception as e:
        return _lost(ctx, 3, e, started)
    return {"error": None}


def _assert_named(outcomes, victim):
    """Every survivor raised a RankFailureError naming only ``victim``, within seconds; the ranks that exchanged
    with it raised the transport's own PeerLost."""
    survivors = [o.value for o in outcomes if o.rank != victim]
    assert outcomes[victim].killed and all(o.ok for o in outcomes if o.rank != victim), outcomes
    for out in survivors:
        assert out["error"] in ("PeerLost", "RankFailureError"), out
        assert out["silent"] == str(victim), out
        assert out["seconds"] < 60, out
    assert any(out["error"] == "PeerLost" for out in survivors), survivors


@pytest.mark.slow
def test_a_peer_lost_mid_replication_is_named_typed_and_the_previous_local_step_restores_exactly(root, nodes):
    outcomes = _run(_save_then_lose_rank3_mid_replication, root, nodes, pg_timeout=5)
    _assert_named(outcomes, 3)
    assert not any(os.path.exists(os.path.join(node, RUN, f"step_{2:010d}", "COMMITTED")) for node in nodes)
    for out in assert_all_ok(_run(_restore, root, nodes, 1)):
        assert out["served"]["tier"] == "local"
        _exact(out["full"], torch.load(os.path.join(root, "expected1.pt")))


def _restore_losing_a_sender(ctx):
    import time

    model, optim = _fsdp_app(ctx.world_size, 42)
    manager = _manager(ctx, timeout=5)  # no close() after the failure, as above; the survivors give up after 5 s
    started = time.monotonic()
    try:
        manager.load(_state(model, optim, -1))
    except Exception as e:
        return _lost(ctx, 1, e, started)
    return {"error": None}


@pytest.mark.slow
def test_a_sender_lost_mid_restore_is_named_typed_and_the_next_restore_is_exact(root, nodes):
    """Node B replaced: node A's ranks stream it the step; rank 1 is SIGKILLed as it is about to post its first chunk round."""
    saved = assert_all_ok(_run(_train_and_save, root, nodes, [10, 20]))
    shutil.rmtree(os.path.join(nodes[1], RUN))

    def env(rank):
        return {**_node_env(rank), "DCP_ATOMIC_FAILPOINTS": "transfer.round@1#1=kill" if rank == 1 else None}

    _assert_named(_run(_restore_losing_a_sender, root, nodes, rank_env=env, pg_timeout=5), 1)
    assert not os.path.exists(os.path.join(nodes[1], RUN, f"step_{20:010d}", "COMMITTED"))
    for out in assert_all_ok(_run(_restore, root, nodes, 20)):
        assert out["served"]["tier"] == "local"
        _exact(out["full"], saved[0]["saved"][20])


def _drain_with_an_unreadable_latest(ctx):
    """World 1: the durable LATEST is a directory, so everything after the marker fails; returns close()'s error."""
    from dcp_atomic import CheckpointManager
    from dcp_atomic.tiers import drain

    drain.DRAIN_ATTEMPTS = 1
    durable, local = os.path.join(ctx.root, "durable"), os.path.join(ctx.root, "local")
    os.makedirs(os.path.join(durable, RUN, "LATEST"))
    manager = CheckpointManager(durable, RUN, local=LocalTierOptions(local, replicas=0, durable_every=1), timeout=10)
    manager.save(1, {"w": torch.arange(4.0)})
    try:
        manager.close()
    except Exception as e:  # the drain's failure
        return {"error": str(e), "committed": os.path.exists(os.path.join(durable, RUN, f"step_{1:010d}", "COMMITTED"))}
    return {"error": None}


def test_a_drain_failing_after_its_marker_says_the_step_is_committed(root):
    # Before: the read of LATEST after the marker failed outside the "committed" path: "No durable marker was written".
    [out] = assert_all_ok(run_world(_drain_with_an_unreadable_latest, 1, root, timeout=60))
    assert out["committed"] and "is committed to the durable root" in out["error"], out
    assert "No durable marker" not in out["error"]


# -- a step saved for a durable copy whose drain never committed -----------------------------------------------------


def _flat(step: int) -> dict:
    return {"w": torch.arange(64.0) + step, "meta": {"step": step}}


def _drain_of_step_1_fails(ctx):
    from dcp_atomic.tiers import drain

    def full_disk(rank, step):
        raise OSError(28, "No space left on device (injected)")

    failpoints.arm("drain.before_marker", full_disk)
    drain.RETRY_BACKOFF = 0.1
    with _manager(ctx, keep_local=2) as manager:
        manager.save(1, _flat(1), durable=True)
        with pytest.raises(Exception) as failed:
            manager.wait()
        return type(failed.value).__name__


def _restart_and_save_locally(ctx):
    with _manager(ctx, keep_local=2) as manager:
        for step in (2, 3):  # local only: before the fix, keep_local=2 removed step 1 here, never drained
            manager.save(step, _flat(step), durable=False)
        manager.wait()
        listed = (manager.steps(tier="local"), manager.steps(tier="durable"))
    if 1 not in listed[1]:
        return listed, False  # a reader would wait out its timeout for a marker that never comes
    from dcp_atomic import AtomicStorageReader
    import torch.distributed.checkpoint as dcp

    state = _flat(-1)
    dcp.load(state, storage_reader=AtomicStorageReader(), checkpoint_id=os.path.join(ctx.root, RUN, f"step_{1:010d}"))
    return listed, torch.equal(state["w"], _flat(1)["w"]) and state["meta"] == {"step": 1}


def test_a_step_whose_drain_never_committed_is_kept_locally_and_drained_again_after_a_restart(root, nodes):
    """The newest durable-pending step survives local retention across a restart, and the next save queues it."""
    assert set(out for out in assert_all_ok(_run(_drain_of_step_1_fails, root, nodes))) == {"StorageError"}
    assert _durable_markers(root) == []
    for listed, exact in assert_all_ok(_run(_restart_and_save_locally, root, nodes)):
        assert listed == ([2, 3], [1]), listed  # kept until the drain queued again committed it, then retired
        assert exact


def _one_rank_manager(ctx, *, keep_local):
    from dcp_atomic import CheckpointManager

    local = LocalTierOptions(os.path.join(ctx.root, "node"), replicas=0, keep_local=keep_local, durable_every=None)
    return CheckpointManager(ctx.root, RUN, local=local, timeout=10)


def _rollback_past_an_undrained_step(ctx):
    from dcp_atomic.tiers import drain

    drain.RETRY_BACKOFF = 0.01
    with _one_rank_manager(ctx, keep_local=3) as manager:
        manager.save(1, _flat(1), durable=True)
        manager.wait()
        failpoints.arm("drain.before_upload", lambda rank, step: (_ for _ in ()).throw(OSError(5, "injected")))
        manager.save(3, _flat(3), durable=True)  # the branch about to be abandoned; its drain fails
        with pytest.raises(Exception):
            manager.wait()
        failpoints.disarm_all()
        manager.load(_flat(-1), step=1)  # roll back
        manager.save(2, _flat(20), durable=False)  # the new branch, local only
        manager.wait()
        return manager.steps(tier="durable")


def test_a_rollback_never_drains_the_abandoned_branchs_undrained_step(root):
    """P14: the step a rollback left is not this job's to make durable (it would become the durable LATEST)."""
    [durable] = assert_all_ok(run_world(_rollback_past_an_undrained_step, 1, root, timeout=120))
    assert durable == [1], durable


def _a_drain_that_always_fails(ctx):
    from dcp_atomic.tiers import drain

    drain.RETRY_BACKOFF = 0.01
    uploads = []

    def broken(rank, step):
        uploads.append(step)
        raise OSError(5, "injected, for good")

    failpoints.arm("drain.before_upload", broken)
    with _one_rank_manager(ctx, keep_local=1) as manager:
        manager.save(1, _flat(1), durable=True)
        with pytest.raises(Exception):
            manager.wait()
        per_save = []
        for step in range(2, 10):
            manager.save(step, _flat(step), durable=False)
            with contextlib.suppress(Exception):
                manager.wait()
            per_save.append((len(uploads), manager.steps(tier="local")))
        failpoints.disarm_all()
        return per_save


def test_an_undrained_step_is_kept_and_queued_again_at_doubling_intervals_not_at_every_save(root):
    # Before: queued again once, then keep_local=1 deleted step 1 although it never became durable.
    [per_save] = assert_all_ok(run_world(_a_drain_that_always_fails, 1, root, timeout=120))
    assert [count for count, _ in per_save] == [6, 6, 9, 9, 9, 9, 12, 12], per_save  # saves 2, 4, 8: 3 tries each
    assert [local for _, local in per_save] == [[1, step] for step in range(2, 10)], per_save  # kept throughout


def _durable_root_full_then_healed(ctx):
    """Two nodes, keep_local=1: step 1's drain fails (the durable store is full), local saves go on, node B's disk
    fills (a save fails for space), the store heals; returns what each phase showed."""
    import torch.distributed as dist

    from dcp_atomic.tiers import drain

    drain.RETRY_BACKOFF = 0.01
    failpoints.arm("drain.before_upload", lambda rank, step: (_ for _ in ()).throw(
        OSError(28, "No space left on device (injected: the durable store is full)")))
    seen = {}
    with _manager(ctx, keep_local=1, local_root=ctx.extra["nodes"][ctx.rank]) as manager:
        manager.save(1, _flat(1), durable=True)
        with pytest.raises(Exception):
            manager.wait()
        manager.save(2, _flat(2), durable=False)
        with contextlib.suppress(Exception):
            manager.wait()
        seen["local_while_down"] = manager.steps(tier="local")
        ballast = os.path.join(ctx.extra["nodes"][1], ".ballast")
        if ctx.rank == 1:
            _fill(ballast)
        dist.barrier()
        try:
            manager.save(3, _flat(3), durable=False)
        except Exception as e:
            seen["full"] = f"{type(e).__name__}: {e}"
        dist.barrier()
        if ctx.rank == 1:
            os.unlink(ballast)  # the operator frees space
        failpoints.disarm_all()  # the durable store heals
        manager.save(4, _flat(4), durable=False)
        try:
            manager.wait()
            seen["healed"] = None
        except Exception as e:
            seen["healed"] = f"{type(e).__name__}: {e}"
        seen["durable"] = manager.steps(tier="durable")
        manager.save(5, _flat(5), durable=False)
        seen["local_after"] = manager.steps(tier="local")
        state = _flat(-1)
        try:
            seen["loaded"] = manager.load(state, step=1), manager.restored_from["tier"]
        except Exception as e:  # before: step 1 was in neither tier
            seen["loaded"] = f"{type(e).__name__}: {e}"
        seen["exact"] = torch.equal(state["w"], _flat(1)["w"]) and state["meta"] == {"step": 1}
    return seen


def _fill(path):
    """Write ``path`` until its disk is full (a page-sized tail included)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        while True:
            os.write(fd, b"\xab" * 65536)
    except OSError as e:
        assert e.errno == 28, e
    finally:
        os.close(fd)


def test_a_durable_pending_step_is_kept_on_every_node_until_the_healed_store_drains_it(root, nodes):
    """Step 1 (durable=True) stays on both nodes past keep_local=1 while its drain fails, a save that
    fails for space says step 1 takes it and why, and once the store heals a later save drains it; a newer durable
    step then lets it go."""
    from tests.helpers.drain import _one_node_each

    outcomes = assert_all_ok(_run(_durable_root_full_then_healed, root, nodes, world=2, rank_env=_one_node_each))
    for rank, seen in enumerate(outcomes):
        assert seen["local_while_down"] == [1, 2], (rank, seen)
        full = seen.get("full", "")
        assert full.startswith("StorageError") and "No space left" in full, (rank, full)
        assert "Step 1 is kept" in full and "not durable yet" in full and "queue_drain(1)" in full, (rank, full)
        assert os.path.join(nodes[rank], RUN, f"step_{1:010d}") in full, (rank, full)
        assert seen["healed"] is None and seen["durable"] == [1], (rank, seen)
        assert seen["local_after"] == [5], (rank, seen)  # durable now: keep_local=1 lets it go
        assert seen["loaded"] == (1, "durable") and seen["exact"], (rank, seen)


def test_markers_and_the_commits_journal_carry_drain_only_where_set_as_earlier_versions_read_them():
    """Earlier versions build ``Marker(**entry)`` from each journal entry: a field they do not know would make
    them drop the journal and rescan every marker."""
    import json

    from dcp_atomic.format.manifest import Marker

    marker = Marker(run_id="r", step=1, save_id="20260101T000000Z-0123abcd", manifest="20260101T000000Z-0123abcd/"
                    "manifest.json", manifest_sha256="0" * 64, committed_at=1.0, library_version="x", sequence=1)
    assert "drain" not in json.loads(marker.to_json()) and "drain" not in marker.record()
    local = Marker(**{**marker.record(), "drain": True})
    assert json.loads(local.to_json())["drain"] is True
    assert Marker.from_json(local.to_json(), where="t").drain is True
    assert Marker.from_json(marker.to_json(), where="t").drain is None
