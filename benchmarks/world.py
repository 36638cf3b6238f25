"""The one world launcher (the tests' own, from testbed/) and the measured save / load round every world scenario runs.

A scenario's rank function runs inside ``testbed.worlds.run_world`` (forkserver with torch preloaded,
one gloo process group, hard timeout, ``killpg`` cleanup): it builds its state once and loops over its
contenders and repeats itself, so process start-up is never timed.  Each rank times an operation between
two barriers; :func:`gather` brings every rank's numbers to rank 0, which prints progress and returns
the records.  Rank functions must be module-level (they travel to the workers by reference).
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch.distributed as dist

from benchmarks.common import BenchError, PeakRss, assert_bit_exact, bytes_on_disk, clear, drop_caches
from benchmarks.contenders import Contenders, checkpoint_path


def launch(fn: Callable, world: int, root: str, *, args: tuple = (), op_timeout: float, ops: int,
           rank_env: Callable[[int], dict[str, str]] | None = None) -> Any:
    """Run ``fn(ctx, *args)`` on a fresh world of ``world`` ranks (one node, else the nodes ``rank_env`` gives each
    rank); rank 0's return value, or BenchError naming every failed rank.  ``op_timeout`` bounds one collective,
    ``ops * op_timeout`` the whole world."""
    from testbed.worlds import run_world

    outcomes = run_world(fn, world, root, args=args, env={"LOCAL_WORLD_SIZE": str(world)}, rank_env=rank_env,
                         timeout=op_timeout * max(1, ops) + 60, pg_timeout=op_timeout)
    failed = [o for o in outcomes if not o.ok]
    if failed:
        raise BenchError("\n".join(f"rank {o.rank} of world {world}: {o.error_type} (exit {o.exitcode}): {o.error}"
                                   for o in failed))
    return outcomes[0].value


def gather(value: Any) -> list[Any]:
    """Every rank's ``value``, on every rank (a collective: call it on all ranks)."""
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def measured(fn: Callable[[], dict | None]) -> dict:
    """Wall and CPU seconds and peak RSS growth of ``fn`` on this rank, between two barriers."""
    dist.barrier()
    with PeakRss() as rss:
        started, cpu_started = time.perf_counter(), time.process_time()
        extra = fn() or {}
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    dist.barrier()
    return {"seconds": seconds, "cpu_seconds": cpu, "rss_extra": rss.extra, "rss_method": rss.method, **extra}


@dataclass
class Progress:
    """Operations done of ``total``, since ``started`` (``time.monotonic``: the same clock in every process)."""

    total: int
    started: float
    done: int = 0

    def stamp(self) -> str:
        elapsed = time.monotonic() - self.started
        if self.done:
            eta = elapsed / self.done * max(0, self.total - self.done)
            return f"[{elapsed:5.0f}s, {self.done}/{self.total} ops, ~{eta:.0f}s left]"
        return f"[{elapsed:5.0f}s]"


def save_and_load(rank: int, contenders: Contenders, name: str, where: str, number: int, *, verify: bool,
                  cold: bool, progress: Progress) -> dict | None:
    """One save, its warm load (checked bit-exact when ``verify``) and, when ``cold``, a load after dropping
    the page cache; then the checkpoint is deleted.  Rank 0 gets every rank's numbers, the others None."""
    save = gather(measured(lambda: contenders.save(name, where, number)))
    path = checkpoint_path(name, where, number)
    stored = bytes_on_disk(path) if rank == 0 else 0
    control = bytes_on_disk(path, control_only=True) if rank == 0 else 0
    if verify:
        clear(contenders.target)
    warm = gather(measured(lambda: contenders.load(name, where, number)))
    if verify:
        assert_bit_exact(contenders.state, contenders.target)
    cold_load = None
    if cold:
        if rank == 0:
            drop_caches()
        cold_load = gather(measured(lambda: contenders.load(name, where, number)))
    progress.done += 3 if cold else 2
    if rank != 0:
        return None
    shutil.rmtree(where, ignore_errors=True)  # the next operation starts with a barrier
    return {"save": save, "warm": warm, "cold": cold_load, "bytes_on_disk": stored, "control_bytes": control,
            "verified": verify}
