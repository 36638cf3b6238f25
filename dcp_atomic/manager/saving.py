"""The storage tiers' half of ``CheckpointManager.save`` and ``async_save``: the commit rule checked first (every rank
raises the same refusal), the writer, DCP's save, a failure settled (a marker that names this save means it
committed) and typed, retention after a commit, and the one ``async_save`` in flight, whose failure is raised once, by
whichever call asks first.  The manager validates the arguments and numbers the operation; the tier policy
(:mod:`.tiering`) commits and drains; what is reported goes through :mod:`.reports`.

Why an object of its own: the save in flight is one rule with three users, the manager's calls (each waits for it
first), its close and exit-time wait, and the snapshot tier's durable copies, which start saves of their own
(:class:`~.snapshot_tier.DurableCopySaves`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import Any, Callable

import torch.distributed.checkpoint as dcp

from .._base import world_of_one
from .._base.futures import ReportedFuture
from .._base.retry import Deadline
from .._base.stats import SaveStats
from ..dcp.watched import WatchedSavePlanner
from ..dcp.writer import AtomicStorageWriter
from ..errors import CheckpointError, StorageError
from ..exchange.collective import first_line, raise_typed
from ..exchange.liveness import OpWatch
from ..format.layout import RunLayout, validate_step
from ..format.manifest import Marker
from ..format.parallelism import Parallelism
from ..protocol.catalog import shows_at_once
from ..protocol.commit import read_marker, refuse_committed
from ..protocol.retention import retain_after_commit
from ..staging import LiveState, StableState, Staging, WindowPool
from .reports import Reports
from .tiering import TierContext, TierPolicy

log = logging.getLogger("dcp_atomic.manager")


def committed_marker(layout: RunLayout, step: int, timeout: float) -> Marker | None:
    """Rank 0: ``layout``'s marker of ``step``, or None; a read that fails is a typed error."""
    try:
        return read_marker(layout, step, Deadline(timeout), missing_ok=True)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise StorageError(f"could not read the marker of step {step} in {layout.storage.describe()} to check "
                           f"that the step is not committed yet: {e}", step=step, path=layout.marker(step)) from e


class Saves:
    """One manager's saves (every method on every rank alike unless it says otherwise)."""

    def __init__(self, ctx: TierContext, tier: TierPolicy, reports: Reports, *, async_group: Any,
                 staging: Staging | None, staging_pool: WindowPool | None, parallelism: Parallelism | None,
                 compression: Any, reuse: bool, divergence: Any, operation: Callable[[], int]) -> None:
        """``async_group``: the process group of background saves; ``operation``: the number of the manager's
        current operation (its heartbeat's)."""
        self.ctx, self.tier, self.reports = ctx, tier, reports
        self.async_group, self.staging, self.staging_pool = async_group, staging, staging_pool
        self.parallelism, self.compression, self.reuse, self.divergence = parallelism, compression, reuse, divergence
        self.operation = operation
        self.inflight: ReportedFuture | None = None  # the async_save whose failure is not raised yet, or None
        self._staged: LiveState | None = None  # the bounded staging of the latest async_save
        self._lock = threading.Lock()

    def save(self, step: int, state_dict: dict[str, Any], metadata: dict[str, Any] | None,
             drain: bool | None) -> int:
        """``CheckpointManager.save`` once its arguments are checked."""
        self.wait_for_async_save()
        started = time.perf_counter()
        with self.reports.failures_reported("save", step, started):
            self.refuse_conflicts(step)
            watch = self.ctx.watch(f"saving step {step}")
            writer = self._writer(step, watch, metadata)
            with self.tier.failed_attempt_removed(step, writer):
                try:
                    world_of_one.explain()
                    dcp.save(state_dict, storage_writer=writer, planner=self._planner(watch),
                             process_group=self.ctx.group)
                except BaseException as e:  # CheckpointException is a BaseException
                    self._settle_failed_save(e, step, writer, watch)
                else:
                    watch.finish()
                self.tier.commit(step, writer, self.ctx.group, drain)
        self.reports.saved(step, writer, time.perf_counter() - started, 0.0, False, self._retention)
        return step

    def async_save(self, step: int, state_dict: dict[str, Any], metadata: dict[str, Any] | None,
                   drain: bool | None, copy_of: int | None = None) -> ReportedFuture:
        """``CheckpointManager.async_save`` once its arguments are checked; ``copy_of``: the save is the durable copy
        of the memory snapshot of that commit sequence (recorded in its manifest): nothing changes ``state_dict`` (a
        pinned slot) until the save is done, so it is written as it is, without staging."""
        stable = copy_of is not None
        self.wait_for_async_save()
        op = self.operation()
        result = ReportedFuture()
        started = time.perf_counter()
        with self.reports.failures_reported("async_save", step, started):
            self.refuse_conflicts(step)
            watch = self.ctx.watch(f"saving step {step}")
            staged = None if self.staging is None or stable else LiveState(self.staging, self.staging_pool)
            writer = self._writer(step, watch, metadata, staged, copy_of)
            self._staged = staged
            stager = StableState() if stable else staged
            try:
                world_of_one.explain()
                pending = dcp.async_save(state_dict, storage_writer=writer, planner=self._planner(watch),
                                         process_group=self.async_group,
                                         **({"async_stager": stager} if stager is not None else {}))
            except BaseException as e:
                if staged is not None:
                    staged.release()
                self._settle_failed_save(e, step, writer, watch)
        stage_seconds = time.perf_counter() - started
        pending = getattr(pending, "upload_completion", pending)  # AsyncSaveResponse in some torch versions

        def finished(done) -> None:
            if staged is not None:  # a save that failed before its writer read the live tensors never will
                staged.release()
            try:
                with self.tier.failed_attempt_removed(step, writer):
                    try:
                        done.result()
                    except BaseException as e:
                        if self.ctx.heartbeat is not None:
                            self.ctx.heartbeat.gave_up(op)
                        self._settle_failed_save(e, step, writer, watch)
                    else:
                        watch.finish()
                    self.tier.commit(step, writer, self.async_group, drain)
                self.reports.saved(step, writer, time.perf_counter() - started, stage_seconds, True, self._retention)
                result.set_result(step)
            except BaseException as e:
                self.reports.failure("async_save", step, e, started)
                result.set_exception(e)

        pending.add_done_callback(finished)
        result.step = step
        with self._lock:
            self.inflight = result
        return result

    def durable_copy(self, step: int, state_dict: dict[str, Any], sequence: int) -> ReportedFuture:
        """The memory tier's durable copy of its snapshot of commit ``sequence``: an ``async_save`` of the slot's
        bytes as they are (nothing changes them until it is done), drained as a ``durable=True`` save is."""
        return self.async_save(step, state_dict, None, self.tier.drain_decision(True), copy_of=sequence)

    def wait_staged(self) -> float:
        """Block until the writer of the ``async_save`` in flight has read every live tensor; the seconds waited."""
        staged = self._staged
        return 0.0 if staged is None else staged.read.wait()

    def failed(self, step: int, error: CheckpointError, report: bool) -> ReportedFuture:
        """A save of ``step`` (a durable copy) that could not start, made the save in flight, so that ``wait()`` or
        the next call raises it once as a failed ``async_save``; ``report``: to ``on_failed`` first."""
        log.warning("run %r: the durable copy of memory step %d did not start (%s); it is raised by wait() or the "
                    "next call, and the snapshot stays memory-committed", self.ctx.run_id, step, first_line(error))
        if report:
            self.reports.failure("async_save", step, error, time.perf_counter())
        failed = ReportedFuture()
        failed.step = step
        failed.set_exception(error)
        with self._lock:
            self.inflight = failed
        return failed

    def busy(self) -> bool:
        """An ``async_save`` is still running."""
        inflight = self.inflight
        return inflight is not None and not inflight.done()

    def wait_for_async_save(self) -> int | None:
        """Wait for the in-flight ``async_save``; raise its failure unless already reported. Returns its step.

        The save stays in flight until the wait is over: interrupted (Ctrl-C), it is still there for
        ``close()`` to wait for, and its failure still gets raised."""
        inflight = self.inflight
        if inflight is None:
            return None
        concurrent.futures.wait([inflight])
        with self._lock:
            if self.inflight is inflight:
                self.inflight = None
        error = concurrent.futures.Future.exception(inflight)  # the base method: reading it here is not a report
        if error is None:
            return concurrent.futures.Future.result(inflight)
        if inflight.reported:
            return None
        inflight.reported = True
        raise error

    def refuse_conflicts(self, step: int) -> None:
        """Before a save writes anything, on every rank alike: global rank 0 applies the commit rule
        (:func:`~.commit.refuse_committed`: only a step this job abandoned by resuming below it may be saved again)
        to the step's commit in each tier the save reaches (the local one first, :meth:`.TierPolicy.refuse_conflicts`),
        and every rank raises the same ``CommitConflictError`` -- from ``save``/``async_save`` itself, not later from
        a drain.  The writers check again as they plan."""
        ctx = self.ctx

        def check() -> None:
            validate_step(step)
            self.tier.refuse_conflicts(step)
            if self.tier.durable_may_hold(step):
                marker = ctx.committed_marker(ctx.layout, step)
                if marker is not None:
                    refuse_committed(marker, step, ctx.run_id, ctx.resumed(),
                                     f"the durable root {ctx.layout.storage.describe()}")

        ctx.on_rank0(check, "check that the step is not committed yet", request=f"save step {step}")

    def _writer(self, step: int, watch: OpWatch, metadata: dict[str, Any] | None = None,
                staged: LiveState | None = None, copy_of: int | None = None) -> AtomicStorageWriter:
        validate_step(step)
        return self.tier.writer(step, parallelism=self.parallelism, metadata=metadata, compression=self.compression,
                                thread_count=self.ctx.thread_count, resumed_from=self.ctx.resumed(),
                                timeout=self.ctx.timeout, watch=watch, **({"reuse": True} if self.reuse else {}),
                                **({"live_state": staged} if staged is not None else {}),
                                **({"copy_of_sequence": copy_of} if copy_of is not None else {}))

    def _planner(self, watch: OpWatch) -> WatchedSavePlanner:
        return WatchedSavePlanner(watch, divergence=self.divergence)

    def _retention(self, step: int, writer: AtomicStorageWriter, stats: SaveStats) -> None:
        """Applies the retention policy reading only the journal and the markers (and, for ``best``, the manifests
        not read before) of the steps it keeps, so a commit costs the same at step 100,000 as at step 10 (no scan of
        every marker; see retain_after_commit)."""
        ctx = self.ctx
        if ctx.retention.keeps_all or writer.last_marker is None:  # a local commit: retained per root (keep_local)
            return
        plan = retain_after_commit(ctx.layout, writer.last_marker, ctx.retention, lease_seconds=ctx.lease_seconds)
        if plan.unreadable_steps:
            stats.unreadable_steps = [s for s, _ in plan.unreadable_steps]
            log.warning("retention keeps step(s) whose marker cannot be validated: %s",
                        "; ".join(f"step {s}: {why}" for s, why in plan.unreadable_steps))
        above = sorted(s for s in {*plan.kept_steps, *plan.delete_steps} if s > step)  # every step the journal knows
        if above:
            log.info("step %d saved below committed step(s) %s: a new branch starts (rollback restart)", step,
                     above[:5])

    def _settle_failed_save(self, error: BaseException, step: int, writer: AtomicStorageWriter,
                            watch: OpWatch) -> None:
        """DCP said the save failed; if our marker exists anyway, it committed (returns), else raise typed
        (a liveness verdict first: the gloo error that followed it names nobody).  A local save has no marker
        until after DCP returns (``commits_in_dcp``), so there is nothing to settle."""
        layout, timeout = self.ctx.layout, self.ctx.timeout
        if writer.save_id is not None and self.tier.commits_in_dcp:
            try:  # rank 0 may have just created it on another client: allow for visibility lag, where there is any
                marker = (read_marker(layout, step, Deadline(0.0), missing_ok=True)
                          if shows_at_once(layout, layout.step_dir(step)) else
                          read_marker(layout, step, Deadline(min(timeout, 5.0))))
                if marker.save_id == writer.save_id:
                    log.warning("step %d: DCP reported a failure (%s) after the commit; the marker names this "
                                "save (%s), so the checkpoint IS committed", step, first_line(error), writer.save_id)
                    return
            except Exception:
                pass
        raise_typed(watch.verdict or self.ctx.translate(error, f"saving step {step}"))
