"""Drains of the local tier to the durable root: saves whose uploads a store refuses, resumed jobs at another world
size, and loads from the durable root alone."""

from __future__ import annotations

from dcp_atomic._base import failpoints

from tests.helpers.fsdp_app import _fsdp_app, _full, _train_step
from tests.helpers.tiers import RUN, _manager, _state


def _one_node_each(rank: int) -> dict[str, str]:
    """A world of 2: one rank per node (the resized job)."""
    return {"DCP_ATOMIC_FAILURE_DOMAIN": "node" + "AB"[rank], "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
            "GROUP_RANK": str(rank)}


def _two_per_node_of(world: int):
    def env(rank: int) -> dict[str, str]:
        per = world // 2
        return {"DCP_ATOMIC_FAILURE_DOMAIN": "node" + "AB"[rank // per], "LOCAL_RANK": str(rank % per),
                "LOCAL_WORLD_SIZE": str(per), "GROUP_RANK": str(rank // per)}
    return env


def _save_with_a_refusing_store(ctx, step, ranks_per_node=2, options=None):
    """Save ``step`` for a durable copy while the durable store refuses every upload: it stays local-only."""
    from dcp_atomic.tiers import drain

    drain.RETRY_BACKOFF = 0.01

    def refuses(rank, _step):
        raise OSError(13, "Permission denied (injected: the durable store refuses writes)")

    failpoints.arm("drain.before_upload", refuses)
    model, optim = _fsdp_app(ctx.world_size, 0)
    _train_step(model, optim, step)
    failed = None
    try:
        with _manager(ctx, keep_local=2, local_root=ctx.extra["nodes"][ctx.rank // ranks_per_node],
                      storage_options=options) as manager:
            manager.save(step, _state(model, optim, step), durable=True)
            try:
                manager.wait()
            except Exception as e:
                failed = type(e).__name__
            durable = manager.steps(tier="durable")
    except Exception as e:  # close() raising the drain's failure again is fine: the step is what matters
        failed = failed or type(e).__name__
        durable = []
    finally:
        failpoints.disarm_all()
    return {"full": _full(model), "failed": failed, "durable": durable}


def _resume_saving(ctx, step, ranks_per_node=2, restore=False, options=None):
    """A job of this world (``restore``: that first restores the newest step) saves ``step`` locally, the store
    healed: the undrained step is queued again and drains from whatever roots hold its files."""
    from dcp_atomic import CheckpointManager, LocalTierOptions

    model, optim = _fsdp_app(ctx.world_size, 1)
    restored = tier = error = at_close = None
    local = LocalTierOptions(ctx.extra["nodes"][ctx.rank // ranks_per_node], replicas=1, keep_local=2)
    manager = CheckpointManager(ctx.root, RUN, local=local, timeout=20, storage_options=options)
    try:
        if restore:
            restored = manager.load(_state(model, optim, -1))
            tier = manager.restored_from["tier"]
        _train_step(model, optim, step)
        manager.save(step, _state(model, optim, step), durable=False)
        try:
            manager.wait()
        except Exception as e:
            error = (type(e).__name__, str(e))
        durable = manager.steps(tier="durable")
    finally:
        try:  # close() drains a step still not durable once more, and names it if that fails again
            manager.close()
        except Exception as e:
            at_close = (type(e).__name__, str(e))
    return {"durable": durable, "error": error, "at_close": at_close, "restored": restored, "tier": tier}


def _load_durable(ctx, step, options=None):
    from dcp_atomic import CheckpointManager

    model, optim = _fsdp_app(ctx.world_size, 42)
    state = _state(model, optim, -1)
    with CheckpointManager(ctx.root, RUN, timeout=20, storage_options=options) as manager:
        loaded = manager.load(state, step=step)
    return {"step": loaded, "full": _full(model), "progress": state["progress"]["step"]}
