"""CheckpointManager step resolution and late ranks (G5, G10, G14): step resolution,
slow rank 0 before a resolve, Ctrl-C during wait(), ranks asking for different steps, a late caller,
and store keys left behind.  Real gloo worlds of two ranks, tiny state dicts."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from dcp_atomic import CheckpointError, CheckpointManager, CheckpointNotFoundError, list_steps
from tests.harness import assert_all_ok, run_world

pytestmark = pytest.mark.slow

RUN = "exp"


def _state(rank: int, step: int) -> dict:
    return {f"r{rank}": torch.full((8,), float(step)), "shared": torch.arange(4.0) * step}


def _target(rank: int) -> dict:
    return {k: torch.zeros_like(v) for k, v in _state(rank, 0).items()}


def _outcome(call):
    """(error class or "ok", message or value, seconds, RankFailureError's silent ranks)."""
    started = time.monotonic()
    try:
        value = call()
    except Exception as e:  # noqa: BLE001 - the type is what the tests assert
        return (type(e).__name__, str(e), time.monotonic() - started, getattr(e, "details", {}).get("silent"))
    return ("ok", value, time.monotonic() - started, None)


# -- resolving the step to load; no store key per operation ----------------------------


def _operation_keys(store, manager) -> list[str]:
    """The liveness keys of every operation so far that are still in the store (the store cannot list keys,
    and its key count moves with torch's own keys)."""
    names = ["ended", "0", "1"] + [f"{phase}/{leaf}" for phase in ("plan", "write", "read", "check", "resolve")
                                   for leaf in ("count", "abandoned", "0", "1")]
    keys = [f"{manager._heartbeat.prefix}/op{op}/{name}" for op in range(1, manager._ops + 1) for name in names]
    return [key for key in keys if store.check([key])]


def _resolve_job(ctx, timeout):
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    manager = CheckpointManager(ctx.root, RUN, timeout=timeout, thread_count=1)
    seen: dict = {}
    manager.save(1, _state(ctx.rank, 1))
    manager.save(2, _state(ctx.rank, 2))
    manager.async_save(3, _state(ctx.rank, 3)).result()
    manager.wait()
    seen["ops"] = [manager.load(_target(ctx.rank)), manager.load(_target(ctx.rank), step=1), manager.steps(),
                   manager.latest_step()]
    dist.barrier()
    seen["keys_left"] = _operation_keys(store, manager)

    seen["missing"] = _outcome(lambda: manager.load(_target(ctx.rank), step=77))
    if ctx.rank == 0:  # a crashed save of step 5: its directory exists, its marker never will
        os.makedirs(os.path.join(ctx.root, RUN, "step_0000000005", "crashed-attempt"))
    dist.barrier()
    seen["uncommitted"] = _outcome(lambda: manager.load(_target(ctx.rank), step=5))
    seen["mismatch"] = _outcome(lambda: manager.load(_target(ctx.rank), step=1 + ctx.rank))
    seen["after"] = _outcome(lambda: manager.load(_target(ctx.rank)))  # the manager's groups are still usable
    manager.close()
    return seen


def test_load_resolution_errors_are_typed_prompt_and_agreed_and_operations_leave_no_store_keys(root):
    timeout = 3.0
    results = assert_all_ok(run_world(_resolve_job, 2, root, args=(timeout,), timeout=90))
    for rank, seen in enumerate(results):
        assert seen["ops"] == [3, 1, [1, 2, 3], 3], (rank, seen)
        assert seen["keys_left"] == [], (rank, seen)  # no store key per operation
        kind, message, seconds, _ = seen["missing"]  # no directory -> not found at once, on every rank
        assert kind == "CheckpointNotFoundError" and "step 77" in message and seconds < timeout / 2, (rank, seen)
        kind, message, _, _ = seen["uncommitted"]  # rank 0's wait for the marker is waited for
        assert kind == "CheckpointNotFoundError" and "step 5" in message, (rank, seen)
        kind, message, _, _ = seen["mismatch"]  # ranks asking for different steps
        assert kind == "RankConsistencyError" and "rank(s) 0: step 1" in message and "rank(s) 1: step 2" in message, \
            (rank, seen)
        assert seen["after"][:2] == ("ok", 3), (rank, seen)


def test_a_missing_step_is_not_found_at_once_in_one_process(root):
    from tests.fault_fixtures import watched_reads

    timeout = 60.0
    manager = CheckpointManager(root, RUN, timeout=timeout)
    manager.save(1, _state(0, 1))
    started = time.monotonic()
    with watched_reads() as reads, pytest.raises(CheckpointNotFoundError, match="step 77"):
        manager.load(_target(0), step=77)
    # At once: the marker of step 77 is never waited for (read at most once), far inside the timeout.
    assert len(reads.of(os.path.join(root, RUN, "step_0000000077", "COMMITTED"))) <= 1, reads.events
    assert time.monotonic() - started < timeout / 4
    manager.close()


# -- rank 0 still busy after a save is waited for by the next resolve --------------------------


def _slow_bookkeeping_job(ctx, timeout):
    manager = CheckpointManager(ctx.root, RUN, timeout=timeout, thread_count=1)
    if ctx.rank == 0:  # deleting old steps after each commit takes longer than timeout (busy NFS server)
        retention = manager._saves._retention

        def slow_retention(*args, **kwargs):
            time.sleep(2 * timeout + 1)
            return retention(*args, **kwargs)

        manager._saves._retention = slow_retention
    manager.save(1, _state(ctx.rank, 1))
    steps = manager.steps()
    manager.save(2, _state(ctx.rank, 2))
    loaded = manager.load(_target(ctx.rank))
    manager.save(3, _state(ctx.rank, 3))
    latest = manager.latest_step()
    manager.close()
    return [steps, loaded, latest]


def test_rank0_slower_than_timeout_after_a_save_does_not_fail_steps_load_or_latest_step(root):
    results = assert_all_ok(run_world(_slow_bookkeeping_job, 2, root, args=(2.0,), timeout=90))
    assert results == [[[1], 2, 3]] * 2


# -- Ctrl-C during wait() keeps the save; close() waits for it and raises its failure ----------


class _CtrlCInWait:
    """Ctrl-C while the main thread waits for the save, with nothing racing the save: the manager's wait, entered
    from :meth:`interrupted`, first sends SIGINT to the main thread, whose handler raises the KeyboardInterrupt
    inside that wait.  (A writer held at a failpoint that sent the signal raced the save it belongs to: in the
    failing save, a loaded rank 0 learnt of rank 1's failure before its writer reached the failpoint, and its wait
    returned the failure with no Ctrl-C at all.)  A writer that reaches the failpoint is held there until the
    interrupt was caught, so a save is still in flight when Ctrl-C lands (bounded: nothing waits forever)."""

    def __init__(self) -> None:
        import concurrent.futures

        self.armed = False
        self.caught = threading.Event()
        real = concurrent.futures.wait

        def wait(fs, *args, **kwargs):
            if self.armed and threading.current_thread() is threading.main_thread():
                self.armed = False
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            return real(fs, *args, **kwargs)

        concurrent.futures.wait = wait  # in this rank's process: the manager waits through the module attribute

    def saving(self) -> None:
        """Before a save: its writer will be held at the failpoint until this save's wait is interrupted."""
        self.caught.clear()

    def at_failpoint(self, rank, step) -> None:
        self.caught.wait(30)

    def interrupted(self, call) -> str:
        try:
            self.armed = True
            call()
            return "returned"
        except KeyboardInterrupt:
            self.caught.set()
            return "interrupted"
        finally:
            self.armed = False


def _interrupted_wait_job(ctx):
    from dcp_atomic._base import failpoints

    seen: dict = {}
    # Ctrl-C as a Python program gets it: a suite started in the background (`cmd &` in a script) inherits SIGINT
    # ignored, down to these ranks, and no KeyboardInterrupt would ever come (this test then failed every time)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    ctrl_c = _CtrlCInWait()
    failpoints.arm("write.mid_data", ctrl_c.at_failpoint)
    manager = CheckpointManager(ctx.root, RUN, timeout=10, thread_count=1)
    ctrl_c.saving()
    future = manager.async_save(1, _state(ctx.rank, 1))
    seen["wait"] = ctrl_c.interrupted(manager.wait)
    seen["close"] = _outcome(manager.close)[:2]
    seen["done_at_close"] = future.done()
    seen["steps"] = list_steps(ctx.root, RUN)

    if ctx.rank == 1:
        failpoints.arm("write.after_data", "raise", rank=1)
    failing = CheckpointManager(ctx.root, RUN, timeout=10, thread_count=1)
    ctrl_c.saving()
    failing.async_save(2, _state(ctx.rank, 2))
    seen["failing_wait"] = ctrl_c.interrupted(failing.wait)
    try:
        failing.close()
        seen["failing_close"] = "returned"
    except CheckpointError as e:  # typed, whichever subclass the writer chose
        seen["failing_close"] = str(e)
    seen["failing_steps"] = list_steps(ctx.root, RUN)
    return seen


def test_ctrl_c_during_wait_keeps_the_save_and_close_waits_for_it_and_raises_its_failure(root):
    results = assert_all_ok(run_world(_interrupted_wait_job, 2, root, timeout=90))
    for rank, seen in enumerate(results):
        assert seen["wait"] == "interrupted" and seen["failing_wait"] == "interrupted", (rank, seen)
        assert seen["close"] == ("ok", None) and seen["done_at_close"], (rank, seen)
        assert seen["steps"] == [1], (rank, seen)
        assert "saving step 2" in seen["failing_close"] and "injected I/O error" in seen["failing_close"], (rank, seen)
        assert seen["failing_steps"] == [1], (rank, seen)


# -- a rank that enters a call more than timeout late knows it was the late one ----------------


def _late_caller_job(ctx, timeout):
    import torch.distributed as dist

    seen: dict = {}
    manager = CheckpointManager(ctx.root, RUN, timeout=timeout, work_timeout=600, thread_count=1)
    if ctx.rank == 1:  # a longer evaluation on this rank before the save
        time.sleep(3 * timeout)
    seen["save"] = _outcome(lambda: manager.save(1, _state(ctx.rank, 1)))
    dist.barrier()  # the ranks failed at different times; a new manager's groups need both at once
    second = CheckpointManager(ctx.root, RUN, timeout=timeout, work_timeout=600, thread_count=1)
    second.save(2, _state(ctx.rank, 2))
    if ctx.rank == 1:
        time.sleep(3 * timeout)
    seen["async_save"] = _outcome(lambda: second.async_save(3, _state(ctx.rank, 3)).result())
    dist.barrier()  # rank 0's process hosts the store: it stays until rank 1 is done
    return seen


def test_a_rank_entering_a_save_more_than_timeout_late_is_told_it_was_late_and_peers_name_it(root):
    timeout = 2.0
    results = assert_all_ok(run_world(_late_caller_job, 2, root, args=(timeout,), timeout=120))
    for call in ("save", "async_save"):
        kind, message, _, silent = results[0][call]
        assert kind == "RankFailureError" and silent.startswith("1 ") and "within timeout" in message, (call, results)
        kind, message, _, silent = results[1][call]
        assert kind == "RankFailureError" and "late" in silent and "after rank(s) 0" in message, (call, results)
    assert list_steps(root, RUN) == [2]
