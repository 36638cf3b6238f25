"""A drain's end in a job's life: a frozen durable store, a hung client, a slow commit (P13).

* The durable root is a real FUSE mount (bindfs) whose daemon the test stops (``SIGSTOP``: a hung NFS server) while
  the drain uploads: ``wait()`` and ``close()`` give up after the stall deadline with ``DrainStalledError`` naming the
  step and the store, instead of hanging the job forever.
* One clock and one verdict on every rank: a rank that only waits in the drain's collective for a peer whose client
  hangs gives up at the same deadline; a commit stuck before its marker is "not durable" everywhere (and stays so),
  one slower than the deadline after its marker is ok everywhere.

A process that exits without ``close()``: ``tests/manager/test_exit_without_close.py``.
"""

from __future__ import annotations

import glob
import os
import re
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
            # close(): already past it, and the verdict was raised once, by wait(): not again, on any rank
            assert out["seen"][1][:2] == ("returned", out["seen"][1][1]) and out["seen"][1][1] < 2, (rank, out)
            kind, _, message, _ = out["seen"][0]
            assert kind == "DrainStalledError", (rank, out["seen"])
            assert "step 1 " in message and durable in message and "no progress" in message, message
            assert "this rank is stuck uploading its files on the store" in message, message
        from dcp_atomic.format.layout import MARKER

        assert not os.path.exists(os.path.join(clients.backing, RUN, "step_0000000001", MARKER))


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
        # raised once, by wait(), on every rank: close() neither says it again nor waits
        assert close_kind == "returned" and close_seconds < 2, (rank, calls)
    # each rank says what it saw: rank 0 waited for its peer, whose store did not answer (its own did); rank 1 was
    # the one stuck, uploading (stuck still, or "was" where rank 0's verdict released the hang and ended its round
    # before rank 1 judged: the release is rank 0's on_stall)
    said = seen[0][0][2]
    assert "this rank waited for its peers" in said and "another rank's work on its stores" in said, said
    assert re.search(r"this rank (is|was) stuck uploading its files", seen[1][0][2]), seen[1][0][2]
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
    # rank 0 was stuck in its commit, not in uploads; rank 1 waited for it
    # (stuck still, or, where a waiter's verdict ended its round first, was stuck there)
    assert re.search(r"this rank (is|was) stuck committing the step", seen[0][0][2]), seen[0][0][2]
    assert "this rank waited for its peers" in seen[1][0][2], seen[1][0][2]
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
