"""A fresh job's save of a step already committed is refused at ``save``/``async_save``, in both tiers (P9, P14).

Before, a two-tier manager local-committed the step and only its drain refused it, later, from ``wait()``; a one-tier
``async_save`` raised only from its future.  And a restore never takes a local copy of a step over a different,
newer durable commit of the same step.  A world of 4 as two simulated nodes (tmpfs local roots).
"""

from __future__ import annotations

import os

import pytest

from tests.harness import assert_all_ok
from tests.helpers.fsdp_app import _fsdp_app, _full, _train_step
from tests.helpers.tiers import RUN, _exact, _run, _state


def _job(ctx, steps, seed, local, durable=None):
    """Save ``steps`` (two tiers when ``local`` names the local roots' base, else one tier); the weights per step."""
    from dcp_atomic import CheckpointManager, LocalTierOptions

    model, optim = _fsdp_app(ctx.world_size, seed)
    tier = None
    if local is not None:
        tier = LocalTierOptions(local[ctx.rank // 2] if isinstance(local, list)
                                else os.path.join(ctx.root, local, str(ctx.rank // 2)),
                                failure_domain=f"node{ctx.rank // 2}")
    weights = {}
    with CheckpointManager(ctx.root, RUN, timeout=20, local=tier) as manager:
        for step in steps:
            _train_step(model, optim, step)
            manager.save(step, _state(model, optim, step), durable=durable)
            weights[step] = _full(model)
    return weights


def _fresh_saves(ctx, local, new_step):
    """A fresh job (it did not load) saves step 2 with ``save`` and ``async_save``: both must raise themselves."""
    from dcp_atomic import CheckpointManager, CommitConflictError, LocalTierOptions

    model, optim = _fsdp_app(ctx.world_size, 7)
    tier = None if local is None else LocalTierOptions(os.path.join(ctx.root, local, str(ctx.rank // 2)),
                                                       failure_domain=f"node{ctx.rank // 2}")
    seen = {}
    with CheckpointManager(ctx.root, RUN, timeout=20, local=tier) as manager:
        for name in ("save", "async_save"):
            try:
                result = getattr(manager, name)(2, _state(model, optim, 2))
                seen[name] = "returned" if name == "save" else f"a future ({result.exception()!r})"
            except CommitConflictError as e:
                seen[name] = str(e)
        manager.save(new_step, _state(model, optim, new_step))  # a new step still saves
        seen["steps"] = manager.steps()
    attempts = os.path.join(ctx.root, local, str(ctx.rank // 2), RUN, "step_0000000002") if local else None
    seen["local_attempt"] = attempts is not None and os.path.exists(attempts)
    return seen


@pytest.mark.slow
def test_a_fresh_jobs_save_of_a_committed_step_is_refused_at_save_and_async_save_in_both_tiers(root, nodes):
    assert_all_ok(_run(_job, root, nodes, [1, 2], 0, nodes))  # two tiers, drained by default: durable [1, 2]
    for local, new_step in (("b", 3), (None, 4)):  # a fresh two-tier job on other local roots; a one-tier one
        seen = assert_all_ok(_run(_fresh_saves, root, nodes, local, new_step))
        for rank, out in enumerate(seen):
            for name in ("save", "async_save"):
                assert "step 2 of run" in out[name] and "already committed in the durable root" in out[name], \
                    (local, rank, name, out[name])
            assert out["steps"] == [1, 2, new_step] if local else [1, 2, 3, 4], (local, rank, out["steps"])
            assert not out["local_attempt"], (local, rank)  # nothing was written for step 2


def _restore(ctx, nodes):
    from dcp_atomic import CheckpointManager, LocalTierOptions

    loaded = {}
    with CheckpointManager(ctx.root, RUN, local=LocalTierOptions(nodes[ctx.rank // 2]), timeout=20) as manager:
        for step in (None, 3):
            model, optim = _fsdp_app(ctx.world_size, 99)
            assert manager.load(_state(model, optim, -1), step=step) == 3
            loaded[step] = (_full(model), manager.restored_from["tier"])
    return loaded


@pytest.mark.slow
def test_a_restore_takes_the_newer_durable_commit_of_a_step_over_the_local_copy(root, nodes):
    local_only = assert_all_ok(_run(_job, root, nodes, [3], 0, nodes, False))  # local only: durable root empty
    durable = assert_all_ok(_run(_job, root, nodes, [3], 5, None))  # another job commits step 3 to the durable root
    loaded = assert_all_ok(_run(_restore, root, nodes, nodes))
    for rank, out in enumerate(loaded):
        for step in (None, 3):
            weights, tier = out[step]
            assert tier == "durable", (rank, step, tier)
            _exact(weights, durable[rank][3])
            assert any(not bool((weights[k] == local_only[rank][3][k]).all()) for k in weights)
