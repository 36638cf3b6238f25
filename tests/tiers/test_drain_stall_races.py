"""The drain's stall verdict and commit attacked as a cluster breaks them: what every *other* rank sees at each wait,
verdict and deletion.

* A rank 0 that is slow *after* its durable marker (descheduled, paging) while the waiters' clocks run out: the
  verdict cell must say the step is committed, so no waiter can claim "stalled" (and say "no durable marker was or
  will be written") over a marker that is there.  Before, rank 0 emptied the cell after its commit, and a waiter
  that looked before the marker claimed "stalled" after it.
* A frozen global rank 0 (``SIGSTOP``): it hosts the rendezvous store, so the waiters' reads go unanswered; they must
  still give up at the stall deadline, saying "unknown", not after a second wait for the store (twice the deadline).
* A durable store that freezes after a drain failed: ``tests/tiers/test_durable_pending_frozen_store.py``.
* ``gc`` with a lease shorter than the drain, run while rank 0 commits the drained step: the commit withdraws its
  marker, the drain retries, and the step ends durable and loadable on every rank.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from dcp_atomic._base import failpoints

from tests.harness import assert_all_ok
from testbed.worlds import run_world
from tests.helpers.drain import _one_node_each
from tests.helpers.tiers import RUN, _run

pytestmark = pytest.mark.timeout(180)

STALL = 5.0  # the manager's timeout: its stall deadline


def _marker_of(durable_root: str, step: int) -> bool:
    from dcp_atomic.format import MARKER

    return os.path.exists(os.path.join(durable_root, RUN, f"step_{step:010d}", MARKER))


def _waited(manager) -> tuple[str, float, bool | None, str]:
    """What ``manager.wait()`` did: (outcome, seconds, ``details["durable"]``, message)."""
    from dcp_atomic import DrainStalledError

    started = time.monotonic()
    try:
        manager.wait()
        return "returned", time.monotonic() - started, None, ""
    except DrainStalledError as e:
        return "DrainStalledError", time.monotonic() - started, e.details.get("durable"), str(e)


def test_a_waiter_cannot_claim_stalled_over_a_marker_placed_since_it_last_looked():
    """The race in one process (a world of one keeps the cell in memory): the waiter's clock has run out, and rank 0
    claims, writes and finishes its marker before the waiter's claim lands.  The waiter finds its step named
    committed: no "stalled" claim, one more period, then "durable" if the outcome never comes.  A waiter of another
    job may still claim "stalled", and then rank 0's next commit is refused."""
    from dcp_atomic.exchange import StallClock

    clock = StallClock(0.05)
    clock.start_waiting()
    assert clock.check("1:save-a") is None  # the waiter's first look
    time.sleep(0.06)  # its clock ran out; it has not looked at the cell since
    assert clock.claim_commit()  # rank 0: "commit", the marker, then the cell names the step committed
    clock.commit_done("1:save-a")
    assert clock.check("1:save-a") is None  # not "stalled": the step is committed, its outcome may be on its way
    time.sleep(0.06)
    assert clock.check("1:save-a") == "durable"
    clock.start_waiting()  # a later job, which never reaches its marker
    assert clock.check("2:save-b") is None
    time.sleep(0.06)
    assert clock.check("2:save-b") == "stalled"
    assert not clock.claim_commit()


def _slow_after_the_marker(ctx):
    from dcp_atomic import CheckpointManager, LocalTierOptions

    failpoints.arm("drain.after_commit", f"sleep:{STALL * 1.6}", rank=0)  # the marker is written; the outcome waits
    local = LocalTierOptions(ctx.extra["nodes"][ctx.rank], replicas=1)
    manager = CheckpointManager(ctx.root, RUN, local=local, timeout=STALL)
    manager.save(1, {f"w{ctx.rank}": torch.arange(4096.0) + ctx.rank})
    seen = _waited(manager)
    manager.close()
    return seen


def test_a_rank_0_slow_after_its_durable_marker_is_never_called_not_durable(nodes, tmp_path):
    """Rank 0 committed step 1 (marker and LATEST written) and then hands out the outcome 1.6 stall periods late:
    every waiter finds the cell naming its step committed and gives rank 0 one more period, so every rank says ok.
    Before, each waiter claimed "stalled" once its clock ran out and said no durable marker would be written."""
    durable = str(tmp_path / "durable")
    seen = assert_all_ok(_run(_slow_after_the_marker, durable, nodes, world=2, rank_env=_one_node_each))
    assert _marker_of(durable, 1)
    for rank, (outcome, seconds, said_durable, message) in enumerate(seen):
        assert said_durable is not False, (rank, message)  # never "not durable" over a marker that is there
        assert outcome == "returned", (rank, outcome, seconds, message)


def _frozen_rank_0(ctx):
    from dcp_atomic import CheckpointManager, LocalTierOptions

    failpoints.arm("drain.before_marker", "stop", rank=0)  # rank 0, and the rendezvous store it hosts, freeze
    local = LocalTierOptions(ctx.extra["nodes"][ctx.rank], replicas=1)
    manager = CheckpointManager(ctx.root, RUN, local=local, timeout=STALL)
    manager.save(1, {f"w{ctx.rank}": torch.arange(4096.0) + ctx.rank})
    return _waited(manager)  # rank 0 never gets here; the world kills it once rank 1 answered


def test_a_frozen_rank_0_ends_every_waiter_at_the_stall_deadline_saying_unknown(nodes, tmp_path):
    """Global rank 0 freezes (``SIGSTOP``) just before its durable marker: the store answers no one.  Rank 1's
    ``wait()`` says "unknown" within the deadline and one poll, not after waiting for the store a second time."""
    outcomes = run_world(_frozen_rank_0, 2, str(tmp_path / "durable"), rank_env=_one_node_each,
                         extra={"nodes": nodes}, timeout=90, pg_timeout=60, wait_for=[1])
    outcome = outcomes[1]
    assert outcome.error_type is None, outcome  # its answer (its exit, with a frozen peer, is not what is tested)
    kind, seconds, said_durable, message = outcome.value
    assert kind == "DrainStalledError" and said_durable is None, (kind, message)
    assert "rendezvous store on global rank 0 does not answer" in message, message
    assert STALL <= seconds < STALL + 3.5, (seconds, message)  # before: about twice the deadline


def _dead_peer(ctx):
    from dcp_atomic import CheckpointManager, LocalTierOptions

    failpoints.arm("drain.before_upload", "kill", rank=1)  # rank 1 dies mid-drain (SIGKILL)
    local = LocalTierOptions(ctx.extra["nodes"][ctx.rank], replicas=1)
    manager = CheckpointManager(ctx.root, RUN, local=local, timeout=STALL)
    manager.save(1, {f"w{ctx.rank}": torch.arange(4096.0) + ctx.rank})
    started = time.monotonic()
    try:
        manager.wait()
    except Exception as e:  # noqa: BLE001 - what it raised is the result
        return type(e).__name__, time.monotonic() - started, str(e)
    return "returned", time.monotonic() - started, ""


def test_a_peer_killed_mid_drain_fails_wait_on_rank_0_within_the_deadline_and_leaves_no_marker(nodes, tmp_path):
    """Rank 1 is killed before its upload: rank 0's ``wait()`` fails within the stall deadline (the drain group's
    broken collective, not its timeout), saying no durable marker was written, and there is none."""
    durable = str(tmp_path / "durable")
    outcomes = run_world(_dead_peer, 2, durable, rank_env=_one_node_each, extra={"nodes": nodes}, timeout=90,
                         pg_timeout=60, wait_for=[0])
    assert outcomes[0].error_type is None, outcomes[0]
    kind, seconds, message = outcomes[0].value
    assert kind != "returned" and seconds < STALL + 3, (kind, seconds, message)
    assert "no durable marker was written for step 1" in message or "will be written" in message, message
    assert not _marker_of(durable, 1)


def _gc_under_the_commit(ctx):
    from dcp_atomic import CheckpointManager, LocalTierOptions
    from dcp_atomic.format import RunLayout
    from dcp_atomic.protocol import apply_gc, plan_gc
    from dcp_atomic.stores import open_storage
    from dcp_atomic.tiers import drain

    drain.RETRY_BACKOFF = 0.01
    ran = []

    def gc_with_a_short_lease(rank, step):  # an operator's `dcp-atomic gc --lease-hours 0` while rank 0 commits
        if not ran:
            ran.append(step)
            layout = RunLayout(open_storage(ctx.root), RUN)
            apply_gc(layout, plan_gc(layout, None, lease_seconds=0.0, now=time.time() + 1))

    failpoints.arm("drain.before_marker", gc_with_a_short_lease, rank=0)
    state = {f"w{ctx.rank}": torch.arange(4096.0) + ctx.rank}
    local = LocalTierOptions(ctx.extra["nodes"][ctx.rank], replicas=1)
    with CheckpointManager(ctx.root, RUN, local=local, timeout=20) as manager:
        manager.save(1, state, durable=True)
        manager.wait()
    loaded = {f"w{ctx.rank}": torch.zeros(4096)}
    with CheckpointManager(ctx.root, RUN, timeout=20) as durable_only:  # the durable root alone
        durable_only.load(loaded, step=1)
    return ran, torch.equal(loaded[f"w{ctx.rank}"], state[f"w{ctx.rank}"])


def test_gc_racing_a_drain_s_commit_never_leaves_a_durable_step_without_its_files(nodes, tmp_path):
    """gc removes the drain's attempt while rank 0 commits it: the commit withdraws its marker, the drain retries
    (claim and uploads again), and step 1 is durable and loads exactly on every rank; ``wait()`` says ok."""
    durable = str(tmp_path / "durable")
    seen = assert_all_ok(_run(_gc_under_the_commit, durable, nodes, world=2, rank_env=_one_node_each))
    assert seen[0][0] == [1], seen  # gc ran under the commit
    assert all(exact for _, exact in seen), seen
    assert _marker_of(durable, 1)
