"""Two simulated nodes of two ranks each (failure domains nodeA/nodeB, torchrun's per-node variables), each node's
local root its own tmpfs: the worlds the tier tests run, their manager and checks."""

from __future__ import annotations

import torch

from tests.harness import run_world
from tests.helpers.fsdp_app import _AppState


RUN = "exp"
WORLD = 4


def _node_env(rank: int) -> dict[str, str]:
    node = rank // 2
    return {"DCP_ATOMIC_FAILURE_DOMAIN": "nodeAB"[4 + node], "LOCAL_RANK": str(rank % 2),
            "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": str(node)}


def _run(fn, root, nodes, *args, world=WORLD, rank_env=_node_env, pg_timeout=30):
    return run_world(fn, world, root, args=args, rank_env=rank_env, extra={"nodes": nodes}, timeout=120,
                     pg_timeout=pg_timeout)


def _manager(ctx, *, local_root=None, keep_local=2, durable_every=None, **kwargs):
    """This world's two-tier manager: the rank's node root (unless ``local_root``), one replica, ``keep_local`` steps
    (the tests count on 2), drains asked for by ``durable=`` (these tests drive the local tier); ``kwargs`` go to
    ``CheckpointManager``."""
    from dcp_atomic import CheckpointManager, LocalTierOptions
    from dcp_atomic.exchange import file_transfer

    file_transfer.CHUNK_BYTES = 64 << 10  # every replica and restore transfer crosses chunk boundaries
    kwargs.setdefault("timeout", 20)
    local = LocalTierOptions(local_root or ctx.extra["nodes"][ctx.rank // 2], replicas=1, keep_local=keep_local,
                             durable_every=durable_every)
    return CheckpointManager(ctx.root, RUN, local=local, **kwargs)


def _state(model, optim, step):
    return {"app": _AppState(model, optim), "progress": {"step": step}}


def _exact(got, want):
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


def _flip_byte(path, offset=100):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


class _Lines:
    """The log lines one logger emits in this rank (a handler, so the test reads what an operator reads)."""

    def __init__(self, name):
        import logging

        self.lines = []
        handler = logging.Handler()
        handler.emit = lambda record: self.lines.append(record.getMessage())
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
