"""Snapshots through bounded staging (P16: ``CheckpointManager(memory=..., staging=...)``): ``snapshot()`` returns
while the tensors are still being copied into the slot through the pool; ``wait_staged()`` says when they may
change; an in-place change before it (an optimizer step) fails that snapshot with ``StagingRaceError`` on every
rank, commits nothing and leaves the previous snapshot to restore.

Worlds of 4 ranks as 2 simulated nodes, each node's memory path on its own tmpfs (tests/helpers/memory.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.harness import assert_all_ok
from tests.helpers.fsdp_app import _train_step
from tests.helpers.memory import full_state, memory_manager, state_of, trained
from tests.helpers.tiers import WORLD, _run

pytestmark = pytest.mark.timeout(300)


def _staged_snapshots(ctx, race_at):
    """Snapshots of steps 1..3 with staging (every tensor copied after the call: the test model's are small); at ``race_at`` the optimizer steps before ``wait_staged()`` while the
    stager is held before its copy (a failpoint), so the change lands first.  Returns what each snapshot did, then
    what a fresh job restores."""
    from dcp_atomic import Staging, StagingRaceError
    from dcp_atomic._base import failpoints

    model, optim = trained(WORLD, 0)
    outcomes = {}
    release = threading.Event()
    with memory_manager(ctx, staging=Staging(pool_bytes=8 << 20, window_bytes=1 << 20, eager_bytes=0)) as manager:
        for step in (1, 2, 3):
            _train_step(model, optim, step)
            expected = {k: v.clone() for k, v in full_state(model, optim).items()}  # collectives: before arming
            held = step == race_at
            if held:
                failpoints.arm("stage.before_copy", lambda rank, s: release.wait(30))
            future = manager.snapshot(step, state_of(model, optim, step))
            if held:
                with torch.no_grad():  # what optimizer.step() does before wait_staged(): in place
                    for parameter in model.parameters():
                        parameter.add_(1.0)
                release.set()
            else:
                manager.wait_staged()
            try:
                outcomes[step] = future.result()
            except StagingRaceError as e:
                outcomes[step] = ("StagingRaceError", e.details.get("step"))
            failpoints.disarm("stage.before_copy")
            if held:
                with torch.no_grad():
                    for parameter in model.parameters():
                        parameter.sub_(1.0)
            if outcomes[step] == step:
                last, last_state = step, expected
    fresh, optim2 = trained(WORLD, 0, seed=7)
    with memory_manager(ctx) as manager:
        restored = manager.load(state_of(fresh, optim2, 0))
        tier = (manager.restored_from or {}).get("tier")
    got = full_state(fresh, optim2)
    exact = got.keys() == last_state.keys() and all(torch.equal(got[k], last_state[k]) for k in got)
    return outcomes, restored, tier, exact, last


def test_a_staged_snapshot_restores_exactly_what_it_held_when_it_was_taken(root, nodes):
    results = assert_all_ok(_run(_staged_snapshots, root, nodes, None))
    for outcomes, restored, tier, exact, last in results:
        assert outcomes == {1: 1, 2: 2, 3: 3}, outcomes
        assert (restored, tier, exact, last) == (3, "memory", True, 3)


def test_an_optimizer_step_before_wait_staged_fails_the_snapshot_on_every_rank_and_the_previous_one_restores(
        root, nodes):
    results = assert_all_ok(_run(_staged_snapshots, root, nodes, 3))
    for outcomes, restored, tier, exact, last in results:
        assert outcomes == {1: 1, 2: 2, 3: ("StagingRaceError", 3)}, outcomes  # on every rank
        assert (restored, tier, exact, last) == (2, "memory", True, 2)  # nothing of step 3 committed


def _fsdp_async_save_race(ctx):
    """async_save of an FSDP2 model with staging; its parameters (DTensors) changed in place while the writer is held
    before its first byte: the version counter that moves is the DTensor's own, not its local shard's."""
    from dcp_atomic import CheckpointManager, Staging, StagingRaceError
    from dcp_atomic._base import failpoints

    model, optim = trained(WORLD, 1)
    release = threading.Event()
    failpoints.arm("write.before_data", lambda rank, step: release.wait(30) if step == 2 else None)
    with CheckpointManager(ctx.root, "fsdp", staging=Staging(pool_bytes=8 << 20, window_bytes=1 << 20, eager_bytes=0),
                           timeout=30) as manager:
        manager.async_save(1, state_of(model, optim, 1)).result()
        future = manager.async_save(2, state_of(model, optim, 2))
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(1.0)  # what optimizer.step() does before wait_staged()
        release.set()
        try:
            future.result()
            outcome = "committed"
        except StagingRaceError as e:
            outcome = ("StagingRaceError", e.details.get("step"))
        return outcome, manager.steps()


def test_an_fsdp2_parameter_changed_before_wait_staged_fails_async_save_on_every_rank(root, nodes):
    results = assert_all_ok(_run(_fsdp_async_save_race, root, nodes))
    assert results == [(("StagingRaceError", 2), [1])] * WORLD, results


class _DataSGD(torch.optim.Optimizer):
    """An optimizer that writes through ``p.data`` (as some still do): it moves no version counter of ``p``."""

    def __init__(self, params):
        super().__init__(params, {"lr": 1.0})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.data.add_(1.0)


def test_an_optimizer_writing_through_data_waits_for_the_staged_copy_so_the_snapshot_holds_its_step(tmp_path):
    """One process, no replicas: the stager is held before its copy, and the optimizer steps at once (no
    ``wait_staged()``): the manager's optimizer step pre-hook waits for the copy, so the snapshot holds the values
    of its step, never the post-step ones under its step's number; after ``close()`` the hook is gone."""
    from dcp_atomic import CheckpointManager, MemoryTier, Staging
    from dcp_atomic._base import failpoints

    memory = tmp_path / "shm"
    memory.mkdir()
    model = torch.nn.Linear(64, 64)
    optimizer = _DataSGD(model.parameters())
    at_snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    tier = MemoryTier(str(memory), replicas=0)
    staging = Staging(pool_bytes=1 << 20, window_bytes=64 << 10, eager_bytes=0)
    with CheckpointManager(str(tmp_path / "ckpt"), "data", memory=tier, staging=staging) as manager:
        failpoints.arm("stage.before_copy", "sleep:0.5")
        future = manager.snapshot(1, {"model": model.state_dict()})
        optimizer.step()  # no wait_staged(): the hook waits
        assert future.result() == 1
        failpoints.disarm("stage.before_copy")
    optimizer.step()  # the manager is closed: no hook left that could reach it
    restored = {"model": torch.nn.Linear(64, 64).state_dict()}
    with CheckpointManager(str(tmp_path / "ckpt"), "data", memory=tier) as manager:
        assert manager.load(restored) == 1
    for key, value in at_snapshot.items():
        assert torch.equal(restored["model"][key], value), key
    assert not any(torch.equal(model.state_dict()[k], v) for k, v in at_snapshot.items())  # training moved on


def test_a_staging_race_in_a_snapshot_is_said_once_whole_naming_the_key(tmp_path):
    """The snapshot's ``StagingRaceError`` names the key and its versions once, whole (not the save's message cut
    and followed by its own advice again)."""
    from dcp_atomic import CheckpointManager, MemoryTier, Staging, StagingRaceError
    from dcp_atomic._base import failpoints

    (tmp_path / "shm").mkdir()
    weights, release = torch.zeros(1 << 16), threading.Event()
    staging = Staging(pool_bytes=1 << 20, window_bytes=64 << 10, eager_bytes=0)
    with CheckpointManager(str(tmp_path / "ckpt"), "race", memory=MemoryTier(str(tmp_path / "shm"), replicas=0),
                           staging=staging) as manager:
        failpoints.arm("stage.before_copy", lambda rank, step: release.wait(30))
        future = manager.snapshot(1, {"weights": weights})
        weights.add_(1.0)  # in place, outside any optimizer, before wait_staged()
        release.set()
        with pytest.raises(StagingRaceError) as raced:
            future.result()
        failpoints.disarm("stage.before_copy")
    message = str(raced.value)
    assert "'weights' was changed in place (version 0 -> 1)" in message, message
    assert message.count("wait_staged") == 1 and "…" not in message and message.count("rank 0") == 1, message
