"""HF Accelerate the way its users run it: a real ``Accelerator`` with ``prepare`` (DDP over gloo on the CPU: Accelerate
turns on FSDP only on accelerator devices), saved through :class:`AcceleratorCheckpoint` where they would call
``save_state`` — a job killed inside a save resumes the last committed step exactly (weights, optimizer, scheduler,
sampler epoch, registered objects, every rank's random generators) and trains on to the same weights; a job on
one process loads it too; a save that would hold no model weights is refused with the fix."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from tests.harness import assert_all_ok, run_world

pytest.importorskip("accelerate")


class Counter:
    """A ``register_for_checkpointing`` object."""

    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


def _job(seed: int = 0, seedable: bool = True):
    """What every run of the test job builds, identically: the user's script up to its training loop.  Accelerate's
    default sampler shuffles with a generator it synchronises across ranks; the seedable one reseeds per epoch."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed

    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=seedable))
    set_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)
    data = torch.randn(32, 6, generator=torch.Generator().manual_seed(99))  # the same data, whatever the seed
    data = torch.utils.data.TensorDataset(data[:, :4], data[:, 4:])
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    return accelerator, model, optimizer, loader, scheduler, counter


def _train_step(accelerator, model, optimizer, loader, scheduler, counter) -> None:
    """One step = one epoch of the loader (its order decides the float sums: a wrong sampler epoch shows)."""
    for x, y in loader:
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()
    counter.n += 1


def _snapshot(accelerator, model, optimizer, scheduler, counter) -> dict:
    def cloned(value):
        if isinstance(value, torch.Tensor):
            return value.detach().clone()
        if isinstance(value, dict):
            return {k: cloned(v) for k, v in value.items()}
        return value

    return {"weights": cloned(accelerator.unwrap_model(model).state_dict()),
            "optimizer": cloned(optimizer.optimizer.state_dict()["state"]), "lr": scheduler.get_last_lr(),
            "counter": counter.n}


def _draws() -> tuple:
    return (torch.rand(3), random.random(), float(np.random.rand()))


def _first_run(ctx):
    """Train 5 steps, save at 2 and 3 (keep_last=2); what a resume must reproduce is recorded after the step-3
    save; the save at step 5 is killed on rank 1 (DCP_ATOMIC_FAILPOINTS)."""
    from dcp_atomic.integrations.accelerate import AcceleratorCheckpoint

    job = _job(seedable=ctx.extra["seedable"])
    accelerator = job[0]
    torch.manual_seed(100 + ctx.rank), random.seed(ctx.rank), np.random.seed(ctx.rank)  # generators of its own
    # timeout=5: the survivor of the kill names its dead peer after 5 s (15 s proved no more)
    checkpoint = AcceleratorCheckpoint(accelerator, ctx.root, "exp", keep_last=2, timeout=5)
    assert checkpoint.load() is None  # a fresh start
    record = {}
    for step in range(1, 6):
        _train_step(*job)
        if step in (2, 3):
            checkpoint.save(step)
        if step == 3:
            record["at_3"] = _snapshot(accelerator, job[1], job[2], job[4], job[5])
            record["draws"] = _draws()
            record["loader_iteration"] = job[3].iteration
    record["at_5"] = _snapshot(accelerator, job[1], job[2], job[4], job[5])
    torch.save(record, os.path.join(ctx.root, f"first_rank{ctx.rank}.pt"))
    checkpoint.save(5)  # rank 1 is killed inside it


def _resumed_run(ctx):
    from dcp_atomic.integrations.accelerate import AcceleratorCheckpoint

    job = _job(seed=123, seedable=ctx.extra.get("seedable", True))  # everything that matters from the checkpoint
    accelerator = job[0]
    with AcceleratorCheckpoint(accelerator, ctx.root, "exp", keep_last=2, timeout=15) as checkpoint:
        step = checkpoint.load()
        got = {"step": step, "at_3": _snapshot(accelerator, job[1], job[2], job[4], job[5]), "draws": _draws(),
               "loader_iteration": job[3].iteration, "steps": checkpoint.manager.steps()}
        if ctx.extra.get("train_on"):
            for _ in range(step + 1, 6):
                _train_step(*job)
            got["at_5"] = _snapshot(accelerator, job[1], job[2], job[4], job[5])
    return got


def _assert_same(got, want, where):
    if isinstance(want, torch.Tensor):
        assert torch.equal(got, want), where
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for k in want:
            _assert_same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (tuple, list)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want, where


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("sampler", ["seedable", "default"])
def test_a_job_killed_inside_a_save_resumes_the_last_commit_exactly_on_two_ranks_and_on_one(tmp_path, sampler):
    root, seedable = str(tmp_path), sampler == "seedable"
    first = run_world(_first_run, 2, root, env={"DCP_ATOMIC_FAILPOINTS": "write.mid_data@1#3=kill"}, timeout=150,
                      extra={"seedable": seedable})
    assert first[1].killed or first[1].error_type == "ProcessDied", first[1]
    assert not first[0].ok  # its peer died inside the save: the save failed, never reported committed
    recorded = [torch.load(os.path.join(root, f"first_rank{r}.pt"), weights_only=False) for r in range(2)]
    assert recorded[0]["loader_iteration"] == 3  # three epochs: a fresh loader would start at 0

    resumed = assert_all_ok(run_world(_resumed_run, 2, root, extra={"train_on": True, "seedable": seedable},
                                      timeout=150))
    for rank, got in enumerate(resumed):
        want = recorded[rank]
        assert got["step"] == 3 and got["steps"] == [2, 3]  # the killed save is not a step; keep_last=2
        _assert_same(got["at_3"], want["at_3"], f"rank {rank} at step 3")
        _assert_same(got["draws"], want["draws"], f"rank {rank} random draws after the load")
        assert got["loader_iteration"] == want["loader_iteration"]
        _assert_same(got["at_5"], want["at_5"], f"rank {rank} trained on to step 5")
    assert not torch.equal(resumed[0]["draws"][0], resumed[1]["draws"][0])  # each rank got its own generators

    [alone] = assert_all_ok(run_world(_resumed_run, 1, root, no_process_group=True, timeout=150,
                                      extra={"seedable": seedable}))
    assert alone["step"] == 3
    _assert_same(alone["at_3"], recorded[0]["at_3"], "one process at step 3")
    _assert_same(alone["draws"], recorded[0]["draws"], "one process: rank 0's generators")


def _refusals(ctx):
    from accelerate import Accelerator

    from dcp_atomic.errors import ConfigurationError
    from dcp_atomic.integrations.accelerate import AcceleratorCheckpoint

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 2)
    optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))  # the model is not prepared
    messages = []
    with AcceleratorCheckpoint(accelerator, ctx.root, "exp") as checkpoint:
        try:
            checkpoint.save(1)
        except ConfigurationError as e:
            messages.append(str(e))
        accelerator.prepare(torch.nn.Linear(3, 3))  # a model, but not the optimizer's
        try:
            checkpoint.save(1)
        except ConfigurationError as e:
            messages.append(str(e))
        steps = checkpoint.manager.steps()
    del optimizer
    return messages, steps


@pytest.mark.slow
def test_a_save_that_would_hold_no_model_weights_is_refused_with_the_fix(tmp_path):
    [(messages, steps)] = assert_all_ok(run_world(_refusals, 1, str(tmp_path), no_process_group=True, timeout=120))
    assert len(messages) == 2, messages
    assert "holds no model" in messages[0] and "accelerator.prepare(model, optimizer" in messages[0]
    assert "optimizer 0 updates parameters that are in no model the Accelerator prepared" in messages[1]
    assert steps == []  # nothing was committed


def _two_tiers(ctx):
    from dcp_atomic import LocalTierOptions
    from dcp_atomic.integrations.accelerate import AcceleratorCheckpoint

    job = _job()
    durable, local = os.path.join(ctx.root, "durable"), os.path.join(ctx.root, "local")
    with AcceleratorCheckpoint(job[0], durable, "exp", local=LocalTierOptions(local, replicas=0)) as checkpoint:
        _train_step(*job)
        checkpoint.save(1)
        want = _snapshot(job[0], job[1], job[2], job[4], job[5])
    job = _job(seed=7)
    with AcceleratorCheckpoint(job[0], durable, "exp", local=LocalTierOptions(local, replicas=0)) as checkpoint:
        step = checkpoint.load()
        tier = checkpoint.manager.restored_from["tier"]
        durable_steps = checkpoint.manager.steps("durable")
    return step, tier, durable_steps, want, _snapshot(job[0], job[1], job[2], job[4], job[5])


@pytest.mark.slow
def test_the_local_tier_works_through_it_as_through_the_manager(tmp_path):
    [(step, tier, durable_steps, want, got)] = assert_all_ok(
        run_world(_two_tiers, 1, str(tmp_path), no_process_group=True, timeout=120))
    assert (step, tier, durable_steps) == (1, "local", [1])  # restored from the node's disk, drained on close
    _assert_same(got, want, "restored from the local tier")


def _other_objects(ctx):
    from accelerate import Accelerator

    from dcp_atomic.errors import CheckpointError
    from dcp_atomic.integrations.accelerate import AcceleratorCheckpoint

    job = _job()
    with AcceleratorCheckpoint(job[0], ctx.root, "exp") as checkpoint:
        checkpoint.save(1)
    errors = {}
    for extra in (0, 1):  # one object fewer than saved, then one more
        accelerator = Accelerator(cpu=True)
        model = accelerator.prepare(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)))
        accelerator._custom_objects.clear()  # the Accelerator state is per process: start from this job's objects
        accelerator.register_for_checkpointing(*[Counter() for _ in range(extra * 2)])
        with AcceleratorCheckpoint(accelerator, ctx.root, "exp") as checkpoint:
            try:
                checkpoint.load()
            except CheckpointError as e:
                errors[extra] = (type(e).__name__, str(e))
        del model
    accelerator, _, optimizer, *_ = _job()  # what was saved, and one more scheduler
    accelerator.prepare(torch.optim.lr_scheduler.StepLR(optimizer.optimizer, step_size=1, gamma=0.5))
    with AcceleratorCheckpoint(accelerator, ctx.root, "exp") as checkpoint:
        try:
            checkpoint.load()
        except CheckpointError as e:
            errors[2] = (type(e).__name__, str(e))
    return errors


@pytest.mark.slow
def test_a_load_into_an_accelerator_holding_other_objects_is_refused_naming_them(tmp_path):
    """Fewer objects than saved, more, or one more scheduler: refused naming what the step holds and what this
    Accelerator holds (not DCP's first missing key)."""
    [errors] = assert_all_ok(run_world(_other_objects, 1, str(tmp_path), no_process_group=True, timeout=120))
    fewer, more, scheduler = errors[0], errors[1], errors[2]
    assert fewer[0] == "ConfigurationError" and "'optimizers': 1" in fewer[1] and "'optimizers': 0" in fewer[1]
    assert "Prepare the same objects, in the same order" in fewer[1]
    assert more[0] == "ConfigurationError" and "'custom_objects': 1" in more[1] and "'custom_objects': 2" in more[1]
    assert scheduler[0] == "ConfigurationError", scheduler
    assert "holding {'models': 1, 'optimizers': 1, 'schedulers': 1" in scheduler[1], scheduler
    assert "this one holds {'models': 1, 'optimizers': 1, 'schedulers': 2" in scheduler[1], scheduler


class Tracker:
    """A registered object whose state grows: a fresh one's ``state_dict()`` has none of the saved keys."""

    def __init__(self):
        self.best: dict = {}

    def state_dict(self):
        return {"best": self.best}

    def load_state_dict(self, state):
        self.best = state["best"]


def _what_users_do(ctx):
    """A fresh start and a save before the first step change nothing; growing state loads whole; one optimizer over
    two models; Accelerate's pre-hooks and a save into another run's steps without load() are refused."""
    from accelerate import Accelerator

    from dcp_atomic.errors import ConfigurationError
    from dcp_atomic.integrations.accelerate import AcceleratorCheckpoint

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    generator, critic = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    optimizer = torch.optim.Adam(list(generator.parameters()) + list(critic.parameters()), lr=0.1)
    generator, critic, optimizer = accelerator.prepare(generator, critic, optimizer)
    tracker = Tracker()
    accelerator.register_for_checkpointing(tracker)
    got = {}
    with AcceleratorCheckpoint(accelerator, ctx.root, "exp") as checkpoint:
        got["fresh_load"] = checkpoint.load()
        got["state_after_fresh_load"] = len(optimizer.optimizer.state)
        checkpoint.save(0)
        got["state_after_save_0"] = len(optimizer.optimizer.state)
        critic(generator(torch.ones(2, 4))).sum().backward()
        optimizer.step()
        tracker.best = {"loss": torch.tensor(0.25), "epoch": 3}
        checkpoint.save(1)
        want = {k: v.clone() for k, v in optimizer.optimizer.state_dict()["state"][0].items()}
    tracker.best = {}
    with AcceleratorCheckpoint(accelerator, ctx.root, "exp") as checkpoint:
        got["loaded"] = checkpoint.load(0)
        got["state_after_loading_0"] = len(optimizer.optimizer.state)
        got["loaded"] = (got["loaded"], checkpoint.load())
        loaded = optimizer.optimizer.state_dict()["state"][0]
        got["optimizer_exact"] = all(torch.equal(loaded[k], want[k]) for k in want)
        got["tracker"] = tracker.best
    with AcceleratorCheckpoint(accelerator, ctx.root, "exp") as checkpoint:  # a new job forgets load()
        try:
            checkpoint.save(1)
        except ConfigurationError as e:
            got["no_load"] = str(e)
        accelerator.register_save_state_pre_hook(lambda models, weights, output_dir: None)
        try:
            checkpoint.load()
        except ConfigurationError as e:
            got["hooks"] = str(e)
        got["steps"] = checkpoint.manager.steps()
    return got


@pytest.mark.slow
def test_what_accelerate_users_do_saves_and_loads_what_they_meant_or_is_refused(tmp_path):
    [got] = assert_all_ok(run_world(_what_users_do, 1, str(tmp_path), no_process_group=True, timeout=120))
    assert got["fresh_load"] is None
    assert got["state_after_fresh_load"] == got["state_after_save_0"] == got["state_after_loading_0"] == 0
    assert got["loaded"] == (0, 1) and got["optimizer_exact"]
    assert torch.equal(got["tracker"]["loss"], torch.tensor(0.25)) and got["tracker"]["epoch"] == 3
    assert "already holds committed steps [0, 1]; call AcceleratorCheckpoint.load() first" in got["no_load"]
    assert "1 save/load-state pre-hook(s)" in got["hooks"] and "register_for_checkpointing" in got["hooks"]
    assert got["steps"] == [0, 1]  # nothing written by the refused calls


def _on_s3(ctx):
    from dcp_atomic.integrations.accelerate import AcceleratorCheckpoint

    options = ctx.extra["options"]
    job = _job()
    with AcceleratorCheckpoint(job[0], ctx.extra["root"], "exp", keep_last=1, storage_options=options) as checkpoint:
        assert checkpoint.load() is None
        for step in (1, 2):
            _train_step(*job)
            checkpoint.save(step)
        want = _snapshot(job[0], job[1], job[2], job[4], job[5])
    job = _job(seed=5)
    with AcceleratorCheckpoint(job[0], ctx.extra["root"], "exp", keep_last=1, storage_options=options) as checkpoint:
        step, steps = checkpoint.load(), checkpoint.manager.steps()
    return step, steps, want, _snapshot(job[0], job[1], job[2], job[4], job[5])


@pytest.mark.slow
def test_an_s3_root_works_through_it_as_through_the_manager(s3_seaweedfs, tmp_path):
    extra = {"root": s3_seaweedfs.root, "options": s3_seaweedfs.options()}
    [(step, steps, want, got)] = assert_all_ok(run_world(_on_s3, 1, str(tmp_path), no_process_group=True,
                                                         extra=extra, timeout=120))
    assert (step, steps) == (2, [2])  # keep_last=1 on the object store
    _assert_same(got, want, "loaded back from S3")


class Stamped:
    """A registered object holding a type torch's weights-only load refuses."""

    def state_dict(self):
        import datetime

        return {"at": datetime.datetime(2026, 12, 3)}

    def load_state_dict(self, state):
        pass


def _unloadable(ctx):
    from accelerate import Accelerator

    from dcp_atomic.errors import UnsafeItemError
    from dcp_atomic.integrations.accelerate import AcceleratorCheckpoint

    accelerator = Accelerator(cpu=True)
    accelerator.prepare(torch.nn.Linear(2, 2))
    accelerator.register_for_checkpointing(Stamped())
    with AcceleratorCheckpoint(accelerator, ctx.root, "exp") as checkpoint:
        try:
            checkpoint.save(1)
            refused = None
        except UnsafeItemError as e:
            refused = str(e)
        return refused, checkpoint.manager.steps()


def test_registered_state_the_load_would_refuse_is_refused_at_save_not_at_resume(tmp_path):
    [(refused, steps)] = assert_all_ok(run_world(_unloadable, 1, str(tmp_path), no_process_group=True, timeout=120))
    assert refused and "'custom'" in refused and "datetime" in refused and "add_safe_globals" in refused, refused
    assert steps == []  # nothing committed that the resume could not read
