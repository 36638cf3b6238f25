"""DCP's plan caching (``enable_plan_caching=True``) with dcp_atomic.

A cached plan is replayed by every rank without reaching the coordinator, so the save_id cannot ride in it:
each save of a series derives its own from the series' first save_id and a count every rank advances in
lockstep, and the coordinator refuses to commit unless every rank wrote the step and save_id it planned.

One refused save never breaks the next (P14): DCP's coordinator fills its plan caches before
``prepare_global_plan`` may refuse, while the ranks' caches advance only after it; and each planner class has its
own DCP cache, so its own series.
"""

from __future__ import annotations

import json
import os

import torch

import pytest
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from dcp_atomic import AtomicSavePlanner
from tests.harness import assert_all_ok, run_world

RUN = "cached"


class ModelOnlySavePlanner(AtomicSavePlanner):
    """A job's second caching planner class, for model-only saves: DCP caches its plans apart (by class name)."""


class PlainModelOnlySavePlanner(DefaultSavePlanner):
    """The same with DCP's own planner, whose plans do not say which cache they come from."""


def _state(rank: int, value: int) -> dict:
    return {"shared": torch.arange(6.0) * value, f"own{rank}": torch.full((3,), float(10 * rank + value)),
            "meta": {"value": value}}


def _model_state(rank: int, value: int) -> dict:
    """What a model-only save holds: a part of ``_state``, so another plan."""
    return {k: v for k, v in _state(rank, value).items() if k != "meta"}


def _grown_state(rank: int, value: int) -> dict:
    return {**_state(rank, value), "extra": torch.full((4,), float(value))}


def _save(ctx, step: int, value: int, planner, *, overwrite: bool = False, run: str = RUN, asynchronous=False,
          state=_state):
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageWriter

    writer = AtomicStorageWriter(ctx.root, run, step, thread_count=1, overwrite=overwrite)
    if asynchronous:
        dcp.async_save(state(ctx.rank, value), storage_writer=writer, planner=planner).result()
    else:
        dcp.save(state(ctx.rank, value), storage_writer=writer, planner=planner)
    return writer.save_id


def _refused(fn) -> str | None:
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - DCP wraps the coordinator's error in a CheckpointException
        return str(e)
    return None


def _loads_bit_exact(ctx, step: int, value: int, run: str = RUN, state=_state) -> bool:
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageReader

    want = state(ctx.rank, value)
    got = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"value": -1} for k, v in want.items()}
    dcp.load(got, storage_reader=AtomicStorageReader(ctx.root, run, step))
    return all(torch.equal(got[k], want[k]) if isinstance(want[k], torch.Tensor) else got[k] == want[k]
               for k in want)


def _cached_series(ctx):
    """World 2, in order: five cached saves (sync, async, an overwrite) and their loads; a rank built for
    another step; a save after that; a rank whose count of saves fell behind; AtomicSavePlanner with caching,
    whose content check still runs on a cached save."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from dcp_atomic import AtomicSavePlanner
    from dcp_atomic.dcp import plan_cache

    global_plans = []  # DCP's dedup + global plan runs only when a plan is not cached
    build = DefaultSavePlanner._create_global_plan
    DefaultSavePlanner._create_global_plan = lambda self, plans: global_plans.append(1) or build(self, plans)

    def caching():
        return DefaultSavePlanner(enable_plan_caching=True)

    out = {"ids": {}}
    for step in (1, 2, 3):
        out["ids"][step] = _save(ctx, step, step, caching())
    out["ids"][4] = _save(ctx, 4, 4, caching(), asynchronous=True)
    out["ids"]["3b"] = _save(ctx, 3, 30, caching(), overwrite=True)
    out["global_plans"] = len(global_plans)
    out["loads"] = {step: _loads_bit_exact(ctx, step, value) for step, value in ((1, 1), (2, 2), (3, 30), (4, 4))}

    out["other_step"] = _refused(lambda: _save(ctx, 5 if ctx.rank == 0 else 6, 5, caching()))
    out["ids"][7] = _save(ctx, 7, 7, caching())
    out["loads"][7] = _loads_bit_exact(ctx, 7, 7)

    if ctx.rank == 1:  # as if this rank had missed a save of the series
        plan_cache._counts[next(reversed(plan_cache._counts))] -= 1
    out["behind"] = _refused(lambda: _save(ctx, 8, 8, caching()))

    def atomic():
        return AtomicSavePlanner(enable_plan_caching=True)

    out["ids"][10] = _save(ctx, 10, 10, atomic(), run="atomic")
    out["ids"][11] = _save(ctx, 11, 11, atomic(), run="atomic")
    out["loads"][11] = _loads_bit_exact(ctx, 11, 11, run="atomic")

    def diverged():
        import torch.distributed.checkpoint as dcp

        from dcp_atomic import AtomicStorageWriter

        state = _state(0, 12)  # "own0" on both ranks: a plain tensor whose copies differ
        state["own0"] += ctx.rank
        dcp.save(state, storage_writer=AtomicStorageWriter(ctx.root, "atomic", 12, thread_count=1), planner=atomic())

    out["diverged"] = _refused(diverged)
    return out


def _committed(root: str, run: str, step: int) -> str | None:
    path = os.path.join(root, run, f"step_{step:010d}", "COMMITTED")
    return json.load(open(path))["save_id"] if os.path.exists(path) else None


def test_cached_plans_save_distinct_committed_attempts_and_diverging_ranks_are_refused(root):
    results = assert_all_ok(run_world(_cached_series, 2, root, timeout=240))
    rank0, rank1 = results
    assert rank0["ids"] == rank1["ids"], results
    ids = rank0["ids"]
    assert len(set(ids.values())) == len(ids), ids  # every save its own attempt, the overwrite included
    assert rank0["global_plans"] == 1, "the plan was not cached: DCP planned again"
    assert all(r["loads"] for r in results) and all(all(r["loads"].values()) for r in results), results
    for step in (1, 2, 4, 7):
        assert _committed(root, RUN, step) == ids[step]
    assert _committed(root, RUN, 3) == ids["3b"]
    assert os.path.isdir(os.path.join(root, RUN, "step_0000000003", ids[3]))  # the replaced attempt is untouched
    assert _committed(root, "atomic", 10) == ids[10] and _committed(root, "atomic", 11) == ids[11]

    for error in (rank0["other_step"], rank1["other_step"]):
        assert error and "RankConsistencyError" in error and "rank 1" in error and "step 6" in error, error
    assert _committed(root, RUN, 5) is None and _committed(root, RUN, 6) is None
    for error in (rank0["behind"], rank1["behind"]):
        assert error and "RankConsistencyError" in error and "rank 1" in error and "rank 0" in error, error
    assert _committed(root, RUN, 8) is None
    for error in (rank0["diverged"], rank1["diverged"]):
        assert error and "ReshardError" in error and "'own0'" in error, error
    assert _committed(root, "atomic", 12) is None


def _count_global_plans() -> dict[str, int]:
    """DCP's dedup + global planning, per planner class: it runs only where a plan is not cached."""
    counts: dict[str, int] = {}
    build = DefaultSavePlanner._create_global_plan

    def counted(self, plans):
        counts[type(self).__name__] = counts.get(type(self).__name__, 0) + 1
        return build(self, plans)

    DefaultSavePlanner._create_global_plan = counted
    return counts


def _committed_step_refusals(ctx, kind: str):
    """World 2: a job resumed at a committed step, then saves of committed steps in mid-series, one of them with
    a grown state dict (DCP re-plans it), each followed by cached saves.  ``kind``: a fresh DefaultSavePlanner per
    save, or one AtomicSavePlanner reused for every save, as a training loop holds it."""
    reused = AtomicSavePlanner(enable_plan_caching=True)

    def planner():
        return DefaultSavePlanner(enable_plan_caching=True) if kind == "default" else reused

    plans = _count_global_plans()
    out = {"ids": {}, "refused": {}}
    out["ids"][1] = _save(ctx, 1, 1, None)  # a previous job's checkpoint, saved without caching
    out["refused"][1] = _refused(lambda: _save(ctx, 1, 1, planner()))  # this process's first cached save
    out["ids"][2] = _save(ctx, 2, 2, planner())
    out["ids"][3] = _save(ctx, 3, 3, planner())
    out["refused"][2] = _refused(lambda: _save(ctx, 2, 2, planner()))  # the series' plans cached on every rank
    out["ids"][4] = _save(ctx, 4, 4, planner())
    out["refused"][3] = _refused(lambda: _save(ctx, 3, 3, planner(), state=_grown_state))  # a plan DCP re-made
    out["ids"][5] = _save(ctx, 5, 5, planner())
    out["ids"][6] = _save(ctx, 6, 6, planner(), state=_grown_state)
    out["ids"][7] = _save(ctx, 7, 7, planner(), state=_grown_state)
    out["global_plans"] = sum(plans.values())
    out["loads"] = {step: _loads_bit_exact(ctx, step, step, state=_grown_state if step >= 6 else _state)
                    for step in range(1, 8)}
    return out


def _every_save_committed_its_own_attempt(root, results, run_of=lambda step: RUN) -> dict:
    """Both ranks derived the same save ids, one per save, and each step's marker names its save's."""
    rank0, rank1 = results
    assert rank0["ids"] == rank1["ids"], results
    ids = rank0["ids"]
    assert len(set(ids.values())) == len(ids), ids
    for step, save_id in ids.items():
        assert _committed(root, run_of(step), step) == save_id, (step, ids)
    return ids


@pytest.mark.parametrize("kind", ["default", "atomic"])
def test_a_refused_save_of_a_committed_step_leaves_every_later_cached_save_committing(root, kind):
    results = assert_all_ok(run_world(_committed_step_refusals, 2, root, args=(kind,), timeout=240))
    _every_save_committed_its_own_attempt(root, results)
    for rank in results:
        for step, error in rank["refused"].items():
            assert error and "CommitConflictError" in error and f"step {step} " in error, (step, error)
        assert all(rank["loads"].values()), rank["loads"]
    # planned by DCP: the uncached save, the refused first one (its plan unknown to the ranks, planned again),
    # the grown state refused, then written; every other save replayed its rank's cached plan
    assert results[0]["global_plans"] == 5, results[0]["global_plans"]


def _check_and_storage_refusals(ctx):
    """World 2, AtomicSavePlanner with caching: a save its content check refuses (a plain tensor whose copies
    differ, under a key rank 1 does not otherwise have), and a save whose attempt cannot be created (a file where
    the step's directory goes) with a grown state dict; each followed by cached saves."""
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageWriter

    def planner():
        return AtomicSavePlanner(enable_plan_caching=True)

    out = {"ids": {}}
    out["ids"][1] = _save(ctx, 1, 1, planner())
    out["ids"][2] = _save(ctx, 2, 2, planner())

    def diverged():
        state = _state(0, 9)  # "own0" on both ranks: a plain tensor whose copies differ
        state["own0"] += ctx.rank
        dcp.save(state, storage_writer=AtomicStorageWriter(ctx.root, RUN, 9, thread_count=1), planner=planner())

    out["diverged"] = _refused(diverged)
    out["ids"][3] = _save(ctx, 3, 3, planner())

    blocker = os.path.join(ctx.root, RUN, f"step_{4:010d}")
    if ctx.rank == 0:
        open(blocker, "w").close()
    # overwrite=True: past the committed-step check, the refusal comes from creating the attempt
    out["storage"] = _refused(lambda: _save(ctx, 4, 4, planner(), state=_grown_state, overwrite=True))
    if ctx.rank == 0:
        os.remove(blocker)
    out["ids"][4] = _save(ctx, 4, 4, planner(), state=_grown_state)
    out["ids"][5] = _save(ctx, 5, 5, planner(), state=_grown_state)
    out["loads"] = {step: _loads_bit_exact(ctx, step, step, state=_grown_state if step >= 4 else _state)
                    for step in range(1, 6)}
    return out


def test_a_save_refused_by_a_check_or_by_storage_leaves_every_later_cached_save_committing(root):
    results = assert_all_ok(run_world(_check_and_storage_refusals, 2, root, timeout=240))
    _every_save_committed_its_own_attempt(root, results)
    assert _committed(root, RUN, 9) is None
    for rank in results:
        assert rank["diverged"] and "ReshardError" in rank["diverged"] and "'own0'" in rank["diverged"], rank
        error = rank["storage"]
        assert error and "StorageError" in error and "creating the attempt" in error and "step_0000000004" in error
        assert all(rank["loads"].values()), rank["loads"]


def _interleaved_planner_classes(ctx):
    """World 2: full saves through AtomicSavePlanner and model-only saves through a subclass, alternating, both
    cached; then two plain DCP planner classes, whose replays cannot be told apart."""
    plans = _count_global_plans()
    out = {"ids": {}}
    for step in range(1, 9):
        if step % 2:
            out["ids"][step] = _save(ctx, step, step, AtomicSavePlanner(enable_plan_caching=True))
        else:
            out["ids"][step] = _save(ctx, step, step, ModelOnlySavePlanner(enable_plan_caching=True),
                                     state=_model_state)
    out["global_plans"] = dict(plans)
    out["loads"] = {step: _loads_bit_exact(ctx, step, step, state=_model_state if step % 2 == 0 else _state)
                    for step in range(1, 9)}

    out["ids"][10] = _save(ctx, 10, 10, DefaultSavePlanner(enable_plan_caching=True), run="plain")
    out["ids"][11] = _save(ctx, 11, 11, PlainModelOnlySavePlanner(enable_plan_caching=True), run="plain",
                           state=_model_state)
    out["ambiguous"] = _refused(lambda: _save(ctx, 12, 12, DefaultSavePlanner(enable_plan_caching=True),
                                              run="plain"))
    out["ids"][13] = _save(ctx, 13, 13, AtomicSavePlanner(enable_plan_caching=True))  # named: still found
    out["loads"][13] = _loads_bit_exact(ctx, 13, 13)
    return out


def test_two_caching_planner_classes_interleaved_each_continue_their_own_series(root):
    results = assert_all_ok(run_world(_interleaved_planner_classes, 2, root, timeout=240))
    ids = _every_save_committed_its_own_attempt(root, results, lambda step: "plain" if step in (10, 11) else RUN)
    rank0 = results[0]
    assert rank0["global_plans"] == {"AtomicSavePlanner": 1, "ModelOnlySavePlanner": 1}, rank0["global_plans"]
    # a save of either series is the next of that series: same time part, as _series_save_id derives it
    assert {ids[step][:17] for step in (1, 3, 5, 7, 13)} == {ids[1][:17]}
    assert {ids[step][:17] for step in (2, 4, 6, 8)} == {ids[2][:17]}
    for rank in results:
        assert all(rank["loads"].values()), rank["loads"]
        error = rank["ambiguous"]
        assert error and "ConfigurationError" in error, error
        assert "DefaultSavePlanner, PlainModelOnlySavePlanner" in error and "AtomicSavePlanner" in error, error
    assert _committed(root, "plain", 12) is None
