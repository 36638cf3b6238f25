"""A tiny Lightning module and trainer (lightning or pytorch_lightning, whichever is installed) and the weight checks
the Lightning tests share."""

from __future__ import annotations

import torch


def _module_class(package: str):
    import importlib

    pl = importlib.import_module(package)
    from dcp_atomic.integrations.lightning import AtomicCheckpointHooks

    class Module(AtomicCheckpointHooks, pl.LightningModule):
        def __init__(self, seed: int = 0, data_seed: int = 1):
            super().__init__()
            self.save_hyperparameters()
            torch.manual_seed(seed)
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
            self.data_seed = data_seed
            self.at_start = None

        def configure_model(self):
            from torch.distributed.fsdp import FSDPModule, fully_shard

            if self.device_mesh is None or isinstance(self.net, FSDPModule):  # outside a Trainer, or sharded already
                return
            mesh = self.device_mesh["data_parallel"]
            for layer in (self.net[0], self.net[2]):
                fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

        def training_step(self, batch, _):
            return self.net(batch).sum()

        def on_train_start(self):
            self.at_start = _weights(self)

        def configure_optimizers(self):
            return torch.optim.Adam(self.net.parameters(), lr=0.01)

        def train_dataloader(self):
            torch.manual_seed(self.data_seed)
            return torch.utils.data.DataLoader(torch.randn(64, 8), batch_size=4)

    return pl, Module


def _weights(module) -> dict:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in module.net.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _trainer(pl, ctx, max_steps, callbacks=(), **kwargs):
    from dcp_atomic.integrations.lightning import strategy_class

    strategy = strategy_class("lightning.pytorch" if pl.__name__.startswith("lightning") else "pytorch_lightning")
    return pl.Trainer(accelerator="cpu", devices=2, max_steps=max_steps, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=ctx.root,
                      strategy=strategy(data_parallel_size=2, tensor_parallel_size=1, timeout=30),
                      callbacks=list(callbacks), enable_checkpointing=bool(callbacks), **kwargs)


def _resumed_weights(pl, Module, ctx, path, max_steps):
    """What ``fit(ckpt_path=path)`` restores (one more step to reach on_train_start; no checkpoints written)."""
    module = Module(seed=99)
    _trainer(pl, ctx, max_steps).fit(module, ckpt_path=path)
    return module.at_start
