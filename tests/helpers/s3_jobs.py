"""Jobs against an object store (S3 or GCS through the same backend): world functions that save and load steps, and two
jobs racing for the same steps."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException


RUN = "exp"


def _world_state(rank: int, step: int, world: int, big: bool) -> dict:
    """DTensor shards, a replicated plain tensor, a per-rank key, an object; ``big`` adds 12 MB per rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    generator = torch.Generator().manual_seed(step)
    state = {
        "dtensor": distribute_tensor(torch.randn(8, 6, generator=generator), mesh, [Shard(0)]),
        "replicated": torch.arange(12, dtype=torch.float32).reshape(3, 4) * step,
        f"rank{rank}": torch.full((16,), float(step * 10 + rank)),
        "bf16": (torch.linspace(-1, 1, 64) * step).to(torch.bfloat16),
        "extra": {"step": step, "lrs": [0.1, 0.01]},
    }
    if big:  # beyond the 5 MiB part size: a multipart upload per rank
        state[f"big{rank}"] = torch.randn(3_000_000, generator=torch.Generator().manual_seed(step * 100 + rank))
    return state


def _save_steps(ctx, steps, big_steps=(), thread_count=None):
    from dcp_atomic import AtomicSavePlanner, AtomicStorageWriter

    ids = []
    for step in steps:
        writer = AtomicStorageWriter(ctx.root, RUN, step, timeout=20, thread_count=thread_count,
                                     storage_options=ctx.extra["storage_options"])
        dcp.save(_world_state(ctx.rank, step, ctx.world_size, step in big_steps), storage_writer=writer,
                 planner=AtomicSavePlanner())
        ids.append(writer.save_id)
    return ids


def _load_steps(ctx, requests):
    """Load each (step or None, big) and check every value against what that step saved."""
    from dcp_atomic import AtomicStorageReader

    seen = []
    for step, big in requests:
        template = _world_state(ctx.rank, 0, ctx.world_size, big)
        for value in template.values():
            if isinstance(value, torch.Tensor):
                (value.to_local() if hasattr(value, "to_local") else value).zero_()
        reader = AtomicStorageReader(ctx.root, RUN, step, timeout=20, storage_options=ctx.extra["storage_options"])
        dcp.load(template, storage_reader=reader)
        expected = _world_state(ctx.rank, reader.step, ctx.world_size, big)
        for key, want in expected.items():
            got = template[key]
            if hasattr(got, "full_tensor"):
                got, want = got.full_tensor(), want.full_tensor()
            assert (torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want), \
                f"rank {ctx.rank}: {key} differs after loading step {reader.step}"
        seen.append((reader.step, reader.save_id))
    return seen


def _job_state(job: int, step: int) -> dict:
    generator = torch.Generator().manual_seed(1000 * job + step)
    return {"w": torch.randn(256, 256, generator=generator), "b": torch.randn(7, generator=generator),
            "who": {"job": job, "step": step}}


def _barrier(directory: str, name: str, me: int, parties: int, timeout: float = 30.0) -> None:
    open(os.path.join(directory, f"{name}.{me}"), "w").close()
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(os.path.join(directory, f"{name}.{p}")) for p in range(parties)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier {name}: the other job never arrived")
        time.sleep(0.0005)


def _racing_job(ctx, steps, barrier_dir):
    """An independent job (no process group) committing ``steps``; both jobs release their marker PUTs together."""
    from dcp_atomic import AtomicStorageWriter

    results = []
    for step in steps:
        writer = AtomicStorageWriter(ctx.root, RUN, step, timeout=20, storage_options=ctx.extra["storage_options"])
        create_exclusive = writer.storage.create_exclusive

        def at_the_same_time(path, data, step=step, create_exclusive=create_exclusive):
            _barrier(barrier_dir, f"step{step}", ctx.rank, 2)
            return create_exclusive(path, data)

        writer.storage.create_exclusive = at_the_same_time
        try:
            dcp.save(_job_state(ctx.rank, step), storage_writer=writer)
            results.append({"won": True, "save_id": writer.save_id})
        except CheckpointException as e:
            inner = _inner(e)
            results.append({"won": False, "save_id": writer.save_id, "errors": [type(x).__name__ for x in inner],
                            "message": " ".join(str(x) for x in inner)})
    return results


def _inner(exc: BaseException) -> list[BaseException]:
    return [w[0] if isinstance(w, tuple) else w for w in getattr(exc, "failures", {}).values()]
