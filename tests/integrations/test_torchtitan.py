"""torchtitan the way its users run it: its own CheckpointManager built from its config, ``load(step=load_step)``
as its Trainer calls it, ``interval``, ``keep_latest_k`` and ``initial_load_path`` — over a job's life: train,
roll back to an earlier step and train on, restart, start a new run from another run's step."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from dcp_atomic import list_steps
from tests.harness import assert_all_ok, run_world
from tests.helpers.integrations import _sharded_model, _Stateful, _train_step

pytestmark = pytest.mark.slow


def _full(model, optim):
    """Exact weights and Adam moments (none before the first step)."""
    weights = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    moments = {f"{p}.{k}": optim.state[param][k].full_tensor().clone()
               for p, param in model.named_parameters() if param in optim.state for k in ("exp_avg", "exp_avg_sq")}
    return weights, moments


def _manager(ctx, folder, model, optim, train_state, **config):
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    from dcp_atomic.integrations.torchtitan import AtomicCheckpointManager

    cfg = AtomicCheckpointManager.Config(**{"enable": True, "folder": folder, "interval": 2, "async_mode": "async",
                                            "timeout": 20, **config})
    optimizers = _Stateful(lambda: get_optimizer_state_dict(model, optim),
                           lambda sd: set_optimizer_state_dict(model, optim, sd))
    schedulers = _Stateful(lambda: {"last_epoch": torch.tensor(train_state["step"])}, lambda sd: None)
    states = {"train_state": _Stateful(lambda: {"step": torch.tensor(train_state["step"])},
                                       lambda sd: train_state.update(step=int(sd["step"])))}
    return cfg, cfg.build(dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
                          states=states, sd_adapter=None, base_folder=ctx.root)


def _job(ctx, folder, last_step, data_seed, **config):
    """One torchtitan job: build, ``load(step=config.load_step)`` (as its Trainer does), train to ``last_step``
    saving every interval; returns where it started and the exact weights at every step it saved."""
    model = _sharded_model(0)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    train_state = {"step": 0}
    cfg, manager = _manager(ctx, folder, model, optim, train_state, **config)
    manager.load(step=cfg.load_step)
    started = train_state["step"]
    weights_at_start = _full(model, optim)
    saved = {}
    for step in range(started + 1, last_step + 1):
        _train_step(model, optim, data_seed * 1000 + step)
        train_state["step"] = step
        if manager.save(step):
            saved[step] = _full(model, optim)
        manager.maybe_wait_for_staging()
    manager.maybe_wait_for_saving()
    manager.close()
    return {"started": started, "start": weights_at_start, "saved": saved}


def _same(a, b) -> bool:
    return all(a[part].keys() == b[part].keys() and all(torch.equal(a[part][k], b[part][k]) for k in a[part])
               for part in (0, 1))


def _rollback_life(ctx):
    first = _job(ctx, "ckpt", 6, data_seed=1, keep_latest_k=3)              # saves 2, 4, 6
    rolled = _job(ctx, "ckpt", 8, data_seed=2, keep_latest_k=3, load_step=2)  # loss spike: back to 2, new data
    restarted = _job(ctx, "ckpt", 10, data_seed=3, keep_latest_k=3)         # a crash-restart: latest committed
    at_4 = _job(ctx, "ckpt", 4, data_seed=4, keep_latest_k=3, load_step=4)   # loads step 4, trains nothing
    return {
        "first_saved": sorted(first["saved"]), "rolled_saved": sorted(rolled["saved"]),
        "rolled_started": rolled["started"], "rolled_start_exact": _same(rolled["start"], first["saved"][2]),
        "restart_started": restarted["started"], "restart_exact": _same(restarted["start"], rolled["saved"][8]),
        "step4_is_the_new_branch": _same(at_4["start"], rolled["saved"][4]),
        "step4_differs_from_old": not _same(rolled["saved"][4], first["saved"][4]),
    }


def test_load_step_rollback_then_training_on_supersedes_the_abandoned_steps(root):
    results = assert_all_ok(run_world(_rollback_life, 2, root, timeout=240))
    for out in results:
        assert out["first_saved"] == [2, 4, 6] and out["rolled_started"] == 2 and out["rolled_start_exact"]
        assert out["rolled_saved"] == [4, 6, 8]  # stock torchtitan overwrites these; we supersede, never refuse
        assert out["restart_started"] == 8 and out["restart_exact"]
        assert out["step4_is_the_new_branch"] and out["step4_differs_from_old"]
    # keep_latest_k=3 counts commits: when the save of step 10 purged (it was still in flight, async), the newest
    # were 8, 6', 4', so the step 2 the rollback started from went, in the background
    assert list_steps(root, "ckpt") == [4, 6, 8, 10]


def _initial_load_from_another_run(ctx):
    source = _job(ctx, "pretrain", 2, data_seed=1, keep_latest_k=0)
    path = os.path.join(ctx.root, "pretrain", "step_0000000002")
    finetune = _job(ctx, "finetune", 4, data_seed=2, keep_latest_k=0, initial_load_path=path,
                    initial_load_model_only=True)
    return {"model_exact": all(torch.equal(a, b) for a, b in zip(finetune["start"][0].values(),
                                                                source["saved"][2][0].values(), strict=True)),
            "finetune_saved": sorted(finetune["saved"])}


def test_initial_load_path_names_a_step_of_another_dcp_atomic_run(root):
    for out in assert_all_ok(run_world(_initial_load_from_another_run, 2, root, timeout=180)):
        assert out["model_exact"] and out["finetune_saved"] == [2, 4]
    assert list_steps(root, "pretrain") == [2] and list_steps(root, "finetune") == [2, 4]


def _purge_in_background(ctx):
    import torch.distributed as dist

    from dcp_atomic.integrations import torchtitan

    started, release, threads = threading.Event(), threading.Event(), []
    real = torchtitan.apply_gc

    def held_apply_gc(layout, plan):  # the purge blocks until training has gone on
        threads.append(threading.current_thread().name)
        started.set()
        assert release.wait(60)
        real(layout, plan)

    torchtitan.apply_gc = held_apply_gc
    model = _sharded_model(0)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    train_state = {"step": 0}
    _, manager = _manager(ctx, "ckpt", model, optim, train_state, keep_latest_k=1, async_mode="disabled")
    for step in (2, 4):  # the save of step 4 purges step 2 on rank 0
        train_state["step"] = step
        manager.save(step)
    returned_while_purging = started.wait(30) and not release.is_set() if dist.get_rank() == 0 else None
    release.set()
    manager.close()  # waits for the purge
    return {"returned_while_purging": returned_while_purging, "threads": threads}


def test_purging_old_steps_runs_off_the_training_thread(root):
    results = assert_all_ok(run_world(_purge_in_background, 2, root, timeout=120))
    assert results[0]["returned_while_purging"] is True
    assert results[0]["threads"] and all(name.startswith("dcp_atomic-purge") for name in results[0]["threads"])
    assert results[1]["threads"] == []  # rank 0 alone purges
    assert list_steps(root, "ckpt") == [4]
