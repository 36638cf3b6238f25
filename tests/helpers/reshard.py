"""Models laid out over a device mesh (FSDP, TP, both), saved at one layout to be loaded at another."""

from __future__ import annotations

import torch


RUN = "exp"


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 8)
        self.norm = torch.nn.LayerNorm(8)


def _build(layout: dict[str, int], seed: int):
    """A block laid out as {"dp": n, "tp": m}: TP via parallelize_module, DP via FSDP2."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    names = tuple(layout)
    mesh = init_device_mesh("cpu", tuple(layout.values()), mesh_dim_names=names)
    model = _Block()
    with torch.no_grad():
        torch.manual_seed(seed)
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    if layout.get("tp", 1) > 1:
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    if layout.get("dp", 1) > 1:
        fully_shard(model, mesh=mesh["dp"])
    return model


def _full(model) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v.clone())
            for k, v in get_model_state_dict(model).items()}


def _save_layout(ctx, layout, step, seed, planner_kwargs=None):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from dcp_atomic import AtomicSavePlanner, AtomicStorageWriter

    model = _build(layout, seed)
    dcp.save({"model": get_model_state_dict(model)}, storage_writer=AtomicStorageWriter(ctx.root, RUN, step, timeout=20),
             planner=AtomicSavePlanner(**(planner_kwargs or {})))
    return _full(model)
