"""Worlds of 4 ranks on 2 simulated nodes (tests.helpers.tiers) that snapshot into the memory tier: each node's
memory path a directory on its own tmpfs."""

from __future__ import annotations

import os

import torch

from tests.helpers.fsdp_app import _fsdp_app, _full, _train_step
from tests.helpers.tiers import RUN, _state


def two_nodes_env(rank: int) -> dict[str, str]:
    """A world of 2 as 2 simulated nodes of one rank each (failure domains nodeA/nodeB)."""
    return {"DCP_ATOMIC_FAILURE_DOMAIN": "nodeAB"[4 + rank], "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
            "GROUP_RANK": str(rank)}


def memory_path(ctx) -> str:
    """The memory path on the rank's node (the world's ranks spread evenly over ``ctx.extra["nodes"]``)."""
    nodes = ctx.extra["nodes"]
    path = os.path.join(nodes[ctx.rank * len(nodes) // ctx.world_size], "mem")
    os.makedirs(path, exist_ok=True)
    return path


def one_node_per_rank(rank: int) -> dict[str, str]:
    """``rank_env`` of a world of 2 on the 2 simulated nodes: rank r alone on node r (failure domain nodeA/nodeB)."""
    return {"DCP_ATOMIC_FAILURE_DOMAIN": "nodeAB"[4 + rank], "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
            "GROUP_RANK": str(rank)}


def memory_manager(ctx, *, every=1, replicas=1, slots=2, budget_bytes=None, durable_every=None, path=None, root=None,
                   **kwargs):
    """This world's manager with a memory tier on the rank's node (durable root: ``root``, else ``ctx.root``)."""
    from dcp_atomic import CheckpointManager, MemoryTier
    from dcp_atomic.exchange import file_transfer

    file_transfer.CHUNK_BYTES = file_transfer.DIRECT_CHUNK_BYTES = 64 << 10  # replicas cross chunk boundaries
    kwargs.setdefault("timeout", 10)
    memory = MemoryTier(path or memory_path(ctx), every=every, replicas=replicas, slots=slots,
                        budget_bytes=budget_bytes, durable_every=durable_every)
    return CheckpointManager(root or ctx.root, RUN, memory=memory, **kwargs)


def trained(world: int, step: int, seed: int = 0):
    """The model and optimizer of this rank after ``step`` training steps (the same on every run)."""
    model, optim = _fsdp_app(world, seed)
    for s in range(1, step + 1):
        _train_step(model, optim, s)
    return model, optim


def state_of(model, optim, step):
    return _state(model, optim, step)


def full_state(model, optim) -> dict[str, torch.Tensor]:
    """Every parameter and momentum buffer as full tensors (collectives: every rank alike)."""
    out = {f"model.{k}": v for k, v in _full(model).items()}
    for name, param in model.named_parameters():
        buffer = optim.state[param].get("momentum_buffer")
        if buffer is not None:
            out[f"momentum.{name}"] = buffer.full_tensor()
    return out
