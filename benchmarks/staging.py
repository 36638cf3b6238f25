"""Bounded staging (P16): ``CheckpointManager.async_save`` with ``Staging`` against without it, one world.

What it measures
    A world of ``--world`` ranks (default 2), each holding ``--state-mb`` MiB (default 512) of fp32 tensors of
    ``--tensor-mb`` MiB under keys of its own.  Per contender, ``--repeats`` saves (default 3) into a root on tmpfs
    (``/dev/shm``; the storage is not what is measured), each timed on every rank:

    staged  ``CheckpointManager(..., staging=Staging(pool_bytes=--pool-mb, window_bytes=--window-mb))``
    stock   the same manager without ``staging``: DCP copies the state to host memory at the call

    call = ``async_save``'s blocking time; wait_staged = ``manager.wait_staged()`` right after the call (the
    training loop's stall before ``optimizer.step()``; stock: nothing to wait for, its copy was made at the call);
    committed = from the call to the future's result; RSS = the rank's peak resident-set growth over that span
    (VmHWM after ``clear_refs``: exact).  Then the newest step is loaded into zeroed tensors and checked bit-exact.

What the numbers mean
    Medians over the repeats, the slowest rank's time and the largest rank's RSS.  Target (issue 43): the staged
    RSS growth <= pool + 32 MiB, where stock grows by the state.  The staged call copies only the eager items, and
    wait_staged lasts until the rank's writer has read its tensors (here: written them to tmpfs), the cost that
    stock pays inside the call instead.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

from benchmarks import report
from benchmarks.common import MiB, PeakRss, assert_bit_exact, quiet_warnings, say, zeroed_like
from benchmarks.world import gather, launch

TARGET_SLACK_MIB = 32  # issue 43: staged RSS growth <= pool + 32 MiB


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world", type=int, default=2, help="ranks (default %(default)s)")
    parser.add_argument("--state-mb", type=int, default=512, help="state per rank, MiB (default %(default)s)")
    parser.add_argument("--tensor-mb", type=int, default=32, help="one tensor, MiB (default %(default)s)")
    parser.add_argument("--pool-mb", type=int, default=64, help="Staging.pool_bytes, MiB (default %(default)s)")
    parser.add_argument("--window-mb", type=int, default=16, help="Staging.window_bytes, MiB (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="saves per contender (default %(default)s)")
    parser.add_argument("--root", default=None, help="checkpoint root (default: a directory on /dev/shm)")
    parser.add_argument("--json", default="bench-results/staging.json", help="results file (default %(default)s)")
    parser.add_argument("--op-timeout", type=float, default=600, help="seconds one operation may take")
    parser.add_argument("--smoke", action="store_true", help="seconds: 32 MiB per rank, pool 8 MiB, one save each")


def finish_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.smoke:
        args.state_mb, args.tensor_mb, args.pool_mb, args.window_mb, args.repeats = 32, 8, 8, 2, 1
    if args.world < 1 or args.repeats < 1 or min(args.state_mb, args.tensor_mb, args.window_mb) < 1:
        parser.error("--world, --repeats, --state-mb, --tensor-mb and --window-mb must be at least 1")
    if args.pool_mb < args.window_mb:
        parser.error("--pool-mb must hold at least one window (--window-mb)")


def _state(rank: int, state_mb: int, tensor_mb: int) -> dict:
    import torch

    generator = torch.Generator().manual_seed(rank)
    count = max(1, state_mb // tensor_mb)
    return {f"rank{rank}": {f"w{i}": torch.randn(tensor_mb * MiB // 4, generator=generator) for i in range(count)}}


def _rank(ctx, config: dict) -> dict:
    """Both contenders on this rank; every rank's rows, gathered."""
    import torch.distributed as dist

    from dcp_atomic import CheckpointManager, Staging

    quiet_warnings()
    state = _state(ctx.rank, config["state_mb"], config["tensor_mb"])
    staging = Staging(pool_bytes=config["pool_mb"] * MiB, window_bytes=config["window_mb"] * MiB)
    mine = {}
    for name, option in (("staged", staging), ("stock", None)):
        rows = []
        with CheckpointManager(config["root"], f"bench-{name}", staging=option, keep_last=1,
                               timeout=config["op_timeout"]) as manager:
            for step in range(1, config["repeats"] + 1):
                dist.barrier()
                with PeakRss() as rss:
                    started = time.perf_counter()
                    future = manager.async_save(step, state)
                    call = time.perf_counter() - started
                    waited = manager.wait_staged()
                    future.result()
                    committed = time.perf_counter() - started
                rows.append({"call": call, "wait_staged": waited, "committed": committed, "rss": rss.extra})
            loaded = zeroed_like(state)
            manager.load(loaded)
            assert_bit_exact(state, loaded, f"rank {ctx.rank}, {name}")
        mine[name] = rows
    return gather(mine)


def _summary(per_rank: list[dict], contender: str) -> dict:
    """Per repeat: the slowest rank's times, the largest rank's RSS; then medians."""
    repeats = len(per_rank[0][contender])
    worst = [{metric: max(rank[contender][k][metric] for rank in per_rank) for metric in per_rank[0][contender][k]}
             for k in range(repeats)]
    return {metric: statistics.median(row[metric] for row in worst) for metric in worst[0]}


def run(args: argparse.Namespace) -> dict:
    root = args.root or tempfile.mkdtemp(prefix="dcp-atomic-staging-",
                                         dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    config = {"root": root, "state_mb": args.state_mb, "tensor_mb": args.tensor_mb, "pool_mb": args.pool_mb,
              "window_mb": args.window_mb, "repeats": args.repeats, "op_timeout": args.op_timeout}
    say(f"staging: world {args.world}, {args.state_mb} MiB per rank, pool {args.pool_mb} MiB, "
        f"windows {args.window_mb} MiB, {args.repeats} save(s) per contender, root {root}")
    try:
        per_rank = launch(_rank, args.world, root, args=(config,), op_timeout=args.op_timeout,
                          ops=4 * args.repeats + 4)
    finally:
        if args.root is None:  # tmpfs is memory: never leave a run behind
            shutil.rmtree(root, ignore_errors=True)
    summary = {name: _summary(per_rank, name) for name in ("staged", "stock")}
    print(f"\nasync_save, world {args.world}, {args.state_mb} MiB per rank, pool {args.pool_mb} MiB "
          f"(medians of {args.repeats}; slowest rank's time, largest rank's RSS; loads bit-exact)")
    print(f"{'contender':<10} {'call s':>8} {'wait_staged s':>14} {'committed s':>12} {'peak RSS +MiB':>14}")
    for name, row in summary.items():
        print(f"{name:<10} {row['call']:>8.3f} {row['wait_staged']:>14.3f} {row['committed']:>12.3f} "
              f"{row['rss'] / MiB:>14.1f}")
    limit = (args.pool_mb + TARGET_SLACK_MIB) * MiB
    check = report.check("staged RSS growth <= pool + 32 MiB", summary["staged"]["rss"] / MiB, limit / MiB,
                         higher_is_better=False, note=f"MiB; stock: {summary['stock']['rss'] / MiB:.0f}")
    report.print_targets([check])
    return {"config": {k: v for k, v in config.items() if k != "root"} | {"world": args.world},
            "environment": report.environment(), "staging": summary, "per_rank": per_rank, "targets": [check]}
