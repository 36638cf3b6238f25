"""The cyclic GC's pause spans a whole save or load, and never outlives it (:mod:`dcp_atomic._base.gc_pause`).

Real gloo worlds of 2 ranks: the collector is paused while DCP's collectives unpickle plans between our hooks,
and it is on again after a successful save and load, after a save that fails between hooks (a peer raising in
its planner, a storage error in a peer's ``write_data``, a failed commit on the coordinator) within the lease's
bound, after the next operation
when a failed one left its lease, and once both an async save and an overlapping load have ended; a user who
disabled the collector keeps it disabled throughout.  The bounds waited for are the configured
``LEASE_SECONDS`` plus a margin for a loaded machine, never tighter.
"""

from __future__ import annotations

import gc
import pickle
import threading
import time

import pytest
import torch

from dcp_atomic._base import gc_pause
from tests.harness import assert_all_ok, run_world

RUN = "gc"
MARGIN = 20.0  # seconds a loaded 2-core machine may add to a watchdog's wake-up; never asserted as an upper bound


def _state(rank: int) -> dict[str, torch.Tensor]:
    return {f"rank{rank}.t{i}": torch.full((8,), float(rank * 100 + i)) for i in range(16)} | {
        f"shared.t{i}": torch.arange(4.0) + i for i in range(8)
    }


def _save(ctx, step: int, planner=None, writer=None, **kwargs):
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicSavePlanner, AtomicStorageWriter

    writer = writer or AtomicStorageWriter(ctx.root, RUN, step, timeout=30)
    return dcp.save(_state(ctx.rank), storage_writer=writer, planner=planner or AtomicSavePlanner(), **kwargs)


def _load(ctx, step: int, **kwargs) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicLoadPlanner, AtomicStorageReader

    state = {k: torch.zeros_like(v) for k, v in _state(ctx.rank).items()}
    dcp.load(state, storage_reader=AtomicStorageReader(ctx.root, RUN, step, timeout=30),
             planner=AtomicLoadPlanner(), **kwargs)
    assert all(torch.equal(state[k], v) for k, v in _state(ctx.rank).items())
    return state


def _watch_unpickling() -> list[bool]:
    """Whether the collector was on in each of DCP's unpickles (every object collective goes through it)."""
    import torch.distributed.distributed_c10d as c10d

    seen: list[bool] = []
    original = c10d._tensor_to_object

    def observed(*args, **kwargs):
        seen.append(gc.isenabled())
        return original(*args, **kwargs)

    c10d._tensor_to_object = observed
    return seen


def _wait_for_collector(bound: float) -> float:
    """Seconds until the collector is on again (polled); raises past ``bound``."""
    started = time.monotonic()
    while not gc.isenabled():
        if time.monotonic() - started > bound:
            raise AssertionError(f"the collector is still off {bound:.0f}s after the failure "
                                 f"(leases held: {gc_pause.leases_held()})")
        time.sleep(0.05)
    return time.monotonic() - started


def _raising_planner(rank: int):
    """An AtomicSavePlanner whose create_local_plan raises on rank 1, before any hook of ours runs there."""
    from dcp_atomic import AtomicSavePlanner

    class Raising(AtomicSavePlanner):
        def create_local_plan(self):
            if rank == 1:
                raise RuntimeError("injected planning failure on rank 1")
            return super().create_local_plan()

    return Raising()


# -- rank functions ----------------------------------------------------------------------------------


def _save_and_load(ctx):
    assert gc.isenabled()
    unpickled = _watch_unpickling()
    metadata = _save(ctx, 1)
    after_save = (gc.isenabled(), gc_pause.leases_held())
    during_save = list(unpickled)
    unpickled.clear()
    _load(ctx, 1)
    return {"after_save": after_save, "during_save": during_save, "during_load": list(unpickled),
            "after_load": (gc.isenabled(), gc_pause.leases_held()),
            "returned_metadata": pickle.dumps(metadata)}  # pickled again, as a user might


def _failed_save_then_wait(ctx, failure: str, lease_seconds: float):
    from torch.distributed.checkpoint.api import CheckpointException

    from dcp_atomic import AtomicSavePlanner
    from dcp_atomic._base import failpoints

    gc_pause.LEASE_SECONDS = lease_seconds
    planner = _raising_planner(ctx.rank) if failure == "planner" else AtomicSavePlanner()
    if failure == "write":
        failpoints.arm("write.mid_data", "raise", rank=1)
    elif failure == "commit":  # the other rank's lease then never sees the coordinator's metadata
        failpoints.arm("commit.before_metadata", "raise", rank=0)
    writer = None
    try:
        from dcp_atomic import AtomicStorageWriter

        writer = AtomicStorageWriter(ctx.root, RUN, 1, timeout=30)
        with pytest.raises(CheckpointException):
            _save(ctx, 1, planner=planner, writer=writer)
    finally:
        failpoints.disarm_all()
    held = gc_pause.leases_held()  # no hook of this save is left to come: only the watchdog can end it
    waited = _wait_for_collector(lease_seconds + MARGIN)
    return {"held_after_failure": held, "waited": waited, "leases": gc_pause.leases_held()}


def _failed_save_then_load(ctx):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from dcp_atomic import AtomicStorageReader

    gc_pause.LEASE_SECONDS = 3600.0  # only the next operation can end the failed one's lease here
    _save(ctx, 1)
    with pytest.raises(CheckpointException):
        _save(ctx, 2, planner=_raising_planner(ctx.rank))
    held = gc_pause.leases_held()
    # The next operation has no planner of ours: the failed save's pending planner part must not outlive it.
    state = {k: torch.zeros_like(v) for k, v in _state(ctx.rank).items()}
    dcp.load(state, storage_reader=AtomicStorageReader(ctx.root, RUN, 1, timeout=30))
    return {"held_after_failure": held, "after_next": (gc.isenabled(), gc_pause.leases_held())}


def _async_save_during_load(ctx, user_disabled: bool):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicSavePlanner, AtomicStorageWriter

    gc_pause.LEASE_SECONDS = 600.0  # the async save's lease must outlast the load, however loaded the machine
    _save(ctx, 1)
    if user_disabled:
        gc.disable()
    reached, gate = threading.Event(), threading.Event()

    class GatedWriter(AtomicStorageWriter):
        """Holds the async save between its planning and its writes until the load has ended."""

        def write_data(self, plan, planner):
            reached.set()
            assert gate.wait(60), "the load never opened the gate"
            return super().write_data(plan, planner)

    save_group = dist.new_group(backend="gloo")
    future = dcp.async_save(_state(ctx.rank), storage_writer=GatedWriter(ctx.root, RUN, 2, timeout=30),
                            planner=AtomicSavePlanner(), process_group=save_group)
    try:
        assert reached.wait(60), "the async save never reached write_data"
        _load(ctx, 1)
        while_saving = (gc.isenabled(), gc_pause.leases_held())  # the async save's lease is still held
    finally:
        gate.set()
    (future.upload_completion if hasattr(future, "upload_completion") else future).result(timeout=60)
    after = (gc.isenabled(), gc_pause.leases_held())
    gc.enable()
    return {"while_saving": while_saving, "after": after}


def _user_disabled(ctx, lease_seconds: float):
    from torch.distributed.checkpoint.api import CheckpointException

    gc_pause.LEASE_SECONDS = lease_seconds
    gc.disable()
    try:
        _save(ctx, 1)
        _load(ctx, 1)
        after_success = gc.isenabled()
        planner = _raising_planner(ctx.rank)
        with pytest.raises(CheckpointException):
            _save(ctx, 2, planner=planner)
        started = time.monotonic()
        while gc_pause.leases_held() and time.monotonic() - started < lease_seconds + MARGIN:
            time.sleep(0.05)
        return {"after_success": after_success, "leases": gc_pause.leases_held(), "after_watchdog": gc.isenabled()}
    finally:
        gc.enable()


# -- tests ---------------------------------------------------------------------------------------------


def test_collector_paused_across_dcp_collectives_and_on_after_save_and_load(tmp_path):
    results = assert_all_ok(run_world(_save_and_load, 2, str(tmp_path), timeout=120))
    for rank, result in enumerate(results):
        assert result["after_save"] == (True, 0), f"rank {rank}: the collector is off after a successful save"
        assert result["after_load"] == (True, 0), f"rank {rank}: the collector is off after a successful load"
    # Rank 0 unpickles every rank's plans and write results between its hooks, the other rank its plan and,
    # after its last hook (write_data), the global metadata of DCP's closing broadcast: all of them paused.
    for rank, result in enumerate(results):
        assert result["during_save"] and not any(result["during_save"]), f"rank {rank}: {result['during_save']}"
        # The signal that ended the other ranks' leases travels once: the Metadata dcp.save returned pickles plain.
        assert b"dcp_atomic" not in result["returned_metadata"], f"rank {rank}"
        assert type(pickle.loads(result["returned_metadata"]).version) is str
    # A load's plans go through DCP's gather and scatter inside the lease; only the closing all_gather of
    # read_data's results (one per rank) comes after the last hook.
    for rank, result in enumerate(results):
        planning = result["during_load"][:-2]
        assert planning and not any(planning), f"rank {rank}: {result['during_load']}"


@pytest.mark.parametrize("failure", ["planner", "write", "commit"])
def test_collector_back_on_within_the_lease_after_a_save_fails_between_hooks(tmp_path, failure):
    lease = 2.0
    results = assert_all_ok(run_world(_failed_save_then_wait, 2, str(tmp_path), args=(failure, lease),
                                      timeout=120))
    for rank, result in enumerate(results):
        assert result["leases"] == 0, f"rank {rank}: {result}"


def test_next_operation_ends_the_lease_a_failed_save_left(tmp_path):
    results = assert_all_ok(run_world(_failed_save_then_load, 2, str(tmp_path), timeout=120))
    for rank, result in enumerate(results):
        assert result["after_next"] == (True, 0), f"rank {rank}: {result}"
    assert results[0]["held_after_failure"] == 1, results[0]


@pytest.mark.parametrize("user_disabled", [False, True], ids=["collector-on", "user-disabled"])
def test_async_save_overlapping_a_load_keeps_the_pause_until_both_end(tmp_path, user_disabled):
    results = assert_all_ok(run_world(_async_save_during_load, 2, str(tmp_path), args=(user_disabled,),
                                      timeout=180))
    for rank, result in enumerate(results):
        assert result["while_saving"] == (False, 1), f"rank {rank}: the load's end resumed collection: {result}"
        assert result["after"] == (not user_disabled, 0), f"rank {rank}: {result}"


def test_user_disabled_collector_stays_disabled(tmp_path):
    results = assert_all_ok(run_world(_user_disabled, 2, str(tmp_path), args=(2.0,), timeout=120))
    for rank, result in enumerate(results):
        assert result == {"after_success": False, "leases": 0, "after_watchdog": False}, f"rank {rank}: {result}"


def _forked_child_does_not_inherit_the_parents_leases():
    """A child forked mid-operation (a data-loader worker) has no watchdog and none of the parent's hooks to come:
    it must start with the collector as the user left it, not wait for a lease it cannot end."""
    import os

    assert gc.isenabled()
    with gc_pause.hook(gc_pause.STORAGE, first=True):
        pass  # this thread's lease stays held: its last hook has not come
    try:
        assert not gc.isenabled() and gc_pause.leases_held() == 1
        pid = os.fork()
        if pid == 0:
            os._exit(0 if gc.isenabled() and gc_pause.leases_held() == 0 else 1)
        _, status = os.waitpid(pid, 0)
    finally:
        gc_pause.leave(gc_pause.STORAGE)
    assert os.waitstatus_to_exitcode(status) == 0, "the forked child kept the parent's pause"
    assert gc.isenabled() and gc_pause.leases_held() == 0


def _forked_child_does_not_inherit_another_threads_pause():
    """An async save's thread inside a hook (gc_paused) while the training thread forks a worker: the worker has no
    such thread, so that pause is not its own; one the forking thread holds itself stays until it ends."""
    import os
    import threading

    inside, release = threading.Event(), threading.Event()

    def in_a_hook():
        with gc_pause.gc_paused():
            inside.set()
            release.wait(30)

    worker = threading.Thread(target=in_a_hook)
    worker.start()
    try:
        assert inside.wait(30) and not gc.isenabled()
        pid = os.fork()
        if pid == 0:
            ok = gc.isenabled()
            with gc_pause.gc_paused():  # the child's own pauses still count as usual
                ok = ok and not gc.isenabled()
            os._exit(0 if ok and gc.isenabled() else 1)
        _, status = os.waitpid(pid, 0)
    finally:
        release.set()
        worker.join(30)
    assert os.waitstatus_to_exitcode(status) == 0, "the forked child kept another thread's pause"
    assert gc.isenabled()


def _in_a_fresh_interpreter(check) -> None:
    """Run ``check`` in a spawned interpreter: it forks and counts on the collector as a fresh process has it, which
    a pytest worker cannot promise (an earlier test's failed in-process save may hold a lease for LEASE_SECONDS)."""
    import multiprocessing

    process = multiprocessing.get_context("spawn").Process(target=check)
    process.start()
    process.join(120)
    assert process.exitcode == 0, f"{check.__name__} failed in its interpreter (exit {process.exitcode}; see stderr)"


def test_forked_child_does_not_inherit_the_parents_leases():
    _in_a_fresh_interpreter(_forked_child_does_not_inherit_the_parents_leases)


def test_forked_child_does_not_inherit_another_threads_pause():
    _in_a_fresh_interpreter(_forked_child_does_not_inherit_another_threads_pause)


def test_read_metadata_on_its_own_leaves_no_lease(tmp_path):
    """export and key listings call read_metadata outside dcp.load: no later hook would end a lease begun there."""
    import torch
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageReader, AtomicStorageWriter

    dcp.save({"w": torch.arange(4.0)}, storage_writer=AtomicStorageWriter(str(tmp_path), "run", 1), no_dist=True)
    assert gc.isenabled() and gc_pause.leases_held() == 0
    metadata = AtomicStorageReader(str(tmp_path), "run", 1).read_metadata()
    assert "w" in metadata.state_dict_metadata
    assert gc.isenabled() and gc_pause.leases_held() == 0


def test_a_step_opened_for_its_tensors_leaves_no_lease(tmp_path):
    """``diff`` and ``export`` open steps with StepTensors and may read no key at all (digests agree): the lease the
    reader's set-up begins must not keep the collector off until the watchdog (an in-process ``diff`` did)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageWriter
    from dcp_atomic.tools.diff import diff_steps

    for step in (1, 2):
        dcp.save({"w": torch.arange(4.0)}, storage_writer=AtomicStorageWriter(str(tmp_path), "run", step), no_dist=True)
    assert gc.isenabled() and gc_pause.leases_held() == 0
    report = diff_steps(str(tmp_path), "run", 1, 2)
    assert report.unchanged == ["w"] and report.unchanged_by_digest == 1, report
    assert gc.isenabled() and gc_pause.leases_held() == 0
