"""The process groups a manager uses, made once by its ``__init__`` on every rank alike (creating a group is a
collective): one for its collectives, one for background saves (DCP's ``async_save`` deadlocks when it shares a group
with collectives on the main thread), and one for each thread of its own that speaks to the other ranks, the drain's
and the memory tier's (gloo pairs collectives by their order in a group: two threads on one group would interleave).
Each is created with the manager's liveness ``timeout``, so a dead or frozen peer ends in bounded time (P8); the
drain's waits for every rank's upload, so it gets the work's limit."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ..errors import ConfigurationError


@dataclass
class ProcessGroups:
    """The groups (None without ``torch.distributed``, or where none is needed) and those the manager made itself,
    which it destroys when it closes (:meth:`destroy`)."""

    main: Any = None
    background: Any = None  # async saves'
    drain: Any = None  # None without a local tier, or when given a process group
    memory: Any = None  # None without a memory tier
    owned: list = field(default_factory=list)

    @classmethod
    def make(cls, given: Any, *, local: bool, memory: bool, timeout: float, work_timeout: float) -> "ProcessGroups":
        """The manager's groups: ``given`` (``process_group=``) serves for both of its own, and no thread gets one."""
        if not (dist.is_available() and dist.is_initialized()):
            return cls()
        if given is not None:
            if memory and dist.get_world_size(given) > 1:
                raise ConfigurationError("CheckpointManager(memory=...) needs a process group of the memory tier's "
                                         "own, which the manager cannot create when it is given process_group=; leave "
                                         "process_group out")
            return cls(given, given)
        liveness = timedelta(seconds=timeout)
        groups = cls(dist.new_group(backend="gloo", timeout=liveness), dist.new_group(backend="gloo", timeout=liveness))
        groups.owned = [groups.main, groups.background]
        if local:
            groups.drain = dist.new_group(backend="gloo", timeout=timedelta(seconds=max(timeout, work_timeout)))
            groups.owned.append(groups.drain)
        if memory:
            groups.memory = dist.new_group(backend="gloo", timeout=liveness)
            groups.owned.append(groups.memory)
        return groups

    def destroy(self) -> None:
        """Destroy the groups the manager made (once; a dead peer can make teardown fail: nothing to save any more)."""
        owned, self.owned = self.owned, []
        for group in owned:
            try:
                dist.destroy_process_group(group)
            except Exception:
                pass
