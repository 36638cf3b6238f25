"""``dcp-atomic demo``: train, checkpoint, crash a save, resume — on real processes.

Launches a world of CPU worker processes (gloo) training a tiny transformer
with FSDP2 + tensor parallelism through a ``CheckpointManager`` that saves in
the background every few steps.  During one save a rank is SIGKILLed mid-write
(a failpoint, so it happens at exactly that moment).  The job then restarts
with another tensor_parallel_size (explicit consent), resumes from the newest
committed step and the loss curve continues.  Everything lands under ``--root``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

DEFAULT_ROOT = os.path.join(os.getcwd(), "dcp-atomic-demo")
RUN_ID = "demo"


# -- worker side -----------------------------------------------------------------------------

VOCAB, DIM, HEADS = 64, 32, 4


def _build_model(mesh):
    """A one-block transformer: tensor parallel over mesh["tp"], FSDP2 over mesh["dp"]."""
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
            self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
            self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

        def forward(self, x):
            b, s, _ = x.shape
            h = self.norm1(x)
            q, k, v = (w(h).view(b, s, -1, DIM // HEADS).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
            attn = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.wo(attn.transpose(1, 2).reshape(b, s, -1))
            return x + self.down(nn.functional.gelu(self.up(self.norm2(x))))

    class TinyLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.block, self.head = nn.Embedding(VOCAB, DIM), Block(), nn.Linear(DIM, VOCAB)

        def forward(self, tokens):
            return self.head(self.block(self.embed(tokens)))

    torch.manual_seed(0)
    model = TinyLM()
    if mesh["tp"].size() > 1:
        plan = {name: ColwiseParallel() for name in ("wq", "wk", "wv", "up")}
        plan.update(wo=RowwiseParallel(), down=RowwiseParallel())
        parallelize_module(model.block, mesh["tp"], plan)
    if mesh["dp"].size() > 1:
        for module in (model.embed, model.block, model.head):
            fully_shard(module, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return model


class _TrainState:
    """Model + optimizer as one DCP ``Stateful``."""

    def __init__(self, model, optim) -> None:
        self.model, self.optim = model, optim

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optim)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optim, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _batch(step: int, dp_rank: int):
    import torch

    g = torch.Generator().manual_seed(step * 1000 + dp_rank)
    tokens = torch.randint(0, VOCAB, (8, 16), generator=g)
    return tokens, (tokens * 7 + 3) % VOCAB  # a learnable mapping


def worker(args: argparse.Namespace) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from dcp_atomic import CheckpointManager, CheckpointNotFoundError, Parallelism
    from dcp_atomic.errors import shorten

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    model = _build_model(mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    train = _TrainState(model, optim)
    manager = CheckpointManager(args.root, RUN_ID, parallelism=Parallelism.from_device_mesh(mesh),
                                keep_last=args.keep_last, timeout=8)
    progress = {"step": 0}
    try:
        start = manager.load({"train": train, "progress": progress}, allow_reshard=True)
        _say(rank, f"resumed from committed step {start} (saved with another tensor_parallel_size: resharded "
                   f"with explicit consent, allow_reshard=True)")
    except CheckpointNotFoundError:
        start = 0
    dp_rank = mesh["dp"].get_local_rank()

    def report(future, step):
        try:
            future.result()
            _say(rank, f"checkpoint step {step} committed (in the background)")
        except Exception as e:  # the typed error from the manager
            _say(rank, shorten(f"checkpoint step {step} FAILED, nothing committed: {e}", 400))

    future = None
    try:
        for step in range(start + 1, args.steps + 1):
            tokens, target = _batch(step, dp_rank)
            loss = torch.nn.functional.cross_entropy(model(tokens).reshape(-1, VOCAB), target.reshape(-1))
            loss.backward()
            optim.step()
            optim.zero_grad()
            reduced = loss.detach().clone()
            dist.all_reduce(reduced)
            _say(rank, f"step {step:3d}  loss {reduced.item() / world:.4f}")
            if step % args.save_every == 0:
                progress["step"] = step
                future = manager.async_save(step, {"train": train, "progress": dict(progress)})
                future.add_done_callback(lambda f, s=step: report(f, s))
        manager.wait()
    except Exception as e:  # a peer died: the job stops, as a launcher would stop it
        if future is not None:
            concurrent.futures.wait([future], timeout=30)  # let the manager name what failed
        _say(rank, f"training stopped: {type(e).__name__}: {shorten(str(e).splitlines()[0], 120)}")
        os._exit(1)
    manager.close()
    dist.destroy_process_group()


def _say(rank: int, message: str) -> None:
    if rank == 0:
        print(f"    [rank 0] {message}", flush=True)


# -- launcher side ---------------------------------------------------------------------------


def _rendezvous_store() -> Any:
    """The job's rendezvous store, hosted by this launcher (as torchrun's agent hosts it) on a port the kernel picks
    as it binds.  A port picked first and bound later by rank 0 can be taken meanwhile: any outgoing connection on
    the machine may use it as its source port (a busy machine's did: rank 0 failed with EADDRINUSE)."""
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _launch(root: str, world: int, tp: int, steps: int, save_every: int, failpoint: str | None,
            timeout: float) -> list[int]:
    """Run one job (``world`` processes); return their exit codes."""
    store = _rendezvous_store()  # held until the job is over; every rank is its client
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port),
                   TORCHELASTIC_USE_AGENT_STORE="True", OMP_NUM_THREADS="1", TORCHELASTIC_ERROR_FILE="")
        env.pop("DCP_ATOMIC_FAILPOINTS", None)
        if failpoint:
            env["DCP_ATOMIC_FAILPOINTS"] = failpoint
        cmd = [sys.executable, "-m", "dcp_atomic.tools.demo", "--worker", "--root", root, "--steps", str(steps),
               "--save-every", str(save_every), "--tp", str(tp)]
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


def run_demo(root: str, world: int = 4) -> int:
    from dcp_atomic import latest_step, list_steps

    if os.path.isdir(os.path.join(root, RUN_ID)):
        shutil.rmtree(os.path.join(root, RUN_ID))
    began = time.monotonic()
    print(f"dcp_atomic demo: {world} CPU ranks (gloo), a tiny transformer with FSDP2 + tensor parallelism,\n"
          f"background checkpoints every 4 steps into {root}/{RUN_ID}\n", flush=True)

    print(f"1) train with tensor_parallel_size=2 (dp={world // 2}); rank {world - 1} is SIGKILLed in the middle of "
          "writing checkpoint 12", flush=True)
    print(f"   (expected below: the surviving ranks' raw gloo lines such as \"Connection closed by peer\" name rank "
          f"{world - 1}'s killed connection, and rank 0 says the job stopped)", flush=True)
    codes = _launch(root, world, tp=2, steps=16, save_every=4, failpoint=f"write.mid_data@{world - 1}#3=kill",
                    timeout=300)
    print(f"   job died (exit codes {codes}); committed steps: {list_steps(root, RUN_ID)}; "
          f"latest = {latest_step(root, RUN_ID)}: checkpoint 12 never became visible\n", flush=True)

    print(f"2) restart with tensor_parallel_size=1 (dp={world}): resume from the newest committed step and train "
          "to step 20", flush=True)
    codes = _launch(root, world, tp=1, steps=20, save_every=4, failpoint=None, timeout=300)
    if any(codes):
        print(f"   unexpected failure: exit codes {codes}")
        return 1
    steps = list_steps(root, RUN_ID)
    print(f"   committed steps: {steps}; latest = {latest_step(root, RUN_ID)}\n", flush=True)
    print(f"Files: {root}/{RUN_ID}  (took {time.monotonic() - began:.0f}s)")
    print("Look (each line is a command):")
    cli = _cli_command()
    for command in ("ls", "show", "verify"):  # shlex.quote: a root with spaces still pastes as one argument
        print(f"  {cli} {command} {shlex.quote(root)} {RUN_ID}" + (" --all" if command == "verify" else ""))
    ok = steps == [4, 8, 12, 16, 20]
    print("demo finished: " + ("OK" if ok else "UNEXPECTED STATE"))
    return 0 if ok else 1


def _cli_command() -> str:
    """How to run the CLI from the user's shell, as printed: ``dcp-atomic`` when that is this install's (on PATH),
    else its full path in this environment (the README's bootstrap puts it in ``.venv/bin``, not on PATH)."""
    script = os.path.join(os.path.dirname(sys.executable), "dcp-atomic")
    on_path = shutil.which("dcp-atomic")
    if on_path and os.path.exists(script) and os.path.samefile(on_path, script):
        return "dcp-atomic"
    if os.path.exists(script):
        return shlex.quote(script)
    return f"{shlex.quote(sys.executable)} -m dcp_atomic"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dcp-atomic demo")
    parser.add_argument("--root", default=DEFAULT_ROOT)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--tp", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--keep-last", type=int, default=None, help=argparse.SUPPRESS)
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
