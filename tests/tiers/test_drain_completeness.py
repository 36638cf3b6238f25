"""A drain commits only a complete step, whatever world drains it (P13; DESIGN "Two tiers").

Worlds as simulated nodes with their own tmpfs local roots (``nodes``), the durable root on disk.  A world-4 job
saves a step for a durable copy whose drain fails (a store that refuses writes); a job of another size, or one
whose nodes lost files, then drains it again.  Before one completeness rule guarded every marker, a world-2 job
uploaded only ranks 0-1's files and committed the step as the latest durable one.
"""

from __future__ import annotations

import glob
import os
import shutil

import pytest

from tests.harness import assert_all_ok
from tests.helpers.drain import (_load_durable, _one_node_each, _resume_saving, _save_with_a_refusing_store,
                                 _two_per_node_of)
from tests.helpers.fsdp_app import _fsdp_app, _full, _train_step
from tests.helpers.tiers import RUN, _exact, _node_env, _run, _state


def test_a_resized_job_drains_an_older_worlds_step_whole_from_the_replicas(root, nodes):
    """4 ranks -> 2: the world-2 job uploads all four ranks' files (its roots hold them as primaries and replicas),
    and the durable step loads exactly at the world that saved it."""
    saved = assert_all_ok(_run(_save_with_a_refusing_store, root, nodes, 10, rank_env=_two_per_node_of(4)))
    assert saved[0]["failed"] is not None and saved[0]["durable"] == []
    resumed = assert_all_ok(_run(_resume_saving, root, nodes, 20, 1, world=2, rank_env=_one_node_each))
    assert all(out["error"] is None for out in resumed), resumed[0]["error"]
    assert resumed[0]["durable"] == [10], resumed[0]["durable"]
    shards = sorted(os.path.basename(p) for p in glob.glob(os.path.join(root, RUN, "step_0000000010", "*",
                                                                         "manifest.*.json")))
    assert shards == [f"manifest.{r}.json" for r in range(4)], shards
    loaded = assert_all_ok(_run(_load_durable, root, nodes, 10, rank_env=_two_per_node_of(4)))
    for out in loaded:
        assert out["step"] == 10 and out["progress"] == 10
        _exact(out["full"], saved[0]["full"])


def test_a_grown_job_drains_a_smaller_worlds_step_whole(root, nodes):
    """2 ranks -> 4: the world-4 job's ranks hold the world-2 step as primaries and replicas; it drains whole and
    loads exactly at the world that saved it."""
    saved = assert_all_ok(_run(_save_with_a_refusing_store, root, nodes, 10, 1, world=2, rank_env=_one_node_each))
    assert saved[0]["failed"] is not None and saved[0]["durable"] == []
    resumed = assert_all_ok(_run(_resume_saving, root, nodes, 20, rank_env=_two_per_node_of(4)))
    assert all(out["error"] is None for out in resumed), resumed[0]["error"]
    assert resumed[0]["durable"] == [10], resumed[0]["durable"]
    loaded = assert_all_ok(_run(_load_durable, root, nodes, 10, world=2, rank_env=_one_node_each))
    for out in loaded:
        assert out["step"] == 10 and out["progress"] == 10
        _exact(out["full"], saved[0]["full"])


def test_a_step_no_root_covers_stays_local_and_the_error_names_the_file_and_its_rank(root, nodes):
    """Node B replaced and node A's replica of rank 3 lost: no root holds ``__3_0.distcp``.  The drain refuses
    to commit, naming the file, its rank and the roots looked in; the durable root gets no marker."""
    saved = assert_all_ok(_run(_save_with_a_refusing_store, root, nodes, 10, rank_env=_node_env))
    assert saved[0]["failed"] is not None
    shutil.rmtree(os.path.join(nodes[1], RUN))  # node B replaced: an empty disk
    [lost] = glob.glob(os.path.join(nodes[0], RUN, "step_0000000010", "*", "__3_0.distcp"))
    os.unlink(lost)
    resumed = assert_all_ok(_run(_resume_saving, root, nodes, 20, rank_env=_node_env))
    for out in resumed:
        assert out["durable"] == [], out["durable"]
        kind, message = out["error"]
        assert kind == "IncompleteStepError", (kind, message)
        assert "__3_0.distcp (rank 3)" in message and nodes[0] in message, message
        assert "fix access on the durable root" not in message
        assert out["at_close"][0] == "IncompleteStepError", out["at_close"]  # close() tried it once more: said again
    assert not glob.glob(os.path.join(root, RUN, "step_0000000010", "COMMITTED"))


@pytest.mark.slow
@pytest.mark.parametrize("restore", [True, False], ids=["restored", "saved-without-loading"])
def test_a_node_wiped_before_its_drain_the_restarted_job_drains_the_step_from_the_surviving_copies(root, nodes,
                                                                                                 restore):
    """Node A (global rank 0's) is replaced while step 10 waits for its drain (the store refused it).  The restarted
    job's next save drains step 10 whole from node B alone (its primaries, its replicas of node A's ranks, its
    control files), whether the job first restored step 10 (which wrote it back to node A) or only saved: then
    rank 0's empty root knows nothing of step 10, and node B's report finds it.  It loads exactly."""
    saved = assert_all_ok(_run(_save_with_a_refusing_store, root, nodes, 10, rank_env=_node_env))
    assert saved[0]["failed"] is not None and saved[0]["durable"] == []
    shutil.rmtree(os.path.join(nodes[0], RUN))  # node A replaced: an empty disk
    resumed = assert_all_ok(_run(_resume_saving, root, nodes, 20, 2, restore, rank_env=_node_env))
    for out in resumed:
        if restore:
            assert out["restored"] == 10 and out["tier"] == "local", out
        assert out["error"] is None and out["durable"] == [10], out
    loaded = assert_all_ok(_run(_load_durable, root, nodes, 10, rank_env=_node_env))
    for rank, out in enumerate(loaded):
        assert out["step"] == 10 and out["progress"] == 10
        _exact(out["full"], saved[rank]["full"])


# -- same disk, one domain ----------------------------------------------------------------------------------------


def test_ranks_sharing_one_local_root_are_one_failure_domain_whatever_they_declare():
    from dcp_atomic.tiers.local_tier import one_domain_per_disk
    from dcp_atomic.tiers.placement import place_replicas

    # Four ranks per node told failure_domain=f"node{rank}": each node's ranks merge into one domain per disk.
    declared = [f"node{r}" for r in range(8)]
    hosts = ("h1",) * 4 + ("h2",) * 4
    domains, note = one_domain_per_disk(declared, hosts, ("/nvme",) * 8)
    assert domains == ["node0"] * 4 + ["node4"] * 4, domains
    assert "ranks 0, 1, 2, 3" in note and "h1:/nvme" in note
    placement = place_replicas(domains, 1)
    for rank, holders in enumerate(placement.holders):  # never a replica on the primary's own disk
        assert all(hosts[h] != hosts[rank] for h in holders), (rank, holders)
    # Transitive: a disk shared by a and b, another by b and c: one domain; distinct disks stay apart.
    domains, _ = one_domain_per_disk(["a", "b", "b", "c", "d"], ("x", "x", "y", "y", "z"), ("/r",) * 5)
    assert domains == ["a", "a", "a", "a", "d"]
    assert one_domain_per_disk(["a", "b"], ("x", "x"), ("/r1", "/r2")) == (["a", "b"], "")


def _construct_on_one_disk(ctx):
    from dcp_atomic import CheckpointManager, LocalTierOptions
    from dcp_atomic.errors import ConfigurationError

    try:
        CheckpointManager(ctx.root, RUN, timeout=20, local=LocalTierOptions(
            os.path.join(ctx.root, "one-disk"), replicas=1, failure_domain=f"node{ctx.rank}"))
    except ConfigurationError as e:
        return str(e)
    return None


def test_a_layout_that_leaves_too_few_domains_on_distinct_disks_is_refused_naming_the_ranks_and_the_path(root):
    from tests.harness import run_world

    refusals = assert_all_ok(run_world(_construct_on_one_disk, 2, root, timeout=90))
    for message in refusals:
        assert message is not None, "two ranks on one disk were accepted as two failure domains"
        assert "replicas=1 needs at least 2 failure domains" in message and "ranks 0, 1" in message, message
        assert os.path.realpath(os.path.join(root, "one-disk")) in message, message


# -- one process, no process group ------------------------------------------------------------------------------


def test_the_two_tier_manager_works_in_one_process_without_torch_distributed(root):
    """replicas=0: local saves, a drained step, a restore from the local tier, all without init_process_group."""
    import torch
    import torch.distributed as dist

    from dcp_atomic import CheckpointManager, ConfigurationError, LocalTierOptions

    assert not dist.is_initialized()
    durable, local = os.path.join(root, "durable"), os.path.join(root, "local")
    with CheckpointManager(durable, RUN, local=LocalTierOptions(local, replicas=0, keep_local=2),
                           timeout=20) as manager:
        for step in (1, 2, 3):
            manager.save(step, {"w": torch.arange(8.0) + step, "meta": {"step": step}}, durable=step == 2)
        manager.wait()
        assert manager.steps(tier="local") == [2, 3] and manager.steps(tier="durable") == [2]
    with CheckpointManager(durable, RUN, local=LocalTierOptions(local, replicas=0), timeout=20) as manager:
        state = {"w": torch.zeros(8), "meta": {"step": -1}}
        assert manager.load(state) == 3 and manager.restored_from["tier"] == "local"
        assert torch.equal(state["w"], torch.arange(8.0) + 3) and state["meta"]["step"] == 3
        state = {"w": torch.zeros(8), "meta": {"step": -1}}
        assert manager.load(state, step=2) == 2 and torch.equal(state["w"], torch.arange(8.0) + 2)
    with pytest.raises(ConfigurationError, match="replicas=1 needs at least 2 failure domains"):
        CheckpointManager(durable, RUN, local=LocalTierOptions(local, replicas=1))


# -- lineage: a node's disk never hands one experiment's step to another -------------------------------------------


def _experiment(ctx, durable_root, step, seed):
    """Save ``step`` local-only into ``durable_root``'s run (the nodes' local roots shared by every experiment)."""
    from dcp_atomic import CheckpointManager, LocalTierOptions
    from dcp_atomic.exchange import file_transfer

    file_transfer.CHUNK_BYTES = 64 << 10
    model, optim = _fsdp_app(ctx.world_size, seed)
    _train_step(model, optim, step)
    local = LocalTierOptions(ctx.extra["nodes"][ctx.rank // 2], replicas=1, keep_local=1)
    with CheckpointManager(durable_root, RUN, local=local, timeout=20) as manager:
        manager.save(step, _state(model, optim, step), durable=False)
    return _full(model)


def _resume(ctx, durable_root):
    import logging

    from dcp_atomic import CheckpointManager, CheckpointNotFoundError, LocalTierOptions

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("dcp_atomic").addHandler(handler)
    model, optim = _fsdp_app(ctx.world_size, 42)
    state = _state(model, optim, -1)
    try:
        local = LocalTierOptions(ctx.extra["nodes"][ctx.rank // 2], replicas=1)
        with CheckpointManager(durable_root, RUN, local=local, timeout=20) as manager:
            loaded = manager.load(state)
    except CheckpointNotFoundError:
        loaded = None
    warnings = [r.getMessage() for r in records if r.levelname == "WARNING" and "another durable root" in r.getMessage()]
    return {"loaded": loaded, "full": _full(model), "warnings": warnings}


def _stranger_saves(ctx, durable_root):
    """The stranger saves: the foreign step's number is refused (not its to replace), a new one commits."""
    from dcp_atomic import CheckpointManager, CommitConflictError, LocalTierOptions

    model, optim = _fsdp_app(ctx.world_size, 42)
    refused = None
    local = LocalTierOptions(ctx.extra["nodes"][ctx.rank // 2], replicas=1)
    with CheckpointManager(durable_root, RUN, local=local, timeout=20) as manager:
        try:
            manager.save(10, _state(model, optim, 10))
        except CommitConflictError as e:
            refused = str(e)
        manager.save(11, _state(model, optim, 11))
        manager.wait()
        return {"refused": refused, "durable": manager.steps(tier="durable")}


@pytest.mark.slow
def test_a_new_experiment_reusing_a_run_id_starts_fresh_and_is_told_of_the_other_ones_local_steps(root, nodes):
    """Two experiments, one run id, two durable roots, the same nodes: the owner restores its local-only step
    exactly; the stranger (an empty durable root) starts fresh, warned of the foreign step by root, run and step,
    which stays on the nodes."""
    owner, stranger = os.path.join(root, "exp-a"), os.path.join(root, "exp-b")
    saved = assert_all_ok(_run(_experiment, root, nodes, owner, 10, 0))
    fresh = assert_all_ok(_run(_resume, root, nodes, stranger))
    for out in fresh:
        assert out["loaded"] is None, "a new experiment continued from another one's weights left on the nodes"
    warnings = fresh[0]["warnings"]  # one per node's root, each naming it
    assert len(warnings) == 2 and all(nodes[i] in warnings[i] for i in (0, 1)), warnings
    assert all("step(s) [10]" in w and repr(RUN) in w and "rm -rf" in w for w in warnings), warnings
    assert all(out["warnings"] == [] for out in fresh[1:])  # rank 0 reports
    for node_root in nodes:  # never deleted silently
        assert os.path.exists(os.path.join(node_root, RUN, "step_0000000010", "COMMITTED"))
    restored = assert_all_ok(_run(_resume, root, nodes, owner))
    for out in restored:
        assert out["loaded"] == 10 and out["warnings"] == []
        _exact(out["full"], saved[0])
    for out in assert_all_ok(_run(_stranger_saves, root, nodes, stranger)):
        assert out["refused"] and "saved for another durable root or experiment" in out["refused"], out
        assert "rm -rf" in out["refused"] and out["durable"] == [11], out


def _strip_lineage(node_root, step):
    """The step's local marker as a version before lineages wrote it (no ``lineage``; re-sealed)."""
    from dcp_atomic.format.manifest import Marker

    path = os.path.join(node_root, RUN, f"step_{step:010d}", "COMMITTED")
    with open(path, "rb") as f:
        marker = Marker.from_json(f.read(), where=path)
    assert marker.lineage is not None
    marker.lineage = None
    with open(path, "wb") as f:
        f.write(marker.to_json())


@pytest.mark.slow
def test_local_steps_that_record_no_lineage_are_no_lineages_own(root, nodes):
    """A local step whose marker records no lineage (an earlier version's, or a job's that could not reach its
    run's LINEAGE) is no experiment's: a new experiment with an empty durable root starts fresh, told of it by
    name, and nothing proves it is the original's either; it stays on the nodes."""
    owner, stranger = os.path.join(root, "exp-a"), os.path.join(root, "exp-b")
    assert_all_ok(_run(_experiment, root, nodes, owner, 10, 0))
    for node_root in nodes:
        _strip_lineage(node_root, 10)
    for durable_root in (stranger, owner):
        resumed = assert_all_ok(_run(_resume, root, nodes, durable_root))
        for out in resumed:
            assert out["loaded"] is None, f"{durable_root}: a job continued from local weights of no lineage"
        warnings = resumed[0]["warnings"]
        assert len(warnings) == 2 and all("step(s) [10]" in w and "rm -rf" in w for w in warnings), warnings
    for node_root in nodes:
        assert os.path.exists(os.path.join(node_root, RUN, "step_0000000010", "COMMITTED"))
