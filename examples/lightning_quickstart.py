# examples/lightning_quickstart.py: torchrun --nproc-per-node 2 examples/lightning_quickstart.py DIRPATH
import sys

import pytorch_lightning as pl  # or: import lightning.pytorch as pl, with LightningAtomicModelParallelStrategy
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.distributed.fsdp import fully_shard

from dcp_atomic.integrations.lightning import AtomicCheckpointHooks, AtomicModelParallelStrategy


class Model(AtomicCheckpointHooks, pl.LightningModule):  # the hooks: Model.load_from_checkpoint(file) works
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(8, 4)

    def configure_model(self):
        if self.device_mesh is not None:  # under the Trainer: shard over the data-parallel mesh
            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch, _):
        return self.net(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.Adam(self.net.parameters(), lr=0.01)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(64, 8), batch_size=4)


def trainer(max_steps):
    return pl.Trainer(accelerator="cpu", devices=2, max_steps=max_steps, logger=False, enable_progress_bar=False,
                      strategy=AtomicModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                      callbacks=[ModelCheckpoint(dirpath=sys.argv[1], every_n_train_steps=2, save_last=True),
                                 ModelCheckpoint(dirpath=sys.argv[1], filename="weights-{step}",
                                                 every_n_train_steps=1, save_weights_only=True)])


trainer(4).fit(Model())                             # commits epoch=0-step=4.ckpt, last.ckpt, weights-step=4.ckpt
resumed = trainer(6)
resumed.fit(Model(), ckpt_path="last")              # verified resume from step 4, weights and optimizer
weights = Model.load_from_checkpoint(f"{sys.argv[1]}/weights-step=6.ckpt")  # a plain module, outside a Trainer
if resumed.is_global_zero:
    print(f"resumed at step 4, trained to step {resumed.global_step}; "
          f"weights-only file loaded {sum(p.numel() for p in weights.parameters())} parameters")
