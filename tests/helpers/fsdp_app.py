"""A small FSDP app (two linear layers, SGD with momentum) sharded over the world, trained one seeded step at a time."""

from __future__ import annotations

import torch


class _AppState:
    """A Stateful wrapper, as training loops hand to DCP."""

    def __init__(self, model, optim) -> None:
        self.model, self.optim = model, optim

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optim)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state):
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optim, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _fsdp_app(world_size: int, seed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    fully_shard(model, mesh=mesh)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, optim


def _train_step(model, optim, step):
    torch.manual_seed(100 + step)
    model(torch.randn(4, 8)).pow(2).mean().backward()
    optim.step()
    optim.zero_grad()


def _full(model):
    return {k: v.full_tensor() for k, v in model.state_dict().items()}
