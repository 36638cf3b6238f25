"""Lightning's local tier: ``AtomicModelParallelStrategy(local_root=...)`` under a real ``pl.Trainer``.

A world of 2 ranks as 2 failure domains (``DCP_ATOMIC_FAILURE_DOMAIN`` node0/node1), each rank's ``local_root`` its
own tmpfs (a node's disk), the durable root (``dirpath``) on disk.  A *replaced node* is its local root emptied
between two ``fit`` calls.  Each file must resume exactly the state Lightning saved under its name (weights and the
optimizer's own shard), served by whichever copy is left, and a step no file names must be gone from both tiers.
"""

from __future__ import annotations

import glob
import os
import pickle
import shutil

import pytest
import torch

from dcp_atomic._base import failpoints

from tests.harness import assert_all_ok, run_world
from tests.helpers.lightning import _module_class, _same, _weights

pytestmark = pytest.mark.slow

PACKAGE = "pytorch_lightning"


def _node_env(rank: int) -> dict[str, str]:
    return {"DCP_ATOMIC_FAILURE_DOMAIN": f"node{rank}"}


def _run(fn, root, nodes, timeout=300):
    return run_world(fn, 2, root, rank_env=_node_env, extra={"nodes": nodes}, timeout=timeout, pg_timeout=60)


def _optimizer_shard(optimizer) -> dict:
    """This rank's own shard of the optimizer's state (sharded alike in both jobs: compared as is)."""
    out = {}
    for g, group in enumerate(optimizer.param_groups):
        for p, param in enumerate(group["params"]):
            for key, value in optimizer.state.get(param, {}).items():
                value = value.to_local() if hasattr(value, "to_local") else value
                out[f"{g}.{p}.{key}"] = value.detach().clone() if torch.is_tensor(value) else value
    return out


def _tracked_module():
    pl, Module = _module_class(PACKAGE)

    class Tracked(Module):
        """Records what each save holds and what each start restored."""

        saved: dict = {}  # global_step -> (weights, optimizer shard)

        def on_save_checkpoint(self, checkpoint):
            Tracked.saved[checkpoint["global_step"]] = (_weights(self), _optimizer_shard(self.optimizers()))
            super().on_save_checkpoint(checkpoint)

        def on_train_start(self):
            super().on_train_start()
            self.optimizer_at_start = _optimizer_shard(self.optimizers())

    return pl, Tracked


def _trainer(pl, ctx, max_steps, callbacks=(), **kwargs):
    from dcp_atomic.integrations.lightning import AtomicModelParallelStrategy

    strategy = AtomicModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, timeout=30,
                                           local_root=ctx.extra["nodes"][ctx.rank], replicas=1)
    return pl.Trainer(accelerator="cpu", devices=2, max_steps=max_steps, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=ctx.root, strategy=strategy,
                      callbacks=list(callbacks), enable_checkpointing=bool(callbacks), **kwargs)


def _resume(pl, Module, ctx, path, max_steps):
    """What ``fit(ckpt_path=path)`` restores on this rank, and which tier served it (one step, no saves)."""
    from pytorch_lightning.callbacks import ModelCheckpoint

    module = Module(seed=99)
    # "last" is looked up in the ModelCheckpoint's dirpath; one that never fires here
    finder = [ModelCheckpoint(dirpath=os.path.join(ctx.root, "ckpts"), save_top_k=0)]
    trainer = _trainer(pl, ctx, max_steps, finder if path == "last" else ())
    trainer.fit(module, ckpt_path=path)
    return module.at_start, module.optimizer_at_start, trainer.strategy.restored_from


def _exactly(restored, saved) -> bool:
    weights, optimizer, _ = restored
    want_weights, want_optimizer = saved
    return _same(weights, want_weights) and _same(optimizer, want_optimizer)


def _tier_steps(ctx, dirpath):
    """Steps committed in the durable root and on every node's local root, and the steps the files name (every rank
    alike, after a barrier: a retire has no collective inside, so global rank 0 may still be removing a step)."""
    import torch.distributed as dist

    from dcp_atomic.integrations.lightning import _pointer, tier_run_for

    dist.barrier()
    from dcp_atomic.format.layout import parse_checkpoint_id

    root, run = tier_run_for(dirpath)

    def committed(base):
        return sorted(int(os.path.basename(os.path.dirname(p))[5:])
                      for p in glob.glob(os.path.join(base, run, "step_*", "COMMITTED")))

    named = sorted(parse_checkpoint_id(_pointer(os.path.join(dirpath, n)))[2] for n in os.listdir(dirpath)
                   if _pointer(os.path.join(dirpath, n)) is not None)
    return {"durable": committed(root), "local": [committed(n) for n in ctx.extra["nodes"]], "named": named}


def _empty(ctx, ranks):
    """Replace the nodes of ``ranks``: their local roots emptied while every rank waits."""
    import torch.distributed as dist

    dist.barrier()
    if ctx.rank in ranks:
        node = ctx.extra["nodes"][ctx.rank]
        for entry in os.listdir(node):
            shutil.rmtree(os.path.join(node, entry))
    dist.barrier()


def _fit_top_k_and_last(pl, Module, ctx, dirpath, max_steps):
    from pytorch_lightning.callbacks import ModelCheckpoint

    Module.saved.clear()
    checkpoint = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_top_k=2, monitor="step", mode="max",
                                 save_last=True)
    module = Module(seed=0, data_seed=1)
    _trainer(pl, ctx, max_steps, [checkpoint]).fit(module)
    return dict(Module.saved)


def _global_step(path) -> int:
    return int(torch.load(path, weights_only=False)["global_step"])


# -- (a) every file resumes exactly, (d) top-k leaves no unnamed step ------------------------------------------


def _every_file_exact_and_no_unnamed_step(ctx):
    import time

    from dcp_atomic.tiers import drain

    pl, Module = _tracked_module()
    dirpath = os.path.join(ctx.root, "ckpts")
    # a slow durable root: each drain outlasts the saves behind it, which the drain queue would skip (module doc)
    failpoints.arm("drain.before_upload", lambda rank, step: time.sleep(1.5))
    try:
        saved = _fit_top_k_and_last(pl, Module, ctx, dirpath, 8)
    finally:
        failpoints.disarm("drain.before_upload")
    after_fit = _tier_steps(ctx, dirpath)  # fit returned: drains waited for, unnamed steps retired
    files = sorted(n for n in os.listdir(dirpath) if n.endswith(".ckpt"))
    exact, served = {}, {}
    for name in files:
        path = os.path.join(dirpath, name)
        restored = _resume(pl, Module, ctx, path, _global_step(path) + 1)
        exact[name] = _exactly(restored, saved[_global_step(path)])
        served[name] = (restored[2] or {}).get("tier")
    # outside any Trainer, one process on its own: the durable copy the file names (every file drained by now)
    weights_only = _same(_weights(Module.load_from_checkpoint(os.path.join(dirpath, "last.ckpt"))), saved[8][0])
    return {"files": files, "after_fit": after_fit, "exact": exact, "served": served, "weights_only": weights_only}


def test_every_file_resumes_exactly_and_top_k_leaves_no_step_that_no_file_names(root, nodes):
    for out in assert_all_ok(_run(_every_file_exact_and_no_unnamed_step, root, nodes)):
        assert out["files"] == ["epoch=0-step=6.ckpt", "epoch=0-step=8.ckpt", "last.ckpt"], out["files"]
        steps = out["after_fit"]
        assert len(set(steps["named"])) == 3, steps  # each file its own save: never a reused step
        assert steps["durable"] == sorted(set(steps["named"])), steps  # every file drained; nothing else kept
        for local in steps["local"]:  # keep_local=2 of the named ones, nothing that no file names
            assert set(local) <= set(steps["named"]) and len(local) == 2, steps
        assert all(out["exact"].values()), out["exact"]
        assert out["weights_only"]  # Model.load_from_checkpoint (AtomicCheckpointHooks) reads the durable copy
        assert out["served"]["last.ckpt"] == "local", out["served"]  # the node's own copy, not the durable one
        assert out["served"]["epoch=0-step=6.ckpt"] == "durable", out["served"]  # past keep_local on the nodes


# -- (b) a replaced node is served by the replicas, (c) every node replaced: the durable copies ------------------


def _replaced_nodes(ctx):
    pl, Module = _tracked_module()
    dirpath = os.path.join(ctx.root, "ckpts")
    saved = _fit_top_k_and_last(pl, Module, ctx, dirpath, 4)
    last = os.path.join(dirpath, "last.ckpt")
    out = {}
    _empty(ctx, ranks={1})
    restored = _resume(pl, Module, ctx, "last", 5)  # Lightning's own "last": the newest last*.ckpt
    out["one_node"] = {"exact": _exactly(restored, saved[4]), "served": restored[2] or {}}
    _empty(ctx, ranks={0, 1})
    out["every_node"] = {}
    for name in sorted(n for n in os.listdir(dirpath) if n.endswith(".ckpt")):
        path = os.path.join(dirpath, name)
        restored = _resume(pl, Module, ctx, path, _global_step(path) + 1)
        out["every_node"][name] = {"exact": _exactly(restored, saved[_global_step(path)]),
                                   "tier": (restored[2] or {}).get("tier")}
    # the last file's step never drained (its durable copy removed) and no node holds it: a typed error, never
    # another step in its place
    import torch.distributed as dist

    from dcp_atomic.stores.backends import open_storage
    from dcp_atomic.integrations.lightning import _pointer
    from dcp_atomic.format.layout import RunLayout, parse_checkpoint_id
    from dcp_atomic.protocol.retention import remove_step

    tier_root, run, step = parse_checkpoint_id(_pointer(last))
    _empty(ctx, ranks={0, 1})
    if ctx.rank == 0:
        remove_step(RunLayout(open_storage(tier_root), run), step)
    dist.barrier()
    try:
        _resume(pl, Module, ctx, last, 5)
        out["gone"] = None
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["gone"] = (type(e).__name__, str(e), pickle.loads(pickle.dumps(e)).details, step)
    return out


def test_a_replaced_node_resumes_last_from_replicas_and_no_node_left_resumes_from_the_durable_copies(root, nodes):
    outs = assert_all_ok(_run(_replaced_nodes, root, nodes))
    for rank, out in enumerate(outs):
        one = out["one_node"]
        assert one["exact"] and one["served"]["tier"] == "local", one
        assert (one["served"]["ranks_fetched"] > 0) == (rank == 1), one  # the emptied node got files from node0
        assert set(out["every_node"]) == {"epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"}, out
        for name, got in out["every_node"].items():
            assert got == {"exact": True, "tier": "durable"}, (name, got)
        kind, message, details, step = out["gone"]
        assert kind == "CheckpointNotFoundError" and details["step"] == step, out["gone"]
        assert "last.ckpt names step" in message and "no complete copy of it is left" in message, message


# -- (e) a rollback, training on, last saved again, resumed ----------------------------------------------------


def _rollback(ctx):
    from pytorch_lightning.callbacks import ModelCheckpoint

    import time

    from dcp_atomic.tiers import drain
    from dcp_atomic.integrations.lightning import _pointer
    from dcp_atomic.format.layout import parse_checkpoint_id

    pl, Module = _tracked_module()
    dirpath = os.path.join(ctx.root, "ckpts")

    def callbacks():
        return [ModelCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_top_k=-1, save_last=True)]

    Module.saved.clear()
    _trainer(pl, ctx, 6, callbacks()).fit(Module(seed=0, data_seed=1))
    old = dict(Module.saved)
    Module.saved.clear()
    rolled = Module(seed=0, data_seed=7)  # a loss spike: back to step 2, on other data
    trainer = _trainer(pl, ctx, 6, callbacks())
    trainer.fit(rolled, ckpt_path=os.path.join(dirpath, "epoch=0-step=2.ckpt"))
    new = dict(Module.saved)
    manual = os.path.join(dirpath, "manual.pt")
    failpoints.arm("drain.before_upload", lambda rank, step: time.sleep(1.0))  # a slow durable root
    try:
        trainer.save_checkpoint(manual)  # after fit: returns once its drain has committed
        manual_durable = _tier_steps(ctx, dirpath)["durable"]
    finally:
        failpoints.disarm("drain.before_upload")
    files = sorted(n for n in os.listdir(dirpath) if n.endswith(".ckpt"))
    resumed = _resume(pl, Module, ctx, "last", 7)
    old_6 = _resume(pl, Module, ctx, os.path.join(dirpath, "epoch=0-step=6.ckpt"), 7)
    return {"files": files, "branches_differ": not _same(old[6][0], new[6][0]),
            "last_is_new_branch": _exactly(resumed, new[6]), "last_served": (resumed[2] or {}).get("tier"),
            "old_6_file_is_old_branch": _exactly(old_6, old[6]), "steps": _tier_steps(ctx, dirpath),
            "manual_durable": parse_checkpoint_id(_pointer(manual))[2] in manual_durable}


def test_a_rollback_trains_on_saves_last_again_and_a_resume_loads_the_new_state(root, nodes):
    for out in assert_all_ok(_run(_rollback, root, nodes)):
        assert out["branches_differ"], out
        assert out["last_is_new_branch"] and out["last_served"] == "local", out
        assert out["old_6_file_is_old_branch"], out  # Lightning versioned the new branch's names (-v1)
        assert out["manual_durable"], out
        steps = out["steps"]
        assert steps["durable"] == sorted(set(steps["named"])) and len(set(steps["named"])) == len(steps["named"]), \
            steps


# -- construction ----------------------------------------------------------------------------------------------


# -- a file whose drain never committed is drained by the next job -------------------------------------------------


def _drain_fails_then_next_job_drains_it(ctx):
    from pytorch_lightning.callbacks import ModelCheckpoint

    from dcp_atomic.tiers import drain

    pl, Module = _tracked_module()
    dirpath = os.path.join(ctx.root, "ckpts")

    def full_disk(rank, step):
        raise OSError(28, "No space left on device (injected)")

    failpoints.arm("drain.before_marker", full_disk)
    drain.RETRY_BACKOFF = 0.1
    first = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_top_k=-1)
    try:
        _trainer(pl, ctx, 2, [first]).fit(Module(seed=0, data_seed=1))
        failed = None
    except Exception as e:  # noqa: BLE001 - the test reads it: the end of fit waits for the drain
        failed = type(e).__name__
    finally:
        failpoints.disarm("drain.before_marker")
    after_failure = _tier_steps(ctx, dirpath)
    second = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_top_k=-1)
    _trainer(pl, ctx, 4, [second]).fit(Module(seed=0, data_seed=1), ckpt_path=os.path.join(dirpath,
                                                                                           "epoch=0-step=2.ckpt"))
    return {"failed": failed, "after_failure": after_failure, "after_next_job": _tier_steps(ctx, dirpath)}


def test_a_file_whose_drain_failed_is_drained_by_the_next_job_before_its_first_save(root, nodes):
    for out in assert_all_ok(_run(_drain_fails_then_next_job_drains_it, root, nodes)):
        assert out["failed"] is not None, out  # the first job's fit ends with its drain's failure
        first = out["after_failure"]
        assert len(first["named"]) == 1 and first["durable"] == [], first  # a file naming a step on the nodes only
        after = out["after_next_job"]
        assert set(first["named"]) <= set(after["durable"]), after  # drained by the next job: no longer node-only
        assert after["durable"] == sorted(set(after["named"])), after


@pytest.mark.parametrize("package", ["pytorch_lightning", "lightning.pytorch"])
def test_both_packages_take_local_root_and_a_relative_one_is_refused_naming_it(package):
    from dcp_atomic.errors import ConfigurationError
    from dcp_atomic.integrations.lightning import strategy_class

    strategy = strategy_class(package)
    with pytest.raises(ConfigurationError) as refused:
        strategy(data_parallel_size=2, tensor_parallel_size=1, local_root="nvme/ckpt")
    assert "(local_root=...) must be an absolute path" in str(refused.value) and "'nvme/ckpt'" in str(refused.value)
    assert str(pickle.loads(pickle.dumps(refused.value))) == str(refused.value)
    taken = strategy(data_parallel_size=2, tensor_parallel_size=1, local_root="/local_nvme/ckpt", replicas=2)
    assert (taken.local_root, taken.replicas) == ("/local_nvme/ckpt", 2)


# -- a copied and a moved dirpath resume their own state, with and without the local tier ---------------------------


def _copied_and_moved(ctx):
    import torch.distributed as dist

    from tests.helpers.lightning import _resumed_weights

    pl, Module = _tracked_module()
    dirpath = os.path.join(ctx.root, "ckpts")
    copy, moved = os.path.join(ctx.root, "copy"), os.path.join(ctx.root, "moved")
    saved = _fit_top_k_and_last(pl, Module, ctx, dirpath, 4)
    if ctx.rank == 0:
        shutil.copytree(dirpath, copy, symlinks=True)  # cp -a
        os.rename(dirpath, moved)  # and the original moved away: only the copies' own state is left in place
    dist.barrier()
    out = {}
    for where in (moved, copy):
        for name in ("epoch=0-step=2.ckpt", "last.ckpt"):
            path = os.path.join(where, name)
            restored = _resume(pl, Module, ctx, path, _global_step(path) + 1)
            out[(os.path.basename(where), name, "tier")] = _exactly(restored, saved[_global_step(path)])
            out[(os.path.basename(where), name, "no tier")] = _same(
                _resumed_weights(pl, Module, ctx, path, _global_step(path) + 1), saved[_global_step(path)][0])
        _empty(ctx, ranks={0, 1})  # the copy next: from its own durable files alone
    out["original_gone"] = not os.path.exists(dirpath)  # no load reached for the original's place
    return out


def test_a_copied_and_a_moved_dirpath_resume_their_own_state_with_and_without_the_local_tier(root, nodes):
    for out in assert_all_ok(_run(_copied_and_moved, root, nodes)):
        assert all(out.values()), out
