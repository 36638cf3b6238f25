"""Who each rank is, checked on the coordinator before a byte is written (P7).

Wrong ``RANK`` / ``WORLD_SIZE`` in a launcher's environment produce two
processes that both believe they are rank 0, or ranks that compute different
shard offsets.  Each rank records what it knows about itself in its local plan;
the coordinator compares them all and names every offender in one error.
"""

from __future__ import annotations

import os
import socket
from collections import defaultdict
from typing import Any

import torch.distributed as dist

from ..errors import RankConsistencyError

_ENV_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def local_identity(group_rank: int, parallelism: dict | None, *, declared: bool = True) -> dict[str, Any]:
    """This rank's identity as plain data (it travels in the plan and the manifest)."""
    initialized = dist.is_available() and dist.is_initialized()
    return {
        "rank": group_rank,
        "global_rank": dist.get_rank() if initialized else None,
        "global_world_size": dist.get_world_size() if initialized else None,
        "env": {k: os.environ[k] for k in _ENV_KEYS if k in os.environ},
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "parallelism": parallelism,
        "parallelism_source": ("declared" if declared else "inferred") if parallelism else None,
    }


def default_thread_count() -> int:
    """I/O threads per rank: this host's CPUs shared among its ranks, 1 to 4.

    Ranks on one host compete for the same cores; more threads than cores per
    rank only adds contention (measured: 4 ranks x 2 threads on 2 cores loaded
    slower than 1 thread each).  LOCAL_WORLD_SIZE is set by torchrun; without
    it, the process group's size is an upper bound.
    """
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local and local.isdigit():
        ranks_here = int(local)
    elif dist.is_available() and dist.is_initialized():
        ranks_here = dist.get_world_size()
    else:
        ranks_here = 1
    return max(1, min(4, cpus // max(1, ranks_here)))


def _who(ident: dict) -> str:
    return f"rank {ident['rank']} (host {ident['host']}, pid {ident['pid']})"


def check_identities(identities: list[dict[str, Any]]) -> None:
    """Raise :class:`RankConsistencyError` listing every inconsistency found."""
    problems: list[str] = []
    world = len(identities)
    for position, ident in enumerate(identities):
        if ident["rank"] not in (None, position):
            problems.append(f"plan {position} comes from a process that calls itself rank {ident['rank']}")
        env = ident["env"]
        global_rank = ident["global_rank"]
        if "RANK" in env and global_rank is not None and str(global_rank) != env["RANK"]:
            problems.append(
                f"{_who(ident)}: environment RANK={env['RANK']} but the process group says global rank {global_rank}"
            )
        env_world = env.get("WORLD_SIZE")
        if env_world is not None and ident["global_world_size"] is not None and env_world != str(ident["global_world_size"]):
            problems.append(
                f"{_who(ident)}: environment WORLD_SIZE={env_world} but the process group has "
                f"{ident['global_world_size']} ranks"
            )
    by_env_rank: dict[str, list[dict]] = defaultdict(list)
    for ident in identities:
        if "RANK" in ident["env"]:
            by_env_rank[ident["env"]["RANK"]].append(ident)
    for env_rank, holders in sorted(by_env_rank.items()):
        if len(holders) > 1:
            problems.append(f"environment RANK={env_rank} is claimed by " + ", ".join(_who(h) for h in holders))
    by_local: dict[tuple, list[dict]] = defaultdict(list)
    for ident in identities:
        env = ident["env"]
        if "LOCAL_RANK" in env:
            by_local[(ident["host"], env.get("GROUP_RANK"), env["LOCAL_RANK"])].append(ident)
    for (host, node, local_rank), holders in sorted(by_local.items(), key=str):
        if len(holders) > 1:
            problems.append(
                f"LOCAL_RANK={local_rank} on host {host} (node {node}) is claimed by "
                + ", ".join(_who(h) for h in holders)
            )
    layouts = {repr(ident["parallelism"]) for ident in identities}
    if len(layouts) > 1:
        problems.append(
            "ranks declare different parallelism: "
            + "; ".join(f"{_who(i)}: {i['parallelism']}" for i in identities)
        )
    declared = identities[0]["parallelism"] if identities else None
    if declared and identities[0].get("parallelism_source") == "declared":
        size = declared["tp"] * declared["dp"] * declared["pp"] * declared.get("cp", 1)
        if size != world:
            problems.append(
                f"declared parallelism tp={declared['tp']} x dp={declared['dp']} x pp={declared['pp']} "
                f"x cp={declared.get('cp', 1)} = {size} "
                f"does not match the {world} ranks saving"
            )
    if problems:
        raise RankConsistencyError(
            "rank identity check failed before any data was written:\n  - "
            + "\n  - ".join(problems)
            + "\nFix the launcher's RANK/LOCAL_RANK/WORLD_SIZE or the declared Parallelism; nothing was saved.",
            problems=problems,
        )
