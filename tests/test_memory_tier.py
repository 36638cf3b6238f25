"""The memory tier (P16): snapshots into RAM-backed slots with verified copies on other failure domains, one commit
sequence with the other tiers, and restores that never load a torn, mixed, damaged or foreign step.

Worlds of 4 ranks as 2 simulated nodes (failure domains nodeA/nodeB), each node's memory path on its own tmpfs,
the durable root on disk.  A *wiped node* is its memory path emptied between two worlds.
"""

from __future__ import annotations

import glob
import os
import shutil

import pytest
import torch

from tests.harness import assert_all_ok
from tests.helpers.memory import full_state, memory_manager, state_of, trained
from tests.helpers.tiers import RUN, _node_env, _run, WORLD


def _snapshot_steps(ctx, steps, then=None):
    """Train and snapshot ``steps`` (each waited for); ``then(manager, model, optim)`` before closing."""
    model, optim = trained(WORLD, 0)
    with memory_manager(ctx) as manager:
        last = 0
        for step in steps:
            for s in range(last + 1, step + 1):
                from tests.helpers.fsdp_app import _train_step

                _train_step(model, optim, s)
            last = step
            assert manager.snapshot(step, state_of(model, optim, step)).result() == step
        return then(manager, model, optim) if then else None


def _restore(ctx, seed=7):
    """A fresh job: load() with no step; (step, tier, exact against the reference state of that step)."""
    model, optim = trained(WORLD, 0, seed=seed)
    with memory_manager(ctx) as manager:
        step = manager.load(state_of(model, optim, 0))
        tier = (manager.restored_from or {}).get("tier")
    got = full_state(model, optim)
    want_model, want_optim = trained(WORLD, step)
    want = full_state(want_model, want_optim)
    exact = got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    return step, tier, exact


def test_a_fresh_job_restores_the_newest_snapshot_from_memory_exactly(root, nodes):
    assert_all_ok(_run(_snapshot_steps, root, nodes, [1, 2, 3, 4]))
    outcomes = assert_all_ok(_run(_restore, root, nodes))
    assert outcomes == [(4, "memory", True)] * WORLD, outcomes
