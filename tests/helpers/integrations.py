"""A sharded model, its Stateful wrapper and a seeded training step, as the framework integrations (torchtitan,
Lightning, plain loops) hand them to DCP."""

from __future__ import annotations

import torch


def _sharded_model(seed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _train_step(model, optim, seed: int) -> None:
    torch.manual_seed(seed)
    model(torch.randn(4, 8)).sum().backward()
    optim.step()
    optim.zero_grad()


class _Stateful:
    """torchtitan's containers reduced to what its checkpointer calls: state_dict / load_state_dict."""

    def __init__(self, get, put):
        self.get, self.put = get, put

    def state_dict(self):
        return self.get()

    def load_state_dict(self, state):
        self.put(state)
