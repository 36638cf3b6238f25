"""A restore at a changed world size from the local tier (DESIGN: "A restore at a different world size may reshard
from the memory or local tier's complete copy"): a job of 4 ranks on two simulated nodes saves to its local tier
only; the job comes back as 2 ranks (one per node) and must load that newest local step, resharded, instead of
rolling back to an older durable step; a tensor-parallel change without consent is still refused by name."""

from __future__ import annotations

import pytest

from tests.harness import assert_all_ok
from tests.helpers.drain import _one_node_each
from tests.helpers.fsdp_app import _fsdp_app, _full, _train_step
from tests.helpers.tiers import _exact, _manager, _run, _state


def _save_durable_then_local(ctx):
    """Step 10 durable (the rollback a refusal to reshard would cost), step 20 on the local tier only."""
    model, optim = _fsdp_app(ctx.world_size, 0)
    saved = {}
    with _manager(ctx) as manager:
        for step, durable in ((10, True), (20, False)):
            _train_step(model, optim, step)
            assert manager.save(step, _state(model, optim, step), durable=durable) == step
            saved[step] = _full(model)
        manager.wait()
    return saved


def _restore_resized(ctx, parallelism=None, allow_reshard=False):
    from dcp_atomic import Parallelism

    model, optim = _fsdp_app(ctx.world_size, 42)
    with _manager(ctx, local_root=ctx.extra["nodes"][ctx.rank],  # one rank per node now
                  parallelism=None if parallelism is None else Parallelism(**parallelism)) as manager:
        state = _state(model, optim, -1)
        try:
            loaded = manager.load(state, allow_reshard=allow_reshard)
        except Exception as e:  # noqa: BLE001 - the test reads the refusal
            return {"error": f"{type(e).__name__}: {e}"}
        return {"step": loaded, "progress": state["progress"]["step"], "served": manager.restored_from,
                "full": _full(model)}


@pytest.mark.slow
def test_a_job_resized_from_4_to_2_ranks_loads_the_newest_local_step_resharded_exactly(root, nodes):
    saved = assert_all_ok(_run(_save_durable_then_local, root, nodes))[0]
    restored = assert_all_ok(_run(_restore_resized, root, nodes, world=2, rank_env=_one_node_each))
    for out in restored:
        assert out["served"]["tier"] == "local" and out["step"] == out["progress"] == 20, out["served"]
        _exact(out["full"], saved[20])
    # A tensor-parallel change without consent is refused by name from the local tier too (never a silent load).
    refused = assert_all_ok(_run(_restore_resized, root, nodes, {"tp": 2, "dp": 1}, world=2,
                                 rank_env=_one_node_each))
    for out in refused:
        assert out.get("error", "").startswith("ReshardError") and "tensor_parallel_size=2" in out["error"], out
