"""The local tier under a framework's checkpointer: a torchtitan-style checkpointer over the tiered manager, and what a
node's local root holds."""

from __future__ import annotations

import glob
import os

import torch

from tests.helpers.integrations import _Stateful, _train_step


FOLDER = "ckpt"  # torchtitan's checkpoint folder: the durable root is ctx.root, the run is "ckpt"


def _node_root(ctx) -> str:
    return ctx.extra["nodes"][ctx.rank // 2]


def _local_steps(node_root: str, run: str = FOLDER) -> list[int]:
    """Steps local-committed on one node's disk."""
    return sorted(int(os.path.basename(p)[5:]) for p in glob.glob(os.path.join(node_root, run, "step_*"))
                  if os.path.exists(os.path.join(p, "COMMITTED")))


def _data_files(node_root: str, step: int, run: str = FOLDER) -> list[str]:
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(node_root, run, f"step_{step:010d}", "*",
                                                                      "__*_*.distcp")))


def _model(world_size: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _full(model, optim):
    weights = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    moments = {f"{p}.{k}": optim.state[param][k].full_tensor().clone()
               for p, param in model.named_parameters() if param in optim.state for k in ("exp_avg", "exp_avg_sq")}
    return weights, moments


def _titan(ctx, last_step: int, data_seed: int, last: bool = False, folder: str = FOLDER, tier: bool = True,
           **config):
    """One torchtitan job (build from the config, ``load(step=load_step)``, train to ``last_step`` saving every
    interval, ``close()``): where it started, the exact state there and at every save and every snapshot (each waited
    for: none skipped), and the tier that served."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    from dcp_atomic.integrations.torchtitan import AtomicCheckpointManager

    model = _model(ctx.world_size)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    train_state = {"step": 0}
    settings = {"enable": True, "folder": folder, "interval": 2, "async_mode": "async", "timeout": 20,
                "keep_latest_k": 0, **config}
    if tier:  # drained: multiples of interval x durable_every = 4, and the last step
        settings = {"local_root": _node_root(ctx), "durable_every": 2, **settings}
    cfg = AtomicCheckpointManager.Config(**settings)
    optimizers = _Stateful(lambda: get_optimizer_state_dict(model, optim),
                           lambda sd: set_optimizer_state_dict(model, optim, sd))
    schedulers = _Stateful(lambda: {"last_epoch": torch.tensor(train_state["step"])}, lambda sd: None)
    states = {"train_state": _Stateful(lambda: {"step": torch.tensor(train_state["step"])},
                                       lambda sd: train_state.update(step=int(sd["step"])))}
    manager = cfg.build(dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
                        states=states, sd_adapter=None, base_folder=ctx.root)
    manager.load(step=cfg.load_step)
    served = manager.tier.restored_from if manager.tier is not None else None
    started = train_state["step"]
    at_start = _full(model, optim)
    saved, snapshots = {}, {}
    for step in range(started + 1, last_step + 1):
        _train_step(model, optim, data_seed * 1000 + step)
        train_state["step"] = step
        if manager.save(step, last_step=last and step == last_step):
            saved[step] = _full(model, optim)
        if manager.snapshotted is not None:
            assert manager.snapshotted.result() == step
            snapshots[step], manager.snapshotted = _full(model, optim), None
        manager.maybe_wait_for_staging()
    manager.maybe_wait_for_saving()
    manager.close()
    return {"started": started, "start": at_start, "saved": saved, "snapshots": snapshots, "served": served}
