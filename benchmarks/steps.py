"""What a snapshot every step costs the training loop (P16): the demo's model trained with and without the memory tier,
world 4 as 2 simulated nodes.

What it measures
    One world of 4 gloo ranks plays 2 nodes (failure domains nodeA / nodeB, 2 ranks each, as ``bench.py memory``),
    each node's memory path on its own tmpfs mount.  The model is the demo's (``dcp-atomic demo``,
    ``examples/train.py``): ``Linear(h/2, h) -> ReLU -> Linear(h, h/2)`` with ``h = --hidden`` (64: the demo's),
    ``fully_shard`` over the 4 ranks, AdamW; its state is the demo's ``Stateful`` (``get_state_dict`` of model and
    optimizer: DTensors).  Both models docs/benchmarks.md reports run, each in its own world (:data:`MODELS`: the
    demo's, ``h = 64``, batch 32, 50 timed steps; and ``h = 2048``, batch 256, 30 timed steps, 12.6 MB per rank), or
    the one ``--hidden`` (``--batch``, ``--steps``) names.  Per contender, the timed training steps (after
    ``--warmup`` untimed ones) on random batches:

    none      no checkpointing: the step itself;
    snapshot  ``CheckpointManager(memory=MemoryTier(node's tmpfs, every=1, replicas=1, slots=2))`` and
              ``manager.snapshot(step, state)`` after every ``optimizer.step()``, its future never waited for (a
              snapshot still in flight when the next is due is skipped and counted, as in a training loop);
    staged    the same with ``staging=Staging(...)``: the call returns before the tensors are copied, and
              ``manager.wait_staged()`` runs right before each ``optimizer.step()`` (the stall it costs is counted).

    Contenders alternate over ``--repeats`` rounds (ABC, CBA, ...).  Each memory round's timed steps are followed by one more step whose snapshot is waited for, restored by a fresh manager (a new model and optimizer)
    and checked bit-exact against the state it was taken at.

What the numbers mean
    step ms = the slowest rank's mean wall time per timed step (the median over rounds); overhead = against
    ``none``.  taken / skipped = the timed steps' snapshots memory-committed and skipped (rank 0).  On this
    2-core machine 4 ranks share the cores with the snapshots' copies, replicas and collectives: the overhead is an
    upper bound of what a GPU job (the copy overlapping the step, CPU cores to spare) would see.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import tempfile
import time

from benchmarks import report
from benchmarks.common import MiB, assert_bit_exact, quiet_warnings, say
from benchmarks.tiers import NODES, WORLD, node_env, node_roots
from benchmarks.world import gather, launch

CONTENDERS = ("none", "snapshot", "staged")
RANKS_PER_NODE = WORLD // NODES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden", type=int, default=None,
                        help="one model of this width (default: both documented models, MODELS)")
    parser.add_argument("--batch", type=int, default=None, help="samples per step and rank, with --hidden (default 32)")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per contender, with --hidden (default 50)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds (default %(default)s)")
    parser.add_argument("--op-timeout", type=float, default=300, help="seconds one operation may take")
    parser.add_argument("--json", default="bench-results/steps.json", help="results file (default %(default)s)")
    parser.add_argument("--smoke", action="store_true", help="seconds: 8 timed steps, 1 warm-up, 1 round")


# the two models docs/benchmarks.md reports, (hidden, batch, timed steps): the demo's 15 ms step, and a 12.6 MB per
# rank one whose step is about 320 ms here
MODELS = ((64, 32, 50), (2048, 256, 30))


def finish_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.hidden is None and (args.batch is not None or args.steps is not None):
        parser.error("--batch and --steps go with --hidden (without it both documented models run, each its own)")
    args.models = list(MODELS) if args.hidden is None else [(args.hidden, args.batch or 32, args.steps or 50)]
    if args.smoke:  # the demo's model only, a few steps: enough for one snapshot to be taken on a loaded machine
        args.models, args.warmup, args.repeats = [(args.models[0][0], args.models[0][1], 8)], 1, 1
    if (min(min(batch, steps) for _, batch, steps in args.models) < 1 or args.repeats < 1 or args.warmup < 0
            or any(hidden < 2 or hidden % 2 for hidden, _, _ in args.models)):
        parser.error("--steps, --repeats and --batch must be at least 1, --warmup at least 0, --hidden even and >= 2")


class _Job:
    """One rank's model, optimizer and the demo's state (a ``Stateful`` of both)."""

    def __init__(self, hidden: int, batch: int, rank: int) -> None:
        import torch
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        from torch.distributed.checkpoint.stateful import Stateful
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        class TrainState(Stateful):
            def __init__(self, model, optim) -> None:
                self.model, self.optim = model, optim

            def state_dict(self) -> dict:
                model_state, optim_state = get_state_dict(self.model, self.optim)
                return {"model": model_state, "optim": optim_state}

            def load_state_dict(self, state: dict) -> None:
                set_state_dict(self.model, self.optim, model_state_dict=state["model"],
                               optim_state_dict=state["optim"])

        torch.manual_seed(0)
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
        self.model = torch.nn.Sequential(torch.nn.Linear(hidden // 2, hidden), torch.nn.ReLU(),
                                         torch.nn.Linear(hidden, hidden // 2))
        fully_shard(self.model, mesh=mesh)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.state = {"train": TrainState(self.model, self.optim)}
        self.generator = torch.Generator().manual_seed(rank)
        self.batch, self.hidden = batch, hidden

    def step(self, before_update=lambda: None) -> None:
        import torch

        x = torch.randn(self.batch, self.hidden // 2, generator=self.generator)
        loss = self.model(x).pow(2).mean()
        loss.backward()
        before_update()
        self.optim.step()
        self.optim.zero_grad()


def _rank(ctx, plan: dict) -> dict | None:
    import torch.distributed as dist

    from dcp_atomic import CheckpointManager, MemoryTier, Staging

    quiet_warnings()
    node = ctx.rank // RANKS_PER_NODE
    job = _Job(plan["hidden"], plan["batch"], ctx.rank)
    step = 0
    mine: dict[str, list[dict]] = {name: [] for name in CONTENDERS}

    def manager(run: str, staged: bool):
        memory = MemoryTier(os.path.join(plan["nodes"][node], run), every=1, replicas=1, slots=2)
        staging = Staging(pool_bytes=4 * MiB, window_bytes=MiB) if staged else None
        return CheckpointManager(plan["disk"], run, memory=memory, staging=staging, timeout=plan["op_timeout"])

    for index in range(plan["repeats"]):
        for name in CONTENDERS if index % 2 == 0 else CONTENDERS[::-1]:
            run = f"{name}-{index}"
            if ctx.rank % RANKS_PER_NODE == 0 and name != "none":
                os.makedirs(os.path.join(plan["nodes"][node], run), exist_ok=True)
            dist.barrier()
            row: dict = {}
            with contextlib.ExitStack() as stack:
                m = None if name == "none" else stack.enter_context(manager(run, name == "staged"))
                before = m.wait_staged if name == "staged" else (lambda: None)
                futures, timed = [], 0.0
                for n in range(plan["warmup"] + plan["steps"]):
                    step += 1
                    started = time.perf_counter()
                    job.step(before)
                    if m is not None:
                        futures.append(m.snapshot(step, job.state))
                    if n >= plan["warmup"]:
                        timed += time.perf_counter() - started
                row["step_seconds"] = timed / plan["steps"]
                if m is not None:
                    m.wait()
                    taken = sum(f.result() is not None for f in futures[plan["warmup"]:])
                    row.update(taken=taken, skipped=plan["steps"] - taken)
                    step += 1  # one more, untimed and waited for: the step the check restores
                    job.step(before)
                    assert m.snapshot(step, job.state).result() == step
                    reference = _cloned(job.state["train"].state_dict())
            if m is not None:
                fresh_job = _Job(plan["hidden"], plan["batch"], ctx.rank)
                with manager(run, False) as fresh:
                    assert fresh.load(fresh_job.state) == step, fresh.restored_from
                assert_bit_exact(reference, fresh_job.state["train"].state_dict(), f"rank {ctx.rank}, {run}")
                dist.barrier()  # the node's memory back for the next round
                if ctx.rank % RANKS_PER_NODE == 0:
                    shutil.rmtree(os.path.join(plan["nodes"][node], run))
            mine[name].append(row)
    everyone = gather(mine)
    return everyone if ctx.rank == 0 else None


def _cloned(tree):
    """The state's tensors copied (the bit-exact check's reference: training goes on changing the live ones)."""
    import torch

    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {key: _cloned(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [_cloned(value) for value in tree]
    return tree


def run(args: argparse.Namespace) -> dict:
    load_before = os.getloadavg()
    models = [_run_model(args, hidden, batch, steps) for hidden, batch, steps in args.models]
    if report.SMOKE:
        print("(--smoke: a few steps; the numbers say nothing)")
    return {"models": models, "environment": {**report.environment(), "loadavg_before": load_before}}


def _run_model(args: argparse.Namespace, hidden: int, batch: int, steps: int) -> dict:
    """One model's world, its table printed; its config, summary and per-rank rows."""
    load_before = os.getloadavg()
    with contextlib.ExitStack() as stack:
        # a node's 2 ranks hold 2 slots of their own and 2 replicas of the other node's: 4 x the state's half, with
        # AdamW's two moments 3 x the parameters' fp32 bytes (about hidden^2 of them)
        nodes, how = stack.enter_context(node_roots(48 * hidden ** 2 + 64 * MiB))
        disk = stack.enter_context(tempfile.TemporaryDirectory(prefix="dcp-steps-durable-", dir="/var/tmp"))
        say(f"steps: world {WORLD} as {NODES} nodes, the demo's model at hidden {hidden}, batch {batch}, "
            f"{steps} timed steps per contender, {args.repeats} round(s); memory paths: {how}")
        plan = {"hidden": hidden, "batch": batch, "steps": steps, "warmup": args.warmup,
                "repeats": args.repeats, "nodes": nodes, "disk": disk, "op_timeout": args.op_timeout}
        per_rank = launch(_rank, WORLD, disk, args=(plan,), op_timeout=args.op_timeout,
                          ops=args.repeats * len(CONTENDERS) * (steps + args.warmup + 4) + 4, rank_env=node_env)
    rows = {}
    for name in CONTENDERS:
        slowest = [max(rank[name][r]["step_seconds"] for rank in per_rank) for r in range(args.repeats)]
        rows[name] = {"step_seconds": statistics.median(slowest), "runs": slowest}
        if name != "none":
            rows[name].update(taken=[r["taken"] for r in per_rank[0][name]],
                              skipped=[r["skipped"] for r in per_rank[0][name]])
    base = rows["none"]["step_seconds"]
    print(f"\nstep time, world {WORLD} as {NODES} nodes, the demo's model at hidden {hidden}, batch {batch}, "
          f"{steps} timed steps, median of {args.repeats} (slowest rank's mean step); load average "
          f"{load_before[0]:.2f} at the start, {os.getloadavg()[0]:.2f} at the end")
    print("| contender | step ms | overhead | snapshots taken / skipped (rank 0, per round) |")
    print("|---|---|---|---|")
    for name, row in rows.items():
        row["overhead"] = row["step_seconds"] / base - 1 if base else None
        counts = "" if name == "none" else ", ".join(f"{t}/{s}" for t, s in zip(row["taken"], row["skipped"]))
        print(f"| {name} | {row['step_seconds'] * 1000:.2f} | {report.fmt(row['overhead'] * 100, '+.0f')}% | "
              f"{counts} |")
    return {"config": {"world": WORLD, "nodes": NODES, "hidden": hidden, "batch": batch, "steps": steps,
                       "warmup": args.warmup, "repeats": args.repeats, "tmpfs": how, "smoke": args.smoke},
            "loadavg": [load_before[0], os.getloadavg()[0]], "summary": rows, "per_rank": per_rank}
