"""The memory tier (P16) as the manager drives it: one more tier behind :class:`~.tiering.SnapshotTier`, built with
the manager's :class:`~.tiering.TierContext` and callables (never its privates), over
:class:`~dcp_atomic.memory.snapshots.MemorySnapshots`, which does the work.

What it adds to the memory package is what ties the tier to the others: the run's lineage its records carry (the
local tier's, else the durable root's), the newest commit of the other tiers that a restore must not be older than,
the restore's bookkeeping (snapshots above the restored step retired, ``restored_from``), and its durable copies
saved through the manager's one save path (:class:`DurableCopySaves`)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
from typing import Any, Callable

from ..errors import CheckpointError
from ..exchange.collective import first_line, raise_typed
from ..format.parallelism import Parallelism
from ..memory import MemorySnapshots, MemoryTier, Restored, SnapshotFuture
from ..protocol.catalog import latest_step as scan_latest_step
from ..protocol.commit import memory_order, read_committed, root_sequence
from ..protocol.lineage import ensure_lineage, new_lineage, refuses_writes
from ..staging import Stager
from .._base.retry import Deadline
from .tiering import SnapshotTier, TierContext

log = logging.getLogger("dcp_atomic.manager")


@dataclasses.dataclass(frozen=True)
class DurableCopySaves:
    """How the memory tier's durable copies are saved (:class:`~dcp_atomic.memory.snapshots.DurableCopies`): through
    the manager's one save path (``async_save``: the local tier and its drain, or the durable root), so the one
    committer, retention, lineage and statistics apply.  A copy that cannot start is a failed save like any other:
    reported to ``on_failed`` and raised by ``wait()`` or the next call, never by the snapshot."""

    #: start ``async_save`` of (step, state_dict) as a copy of memory's commit sequence; its future
    start: Callable[[int, dict[str, Any], int], concurrent.futures.Future]
    #: a save of ``step`` that failed with ``error`` before it started, as the save in flight; its future.  ``report``:
    #: hand it to ``on_failed`` (the copy was refused, not failed inside ``async_save``, which reports its own)
    failed: Callable[[int, CheckpointError, bool], concurrent.futures.Future]
    #: whether this rank's save is still in flight
    busy: Callable[[], bool]
    #: wait for the save in flight; raise its unreported failure
    wait: Callable[[], Any]

    def save(self, step: int, state_dict: dict[str, Any], sequence: int) -> concurrent.futures.Future:
        try:
            return self.start(step, state_dict, sequence)
        except CheckpointError as e:  # refused before it started (async_save reported it)
            return self.failed(step, e, False)

    def refuse(self, step: int, error: CheckpointError) -> concurrent.futures.Future:
        return self.failed(step, error, True)


class MemorySnapshotTier(SnapshotTier):
    """The memory tier of one manager, built by its ``__init__`` on every rank alike."""

    def __init__(self, ctx: TierContext, options: MemoryTier, *, domain: str, lineage: str | None,
                 local_sequence: Callable[[], int | None], stager: Stager | None, copies: DurableCopySaves,
                 parallelism: Parallelism | None) -> None:
        """``lineage``: the local tier's (None: the durable root's, read here); ``local_sequence``: the local tier's
        newest commit sequence (:meth:`.TierPolicy.local_sequence`)."""
        self.ctx, self.local_sequence = ctx, local_sequence
        self.memory = MemorySnapshots(
            rank=ctx.rank, world_size=ctx.world_size, run_id=ctx.run_id, layout=ctx.layout, options=options,
            domain=domain, lineage=lineage or ctx.on_rank0(self._durable_lineage, "read the run's lineage"),
            group=ctx.group, memory_group=ctx.memory_group, timeout=ctx.timeout, translate=ctx.translate,
            stager=stager, deliver=lambda stats: ctx.deliver(ctx.callbacks.on_snapshot, "on_snapshot", stats),
            durable=copies, parallelism=parallelism)
        self.copies = copies

    @property
    def snapshots_skipped(self) -> int:  # type: ignore[override]
        return self.memory.snapshots_skipped

    def snapshot(self, step: int, state_dict: dict[str, Any]) -> SnapshotFuture:
        try:
            return self.memory.snapshot(step, state_dict)
        except BaseException as e:
            raise_typed(self.ctx.translate(e, f"snapshotting step {step}"))

    def wait_staged(self) -> float:
        return self.memory.wait_staged()

    def restore(self, state_dict: dict[str, Any], step: int | None, save_id: str | None,
                allow_reshard: bool) -> Restored | None:
        self.restored_from = None
        if step is not None or save_id is not None:
            return None
        restored = self.memory.restore(state_dict, self._newest_elsewhere(), allow_reshard)
        if restored is not None:
            self.memory.retire_above(restored.step)  # P14: the abandoned branch's snapshots
            self.restored_from = restored.to_dict()
        return restored

    def loaded_elsewhere(self, step: int, save_id: str, served_by_local: bool) -> None:
        self.memory.retire_above(step)
        if not served_by_local:  # the memory tier was asked first: say that the durable root served
            self.restored_from = {"tier": "durable", "step": step, "save_id": save_id, "ranks_fetched": 0,
                                  "bytes_fetched": 0}

    def wait(self) -> None:
        self.memory.wait()

    def finish(self) -> None:
        self.memory.wait()
        if self.memory.flush_durable():
            self.copies.wait()

    def in_flight(self) -> SnapshotFuture | None:
        return self.memory.in_flight()

    def busy(self) -> bool:
        return self.memory.busy()

    def close(self) -> None:
        self.memory.close()

    # -- the other tiers, as the memory tier compares itself with them

    def _durable_lineage(self) -> str:
        """Rank 0: the durable run's lineage id (created with a new one if it has none), which the memory tier's
        records carry without a local tier; a root that cannot be written gives this job a lineage of its own, so
        its snapshots restore only within it (warned)."""
        layout = self.ctx.layout
        try:
            return ensure_lineage(layout, new_lineage())
        except (OSError, CheckpointError) as e:
            if not refuses_writes(e):
                raise
            lineage = new_lineage()
            log.warning("run %r: the durable root %s cannot be written (%s), so the run's lineage could not be "
                        "recorded; this job's memory snapshots carry lineage %s, which a later job cannot confirm, and "
                        "will not restore them", self.ctx.run_id, layout.storage.describe(), first_line(e), lineage)
            return lineage

    def _newest_elsewhere(self) -> int | None:
        """Every rank alike: the newest commit sequence of the durable root and the local tier (None: none)."""
        durable = self.ctx.on_rank0(self._durable_sequence, "read the durable root's commit sequence")
        found = [n for n in (durable, self.local_sequence()) if n]
        return max(found, default=None)

    def _durable_sequence(self) -> int:
        """Rank 0: the durable root's newest commit sequence, as a memory restore compares it (:func:`memory_order`:
        a durable copy of a snapshot counts as that snapshot).  The root's own number, not one this process only
        noted: a restore that saw an incomplete newer snapshot numbers above it, and is not older than itself."""
        ctx = self.ctx
        sequence = root_sequence(ctx.layout)
        step = scan_latest_step(ctx.root, ctx.run_id, ctx.storage_options, timeout=ctx.timeout,
                                missing_root_ok=True) if sequence > 0 else None
        if step is None:
            return sequence
        committed = read_committed(ctx.layout, step, Deadline(ctx.timeout))
        return memory_order(committed.marker, committed.manifest) if committed.marker.sequence == sequence else sequence
