"""A real ``torchrun`` job whose script ends without ``close()`` (P13, "nothing lost"): what is in flight finishes,
on every rank alike, and the log says what became of it.

* A drain in flight: the exit waits for it and the step is in the durable root afterwards, loaded exactly; a drain
  that fails is named at exit with what the next job does about it.
* A save in flight (``async_save``, or a memory slot's durable copy): it used to fail inside its own thread pools
  ("cannot schedule new futures after interpreter shutdown") and nobody was told; now the exit waits for it before
  the pools stop, and a failure nothing reported is logged.
* The heartbeat's thread is stopped before the interpreter finalizes.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


EXIT_SCRIPT = textwrap.dedent('''
    import logging, os, sys, time
    import torch, torch.distributed as dist
    from dcp_atomic import CheckpointManager, LocalTierOptions
    from dcp_atomic._base import failpoints
    from dcp_atomic.tiers import drain

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    dist.init_process_group("gloo")
    rank, base, mode = dist.get_rank(), sys.argv[1], sys.argv[2]
    drain.RETRY_BACKOFF = 0.01

    def slow_or_refused(rank, step):
        time.sleep(2.0)  # the script has returned by now: the drain is in flight at exit
        if mode == "refused":
            raise OSError(13, "Permission denied (injected: the durable store refuses writes)")

    failpoints.arm("drain.before_upload", slow_or_refused)
    local = LocalTierOptions(os.path.join(base, f"node{rank}"), replicas=1, failure_domain=f"node{rank}")
    manager = CheckpointManager(os.path.join(base, "durable"), "run1", local=local, timeout=30)
    manager.save(7, {"w": torch.arange(16.0) * 7})
    # no close(): the script simply ends
''')


def _torchrun(tmp_path, mode, text=EXIT_SCRIPT):
    script = tmp_path / "job.py"
    script.write_text(text)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
               OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(script), str(tmp_path), mode], env=env, capture_output=True, text=True, timeout=240)
    return done.returncode, done.stdout + done.stderr


def test_exit_without_close_waits_for_the_drain_in_flight_and_the_step_is_durable(tmp_path):
    from dcp_atomic import CheckpointManager

    code, output = _torchrun(tmp_path, "slow")
    assert code == 0, output
    assert "exits without close() while step(s) [7] drain to" in output, output
    assert "step(s) [7] drained to" in output and "before exit" in output, output
    with CheckpointManager(str(tmp_path / "durable"), "run1") as durable:  # one process, no process group
        assert durable.steps() == [7]
        state = {"w": torch.zeros(16)}
        assert durable.load(state) == 7
    assert torch.equal(state["w"], torch.arange(16.0) * 7)


def test_exit_without_close_names_a_failed_drain_and_what_the_next_job_does(tmp_path):
    code, output = _torchrun(tmp_path, "refused")
    assert code == 0, output
    assert "did not reach" in output and "Permission denied" in output, output
    assert "the next job of this run on them drains the newest such step again" in output, output
    # nothing committed durably (the drain's claimed attempt, if any, is debris gc collects, as a crashed save's)
    assert not glob.glob(str(tmp_path / "durable" / "run1" / "step_*" / "COMMITTED"))
    assert glob.glob(str(tmp_path / "node0" / "run1" / "step_0000000007"))


HEARTBEAT_AT_EXIT = textwrap.dedent('''
    import atexit, threading
    from datetime import timedelta
    import torch.distributed as dist
    from dcp_atomic.exchange.liveness import Heartbeat

    def still_beating():  # registered first, so it runs last: after every handler dcp_atomic registered
        alive = [t.name for t in threading.enumerate() if t.name == "dcp-atomic-heartbeat" and t.is_alive()]
        print("BEATING AT FINALIZATION:", alive, flush=True)

    atexit.register(still_beating)
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10))
    heartbeat = Heartbeat(store, "job", 0, [0], timeout=0.4)  # a manager never closed leaves it so
''')


def test_a_heartbeat_never_closed_is_stopped_before_the_interpreter_finalizes(tmp_path):
    """A daemon thread still inside a store call at finalization is ended by force through a C++ frame and the
    process aborts ("terminate called without an active exception") after a save that succeeded: the exit without
    close() above did so under load.  The heartbeat's thread must be gone before finalization."""
    script = tmp_path / "beat.py"
    script.write_text(HEARTBEAT_AT_EXIT)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "BEATING AT FINALIZATION: []" in done.stdout, done.stdout + done.stderr


SAVE_SCRIPT = textwrap.dedent('''
    import logging, os, sys, time
    import torch, torch.distributed as dist
    from dcp_atomic import CheckpointManager, MemoryTier
    from dcp_atomic._base import failpoints

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    dist.init_process_group("gloo")
    rank, base, mode = dist.get_rank(), sys.argv[1], sys.argv[2]

    def slow_or_refused(rank, *args):
        time.sleep(2.0)  # the script has returned by now: the save is in flight at exit
        if mode == "refused":
            raise OSError(13, "Permission denied (injected: the durable store refuses writes)")

    failpoints.arm("write.before_data", slow_or_refused)
    durable = os.path.join(base, "durable")
    if mode == "copy":  # step 2's snapshot starts the durable copy of step 1 from its memory slot
        os.makedirs(os.path.join(base, f"mem{rank}"))
        memory = MemoryTier(os.path.join(base, f"mem{rank}"), every=1, replicas=0, durable_every=1)
        manager = CheckpointManager(durable, "run1", memory=memory, timeout=30)
        for step in (1, 2):
            manager.snapshot(step, {"w": torch.arange(16.0) * step}).result()
    else:
        manager = CheckpointManager(durable, "run1", timeout=30)
        manager.async_save(1, {"w": torch.arange(16.0)})
    # no close(), no wait(): the script simply ends
''')


@pytest.mark.parametrize("mode", ["copy", "refused"])
def test_exit_without_close_finishes_the_save_in_flight_or_names_its_failure(tmp_path, mode):
    """``copy``: a memory slot's durable copy in flight at exit commits (before: an attempt directory and no marker,
    exit 0, nothing logged); ``refused``: an ``async_save`` that fails at exit is logged on every rank."""
    from dcp_atomic import CheckpointManager

    code, output = _torchrun(tmp_path, mode, SAVE_SCRIPT)
    assert code == 0, output
    assert output.count("exits without close() while the save of step 1 is in flight") == 2, output
    if mode == "copy":
        assert output.count("the save of step 1 committed before exit") == 2, output
        with CheckpointManager(str(tmp_path / "durable"), "run1") as durable:  # one process, no process group
            assert durable.steps() == [1]
            state = {"w": torch.zeros(16)}
            assert durable.load(state) == 1
        assert torch.equal(state["w"], torch.arange(16.0))
    else:
        assert output.count("the save of step 1 failed") == 2 and "Permission denied" in output, output
        assert "Call close() before exiting" in output, output
        assert not glob.glob(str(tmp_path / "durable" / "run1" / "step_*" / "COMMITTED"))
