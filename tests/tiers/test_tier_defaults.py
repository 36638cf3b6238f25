"""A two-tier manager left at its defaults keeps durable copies (DESIGN "Two tiers"; issue: defaults that keep data).

Tried as a new user would: ``CheckpointManager(durable_root, run, local=LocalTierOptions(local_root,
failure_domain=...))`` and nothing else, five saves, ``wait()``, ``close()``.  Node-local disks are wiped when an
allocation ends, so what must remain is the durable root: before the default drained, it was never even created and
``keep_local=2`` had removed steps 1-3 from the nodes.  A world of 4 as two simulated nodes (tmpfs local roots); every
durable step is then loaded by a one-tier manager and compared with ``torch.equal`` on every rank.
"""

from __future__ import annotations

import logging

import pytest

from tests.harness import assert_all_ok
from tests.helpers.fsdp_app import _fsdp_app, _full, _train_step
from tests.helpers.tiers import RUN, _exact, _run, _state


def _new_user(ctx, steps, tier, durable_last=None):
    """Save ``steps`` with a manager given only what a new user gives (``tier``: more of the local tier's options);
    the weights per step."""
    from dcp_atomic import CheckpointManager, LocalTierOptions

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("dcp_atomic").addHandler(handler)
    model, optim = _fsdp_app(ctx.world_size, 0)
    weights = {}
    local = LocalTierOptions(ctx.extra["nodes"][ctx.rank // 2], failure_domain=f"node{ctx.rank // 2}", **tier)
    manager = CheckpointManager(ctx.root, RUN, local=local)
    for step in steps:
        _train_step(model, optim, step)
        durable = durable_last if step == steps[-1] else None
        manager.save(step, _state(model, optim, step), durable=durable)
        weights[step] = _full(model)
    manager.wait()
    manager.close()
    warned = [r.getMessage() for r in records if r.levelno >= logging.WARNING and "durable_every=None" in r.getMessage()]
    return {"weights": weights, "warned": warned}


def _durable_steps(ctx):
    """Every step the durable root lists, loaded through a one-tier manager (the job's nodes are gone)."""
    from dcp_atomic import CheckpointManager

    loaded = {}
    with CheckpointManager(ctx.root, RUN, timeout=20) as durable:
        for step in durable.steps():
            model, optim = _fsdp_app(ctx.world_size, 99)
            state = _state(model, optim, -1)
            assert durable.load(state, step=step) == step
            assert state["progress"]["step"] == step
            loaded[step] = _full(model)
    return loaded


def _check(root, nodes, saved, expected):
    loaded = assert_all_ok(_run(_durable_steps, root, nodes))
    for rank, out in enumerate(loaded):
        assert sorted(out) == expected, (rank, sorted(out))
        for step in expected:
            _exact(out[step], saved[rank]["weights"][step])


def test_the_defaults_drain_every_save_so_the_job_outlives_its_nodes(root, nodes):
    saved = assert_all_ok(_run(_new_user, root, nodes, [1, 2, 3, 4, 5], {}))
    assert all(out["warned"] == [] for out in saved)
    _check(root, nodes, saved, [1, 2, 3, 4, 5])


@pytest.mark.slow
def test_durable_every_n_drains_its_multiples_and_close_drains_the_last_step(root, nodes):
    saved = assert_all_ok(_run(_new_user, root, nodes, [1, 2, 3, 4, 5], {"durable_every": 3}))
    _check(root, nodes, saved, [3, 5])


@pytest.mark.slow
def test_durable_every_none_is_warned_at_construction_and_an_explicit_local_save_stays_local(root, nodes):
    saved = assert_all_ok(_run(_new_user, root, nodes, [1, 2], {"durable_every": None}))
    assert len(saved[0]["warned"]) == 1 and "only saves with durable=True" in saved[0]["warned"][0]
    assert all(out["warned"] == [] for out in saved[1:])  # rank 0 says it, once
    _check(root, nodes, saved, [])
    # the policy would drain the last step at close(); durable=False on it is the user's word and is kept
    saved = assert_all_ok(_run(_new_user, root, nodes, [3, 4], {"durable_every": 2}, False))
    _check(root, nodes, saved, [])
