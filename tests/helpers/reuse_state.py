"""The state the reuse (P15) tests save on gloo worlds: a frozen base sharded over the ranks (1 MiB of float32, a
512 KiB chunk per rank), an adapter that changes every step, and a counter."""

from __future__ import annotations

import logging

import torch

RUN = "exp"
ROWS, COLS = 256, 1024
CHUNK = ROWS * COLS * 4 // 2  # one rank's chunk of the frozen base at world 2, in bytes


class Messages(logging.Handler):
    """The writer's log lines on this rank."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        logging.getLogger("dcp_atomic.writer").addHandler(self)
        logging.getLogger("dcp_atomic.writer").setLevel(logging.INFO)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def mesh(world_size):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))


def frozen(changed_element: bool = False) -> torch.Tensor:
    base = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(0))
    if changed_element:
        base[3, 5] += 1.0  # in rank 0's chunk (rows 0..127)
    return base


def state(mesh, step: int, changed_element: bool = False) -> dict:
    """A frozen base (sharded), an adapter that changes every step (sharded) and a counter (bytes)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    adapter = torch.full((8, 16), float(step)) + torch.arange(16.0)
    return {"base": distribute_tensor(frozen(changed_element), mesh, [Shard(0)]),
            "adapter": distribute_tensor(adapter, mesh, [Shard(0)]), "step": step}


def empty(mesh) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor

    return {"base": distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(0)]),
            "adapter": distribute_tensor(torch.zeros(8, 16), mesh, [Shard(0)]), "step": -1}


def full(state) -> dict:
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()}


def exact(loaded: dict, expected: dict) -> bool:
    return all(torch.equal(loaded[k], expected[k]) for k in ("base", "adapter")) and loaded["step"] == expected["step"]


def save_steps_on_a_store(ctx, steps) -> list[str]:
    """Rank function: ``steps`` saved with reuse through the writer, onto ``ctx.extra["storage_options"]``'s store;
    the writer's log lines on this rank."""
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageWriter

    world = mesh(ctx.world_size)
    messages = Messages()
    for step in steps:
        dcp.save(state(world, step), storage_writer=AtomicStorageWriter(
            ctx.root, RUN, step, reuse=True, timeout=30, storage_options=ctx.extra["storage_options"]))
    return messages.lines


def load_step_from_a_store(ctx, step):
    """Rank function: ``step`` loaded through the manager; True when exact, else the error's type name."""
    from dcp_atomic import CheckpointManager

    world = mesh(ctx.world_size)
    manager = CheckpointManager(ctx.root, RUN, timeout=30, storage_options=ctx.extra["storage_options"])
    loaded = empty(world)
    try:
        manager.load(loaded, step=step)
        return exact(full(loaded), full(state(world, step)))
    except Exception as e:  # noqa: BLE001 - the type is the answer
        return type(e).__name__
    finally:
        manager.close()
