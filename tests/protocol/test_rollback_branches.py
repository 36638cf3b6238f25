"""Rolling back to an earlier step, the way users hold the library (real process groups, gloo, world 2): a job
restarted after a crash between a step's marker and ``LATEST`` supersedes the orphaned step, and ``keep_last``
after a rollback counts the live branch."""

from __future__ import annotations

import json
import os

import torch

from tests.harness import assert_all_ok, run_world

RUN = "review"


def _marker(root, run, step):
    with open(os.path.join(root, run, f"step_{step:010d}", "COMMITTED")) as f:
        return json.load(f)


# -- a rollback after a crash between a marker and LATEST -------------------------------------------------


def _state(step: int) -> dict:
    torch.manual_seed(step)
    return {"w": torch.randn(4, 3) + step, "progress": {"step": step}}


def _train(ctx, steps, load_step):
    from dcp_atomic import CheckpointManager

    with CheckpointManager(ctx.root, RUN, timeout=20) as manager:
        if load_step is not None:
            state = {"w": torch.zeros(4, 3), "progress": {"step": -1}}
            manager.load(state, step=load_step)
        for step in steps:
            manager.save(step, _state(step))
        return manager.steps()


def test_rollback_after_a_crash_between_marker_and_latest_supersedes_the_orphaned_step(root):
    """Rank 0 is SIGKILLed after step 6's marker, before LATEST (which still names step 4).  The restarted job
    rolls back to step 2 (a loss spike) and trains on: its saves of 4 and 6 belong to the branch it abandoned, and
    must supersede them.  The resume point came from LATEST alone (no scan), so it missed step 6's sequence: the
    save of 6 was refused as "committed after the resume", and the superseding step 4 took step 6's number."""
    crashed = run_world(_train, 2, root, args=([2, 4, 6], None), timeout=60,
                        env={"DCP_ATOMIC_FAILPOINTS": "commit.after_marker@0#3=kill"})
    assert crashed[0].killed, crashed[0]
    assert _marker(root, RUN, 6)["sequence"] == 3  # committed, but LATEST names step 4
    with open(os.path.join(root, RUN, "LATEST")) as f:
        assert json.load(f)["step"] == 4

    steps = assert_all_ok(run_world(_train, 2, root, args=([4, 6, 8], 2), timeout=90))
    assert steps[0] == [2, 4, 6, 8]
    sequences = [_marker(root, RUN, s)["sequence"] for s in (2, 4, 6, 8)]
    assert sequences == sorted(sequences) and len(set(sequences)) == 4, sequences  # no number reused (P10)


# -- retention after a rollback --------------------------------------------------------------------------------


def _rollback_with_keep_last(ctx):
    from dcp_atomic import CheckpointManager

    with CheckpointManager(ctx.root, RUN, timeout=20, keep_last=2) as manager:
        for step in (2, 4, 6):
            manager.save(step, _state(step))
    with CheckpointManager(ctx.root, RUN, timeout=20, keep_last=2) as manager:
        manager.load({"w": torch.zeros(4, 3), "progress": {"step": -1}}, step=4)  # a loss spike after 4
        manager.save(5, _state(5))  # the new branch saves more often
        return manager.steps()


def test_keep_last_after_a_rollback_counts_the_live_branch(root):
    steps = assert_all_ok(run_world(_rollback_with_keep_last, 2, root, timeout=90))
    # keep_last=2 of the live branch (5, 4); the abandoned step 6 is newer than 4, so it stays until superseded
    assert steps[0] == [4, 5, 6], steps[0]
