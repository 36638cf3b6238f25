"""State dicts and a survivors' barrier for shared reads (each byte read from storage once, sent to the ranks that need
it)."""

from __future__ import annotations

import os
import time

import torch


def _state(rank: int, step: int) -> dict:
    """Replicated plain tensors (one over a 4 MiB block), an object, HSDP DTensors, and one per-rank key."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    g = torch.Generator().manual_seed(step)
    return {
        "embed": torch.randn(1_100_000, generator=g),  # 4.4 MB: several blocks / frames
        "norm": torch.randn(64, generator=g).to(torch.bfloat16),
        "empty": torch.empty(0, 3),
        "hsdp": distribute_tensor(torch.randn(64, 33, generator=g), mesh, [Replicate(), Shard(0)]),
        "extra": {"step": step, "schedule": [0.1, 0.01]},
        # many replicated items of odd sizes: each rank receives several items from each of several senders
        "layers": {f"w{i}": torch.randn(100 + 37 * i, generator=g) for i in range(12)},
        f"own{rank}": torch.full((5,), float(rank)),
    }


def _blank(rank: int) -> dict:
    state = _state(rank, 0)
    for value in state.values():
        if isinstance(value, torch.Tensor):
            (value.to_local() if hasattr(value, "to_local") else value).fill_(-7)
    state["extra"] = {"step": -1, "schedule": [0.0, 0.0]}
    return state


def _survivors_barrier(ctx, parties, timeout=60.0):
    open(os.path.join(ctx.root, f".done.{ctx.rank}"), "w").close()
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(os.path.join(ctx.root, f".done.{p}")) for p in parties):
        assert time.monotonic() < deadline, "a survivor never finished"
        time.sleep(0.05)
