"""P14: a resumed job may rewrite its own future, and nobody else's.

A job that loads step k (a rollback to before a loss spike, or a restart after one) and trains on
saves steps above k that the abandoned branch had committed: those saves supersede the old steps
(new attempts, higher commit sequences) instead of killing the job with CommitConflictError, as
stock DCP's overwrite-in-place would also "work".  Without such a load, re-saving a committed step
is still refused: two jobs sharing a run must not overwrite each other.
"""

from __future__ import annotations

import json
import os

import torch

from tests.harness import assert_all_ok, run_world

RUN = "rollback"


def _state(step: int, rank: int) -> dict:
    torch.manual_seed(step)
    return {"w": torch.randn(4, 3) + step, "progress": {"step": step}}


def _save(ctx, steps, load_step):
    from dcp_atomic import CheckpointManager

    with CheckpointManager(ctx.root, RUN, timeout=30) as manager:
        loaded = None
        if load_step != "none":
            state = {"w": torch.zeros(4, 3), "progress": {"step": -1}}
            loaded = manager.load(state, step=load_step)
            assert state["progress"]["step"] == loaded
            assert torch.equal(state["w"], _state(loaded, ctx.rank)["w"])
        for step in steps:
            manager.save(step, _state(step, ctx.rank))
        return {"loaded": loaded, "steps": manager.steps(), "latest": manager.latest_step()}


def _load(ctx, step):
    from dcp_atomic import CheckpointManager

    with CheckpointManager(ctx.root, RUN, timeout=30) as manager:
        state = {"w": torch.zeros(4, 3), "progress": {"step": -1}}
        loaded = manager.load(state, step=step)
        return loaded, state["progress"]["step"], torch.equal(state["w"], _state(loaded, ctx.rank)["w"])


def _marker(root, step):
    with open(os.path.join(root, RUN, f"step_{step:010d}", "COMMITTED")) as f:
        return json.load(f)


def test_save_after_loading_an_earlier_step_supersedes_the_abandoned_steps(root):
    assert_all_ok(run_world(_save, 2, root, args=([2, 4, 6], "none")))
    abandoned = {step: _marker(root, step) for step in (4, 6)}

    out = assert_all_ok(run_world(_save, 2, root, args=([4, 6, 8], 2)))[0]

    assert out["loaded"] == 2 and out["steps"] == [2, 4, 6, 8] and out["latest"] == 8
    for step, old in abandoned.items():
        new = _marker(root, step)
        assert new["save_id"] != old["save_id"] and new["sequence"] > old["sequence"]
        # the abandoned attempt stays on disk for gc (P1: nothing committed is rewritten in place)
        assert os.path.isdir(os.path.join(root, RUN, f"step_{step:010d}", old["save_id"]))
    # a fresh job resumes from the live branch, and every step loads its own values
    for step in (None, 4, 6):
        for loaded, progress, exact in assert_all_ok(run_world(_load, 2, root, args=(step,))):
            assert progress == loaded and exact
            assert loaded == (8 if step is None else step)


def test_resave_without_a_resume_is_still_refused_and_the_next_save_works(root):
    assert_all_ok(run_world(_save, 2, root, args=([2, 4], "none")))
    outcomes = run_world(_save, 2, root, args=([4], "none"))
    for outcome in outcomes:
        assert not outcome.ok and "CommitConflictError" in outcome.error_type + outcome.error, outcome
        assert "load an earlier step first to roll back" in outcome.error
    # the refusal broke nothing: the same kind of job saves the next step
    assert assert_all_ok(run_world(_save, 2, root, args=([6], "none")))[0]["steps"] == [2, 4, 6]


def _resume_then_race(ctx):
    """Resume from step 2, then another job commits step 6 *after* the resume; our save of step 6 must lose."""
    from dcp_atomic import AtomicStorageWriter, CheckpointManager
    import torch.distributed.checkpoint as dcp

    with CheckpointManager(ctx.root, RUN, timeout=30) as manager:
        manager.load({"w": torch.zeros(4, 3), "progress": {"step": -1}}, step=2)
        manager.save(4, _state(4, ctx.rank))  # supersedes the abandoned step 4
        # "another job" (same world, plain dcp.save without a resume) commits step 6 now
        other = {"w": torch.full((4, 3), 66.0), "progress": {"step": 6}}
        dcp.save(other, storage_writer=AtomicStorageWriter(ctx.root, RUN, 6, overwrite=True))
        try:
            manager.save(6, _state(6, ctx.rank))
        except Exception as e:  # noqa: BLE001 - the outcome is what the test checks
            return type(e).__name__, str(e)
        return None, None


def test_a_step_committed_after_the_resume_is_not_superseded(root):
    assert_all_ok(run_world(_save, 2, root, args=([2, 4, 6], "none")))
    for kind, message in assert_all_ok(run_world(_resume_then_race, 2, root)):
        assert kind == "CommitConflictError", message
        assert "resumed from step 2" in message
    loaded, _, _ = assert_all_ok(run_world(_load, 2, root, args=(6,)))[0]
    assert loaded == 6


def _plain_dcp_rollback(ctx):
    """Plain dcp.save/dcp.load users opt in with resume_point() and resumed_from=."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageReader, AtomicStorageWriter, resume_point

    state = {"w": torch.zeros(4, 3)}
    dcp.load(state, storage_reader=AtomicStorageReader(ctx.root, RUN, 2))
    point = resume_point(ctx.root, RUN, 2) if dist.get_rank() == 0 else None
    dcp.save({"w": state["w"] + 1}, storage_writer=AtomicStorageWriter(ctx.root, RUN, 4, resumed_from=point))
    out = {"w": torch.zeros(4, 3)}
    dcp.load(out, storage_reader=AtomicStorageReader(ctx.root, RUN, 4))
    return torch.equal(out["w"], _state(2, ctx.rank)["w"] + 1)


def test_plain_dcp_users_roll_back_with_resume_point(root):
    assert_all_ok(run_world(_save, 2, root, args=([2, 4], "none")))
    assert all(assert_all_ok(run_world(_plain_dcp_rollback, 2, root)))


def test_resume_point_is_picklable_and_says_where():
    import pickle

    from dcp_atomic import ResumePoint
    from dcp_atomic.format.manifest import Marker

    point = pickle.loads(pickle.dumps(ResumePoint(step=8, sequence=5)))
    marker = Marker(run_id=RUN, step=10, save_id="s", manifest="s/manifest.json", manifest_sha256="0" * 64,
                    committed_at=0.0, library_version="x", sequence=5)
    assert point.supersedes(marker)
    assert not point.supersedes(Marker(**{**marker.__dict__, "sequence": 6}))  # committed after the resume
    assert not point.supersedes(Marker(**{**marker.__dict__, "step": 8}))  # the resumed step itself
    assert "resumed from step 8" in point.describe()


def test_retention_keeps_the_live_branch_and_lets_the_abandoned_one_go_once_older_than_every_kept_step():
    from dcp_atomic.format.manifest import Marker
    from dcp_atomic.protocol.retention_policy import retained

    def commits(*steps):  # in commit order: sequence 1, 2, ...
        return [Marker(run_id=RUN, step=step, save_id=f"s{n}", manifest="m", manifest_sha256="0" * 64,
                       committed_at=0.0, library_version="x", sequence=n) for n, step in enumerate(steps, 1)]

    def kept(markers, keep_last):
        return sorted(m.step for m in retained(markers, keep_last))

    assert kept(commits(2, 4, 6, 8), 2) == [6, 8]                # no rollback: the newest
    assert kept(commits(2, 4, 6, 5), 2) == [4, 5, 6]             # resumed from 4: 6 is abandoned, not counted
    assert kept(commits(2, 4, 6, 5, 7), 2) == [5, 7]             # the live branch has 2 newer commits: 6 goes
    assert kept(commits(2, 4, 5, 6), 2) == [5, 6]                # step 6 superseded: one marker, the new sequence
    assert kept(commits(10, 20, 30, 15, 25), 2) == [15, 25]      # the live branch wins over higher step numbers
    assert kept(commits(2, 4, 6), None) == [2, 4, 6]


def _load_save(ctx, step, save_id):
    from dcp_atomic import CheckpointManager, CheckpointNotFoundError

    with CheckpointManager(ctx.root, RUN, timeout=30) as manager:
        state = {"w": torch.full((4, 3), -7.0), "progress": {"step": -1}}
        try:
            loaded = manager.load(state, step=step, save_id=save_id)
        except CheckpointNotFoundError as e:
            untouched = torch.equal(state["w"], torch.full((4, 3), -7.0)) and state["progress"]["step"] == -1
            return "refused", str(e), untouched
        return "loaded", loaded, torch.equal(state["w"], _state(loaded, ctx.rank)["w"])


def test_load_of_one_named_save_refuses_a_step_saved_again_since_before_reading_anything(root):
    """A record that names one save (Lightning's files) must get that save or nothing: after a rollback re-saved
    step 4, asking for the abandoned save of step 4 is refused with the state untouched, the live one loads."""
    assert_all_ok(run_world(_save, 2, root, args=([2, 4], "none")))
    old = _marker(root, 4)["save_id"]
    assert_all_ok(run_world(_save, 2, root, args=([4], 2)))
    new = _marker(root, 4)["save_id"]
    assert new != old
    for outcome, detail, untouched in assert_all_ok(run_world(_load_save, 2, root, args=(4, old))):
        assert outcome == "refused" and untouched, (outcome, detail)
        assert f"holds save {new}, not the requested save {old}" in detail, detail
    for outcome, loaded, exact in assert_all_ok(run_world(_load_save, 2, root, args=(4, new))):
        assert (outcome, loaded, exact) == ("loaded", 4, True)
