"""Issue 11: DCP's plan caching (``enable_plan_caching=True``) with dcp_atomic.

A cached plan is replayed by every rank without reaching the coordinator, so the save_id cannot ride in it:
each save of a series derives its own from the series' first save_id and a count every rank advances in
lockstep, and the coordinator refuses to commit unless every rank wrote the step and save_id it planned.
"""

from __future__ import annotations

import json
import os

import torch

from tests.harness import assert_all_ok, run_world

RUN = "cached"


def _state(rank: int, value: int) -> dict:
    return {"shared": torch.arange(6.0) * value, f"own{rank}": torch.full((3,), float(10 * rank + value)),
            "meta": {"value": value}}


def _save(ctx, step: int, value: int, planner, *, overwrite: bool = False, run: str = RUN, asynchronous=False):
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageWriter

    writer = AtomicStorageWriter(ctx.root, run, step, thread_count=1, overwrite=overwrite)
    if asynchronous:
        dcp.async_save(_state(ctx.rank, value), storage_writer=writer, planner=planner).result()
    else:
        dcp.save(_state(ctx.rank, value), storage_writer=writer, planner=planner)
    return writer.save_id


def _refused(fn) -> str | None:
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - DCP wraps the coordinator's error in a CheckpointException
        return str(e)
    return None


def _loads_bit_exact(ctx, step: int, value: int, run: str = RUN) -> bool:
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageReader

    want = _state(ctx.rank, value)
    got = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"value": -1} for k, v in want.items()}
    dcp.load(got, storage_reader=AtomicStorageReader(ctx.root, run, step))
    return all(torch.equal(got[k], want[k]) if isinstance(want[k], torch.Tensor) else got[k] == want[k]
               for k in want)


def _cached_series(ctx):
    """World 2, in order: five cached saves (sync, async, an overwrite) and their loads; a rank built for
    another step; a save after that; a rank whose count of saves fell behind; AtomicSavePlanner with caching,
    whose content check still runs on a cached save."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from dcp_atomic import AtomicSavePlanner, writer as writer_module

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
        writer_module._series_counts[next(reversed(writer_module._series_counts))] -= 1
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
