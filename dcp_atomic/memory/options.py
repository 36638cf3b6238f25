"""The memory tier's options (:class:`MemoryTier`), beside the code that reads them: checked once where they are built,
handed whole to :class:`~.snapshots.MemorySnapshots`.  Imports no torch (``dcp_atomic.manager.options`` names it)."""

from __future__ import annotations

import dataclasses
import os

from .._base import arguments


@dataclasses.dataclass(frozen=True)
class MemoryTier:
    """The memory tier (docs: "The memory tier", P16): ``manager.snapshot(step, state_dict)`` keeps each rank's state in
    RAM, with verified copies on other failure domains, and ``load()`` restores the newest memory-committed step when
    no other tier holds a newer one.

    Args:
        path: a RAM-backed directory on each node (a tmpfs such as ``/dev/shm/dcp_atomic``; each rank passes its
            node's), writable; created (0700) when missing on a RAM-backed parent, warned about when not RAM-backed.
            ``every``, ``replicas``, ``slots`` and ``durable_every`` must be the same on every rank (refused by name).
        every: every N-th ``snapshot`` call takes one (the others return a future marked ``skipped``).
        replicas: copies of each rank's slot on ranks of other failure domains.
        slots: memory-committed steps kept per rank (at least 1; 2 keeps the previous step while the next is taken).
        budget_bytes: the most this rank's slots and the copies it holds may take at a snapshot's peak:
            ``(slots x (1 + replicas) + replicas) x`` its share of the state (a replica arrives beside the one it
            replaces; ``slots + 1`` with ``durable_every``), checked at the first snapshot (and against the
            directory's free space at construction).  None: only the directory's free space bounds it.
        durable_every: every N-th memory-committed snapshot also becomes a durable step of the same number, written
            from its slot's bytes in the background through ``async_save`` (the local tier and its drain with
            ``local=``); the slot stays pinned until that save is done, one slot outside the rotation, so no
            snapshot is skipped for it; a copy that fails is raised by the next ``snapshot()``.  None: no durable
            copies (``save()`` beside the snapshots).
    """

    path: str | os.PathLike
    every: int = 1
    replicas: int = 1
    slots: int = 2
    budget_bytes: int | None = None
    durable_every: int | None = None

    def __post_init__(self) -> None:
        arguments.location("MemoryTier(path=...)", self.path)
        arguments.count("MemoryTier(every=...)", self.every, optional=False)
        arguments.count("MemoryTier(replicas=...)", self.replicas, minimum=0, optional=False)
        arguments.count("MemoryTier(slots=...)", self.slots, optional=False)
        arguments.count("MemoryTier(budget_bytes=...)", self.budget_bytes)
        arguments.count("MemoryTier(durable_every=...)", self.durable_every)
