"""A drain's end in a job's life: a frozen durable store, and a process that exits without ``close()`` (P13).

* The durable root is a real FUSE mount (bindfs) whose daemon the test stops (``SIGSTOP``: a hung NFS server) while
  the drain uploads: ``wait()`` and ``close()`` give up after the stall deadline with ``DrainStalledError`` naming the
  step and the store, instead of hanging the job forever.
* One clock and one verdict on every rank: a rank that only waits in the drain's collective for a peer whose client
  hangs gives up at the same deadline; a commit stuck before its marker is "not durable" everywhere (and stays so),
  one slower than the deadline after its marker is ok everywhere.
* A real ``torchrun`` job whose script ends without ``close()`` while a drain is in flight: the exit waits for it
  (logged) and the step is in the durable root afterwards, loaded exactly; a drain that fails is named at exit
  with what the next job does about it.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from dcp_atomic._base import failpoints

from tests.harness import assert_all_ok
from tests.helpers.drain import _one_node_each
from tests.helpers.fsdp_app import _fsdp_app, _train_step
from tests.helpers.tiers import RUN, _run, _state
from tests.fault_fixtures import nfs_clients_ctx

STALL = 6.0  # the manager's timeout: its stall deadline


def _wait_then_close(manager, on_stall=lambda: None):
    """What ``wait()`` then ``close()`` did: (outcome, seconds, message, ``details["durable"]``) each."""
    from dcp_atomic import DrainStalledError

    seen = []
    for call in (manager.wait, manager.close):
        started = time.monotonic()
        try:
            call()
            seen.append(("returned", time.monotonic() - started, "", None))
        except DrainStalledError as e:
            seen.append((type(e).__name__, time.monotonic() - started, str(e), e.details.get("durable")))
            on_stall()
    return seen


def _frozen_drain(ctx, signal_dir):
    from dcp_atomic import CheckpointManager, LocalTierOptions

    def uploading(rank, step):  # the test freezes the durable mount once every rank is about to upload
        open(os.path.join(signal_dir, f"uploading.{rank}"), "w").close()
        while not os.path.exists(os.path.join(signal_dir, "frozen")):
            time.sleep(0.05)

    failpoints.arm("drain.before_upload", uploading)
    model, optim = _fsdp_app(ctx.world_size, 0)
    _train_step(model, optim, 1)
    manager = CheckpointManager(ctx.root, RUN, local=LocalTierOptions(ctx.extra["nodes"][ctx.rank], replicas=1),
                                timeout=STALL)
    manager.save(1, _state(model, optim, 1))  # local-committed; the drain starts in the background
    seen = _wait_then_close(manager)
    return {"seen": seen, "local": os.path.isdir(os.path.join(ctx.extra["nodes"][ctx.rank], RUN, "step_0000000001"))}


def test_a_frozen_durable_store_fails_wait_and_close_after_the_stall_deadline(nodes):
    with nfs_clients_ctx(cache_seconds=0.0) as clients:
        durable, signals = clients.a.path, os.path.join(clients.base, "signals")
        os.mkdir(signals)

        def freezer():
            deadline = time.monotonic() + 60
            while len(glob.glob(os.path.join(signals, "uploading.*"))) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            clients.a.freeze()
            open(os.path.join(signals, "frozen"), "w").close()

        thread = threading.Thread(target=freezer, daemon=True)
        thread.start()
        outcomes = _run(_frozen_drain, durable, nodes, signals, world=2, rank_env=_one_node_each)
        thread.join(timeout=5)
        assert clients.a.frozen_now
        clients.a.thaw()
        seen = assert_all_ok(outcomes)
        for rank, out in enumerate(seen):
            assert out["local"], rank  # the step stays on the local tier
            assert STALL <= out["seen"][0][1] < STALL + 20, (rank, out["seen"])  # wait(): the deadline, then gave up
            assert out["seen"][1][1] < 2, (rank, out["seen"])  # close(): already past it
            for kind, seconds, message, _ in out["seen"]:
                assert kind == "DrainStalledError", (rank, out["seen"])
                assert "step 1 " in message and durable in message and "no progress" in message, message
        from dcp_atomic.format.layout import MARKER

        assert not os.path.exists(os.path.join(clients.backing, RUN, "step_0000000001", MARKER))


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


def _torchrun(tmp_path, mode):
    script = tmp_path / "job.py"
    script.write_text(EXIT_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
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
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "BEATING AT FINALIZATION: []" in done.stdout, done.stdout + done.stderr


pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _one_rank_hangs(ctx, signal_dir, point, hang_rank, hang_seconds):
    """Every rank saves step 1 (drained in the background); on ``hang_rank`` the drain blocks at ``point`` (a durable
    client that stopped answering, a commit that does not return) until the test's rank function lets it go, or for
    ``hang_seconds``.  Returns what ``wait()`` and ``close()`` did on this rank."""
    from dcp_atomic import CheckpointManager, LocalTierOptions

    release = os.path.join(signal_dir, "release")

    def hang(rank, step):
        deadline = time.monotonic() + hang_seconds
        while not os.path.exists(release) and time.monotonic() < deadline:
            time.sleep(0.05)

    failpoints.arm(point, hang, rank=hang_rank)
    manager = CheckpointManager(ctx.root, RUN, local=LocalTierOptions(ctx.extra["nodes"][ctx.rank], replicas=1),
                                timeout=STALL)
    manager.save(1, {f"w{ctx.rank}": torch.arange(4096.0) + ctx.rank})
    seen = _wait_then_close(manager, on_stall=lambda: open(release, "w").close())  # the hung client answers again
    deadline = time.monotonic() + 30
    while manager._tier.busy() and time.monotonic() < deadline:  # the released round ends: then close() releases
        time.sleep(0.05)
    manager.close()
    return seen


def _durable_marker(durable_root):
    from dcp_atomic.format.layout import MARKER

    return os.path.exists(os.path.join(durable_root, RUN, "step_0000000001", MARKER))


def test_one_node_s_hung_durable_client_ends_wait_on_every_rank_at_the_stall_deadline(nodes, tmp_path):
    """The healthy node's rank waits in the drain's collective, not on a store: it must still give up at the stall
    deadline (not the drain group's timeout, hours), with the same verdict as the hung rank: not durable."""
    outcomes = _run(_one_rank_hangs, str(tmp_path / "durable"), nodes, str(tmp_path), "drain.before_upload", 1,
                    120.0, world=2, rank_env=_one_node_each)
    seen = assert_all_ok(outcomes)
    for rank, calls in enumerate(seen):
        (kind, seconds, message, durable), (close_kind, close_seconds, *_) = calls
        assert kind == "DrainStalledError", (rank, calls)
        assert STALL <= seconds < STALL + 15, (rank, calls)
        assert "step 1 " in message and "no progress on any rank" in message, message
        assert durable is False and "will be written" in message, (rank, message)  # one verdict: not durable
        # close() says it again while the released round is still ending; once rank 0 abandoned the step it has
        # nothing left to report (wait() did): either way it does not wait
        assert close_kind in ("DrainStalledError", "returned") and close_seconds < 2, (rank, calls)
    assert "this rank waited for its peers" in seen[0][0][2]  # rank 0 was not the one on the store
    assert not _durable_marker(str(tmp_path / "durable"))  # rank 0 abandoned the step once the hang ended


def test_rank_0_s_slow_commit_gets_one_verdict_on_every_rank(nodes, tmp_path):
    """Rank 0's commit stops before the marker for longer than the stall deadline: every rank (rank 0 too) says
    "not durable", and it stays so: the marker is never written afterwards (rank 0 abandons the claimed step)."""
    outcomes = _run(_one_rank_hangs, str(tmp_path / "durable"), nodes, str(tmp_path), "drain.before_marker", 0,
                    STALL * 1.6, world=2, rank_env=_one_node_each)
    seen = assert_all_ok(outcomes)
    for rank, calls in enumerate(seen):
        kind, seconds, message, durable = calls[0]
        assert kind == "DrainStalledError" and durable is False, (rank, calls)
        assert STALL <= seconds < STALL + 15, (rank, calls)
    assert not _durable_marker(str(tmp_path / "durable"))


def test_a_commit_slower_than_the_deadline_after_its_marker_is_ok_on_every_rank(nodes, tmp_path):
    """Rank 0 has claimed the commit and is writing the marker (then LATEST) for longer than the stall deadline:
    the waiters give it one more period, and every rank says ok; the step is durable."""
    outcomes = _run(_one_rank_hangs, str(tmp_path / "durable"), nodes, str(tmp_path), "commit.after_marker", 0,
                    STALL * 1.5, world=2, rank_env=_one_node_each)
    seen = assert_all_ok(outcomes)
    for rank, calls in enumerate(seen):
        assert [c[0] for c in calls] == ["returned", "returned"], (rank, calls)
    assert _durable_marker(str(tmp_path / "durable"))
