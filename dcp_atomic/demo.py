"""``dcp-atomic demo``: train, checkpoint, crash a save, resume — on real processes.

Launches a small world of CPU worker processes (gloo), each training a tiny
transformer sharded with FSDP2.  The job checkpoints every few steps; during
one save a rank is SIGKILLed mid-write (a failpoint, so it happens at exactly
that moment).  The job is then restarted, resumes from the newest committed
step and the loss curve continues.  Everything lands under ``--root``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

DEFAULT_ROOT = os.path.join(os.getcwd(), "dcp-atomic-demo")
RUN_ID = "demo"


# -- worker side -----------------------------------------------------------------------------


def _build_model(mesh):
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    vocab, dim = 64, 32
    model = torch.nn.Sequential(
        torch.nn.Embedding(vocab, dim),
        torch.nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=64, batch_first=True, dropout=0.0),
        torch.nn.Linear(dim, vocab),
    )
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _batch(step: int, rank: int):
    import torch

    g = torch.Generator().manual_seed(step * 1000 + rank)
    tokens = torch.randint(0, 64, (8, 16), generator=g)
    return tokens, (tokens * 7 + 3) % 64  # a learnable mapping


def worker(args: argparse.Namespace) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from dcp_atomic import (AtomicLoadPlanner, AtomicSavePlanner, AtomicStorageReader, AtomicStorageWriter,
                            Parallelism, latest_step)

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    layout = Parallelism.from_device_mesh(mesh)
    model = _build_model(mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)

    start = 0
    found = [latest_step(args.root, RUN_ID) if rank == 0 else None]
    dist.broadcast_object_list(found, src=0)  # one process scans, the others are told
    if found[0] is not None:
        msd, osd = get_state_dict(model, optim)
        state = {"model": msd, "optim": osd, "progress": {"step": 0}}
        reader = AtomicStorageReader(args.root, RUN_ID, found[0], parallelism=layout)
        dcp.load(state, storage_reader=reader, planner=AtomicLoadPlanner())
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = state["progress"]["step"]
        _say(rank, f"resumed from committed step {start} (save {reader.save_id})")

    for step in range(start + 1, args.steps + 1):
        tokens, target = _batch(step, rank)
        loss = torch.nn.functional.cross_entropy(model(tokens).reshape(-1, 64), target.reshape(-1))
        loss.backward()
        optim.step()
        optim.zero_grad()
        reduced = loss.detach().clone()
        dist.all_reduce(reduced)
        _say(rank, f"step {step:3d}  loss {reduced.item() / world:.4f}")
        if step % args.save_every == 0:
            msd, osd = get_state_dict(model, optim)
            writer = AtomicStorageWriter(args.root, RUN_ID, step, parallelism=layout)
            began = time.perf_counter()
            try:
                dcp.save({"model": msd, "optim": osd, "progress": {"step": step}}, storage_writer=writer,
                         planner=AtomicSavePlanner())
            except BaseException as e:  # CheckpointException or a gloo error: a peer died
                cause = str(e).strip().splitlines()[-1][:160]
                _say(rank, f"checkpoint step {step} FAILED, nothing committed: {type(e).__name__}: {cause}")
                os._exit(1)
            _say(rank, f"checkpoint step {step} committed as {writer.save_id} in {time.perf_counter() - began:.2f}s")
    dist.destroy_process_group()


def _say(rank: int, message: str) -> None:
    if rank == 0:
        print(f"    [rank 0] {message}", flush=True)


# -- launcher side ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(root: str, world: int, steps: int, save_every: int, failpoint: str | None, timeout: float) -> list[int]:
    """Run one job (``world`` processes); return their exit codes."""
    port = _free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", TORCHELASTIC_ERROR_FILE="")
        env.pop("DCP_ATOMIC_FAILPOINTS", None)
        if failpoint:
            env["DCP_ATOMIC_FAILPOINTS"] = failpoint
        cmd = [sys.executable, "-m", "dcp_atomic.demo", "--worker", "--root", root, "--steps", str(steps),
               "--save-every", str(save_every)]
        procs.append(subprocess.Popen(cmd, env=env, start_new_session=True,
                                      stderr=subprocess.DEVNULL if rank else None))
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.returncode not in (None, 0) for p in procs):
                time.sleep(1.0)  # let the survivors report the failure, then stop the job like a launcher would
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return [p.returncode for p in procs]


def run_demo(root: str, world: int = 2, fresh: bool = True) -> int:
    from dcp_atomic import latest_step, list_steps

    if fresh and os.path.isdir(os.path.join(root, RUN_ID)):
        shutil.rmtree(os.path.join(root, RUN_ID))
    print(f"dcp_atomic demo: {world} CPU ranks, FSDP2, checkpoints under {root}/{RUN_ID}\n", flush=True)

    print("1) train steps 1-12, checkpoint every 4 steps", flush=True)
    codes = _launch(root, world, steps=12, save_every=4, failpoint=None, timeout=300)
    if any(codes):
        print(f"   unexpected failure: exit codes {codes}")
        return 1
    print(f"   committed steps: {list_steps(root, RUN_ID)}\n", flush=True)

    print("2) continue to step 16; rank 1 is SIGKILLed in the middle of writing checkpoint 16", flush=True)
    codes = _launch(root, world, steps=16, save_every=4, failpoint="write.mid_data@1=kill", timeout=300)
    print(f"   job died (exit codes {codes}); committed steps: {list_steps(root, RUN_ID)}; "
          f"latest = {latest_step(root, RUN_ID)} — step 16 was never visible\n", flush=True)

    print("3) restart: resume from the newest committed step and train to step 20", flush=True)
    codes = _launch(root, world, steps=20, save_every=4, failpoint=None, timeout=300)
    if any(codes):
        print(f"   unexpected failure: exit codes {codes}")
        return 1
    steps = list_steps(root, RUN_ID)
    print(f"   committed steps: {steps}; latest = {latest_step(root, RUN_ID)}\n", flush=True)
    print(f"Inspect it: dcp-atomic ls {root} {RUN_ID}   |   dcp-atomic verify {root} {RUN_ID} --all")
    ok = steps == [4, 8, 12, 16, 20]
    print("demo finished: " + ("OK" if ok else "UNEXPECTED STATE"))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dcp-atomic demo")
    parser.add_argument("--root", default=DEFAULT_ROOT)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=12, help=argparse.SUPPRESS)
    parser.add_argument("--save-every", type=int, default=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    return run_demo(os.path.abspath(args.root), args.world_size)


if __name__ == "__main__":
    sys.exit(main())
