"""Errors that survive and say what happened: every error class pickles, copies and crosses a process queue, and a
failed collective is blamed on a peer only when the liveness verdict says one is dead, never by words in a message."""

from __future__ import annotations

import copy
import multiprocessing
import pickle
import time

import pytest
import torch

from tests.harness import assert_all_ok, run_world

RUN = "errors"


def _echo(queue_in, queue_out):
    queue_out.put(queue_in.get())


@pytest.mark.slow
def test_peer_lost_pickles_copies_and_crosses_a_process_queue_like_every_other_error():
    from dcp_atomic.exchange import PeerLost

    error = PeerLost("shared read of run 'x' step 2: the exchange with rank 1 failed", rank=0, silent="1")
    for again in (pickle.loads(pickle.dumps(error)), copy.copy(error), copy.deepcopy(error)):
        assert type(again) is PeerLost and again.details == {"rank": 0, "silent": "1"} and str(again) == str(error)
    context = multiprocessing.get_context("spawn")
    queue_in, queue_out = context.Queue(), context.Queue()
    child = context.Process(target=_echo, args=(queue_in, queue_out))
    child.start()
    queue_in.put(error)
    crossed = queue_out.get(timeout=60)
    child.join(30)
    assert type(crossed) is PeerLost and crossed.details == error.details and str(crossed) == str(error)


class _SaysTimedOut:
    """A user's Stateful whose load raises its own RuntimeError with the words a gloo timeout uses."""

    def __init__(self, fail: bool):
        self.fail, self.w = fail, torch.zeros(4)

    def state_dict(self):
        return {"w": self.w}

    def load_state_dict(self, state):
        if self.fail:
            raise RuntimeError("fetching the tokenizer from the hub timed out (Connection reset by peer)")
        self.w = state["w"]


def _load_with_a_users_timeout(ctx):
    import torch.distributed as dist

    from dcp_atomic import CheckpointManager, RankFailureError

    with CheckpointManager(ctx.root, RUN, timeout=8) as manager:
        manager.save(1, {"app": _SaysTimedOut(False), "x": torch.arange(4.0)})
        state = {"app": _SaysTimedOut(fail=ctx.rank == 1), "x": torch.zeros(4)}
        started = time.monotonic()
        try:
            manager.load(state)
            outcome = {"error": None}
        except Exception as e:
            outcome = {"type": type(e).__name__, "peer": isinstance(e, RankFailureError), "message": str(e),
                       "cause": type(e.__cause__).__name__, "seconds": time.monotonic() - started}
        dist.barrier()  # rank 0 goes on to train (its next collective), alive, while rank 1 reports
    return outcome


def test_a_users_runtime_error_that_says_timed_out_is_the_users_error_not_a_dead_peer(root):
    outcomes = assert_all_ok(run_world(_load_with_a_users_timeout, 2, root, timeout=120, pg_timeout=8))
    assert outcomes[0] == {"error": None}, outcomes[0]
    failed = outcomes[1]
    assert not failed["peer"], f"a user's RuntimeError was reported as a dead peer: {failed['message']}"
    assert failed["type"] == "CheckpointError" and failed["cause"] == "RuntimeError", failed
    assert "fetching the tokenizer from the hub timed out" in failed["message"], failed
    assert "died or stopped responding" not in failed["message"], failed
    assert failed["seconds"] < 8, failed  # the verdict comes once every peer has beaten, not after the timeout
