"""A training loop checkpointed by ``CheckpointManager``, launched with ``torchrun``.

    torchrun --standalone --nproc-per-node=2 examples/train.py --root ckpt --steps 6

The training process group is whatever the job uses (NCCL on GPUs, gloo on CPU); the manager creates its
own gloo groups over the same rendezvous for checkpoint coordination only.  Run it twice: the second run
resumes from the latest committed step.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from dcp_atomic import CheckpointManager, CheckpointNotFoundError, Parallelism, list_steps


class TrainState(Stateful):
    """Model and optimizer as one DCP ``Stateful``: FSDP2 shards are saved as DTensors."""

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim = model, optim

    def state_dict(self) -> dict:
        model, optim = get_state_dict(self.model, self.optim)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state: dict) -> None:
        set_state_dict(self.model, self.optim, model_state_dict=state["model"], optim_state_dict=state["optim"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True, help="checkpoint root: a path, or an s3:// URL")
    parser.add_argument("--run", default="train")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-every", type=int, default=2)
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dist.init_process_group("nccl" if device == "cuda" else "gloo")  # the training group
    rank, world = dist.get_rank(), dist.get_world_size()
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    mesh = init_device_mesh(device, (world,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32)).to(device)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"train": TrainState(model, optim)}

    manager = CheckpointManager(args.root, args.run, parallelism=Parallelism.from_device_mesh(mesh), keep_last=2)
    try:
        start = manager.load(state) + 1
    except CheckpointNotFoundError:
        start = 0
    for step in range(start, start + args.steps):
        torch.manual_seed(1000 + step)
        loss = model(torch.randn(8, 32, device=device)).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        if step % args.save_every == 0:
            manager.async_save(step, state)
        if rank == 0:
            print(f"step {step} loss {loss.item():.5f}", flush=True)
    manager.close()  # waits for the last save; raises if it failed
    if rank == 0:
        print(f"committed steps: {list_steps(args.root, args.run)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
