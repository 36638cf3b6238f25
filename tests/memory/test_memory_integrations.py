"""The memory tier (P16) turned on with one argument from the frameworks' own entry points: torchtitan's checkpoint
config, Lightning's strategy, the Accelerate integration.

Worlds of 2 ranks as 2 simulated nodes (failure domains nodeA/nodeB), each node's memory path on its own tmpfs, the
durable root on disk.  Each test trains a few steps snapshotting every step, then starts a fresh job (a new world)
that restores: the exact state of the last snapshot, and ``restored_from`` saying memory.
"""

from __future__ import annotations

import glob
import os
import shutil

import pytest
import torch

from tests.harness import assert_all_ok, run_world
from tests.helpers.memory import memory_path, two_nodes_env
from tests.helpers.tier_integrations import FOLDER, _titan

pytestmark = pytest.mark.slow

WORLD = 2


def _world(fn, root, nodes, timeout=120):
    return assert_all_ok(run_world(fn, WORLD, root, rank_env=two_nodes_env, extra={"nodes": nodes},
                                   timeout=timeout))


def _same(a, b) -> bool:
    """Two ``(weights, optimizer moments)`` pairs are equal, tensor by tensor."""
    return all(a[part].keys() == b[part].keys() and all(torch.equal(a[part][k], b[part][k]) for k in a[part])
               for part in (0, 1))


def _durable_steps(root: str) -> list[int]:
    return sorted(int(os.path.basename(os.path.dirname(p))[5:])
                  for p in glob.glob(os.path.join(root, FOLDER, "step_*", "COMMITTED")))


# -- torchtitan ---------------------------------------------------------------------------------------------------


def _titan_memory(ctx):
    """Snapshot steps 1-5 (no durable save: interval 10), then a fresh job restores."""
    memory = {"memory_path": memory_path(ctx), "interval": 10}
    first = _titan(ctx, 5, data_seed=1, tier=False, **memory)
    again = _titan(ctx, 5, data_seed=2, tier=False, **memory)
    return {"snapshots": sorted(first["snapshots"]), "saved": sorted(first["saved"]), "started": again["started"],
            "exact": _same(again["start"], first["snapshots"][5]), "tier": (again["served"] or {}).get("tier")}


def test_torchtitan_memory_path_snapshots_every_step_and_a_fresh_job_restores_the_last_from_memory(root, nodes):
    for out in _world(_titan_memory, root, nodes):
        assert out == {"snapshots": [1, 2, 3, 4, 5], "saved": [], "started": 5, "exact": True, "tier": "memory"}, out
    assert _durable_steps(root) == []


def _titan_side_by_side(ctx):
    """Durable every 2 steps and memory every step: the restore takes step 5 from memory; then a job whose newest
    commit is durable (step 6, no snapshot of it) restores that from the folder.  The durable saves are synchronous:
    an async one commits after the next snapshot, and the newest by commit sequence is then the durable step."""
    tiers = {"tier": False, "memory_path": memory_path(ctx), "interval": 2, "async_mode": "disabled"}
    both = _titan(ctx, 5, data_seed=1, **tiers)
    newest_memory = _titan(ctx, 6, data_seed=2, memory_interval=4, **tiers)
    newest_durable = _titan(ctx, 6, data_seed=3, **tiers)
    return {"saved": sorted(both["saved"]), "snapshots": sorted(both["snapshots"]),
            "memory": (newest_memory["started"], (newest_memory["served"] or {}).get("tier"),
                       _same(newest_memory["start"], both["snapshots"][5])),
            "second_job": (sorted(newest_memory["saved"]), sorted(newest_memory["snapshots"])),
            "durable": (newest_durable["started"], (newest_durable["served"] or {}).get("tier"),
                        _same(newest_durable["start"], newest_memory["saved"][6]))}


def test_torchtitan_durable_interval_and_memory_every_step_side_by_side_restore_the_newest(root, nodes):
    for out in _world(_titan_side_by_side, root, nodes, timeout=180):
        assert out == {"saved": [2, 4], "snapshots": [1, 2, 3, 4, 5], "memory": (5, "memory", True),
                       "second_job": ([6], []), "durable": (6, "durable", True)}, out
    assert _durable_steps(root) == [2, 4, 6]


# -- Accelerate ---------------------------------------------------------------------------------------------------


def _accelerate_job(ctx, steps: int):
    """An Accelerator job (DDP over gloo) with the memory tier: ``load()``, then train and snapshot each step up to
    ``steps`` (each waited for); its start and its state after each snapshot."""
    from dcp_atomic import MemoryTier
    from dcp_atomic.integrations.accelerate import AcceleratorCheckpoint
    from tests.integrations.test_accelerate import _job, _snapshot, _train_step

    job = _job(seed=ctx.extra.get("seed", 0))
    accelerator, model, optimizer, _, scheduler, counter = job
    memory = MemoryTier(memory_path(ctx))
    with AcceleratorCheckpoint(accelerator, ctx.root, "exp", memory=memory, timeout=15) as checkpoint:
        started = checkpoint.load() or 0
        out = {"started": started, "tier": (checkpoint.restored_from or {}).get("tier"),
               "start": _snapshot(accelerator, model, optimizer, scheduler, counter), "snapshots": {}}
        for step in range(started + 1, steps + 1):
            _train_step(*job)
            assert checkpoint.snapshot(step).result() == step
            out["snapshots"][step] = _snapshot(accelerator, model, optimizer, scheduler, counter)
        out["steps"] = checkpoint.manager.steps()
    return out


def _accelerate_memory(ctx):
    first = _accelerate_job(ctx, 3)
    ctx.extra["seed"] = 123  # everything that matters comes from the snapshot
    again = _accelerate_job(ctx, 3)
    return first, again


def test_accelerate_memory_tier_snapshots_every_step_and_a_fresh_job_restores_the_last_from_memory(root, nodes):
    from tests.integrations.test_accelerate import _assert_same

    for first, again in _world(_accelerate_memory, root, nodes):
        assert (first["started"], first["tier"], sorted(first["snapshots"]), first["steps"]) == (0, None, [1, 2, 3], [])
        assert (again["started"], again["tier"], again["snapshots"]) == (3, "memory", {})
        _assert_same(again["start"], first["snapshots"][3], "restored")  # weights, optimizer, lr, registered object


# -- Lightning ----------------------------------------------------------------------------------------------------


def _lightning_job(ctx, max_steps, ckpt_path=None, seed=0, callbacks=()):
    """``fit`` with ``AtomicModelParallelStrategy(memory=...)``, each snapshot waited for (none skipped): the
    module (its state at each snapshot, and at the start) and the strategy."""
    from dcp_atomic import MemoryTier
    from dcp_atomic.integrations.lightning import AtomicModelParallelStrategy
    from tests.integrations.test_lightning_tier import _tracked_module

    pl, Tracked = _tracked_module()

    class Waiting(Tracked):
        def on_train_batch_end(self, *args):  # after the strategy's callback took the step's snapshot
            assert self.trainer.strategy.snapshotted.result() == self.trainer.global_step

    strategy = AtomicModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, timeout=30,
                                           memory=MemoryTier(memory_path(ctx)))
    trainer = pl.Trainer(accelerator="cpu", devices=2, max_steps=max_steps, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=ctx.root, strategy=strategy,
                         callbacks=list(callbacks), enable_checkpointing=bool(callbacks))
    module = Waiting(seed=seed)
    trainer.fit(module, ckpt_path=ckpt_path)
    return module, strategy, Tracked.saved


def _lightning_memory(ctx):
    from dcp_atomic.integrations.lightning import MEMORY
    from tests.helpers.lightning import _same

    from pytorch_lightning.callbacks import ModelCheckpoint

    def exact(module, state):
        return _same(module.at_start, state[0]) and _same(module.optimizer_at_start, state[1])

    def files():  # last.ckpt names step 2 (every 2 steps): older than the memory tier's newest
        return [ModelCheckpoint(dirpath=os.path.join(ctx.root, "ckpts"), every_n_train_steps=2, save_last=True,
                                save_top_k=0)]

    _, _, saved = _lightning_job(ctx, 3, callbacks=files())
    module, strategy, resumed_saved = _lightning_job(ctx, 4, ckpt_path=MEMORY, seed=99)  # snapshots step 4
    from_memory = ((strategy.restored_from or {}).get("tier"), exact(module, saved[3]))
    finder = [ModelCheckpoint(dirpath=os.path.join(ctx.root, "ckpts"), save_top_k=0)]  # "last" is looked up there
    module, strategy, _ = _lightning_job(ctx, 5, ckpt_path="last", seed=98, callbacks=finder)
    last = ((strategy.restored_from or {}).get("tier"), exact(module, resumed_saved[4]))
    # the same step-2 checkpoint under a name of the user's: asked for by name, it is what resumes, never memory's 5
    chosen = os.path.join(ctx.root, "ckpts", "chosen.ckpt")
    shutil.copyfile(os.path.join(ctx.root, "ckpts", "last.ckpt"), f"{chosen}.{ctx.rank}")
    os.replace(f"{chosen}.{ctx.rank}", chosen)  # every rank writes the same bytes, whole
    module, strategy, _ = _lightning_job(ctx, 6, ckpt_path=chosen, seed=97)
    named = ((strategy.restored_from or {}).get("tier"), exact(module, saved[2]))
    return {"snapshots": sorted(saved), "memory": from_memory, "last": last, "named": named}


def test_lightning_strategy_memory_snapshots_every_step_and_a_fresh_fit_and_an_older_last_ckpt_resume_the_last_from_memory_a_named_file_itself(
        root, nodes):
    for out in _world(_lightning_memory, root, nodes, timeout=180):
        assert out == {"snapshots": [1, 2, 3], "memory": ("memory", True), "last": ("memory", True),
                       "named": (None, True)}, out


def _lightning_accumulating(ctx):
    """``fit`` with ``accumulate_grad_batches=2`` for 3 optimizer steps (6 batches): the steps the strategy
    snapshotted (with the batches done by then), then what a fresh ``fit(ckpt_path=MEMORY)`` resumes and whether
    its weights are exactly step 3's."""
    from dcp_atomic import MemoryTier
    from dcp_atomic.integrations.lightning import MEMORY, AtomicModelParallelStrategy
    from tests.helpers.lightning import _same
    from tests.integrations.test_lightning_tier import _tracked_module

    pl, Tracked = _tracked_module()
    taken = []

    class Recording(pl.Callback):
        def on_train_start(self, trainer, module):
            manager = trainer.strategy.memory_manager
            snapshot = manager.snapshot

            def recorded(step, state):
                future = snapshot(step, state)
                taken.append((step, trainer.fit_loop.epoch_loop.batch_progress.current.completed))
                Tracked.saved[step] = (module_weights(module), None)
                return future

            manager.snapshot = recorded

    def module_weights(module):
        from tests.integrations.test_lightning_tier import _weights

        return _weights(module)

    def fit(ckpt_path, seed, max_steps, callbacks=()):
        strategy = AtomicModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, timeout=30,
                                               memory=MemoryTier(memory_path(ctx)))
        trainer = pl.Trainer(accelerator="cpu", devices=2, max_steps=max_steps, logger=False,
                             enable_progress_bar=False, enable_model_summary=False, default_root_dir=ctx.root,
                             strategy=strategy, callbacks=list(callbacks), enable_checkpointing=False,
                             accumulate_grad_batches=2)
        module = Tracked(seed=seed)
        trainer.fit(module, ckpt_path=ckpt_path)
        return module, strategy

    module, strategy = fit(None, 0, 3, [Recording()])
    strategy.snapshotted.result()
    resumed, strategy = fit(MEMORY, 99, 4)  # one step more: its start is what the resume restored
    return taken, (strategy.restored_from or {}).get("tier"), _same(resumed.at_start, Tracked.saved[3][0])


def test_lightning_snapshots_only_after_an_optimizer_step_never_mid_accumulation(root, nodes):
    for taken, tier, exact in _world(_lightning_accumulating, root, nodes, timeout=180):
        # one snapshot per optimizer step, each at the end of the batch that made it: the 2nd, 4th and 6th (Lightning
        # counts a batch completed after its end callbacks); none of a batch that only accumulated (before: steps
        # 0, 1, 1, 2, 2, 3), and the resume is exactly the last one
        assert taken == [(1, 1), (2, 3), (3, 5)], taken
        assert (tier, exact) == ("memory", True), (tier, exact)


def _two_experiments_in_one_root(ctx):
    """Experiments B and A share ``default_root_dir`` (so one memory run), each with its own checkpoint folder: B
    runs to step 4 (last.ckpt = 4), then A to step 6 (snapshots up to 6); B resumes from its own ``"last"``.  What
    B resumed: the tier (None: its file) and whether its start is exactly B's step 4."""
    from pytorch_lightning.callbacks import ModelCheckpoint

    from tests.helpers.lightning import _same

    def files(name):
        return [ModelCheckpoint(dirpath=os.path.join(ctx.root, name), every_n_train_steps=2, save_last=True,
                                save_top_k=0)]

    _, _, saved_b = _lightning_job(ctx, 4, callbacks=files("ckpts-b"), seed=1)
    at_four = saved_b[4]
    _lightning_job(ctx, 6, callbacks=files("ckpts-a"), seed=2)
    finder = [ModelCheckpoint(dirpath=os.path.join(ctx.root, "ckpts-b"), save_top_k=0)]
    module, strategy, _ = _lightning_job(ctx, 7, ckpt_path="last", seed=98, callbacks=finder)  # trains either way
    return ((strategy.restored_from or {}).get("tier"),
            _same(module.at_start, at_four[0]) and _same(module.optimizer_at_start, at_four[1]))


def test_lightning_last_never_resumes_another_experiments_newer_snapshot(root, nodes):
    """Before: B's "last" (step 4) resumed experiment A's step 6 from memory."""
    for out in _world(_two_experiments_in_one_root, root, nodes, timeout=240):
        assert out == (None, True), out
