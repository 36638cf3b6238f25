"""A step asked to be durable whose drain failed must not be forgotten by the end of the job (P13): ``close()``
drains it once the store answers, or says by type which steps are not durable.

Worlds of 4 ranks as 2 simulated nodes (tests.helpers.tiers), the durable store refusing uploads through a failpoint
until it heals."""

from __future__ import annotations

import pytest

from tests.harness import assert_all_ok
from tests.helpers.fsdp_app import _fsdp_app, _train_step
from tests.helpers.tiers import _manager, _run, _state

pytestmark = pytest.mark.timeout(300)


def _a_job_whose_store_heals_before_its_last_save(ctx, heals):
    """Step 1 saved with durable=True while the store refuses; steps 2-4 (kept local) requeue it, at the 1st and
    then the 3rd save (the backoff doubles), each drain refused and raised by wait(); the store heals (or not)
    before step 5, which comes before the next requeue is due; then close().  What close() said, and the durable
    steps after."""
    from dcp_atomic._base import failpoints

    model, optim = _fsdp_app(ctx.world_size, 0)
    seen = {"waits": []}
    failpoints.arm("drain.before_upload", "raise")
    manager = _manager(ctx, keep_local=2, durable_every=None)
    try:
        for step in range(1, 6):
            if step == 5 and heals:
                failpoints.disarm("drain.before_upload")
            _train_step(model, optim, step)
            manager.save(step, _state(model, optim, step), durable=step == 1 or None)
            if step < 5:
                try:
                    manager.wait()
                    seen["waits"].append("ok")
                except Exception as e:
                    seen["waits"].append(type(e).__name__)
        try:
            manager.close()
            seen["close"] = "ok"
        except Exception as e:
            seen["close"] = (type(e).__name__, "step 1" in str(e))
    finally:
        failpoints.disarm_all()
    from dcp_atomic.protocol.catalog import list_steps
    from tests.helpers.tiers import RUN

    seen["durable"] = list_steps(ctx.root, RUN)
    return seen


def test_a_durable_step_whose_drain_failed_is_drained_by_close_once_the_store_answers(root, nodes):
    """Before: wait() ok, close() ok, nothing logged, the durable root empty."""
    for seen in assert_all_ok(_run(_a_job_whose_store_heals_before_its_last_save, root, nodes, True)):
        assert seen["close"] == "ok" and 1 in seen["durable"], seen


def test_a_durable_step_the_store_still_refuses_at_close_is_named_by_close_on_every_rank(root, nodes):
    for seen in assert_all_ok(_run(_a_job_whose_store_heals_before_its_last_save, root, nodes, False)):
        assert seen["close"][1] and seen["close"][0].endswith("Error") and seen["durable"] == [], seen

