"""The local tier turned on from the frameworks' own entry points (torchtitan, Lightning, plain loops).

torchtitan: its ``CheckpointManager`` built from ``AtomicCheckpointManager.Config(local_root=...)``, driven as its
Trainer drives it (``load(step=load_step)``, ``save(step)`` every interval, the async modes, ``close()``), in a world
of 4 ranks as 2 simulated nodes (``DCP_ATOMIC_FAILURE_DOMAIN``), each node's local root its own tmpfs.  A *replaced
node* is its local root emptied between two jobs.
"""

from __future__ import annotations

import glob
import os
import shutil

import pytest
import torch

from tests.harness import assert_all_ok, run_world
from tests.helpers.tier_integrations import FOLDER, _data_files, _local_steps, _node_root, _titan
from tests.helpers.tiers import _node_env

pytestmark = pytest.mark.slow

WORLD = 4


def _durable_steps(root: str, run: str = FOLDER) -> list[int]:
    return sorted(int(os.path.basename(os.path.dirname(p))[5:])
                  for p in glob.glob(os.path.join(root, run, "step_*", "COMMITTED")))


# -- torchtitan ---------------------------------------------------------------------------------------------------


def _same(a, b) -> bool:
    return all(a[part].keys() == b[part].keys() and all(torch.equal(a[part][k], b[part][k]) for k in a[part])
               for part in (0, 1))


def _barrier_then(ctx, act) -> None:
    import torch.distributed as dist

    dist.barrier()
    act()
    dist.barrier()


def _titan_life(ctx):
    """Save to the local tier, lose node B, restore; roll back on the local tier; read a drained step without it."""
    out = {}
    first = _titan(ctx, 8, data_seed=1)  # saves 2, 4, 6, 8; drains 4 and 8
    _barrier_then(ctx, lambda: None)  # every node's local commit and the drains are done (close waited)
    if ctx.rank % 2 == 0:  # one rank per node reads its disk
        node = _node_root(ctx)
        out["local_after_first"] = _local_steps(node)
        out["files_step8"] = _data_files(node, 8)
    out["durable_after_first"] = _durable_steps(ctx.root)
    # node B is replaced: its local disk comes back empty
    _barrier_then(ctx, lambda: ctx.rank == 2 and shutil.rmtree(os.path.join(_node_root(ctx), FOLDER)))
    resumed = _titan(ctx, 10, data_seed=2, async_mode="disabled")  # latest: 8, node B's files from node A's replicas
    out.update(resumed_started=resumed["started"], resumed_served=resumed["served"],
               resumed_exact=_same(resumed["start"], first["saved"][8]))
    if ctx.rank == 2:
        out["node_b_after_restore"] = _local_steps(_node_root(ctx))
    rolled = _titan(ctx, 10, data_seed=3, load_step=8)  # roll back to 8 (local), train on: step 10 again, superseded
    latest = _titan(ctx, 10, data_seed=4)               # restart: the new branch's step 10
    out.update(rolled_started=rolled["started"], rolled_saved=sorted(rolled["saved"]),
               latest_started=latest["started"], latest_exact=_same(latest["start"], rolled["saved"][10]),
               latest_not_old=not _same(latest["start"], resumed["saved"][10]))
    durable = _titan(ctx, 8, data_seed=5, tier=False, load_step=8)  # the drained step, read from folder alone
    out.update(durable_exact=_same(durable["start"], first["saved"][8]), durable_served=durable["served"])
    return out


def test_torchtitan_local_tier_saves_replicates_drains_and_restores_a_replaced_node(root, nodes):
    results = assert_all_ok(run_world(_titan_life, WORLD, root, rank_env=_node_env, extra={"nodes": nodes},
                                      timeout=300))
    everyone = [f"__{r}_0.distcp" for r in range(WORLD)]
    for rank in (0, 2):  # each node holds its own ranks' files and the other node's replicas: all four
        assert results[rank]["local_after_first"] == [6, 8], results[rank]  # keep_local=2
        assert results[rank]["files_step8"] == everyone
    for out in results:
        assert out["durable_after_first"] == [4, 8]  # interval 2 x durable_every 2: only these reached the folder
        assert out["resumed_started"] == 8 and out["resumed_exact"]
        assert out["resumed_served"]["tier"] == "local" and out["resumed_served"]["step"] == 8
        assert out["rolled_started"] == 8 and out["rolled_saved"] == [10]
        assert out["latest_started"] == 10 and out["latest_exact"] and out["latest_not_old"]
        assert out["durable_exact"] and out["durable_served"] is None
    # node B's ranks each received what they read (at least their own files); node A's ranks nothing
    assert [results[r]["resumed_served"]["ranks_fetched"] >= 1 for r in range(WORLD)] == [False, False, True, True]
    assert 8 in results[2]["node_b_after_restore"]
    assert _durable_steps(root) == [4, 8]  # step 10 (both branches) stayed on the nodes


class _NoStager:
    """torchtitan's pinned-memory stager needs an accelerator; with the local tier it is never used to stage."""

    def __init__(self, *args, **kwargs):
        pass

    def close(self):
        pass


def _titan_other_modes(ctx):
    """The last step's model-only export is drained whatever durable_every says; keep_latest_k=1 counts the folder's
    steps; the pinned-memory mode's flow; without local_root nothing changes."""
    from torchtitan.components.checkpointer import dcp as titan_dcp

    _titan(ctx, 3, data_seed=1, last=True, folder="export", durable_every=100, last_save_model_only=True)
    _titan(ctx, 6, data_seed=1, folder="kept", durable_every=1, keep_latest_k=1, async_mode="disabled")
    titan_dcp.DefaultStager = _NoStager
    pinned = _titan(ctx, 4, data_seed=1, folder="pinned", async_mode="async_with_pinned_mem")
    again = _titan(ctx, 4, data_seed=1, folder="pinned", async_mode="async_with_pinned_mem")
    plain = _titan(ctx, 4, data_seed=1, folder="plain", tier=False)
    # neither tier holds a step: torchtitan's own initial load (another run's step, model only), never a silent start
    initial = _titan(ctx, 2, data_seed=2, folder="finetune", initial_load_path=os.path.join(ctx.root, "plain",
                                                                                            "step_0000000004"))
    try:
        _titan(ctx, 2, data_seed=2, folder="empty", load_step=2)
        missing = None
    except Exception as e:  # noqa: BLE001 - the test reads its type and message
        missing = str(e)  # CheckpointError names its class
    return {run: _local_steps(_node_root(ctx), run) for run in ("export", "kept", "pinned", "plain")} | {
        "pinned_restored": again["started"] == 4 and _same(again["start"], pinned["saved"][4]),
        "initial_model": initial["started"] == 0 and _same((initial["start"][0], {}), (plain["saved"][4][0], {})),
        "missing": missing}


def test_torchtitan_last_step_keep_latest_k_pinned_mode_and_no_local_root(root, nodes):
    from dcp_atomic import AtomicStorageReader

    results = assert_all_ok(run_world(_titan_other_modes, WORLD, root, rank_env=_node_env, extra={"nodes": nodes},
                                      timeout=240))
    for out in results:
        missing = out.pop("missing")
        assert out == {"export": [2, 3], "kept": [4, 6], "pinned": [2, 4], "plain": [], "pinned_restored": True,
                       "initial_model": True}, out
        assert missing.startswith("CheckpointNotFoundError: checkpoint.load_step=2: run 'empty' has no committed step")
    assert _durable_steps(root, "export") == [3]  # step 2 (not a multiple of 2 x 100) stayed local
    keys = AtomicStorageReader(root, "export", step=3).read_metadata().state_dict_metadata.keys()
    assert keys and all(not k.startswith(("optimizer", "train_state")) for k in keys), sorted(keys)  # model only
    assert _durable_steps(root, "kept") == [6]  # keep_latest_k=1 applied to the drained steps
    assert _durable_steps(root, "pinned") == [4]
    assert _durable_steps(root, "plain") == [2, 4]  # straight to the folder, as before


def test_torchtitan_config_refuses_a_bad_tier_setting():
    from dcp_atomic.errors import ConfigurationError
    from dcp_atomic.integrations.torchtitan import AtomicCheckpointManager

    with pytest.raises(ConfigurationError, match="durable_every must be an int >= 1"):
        AtomicCheckpointManager.Config(local_root="/local_nvme/ckpt", durable_every=0)
    with pytest.raises(ConfigurationError, match="absolute path"):
        AtomicCheckpointManager.Config(local_root="relative/ckpt")
    assert AtomicCheckpointManager.Config().local_root is None
