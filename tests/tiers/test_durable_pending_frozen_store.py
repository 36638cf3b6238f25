"""A save after the durable store froze, while a durable-pending step exists, must not hang (P13: the drain never
blocks training).  Found by an attack on the durable-pending rule: the save read whether the step became durable on
the training thread, and a frozen mount blocks that read until the store answers."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from dcp_atomic._base import failpoints

from tests.fault_fixtures import nfs_clients_ctx
from tests.harness import assert_all_ok
from testbed.worlds import run_world
from tests.helpers.tiers import RUN

pytestmark = pytest.mark.timeout(300)

STALL = 5.0  # the manager's timeout: its stall deadline


def _save_after_the_store_froze(ctx, daemon_pid, signal_dir):
    from dcp_atomic import CheckpointManager, LocalTierOptions
    from dcp_atomic.tiers import drain

    drain.RETRY_BACKOFF = 0.01
    failpoints.arm("drain.before_upload", lambda rank, step: (_ for _ in ()).throw(OSError(28, "injected: full")))
    seen = {}
    local = LocalTierOptions(os.path.join(signal_dir, "node"), replicas=0, keep_local=1, durable_every=None)
    with CheckpointManager(ctx.root, RUN, local=local, timeout=STALL) as manager:
        manager.save(1, {"w": torch.arange(64.0)}, durable=True)
        try:
            manager.wait()
        except Exception as e:  # noqa: BLE001 - the drain failed: step 1 is durable-pending
            seen["drain"] = type(e).__name__
        failpoints.disarm_all()
        os.kill(daemon_pid, signal.SIGSTOP)  # the durable store stops answering (the test thaws it later)
        open(os.path.join(signal_dir, "frozen"), "w").close()
        started = time.monotonic()
        manager.save(2, {"w": torch.arange(64.0) * 2}, durable=False)
        seen["save_seconds"] = time.monotonic() - started
        manager.save(3, {"w": torch.arange(64.0) * 3}, durable=False)
        seen["both_seconds"] = time.monotonic() - started
        seen["local"] = sorted(os.listdir(os.path.join(signal_dir, "node", RUN)))  # nothing that reads the store
        while not os.path.exists(os.path.join(signal_dir, "thawed")):
            time.sleep(0.05)
    return seen


def test_a_save_after_the_durable_store_froze_does_not_hang_on_the_durable_pending_step(tmp_path):
    """Step 1's drain failed (durable-pending); then the durable mount freezes.  The next saves ask whether step 1
    became durable: they wait for the frozen store at most the stall deadline, once, and keep step 1 (not durable as
    far as anyone knows).  Before, the save blocked on the frozen mount until the store came back."""
    with nfs_clients_ctx(cache_seconds=0.0) as clients:
        signal_dir = os.path.join(clients.base, "signals")
        os.mkdir(signal_dir)

        def thaw_later():  # whatever happens in the job, the store comes back after 4 stall periods
            deadline = time.monotonic() + 60
            while not os.path.exists(os.path.join(signal_dir, "frozen")) and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(STALL * 4)
            os.kill(clients.a.proc.pid, signal.SIGCONT)
            open(os.path.join(signal_dir, "thawed"), "w").close()

        thread = threading.Thread(target=thaw_later, daemon=True)
        thread.start()
        try:
            [seen] = assert_all_ok(run_world(_save_after_the_store_froze, 1, clients.a.path,
                                             args=(clients.a.proc.pid, signal_dir), timeout=120))
        finally:
            thread.join(timeout=70)
            os.kill(clients.a.proc.pid, signal.SIGCONT)
    assert seen["drain"] == "StorageError", seen
    assert seen["save_seconds"] < STALL + 3, seen  # before: until the store was thawed (4 stall periods)
    assert seen["both_seconds"] < STALL + 6, seen  # the second save does not wait again
    steps = [name for name in seen["local"] if name.startswith("step_")]
    assert steps == ["step_0000000001", "step_0000000003"], seen  # step 1 kept past keep_local=1: not known to be durable
