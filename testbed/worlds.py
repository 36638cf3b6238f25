"""Real process-group worlds for the tests and the benchmarks: gloo on CPU, hard timeouts, no orphans.

``run_world(fn, world_size, ...)`` starts ``world_size`` processes from a
forkserver that has torch preloaded (~0.1 s per rank instead of ~1.5 s), each in
its own session so one ``killpg`` ends it and everything it started.  Each rank
initialises a gloo process group, runs ``fn(ctx, *args)`` and sends back its
return value or the exception it raised.  A rank may be SIGKILLed or
SIGSTOPped (failpoints); the harness still returns within ``timeout`` and kills
whatever is left.  Workers also exit on their own if the test runner dies.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

from testbed.ports import free_port

_CTX = mp.get_context("forkserver")
# How long ranks may take to join the world: on a loaded machine (load average 20 on 2 cores) four ranks have taken
# over 6 s to start, and a world whose pg_timeout is short on purpose (a kill test) must not fail its rendezvous.
JOIN_TIMEOUT_S = 120.0
# What the forkserver imports once, so that each rank it forks has it already: the manager's layers and, where a rank
# builds an optimizer, torch._dynamo (torch.optim's constructors import it: 0.5 s of CPU a rank); ranks on S3 import
# s3fs/boto3; the test suite adds pytest (:func:`preload`: every rank imports a test module).  Measured on
# tests/manager + tests/dcp "not slow" (-n 4, 2 cores): 121 s of CPU and 62 s of wall time with torch and dcp_atomic
# alone preloaded, 80 s and 44 s with these.  A module that is not installed is skipped (multiprocessing ignores its
# ImportError).
PRELOAD = ["torch", "torch.distributed.checkpoint", "torch._dynamo", "torch.distributed.fsdp",
           "torch.distributed.tensor", "dcp_atomic", "dcp_atomic.manager.checkpoint_manager",
           "dcp_atomic.memory.snapshots", "s3fs", "boto3", "testbed.worlds"]
_CTX.set_forkserver_preload(PRELOAD)


def preload(*modules: str) -> None:
    """Add ``modules`` to what the forkserver imports; before the first world starts (later, it changes nothing)."""
    _CTX.set_forkserver_preload([*PRELOAD, *modules])


@dataclass
class RankContext:
    """What a rank function gets: its rank, the world size and the test's scratch paths."""

    rank: int
    world_size: int
    root: str
    extra: dict = field(default_factory=dict)


@dataclass
class Outcome:
    rank: int
    value: Any = None
    error_type: str | None = None
    error: str | None = None
    exitcode: int | None = None
    error_chain: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error_type is None and self.exitcode == 0

    @property
    def killed(self) -> bool:
        return self.exitcode is not None and self.exitcode < 0




def _describe_chain(exc: BaseException) -> list[str]:
    """Type names of the exception and of everything DCP wrapped inside it."""
    if isinstance(exc, tuple):  # DCP wraps a rank's failure as (exception, traceback)
        exc = exc[0]
    if not isinstance(exc, BaseException):
        return [type(exc).__name__]
    names = [type(exc).__name__]
    failures = getattr(exc, "failures", None)  # CheckpointException: {rank: wrapped exception}
    if isinstance(failures, dict):
        for inner in failures.values():
            names += _describe_chain(inner)
    for inner in (exc.__cause__, exc.__context__):
        if inner is not None and inner is not exc:
            names.append(type(inner).__name__)
    return names


def _watch_parent(parent_pid: int, hard_timeout: float) -> None:
    deadline = time.monotonic() + hard_timeout
    while time.monotonic() < deadline:
        if os.getppid() != parent_pid:
            os._exit(97)
        time.sleep(0.2)
    os._exit(98)


def _send(conn, outcome: Outcome) -> None:
    """Tensors by value (torch.save), not by shared-memory handle: the sender exits right away."""
    import torch

    buffer = io.BytesIO()
    torch.save(outcome, buffer)
    conn.send_bytes(buffer.getvalue())


def _receive(conn) -> Outcome:
    import torch

    return torch.load(io.BytesIO(conn.recv_bytes()), weights_only=False)


def _rank_main(fn, rank, world_size, port, env, root, extra, pg_timeout, hard_timeout, conn, args) -> None:
    os.setsid()
    threading.Thread(target=_watch_parent, args=(os.getppid(), hard_timeout), daemon=True).start()
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
    os.environ.update({k: v for k, v in env.items() if v is not None})
    for k in [k for k, v in env.items() if v is None]:
        os.environ.pop(k, None)
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    from dcp_atomic._base import failpoints

    torch.set_num_threads(1)
    failpoints.load_from_env()
    try:
        if world_size > 0:
            # The store is made here, with a joining timeout of its own; once every rank is in, it gets pg_timeout,
            # as init_method="tcp://" would have given it, so what a test times after the join is unchanged.
            store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0,
                                  timeout=timedelta(seconds=max(pg_timeout, JOIN_TIMEOUT_S)))
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=pg_timeout))
            store.set_timeout(timedelta(seconds=pg_timeout))
        value = fn(RankContext(rank, world_size, root, extra), *args)
        _send(conn, Outcome(rank, value=value))
    except BaseException as e:  # noqa: BLE001 - report everything to the test
        _send(
            conn,
            Outcome(rank, error_type=type(e).__name__, error=f"{e}\n{traceback.format_exc()}",
                    error_chain=_describe_chain(e)),
        )
    finally:
        conn.close()
        # Skip destroy_process_group: with a dead peer it can block; the OS cleans up.
        sys.stdout.flush()
        os._exit(0)


def run_world(
    fn: Callable,
    world_size: int,
    root: str,
    *,
    args: tuple = (),
    env: dict[str, str | None] | None = None,
    rank_env: Callable[[int], dict[str, str | None]] | None = None,
    extra: dict | None = None,
    timeout: float = 90.0,
    pg_timeout: float = 30.0,
    no_process_group: bool = False,
    wait_for: list[int] | None = None,
) -> list[Outcome]:
    """Run ``fn`` on every rank of a fresh gloo world; return one Outcome per rank.

    ``env`` applies to all ranks, ``rank_env(rank)`` per rank (a value of None
    removes the variable).  ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` are set to
    the true values unless overridden.  ``wait_for`` lists the ranks whose
    answer ends the run (default: all); the others (say, a SIGSTOPped rank) are
    killed then.  The world is always torn down.
    """
    port = free_port()
    procs, conns = [], []
    for rank in range(world_size):
        rank_environment = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank)}
        rank_environment.update(env or {})
        rank_environment.update(rank_env(rank) if rank_env else {})
        parent, child = _CTX.Pipe(duplex=False)
        p = _CTX.Process(
            target=_rank_main,
            args=(fn, rank, 0 if no_process_group else world_size, port, rank_environment, root, extra or {},
                  pg_timeout, timeout + 30, child, args),
        )
        p.start()
        child.close()
        procs.append(p)
        conns.append(parent)
    outcomes: list[Outcome | None] = [None] * world_size
    deadline = time.monotonic() + timeout
    try:
        pending = set(range(world_size))
        awaited = set(range(world_size) if wait_for is None else wait_for)
        while pending & awaited and time.monotonic() < deadline:
            for rank in list(pending):
                conn, proc = conns[rank], procs[rank]
                if conn.poll(0.05):
                    try:
                        outcomes[rank] = _receive(conn)
                    except EOFError:
                        outcomes[rank] = Outcome(rank, error_type="NoResult", error="rank closed its pipe without a result")
                    pending.discard(rank)
                elif not proc.is_alive() and not conn.poll(0):
                    outcomes[rank] = Outcome(rank, error_type="ProcessDied", error=f"exit code {proc.exitcode}")
                    pending.discard(rank)
        for rank in pending:
            late = rank in awaited
            outcomes[rank] = Outcome(rank, error_type="HarnessTimeout" if late else "NotAwaited",
                                     error=f"no result within {timeout}s" if late else "not awaited")
        for p in procs:  # ranks that answered exit on their own right after
            p.join(max(0.0, min(5.0, deadline - time.monotonic())))
    finally:
        for p in procs:
            if p.is_alive() and p.pid:
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    try:
                        os.killpg(p.pid, sig)
                    except ProcessLookupError:
                        pass
        for p in procs:
            p.join(10)
        for c in conns:
            c.close()
    for rank, p in enumerate(procs):
        outcomes[rank].exitcode = p.exitcode  # type: ignore[union-attr]
    return outcomes  # type: ignore[return-value]

