"""``CheckpointManager``: save every N steps in the background, keep the last K, resume.

What it adds over the storage writer and reader:

* one gloo process group of its own, created with ``timeout`` (plus a second
  one for background saves: DCP's ``async_save`` deadlocks when it shares a
  group with collectives on the main thread), so a dead or frozen peer inside
  DCP's collectives ends in bounded time and becomes a :class:`RankFailureError`
  naming the silent ranks (P8);
* slow is not dead (P8): each rank's share of the work (planning, writing,
  reading) ends at a barrier on the rendezvous store where peers are judged by
  heartbeat within ``timeout`` and waited for up to ``work_timeout``, so DCP's
  collectives start only when every rank is there (:mod:`.liveness`);
* step resolution by global rank 0 alone (``LATEST``, else a scan) shared with
  the others, so all ranks load one version without every rank listing, and
  ranks that ask for different steps all fail;
* rollbacks (P14): after ``load(step=k)``, saving a step above ``k`` that the abandoned branch
  committed supersedes it (a new attempt with the next commit sequence), where a plain re-save
  is refused;
* one save in flight; ``LATEST`` and retention move only after a save has
  *committed* (never when ``async_save`` merely returned);
* typed errors: DCP's ``CheckpointException`` is unwrapped to our own classes,
  and a save DCP reports as failed after ``finish`` may have committed is
  settled by reading the marker;
* a committed save is never reported as failed (retention and callback
  errors are logged and counted), and a failed one is never swallowed (see
  ``async_save``);
* statistics of every save, load and failure for ``on_saved`` / ``on_loaded`` /
  ``on_failed``, in the versioned schema of :mod:`.stats` (docs/statistics.md).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import logging
import os
import socket
import threading
import time
from datetime import timedelta
from typing import Any, Callable, NoReturn

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from .catalog import DEFAULT_TIMEOUT, latest_step as scan_latest_step, scan_markers
from .commit import ResumePoint, read_committed, read_marker, resume_point
from .retry import Deadline
from .errors import (CheckpointError, CheckpointNotFoundError, ConfigurationError, RankConsistencyError,
                     RankFailureError, shorten)
from .layout import RunLayout, validate_step
from .liveness import Heartbeat, OpWatch
from .parallelism import Parallelism
from .planners import AtomicLoadPlanner, AtomicSavePlanner
from .reader import AtomicStorageReader
from .retention import DEFAULT_LEASE_SECONDS, retain_after_commit
from .stats import FailureStats, LoadStats, SaveStats
from .backends import open_storage
from .writer import AtomicStorageWriter

log = logging.getLogger(__name__)

StatsCallback = Callable[[dict[str, Any]], None]  # receives a stats.*.to_dict() (docs/statistics.md)

DEFAULT_WORK_TIMEOUT = 2 * 3600.0  # 100+ GB per rank on busy storage must fit; a dead peer is found far sooner


def _operation(method: Callable) -> Callable:
    """A public call: one operation number, identical on every rank (SPMD); peers see it in the heartbeat
    while it runs, and a failure is posted so that peers waiting for this rank at a barrier stop at once."""

    @functools.wraps(method)
    def run(self: "CheckpointManager", *args: Any, **kwargs: Any) -> Any:
        if self._closed:
            raise ConfigurationError("this CheckpointManager is closed")
        self._ops += 1
        op, heartbeat = self._ops, self._heartbeat
        if heartbeat is None:
            return method(self, *args, **kwargs)
        heartbeat.started(op)
        try:
            return method(self, *args, **kwargs)
        except BaseException:
            heartbeat.gave_up(op)
            raise
        finally:
            heartbeat.idle()

    return run


class CheckpointManager:
    """Args:
        root, run_id, storage_options: where checkpoints live (see AtomicStorageWriter).
        parallelism: this job's layout (None: inferred from DTensor meshes where possible).
        keep_last: keep this many most recently committed steps (None: keep all).
        compression: passed to the writer.
        timeout: seconds for every wait of the library, the timeout of the manager's process
            groups, and the liveness deadline: a peer whose heartbeat stops for this long is
            dead or frozen (RankFailureError naming it).  Every rank must enter each manager
            call within ``timeout`` of the others: a rank that arrives later fails the call
            on every rank (it is told that it was the late one, its peers name it).
        work_timeout: seconds one save or load may spend on its work (planning, writing,
            reading; from the call on this rank) while every rank is alive: a peer that is
            slow but alive is waited for this long, then named in a RankFailureError
            (default 2 hours).
        process_group: use this group instead of creating one (the manager then cannot
            create a separate group for background saves and uses this one for both).
        on_saved: callback receiving a save's statistics (``stats.SaveStats`` as a dict; rank 0
            only, once committed). ``stats["retention_error"]`` says retention failed after
            the commit (logged; the next save retries it).
        on_loaded: callback receiving a load's statistics (``stats.LoadStats``; every rank,
            its own share).
        on_failed: callback receiving a failed save's or load's statistics (``stats.FailureStats``:
            error class, message, ranks named); every rank that raises it, before it raises.
            An exception in any callback is logged and counted in ``callback_failures``;
            the operation's outcome stands. Fields: docs/statistics.md.
        lease_seconds: age after which an uncommitted attempt counts as abandoned.
        share_reads: read each stored item once and send it to the other ranks that need it
            (``AtomicStorageReader(share_reads=...)``; default: on for object stores and for ranks on
            several hosts).
    """

    _instances = 0

    def __init__(
        self,
        root: str | os.PathLike,
        run_id: str,
        *,
        parallelism: Parallelism | None = None,
        keep_last: int | None = None,
        compression: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        work_timeout: float = DEFAULT_WORK_TIMEOUT,
        storage_options: dict[str, Any] | None = None,
        process_group: dist.ProcessGroup | None = None,
        thread_count: int | None = None,
        on_saved: StatsCallback | None = None,
        on_loaded: StatsCallback | None = None,
        on_failed: StatsCallback | None = None,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        allow_divergence: bool = False,
        share_reads: bool | None = None,
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
        self.root, self.run_id = root, run_id
        self.storage_options = storage_options
        self.layout = RunLayout(open_storage(root, storage_options), run_id)
        self.parallelism = parallelism
        self.keep_last = keep_last
        self.compression = compression
        self.timeout = timeout
        self.work_timeout = work_timeout
        self.callback_failures = 0
        self.thread_count = thread_count
        self.on_saved, self.on_loaded, self.on_failed = on_saved, on_loaded, on_failed
        self.lease_seconds = lease_seconds
        self.share_reads = share_reads
        self.divergence = "warn" if allow_divergence else "raise"
        self._distributed = dist.is_available() and dist.is_initialized()
        self._owned_groups: list[dist.ProcessGroup] = []
        if not self._distributed:
            self._group = self._async_group = None
        elif process_group is not None:
            self._group = self._async_group = process_group
        else:
            pg_timeout = timedelta(seconds=timeout)
            self._group = dist.new_group(backend="gloo", timeout=pg_timeout)
            self._async_group = dist.new_group(backend="gloo", timeout=pg_timeout)
            self._owned_groups = [self._group, self._async_group]
        self.rank = dist.get_rank(self._group) if self._distributed else 0
        self.world_size = dist.get_world_size(self._group) if self._distributed else 1
        self._inflight: _SaveFuture | None = None
        self._resumed: ResumePoint | None = None  # set by load(): see AtomicStorageWriter(resumed_from=)
        self._lock = threading.Lock()
        self._ops = 0  # operation counter: identical on all ranks (SPMD), names liveness keys
        CheckpointManager._instances += 1
        self._instance = CheckpointManager._instances
        self._heartbeat: Heartbeat | None = None
        if self._distributed and self.world_size > 1:
            self._heartbeat = Heartbeat(dist.distributed_c10d._get_default_store(),
                                        f"dcp_atomic/{run_id}/{self._instance}", dist.get_rank(),
                                        dist.get_process_group_ranks(self._group), timeout)
        self._closed = False

    # -- saving --------------------------------------------------------------------------

    @_operation
    def save(self, step: int, state_dict: dict[str, Any], metadata: dict[str, Any] | None = None) -> int:
        """Save and commit ``step`` synchronously; returns the step.  ``metadata``: a small JSON dict kept with
        the checkpoint (global rank 0's; see :meth:`metadata`).

        Raises the typed error if the save failed.  Before saving, raises the failure of an
        earlier ``async_save`` that nothing has reported yet (see ``async_save``).
        """
        self._drain()
        started = time.perf_counter()
        with self._failures_reported("save", step, started):
            watch = self._watch(f"saving step {step}")
            writer = self._writer(step, watch, metadata)
            try:
                dcp.save(state_dict, storage_writer=writer, planner=self._save_planner(watch),
                         process_group=self._group)
            except BaseException as e:  # CheckpointException is a BaseException
                self._settle_failed_save(e, step, writer, self._ops, watch)
            else:
                watch.finish()
        self._after_commit(step, writer, time.perf_counter() - started, stage_seconds=0.0, asynchronous=False)
        return step

    @_operation
    def async_save(self, step: int, state_dict: dict[str, Any],
                   metadata: dict[str, Any] | None = None) -> concurrent.futures.Future:
        """Stage ``state_dict`` to host memory now, write and commit in the background (``metadata``: as ``save``).

        Returns a future that resolves to ``step`` once the save has *committed*
        (and retention ran), or raises the typed error.  A second call first
        waits for the previous save.

        A failure is never swallowed: it is raised once, by the first of the
        returned future's ``result()`` / ``exception()``, ``wait()``, ``close()``,
        or the next ``save`` / ``async_save`` / ``load`` (which then does
        nothing else).  Every rank sees the same failure; call these the same
        way on every rank.
        """
        self._drain()
        op = self._ops
        result = _SaveFuture()
        started = time.perf_counter()
        with self._failures_reported("async_save", step, started):
            watch = self._watch(f"saving step {step}")
            writer = self._writer(step, watch, metadata)
            try:
                pending = dcp.async_save(state_dict, storage_writer=writer, planner=self._save_planner(watch),
                                         process_group=self._async_group)
            except BaseException as e:
                self._settle_failed_save(e, step, writer, op, watch)
        stage_seconds = time.perf_counter() - started
        pending = getattr(pending, "upload_completion", pending)  # AsyncSaveResponse in some torch versions

        def finished(done) -> None:
            try:
                try:
                    done.result()
                except BaseException as e:
                    if self._heartbeat is not None:
                        self._heartbeat.gave_up(op)
                    self._settle_failed_save(e, step, writer, op, watch)
                else:
                    watch.finish()
                self._after_commit(step, writer, time.perf_counter() - started, stage_seconds, asynchronous=True)
                result.set_result(step)
            except BaseException as e:
                self._report_failure("async_save", step, e, started)
                result.set_exception(e)

        pending.add_done_callback(finished)
        with self._lock:
            self._inflight = result
        return result

    def wait(self) -> int | None:
        """Wait for the in-flight save and return its step (None if there is none).

        Raises its failure unless it was already reported (see ``async_save``).
        """
        return self._drain()

    def close(self) -> None:
        """Wait for the in-flight save and release the manager's process groups.

        Then raises the save's failure unless it was already reported (see
        ``async_save``), so a training loop that ends with ``close()`` cannot exit
        cleanly without its last checkpoint.  Closing twice does nothing.  An
        interrupted close (Ctrl-C) releases nothing: the save keeps its process
        groups, and the next ``close()`` waits for it again.
        """
        if self._closed:
            return
        try:
            self._drain()
        finally:
            if self._inflight is None:  # never destroy the groups under a running save
                self._closed = True
                if self._heartbeat is not None:
                    self._heartbeat.close()
                for group in self._owned_groups:
                    try:
                        dist.destroy_process_group(group)
                    except Exception:  # a dead peer can make teardown fail; nothing to save anymore
                        pass
                self._owned_groups = []

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # an exception is already on its way: report a failed save beside it, do not replace it
            self.close()
        except Exception as failure:
            log.error("closing the checkpoint manager during %s: the last save failed: %s", exc_type.__name__, failure)

    # -- loading and listing -------------------------------------------------------------

    @_operation
    def load(self, state_dict: dict[str, Any], step: int | None = None, allow_reshard: bool = False) -> int:
        """Load ``step`` (default: the most recent commit) into ``state_dict``; returns the step loaded.

        Before loading, raises the failure of an earlier ``async_save`` that nothing has reported yet.
        """
        self._drain()
        started = time.perf_counter()
        with self._failures_reported("load", step, started) as attempt:
            chosen, save_id, resumed = self._on_rank0(
                lambda: self._resolve_step(step), "resolve the step to load",
                request="the latest step" if step is None else f"step {step}")
            if chosen is None:
                raise CheckpointNotFoundError(
                    f"no committed checkpoint for run {self.run_id!r} under {self.layout.storage.describe()}",
                    run_id=self.run_id,
                )
            attempt["step"] = chosen
            # Visibility waits get half the group timeout: the manifest shards read while DCP plans (no
            # barrier there) must give up before the peers' gather of plans times out.
            watch = self._watch(f"loading step {chosen}")
            reader = _WatchedReader(self.root, self.run_id, chosen, save_id=save_id, parallelism=self.parallelism,
                                    allow_reshard=allow_reshard, timeout=self.timeout / 2,
                                    storage_options=self.storage_options, thread_count=self.thread_count,
                                    share_reads=self.share_reads, process_group=self._group, watch=watch)
            self._resolve_everywhere(reader, chosen)
            try:
                dcp.load(state_dict, storage_reader=reader, planner=AtomicLoadPlanner(), process_group=self._group)
            except BaseException as e:
                _raise_typed(watch.verdict or self._translate(e, f"loading step {chosen}"))
            watch.finish()
        self._resumed = resumed  # P14: later saves supersede the steps above it that this load abandoned
        seconds = time.perf_counter() - started
        log.info("loaded run %r step %d (save %s) in %.3fs", self.run_id, chosen, reader.save_id, seconds)
        self._deliver(self.on_loaded, "on_loaded", LoadStats(
            run_id=self.run_id, step=chosen, save_id=reader.save_id, world_size=self.world_size, rank=self.rank,
            seconds=seconds, bytes=reader.bytes_read, files=reader.files_read,
            gb_per_s=reader.bytes_read / max(seconds, 1e-9) / 1e9,
            bytes_from_storage=reader.read_stats.storage_bytes, bytes_from_peers=reader.read_stats.peer_bytes_received,
            bytes_to_peers=reader.read_stats.peer_bytes_sent, storage_seconds=reader.read_stats.storage_seconds,
            exchange_seconds=reader.read_stats.exchange_seconds))
        return chosen

    @_operation
    def latest_step(self) -> int | None:
        """The most recently committed step (global rank 0 scans, the others are told)."""
        return self._on_rank0(
            lambda: scan_latest_step(self.root, self.run_id, self.storage_options, timeout=self.timeout),
            "find the latest step")

    @_operation
    def metadata(self, step: int | None = None) -> dict[str, Any]:
        """The metadata saved with ``step`` (default: the most recent commit); ``{}`` when none was given.
        Global rank 0 reads the verified manifest and tells the others."""
        def read() -> dict[str, Any]:
            chosen, _, _ = self._resolve_step(step)
            if chosen is None:
                raise CheckpointNotFoundError(f"no committed checkpoint for run {self.run_id!r} under "
                                              f"{self.layout.storage.describe()}", run_id=self.run_id)
            return read_committed(self.layout, chosen, Deadline(self.timeout)).manifest.user_metadata or {}

        return self._on_rank0(read, "read a step's metadata",
                              request="the latest step" if step is None else f"step {step}")

    @_operation
    def steps(self) -> list[int]:
        """Committed steps, ascending (global rank 0 scans, the others are told)."""
        return self._on_rank0(lambda: [m.step for m in scan_markers(self.layout)], "list committed steps")

    # -- internals ------------------------------------------------------------------------

    def _writer(self, step: int, watch: OpWatch, metadata: dict[str, Any] | None = None) -> AtomicStorageWriter:
        validate_step(step)
        return _WatchedWriter(self.root, self.run_id, step, parallelism=self.parallelism, metadata=metadata,
                              compression=self.compression, thread_count=self.thread_count, resumed_from=self._resumed,
                              timeout=self.timeout, storage_options=self.storage_options, watch=watch)

    def _save_planner(self, watch: OpWatch) -> AtomicSavePlanner:
        return _WatchedSavePlanner(watch, divergence=self.divergence)

    def _watch(self, what: str) -> OpWatch:
        return OpWatch(self._heartbeat, self._ops, self.work_timeout, what)

    def _drain(self) -> int | None:
        """Wait for the background save; raise its failure unless already reported. Returns its step.

        The save stays in flight until the wait is over: interrupted (Ctrl-C), it is still there for
        ``close()`` to wait for, and its failure still gets raised."""
        inflight = self._inflight
        if inflight is None:
            return None
        concurrent.futures.wait([inflight])
        with self._lock:
            if self._inflight is inflight:
                self._inflight = None
        error = concurrent.futures.Future.exception(inflight)  # the base method: reading it here is not a report
        if error is None:
            return concurrent.futures.Future.result(inflight)
        if inflight.reported:
            return None
        inflight.reported = True
        raise error

    def _resolve_step(self, step: int | None) -> tuple[int | None, str | None, ResumePoint | None]:
        """(step, save_id, resume point) to load, decided by rank 0: every rank then waits for that exact
        attempt, and the resume point says which later steps this job's saves may supersede (P14)."""
        if step is None:
            step = scan_latest_step(self.root, self.run_id, self.storage_options, timeout=self.timeout)
            if step is None:
                return None, None, None
        validate_step(step)
        if not self.layout.storage.is_dir(self.layout.step_dir(step)):  # no trace of it: nothing to wait for (P9)
            raise CheckpointNotFoundError(
                f"run {self.run_id!r} has no step {step} ({self.layout.step_dir(step)} does not exist); "
                "manager.steps() lists the committed ones", step=step)
        save_id = read_marker(self.layout, step, Deadline(self.timeout)).save_id
        return step, save_id, resume_point(self.layout, step)

    def _resolve_everywhere(self, reader: "_WatchedReader", step: int) -> None:
        """Every rank resolves on its own; if any rank cannot, all raise, naming who saw what (P5).

        Done before DCP starts, so a rank that fails here does not leave the
        others waiting in DCP's collectives until the group timeout; the
        exchange waits at a liveness barrier for ranks still reading (a large
        ``.metadata`` on slow storage is work, not death).
        """
        try:
            reader.resolve()
            mine: CheckpointError | None = None
        except CheckpointError as e:
            mine = e
        outcomes = [mine]
        if self._distributed and self.world_size > 1:
            reader.watch.wait_all("check")
            outcomes = [None] * self.world_size
            try:
                dist.all_gather_object(outcomes, mine, group=self._group)
            except BaseException as e:
                _raise_typed(self._translate(e, f"resolving step {step}"))
        failed = [(rank, error) for rank, error in enumerate(outcomes) if error is not None]
        if not failed:
            return
        if mine is not None and len(failed) == 1:
            raise mine
        rank, first = failed[0]
        summary = "; ".join(f"rank {r}: {e}" for r, e in failed)
        raise type(first)(f"{len(failed)} of {len(outcomes)} rank(s) could not resolve step {step} of run "
                          f"{self.run_id!r}, so no rank loads it: {summary}", ranks=[r for r, _ in failed])

    def _on_rank0(self, compute: Callable[[], Any], what: str, request: str | None = None) -> Any:
        """Compute on global rank 0 only and share the outcome; errors there reach every rank.

        Every rank must make the same ``request`` (a rank asking for another step must not silently
        load rank 0's, P5).  The exchange starts at a liveness barrier: rank 0 may be busy for longer
        than the group timeout (retention after the last save, a marker it waits for), and is waited
        for like any work, up to ``work_timeout``.
        """
        outcome = None
        if self.rank == 0:
            try:
                outcome = ("ok", compute())
            except CheckpointError as e:
                outcome = ("error", e)
        if self._distributed and self.world_size > 1:
            watch = self._watch(what)
            watch.wait_all("resolve")
            shared: list[Any] = [None] * self.world_size
            try:
                dist.all_gather_object(shared, (request, outcome), group=self._group)
            except BaseException as e:
                _raise_typed(self._translate(e, what))
            watch.finish()
            requests: dict[str | None, list[int]] = {}
            for rank, (asked, _) in enumerate(shared):
                requests.setdefault(asked, []).append(rank)
            if len(requests) > 1:
                raise RankConsistencyError(
                    f"{what}: the ranks asked for different things, so none goes on: "
                    + "; ".join(f"rank(s) {_rank_list(ranks)}: {asked}" for asked, ranks in requests.items())
                    + ". Every rank must make the same call with the same arguments.",
                    requests={asked: ranks[:8] for asked, ranks in requests.items()})
            outcome = shared[0][1]
        status, value = outcome
        if status == "error":
            raise value
        return value

    def _after_commit(self, step: int, writer: AtomicStorageWriter, seconds: float, stage_seconds: float,
                      asynchronous: bool) -> None:
        """Rank 0's bookkeeping once ``step`` is committed; nothing here may fail the save (it is durable,
        and the other ranks have already returned): errors are logged and counted instead."""
        if self.rank != 0:
            return
        stats = SaveStats.from_writer(writer.last_stats, run_id=self.run_id, step=step, save_id=writer.save_id,
                                      world_size=self.world_size, asynchronous=asynchronous, seconds=seconds,
                                      stage_seconds=stage_seconds)
        try:
            self._retention(step, writer, stats)
        except Exception as e:  # EBUSY on NFS .nfsXXXX files, EIO, throttled deletes: the next save retries
            stats.retention_error = f"{type(e).__name__}: {e}"
            log.warning("run %r step %d is committed, but retention failed (the next save retries it): %s",
                        self.run_id, step, stats.retention_error, exc_info=True)
        log.info("run %r step %d committed: %s", self.run_id, step,
                 ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in stats.to_dict().items() if k != "ranks"))
        self._deliver(self.on_saved, "on_saved", stats)

    @contextlib.contextmanager
    def _failures_reported(self, operation: str, step: int | None, started: float):
        """Report a failure of the enclosed work to ``on_failed``; yields a dict whose ``step`` the work
        may fill in once it knows it (a load of the latest step)."""
        attempt = {"step": step}
        try:
            yield attempt
        except Exception as error:
            self._report_failure(operation, attempt["step"], error, started)
            raise

    def _report_failure(self, operation: str, step: int | None, error: BaseException, started: float) -> None:
        """Never raises: the failure itself must still reach the caller (an async save's future)."""
        if self.on_failed is None:
            return
        try:
            stats = FailureStats.from_error(error, operation=operation, run_id=self.run_id, step=step,
                                            world_size=self.world_size, rank=self.rank,
                                            seconds=time.perf_counter() - started)
        except Exception:
            log.exception("could not describe the failure of %s step %s for on_failed", operation, step)
            return
        self._deliver(self.on_failed, "on_failed", stats)

    def _deliver(self, callback: StatsCallback | None, name: str, stats: SaveStats | LoadStats | FailureStats) -> None:
        """Hand ``stats`` to a user callback; its failure is logged and counted, never the operation's."""
        if callback is None:
            return
        try:
            callback(stats.to_dict())
        except Exception:
            with self._lock:
                self.callback_failures += 1
            log.exception("the %s callback failed for run %r step %s; the %s's outcome stands", name, self.run_id,
                          stats.step, stats.kind)

    def _retention(self, step: int, writer: AtomicStorageWriter, stats: SaveStats) -> None:
        """Applies ``keep_last`` reading only the journal and the markers of steps it may delete, so a commit
        costs the same at step 100,000 as at step 10 (no scan of every marker; see retain_after_commit)."""
        if self.keep_last is None:
            return
        plan = retain_after_commit(self.layout, writer.last_marker, self.keep_last, lease_seconds=self.lease_seconds)
        if plan.unreadable_steps:
            stats.unreadable_steps = [s for s, _ in plan.unreadable_steps]
            log.warning("retention keeps step(s) whose marker cannot be validated: %s",
                        "; ".join(f"step {s}: {why}" for s, why in plan.unreadable_steps))
        above = sorted(s for s in {*plan.kept_steps, *plan.delete_steps} if s > step)  # every step the journal knows
        if above:
            log.info("step %d saved below committed step(s) %s: a new branch starts (rollback restart)", step,
                     above[:5])

    def _settle_failed_save(self, error: BaseException, step: int, writer: AtomicStorageWriter, op: int,
                            watch: OpWatch) -> None:
        """DCP said the save failed; if our marker exists anyway, it committed (returns), else raise typed
        (a liveness verdict first: the gloo error that followed it names nobody)."""
        if writer.save_id is not None:
            try:  # rank 0 may have just created it on another client: allow for visibility lag
                marker = read_marker(self.layout, step, Deadline(min(self.timeout, 5.0)))
                if marker.save_id == writer.save_id:
                    log.warning("step %d: DCP reported a failure (%s) after the commit; the marker names this "
                                "save (%s), so the checkpoint IS committed", step, _first_line(error), writer.save_id)
                    return
            except Exception:
                pass
        _raise_typed(watch.verdict or self._translate(error, f"saving step {step}", op))

    def _translate(self, error: BaseException, what: str, op: int | None = None) -> BaseException:
        """Our own error type for anything DCP or the process group raised."""
        if isinstance(error, CheckpointError):
            return error
        if isinstance(error, CheckpointException):
            inner = [w[0] if isinstance(w, tuple) else w for w in error.failures.values()]
            ours = [e for e in inner if isinstance(e, CheckpointError)]
            if ours:
                return ours[0]
            peers = [e for e in inner if _is_peer_failure(e)]
            if peers:
                return self._peer_failure(peers[0], what, op)
            ranks = sorted(error.failures)
            return CheckpointError(f"{what} failed on rank(s) {ranks}: {_first_line(inner[0])}", ranks=ranks)
        if _is_peer_failure(error):
            return self._peer_failure(error, what, op)
        if isinstance(error, Exception):  # DCP's own checks, a bug: still typed (P8); KeyboardInterrupt is not ours
            typed = CheckpointError(f"{what} failed on rank {self.rank} ({socket.gethostname()}): "
                                    f"{_first_line(error)}", rank=self.rank)
            typed.__cause__ = error
            return typed
        return error

    def _peer_failure(self, error: BaseException, what: str, op: int | None) -> RankFailureError:
        silent = self._silent_ranks(self._ops if op is None else op)
        return RankFailureError(
            f"{what}: a peer died or stopped responding inside a collective (seen by rank {self.rank} on "
            f"{socket.gethostname()}); silent rank(s): {silent}. Nothing new is committed unless the step's "
            f"marker names this save; restart the job and resume from the latest committed step. "
            f"Cause: {_first_line(error)}",
            rank=self.rank,
            silent=silent,
        )

    def _silent_ranks(self, op: int) -> str:
        """Which global ranks never check in on the rendezvous store within a short, bounded window.

        The process group is unusable after a peer failure, but the TCP store
        (hosted by global rank 0) still is, unless rank 0 itself is gone.  Every
        live rank reports under the failing operation's id; the ones missing
        after the group timeout are the dead or frozen ranks.
        """
        if not self._distributed:
            return "none (single process)"
        world, me = dist.get_world_size(), dist.get_rank()
        prefix = f"dcp_atomic/{self.run_id}/{self._instance}/op{op}"
        keys = [f"{prefix}/{r}" for r in range(world)]
        # Live ranks still blocked in the broken collective only notice at the group timeout: wait that long.
        window = self.timeout + 1.0
        present: list[int] = []

        def check_in() -> None:
            store = dist.distributed_c10d._get_default_store()
            store.set(keys[me], "alive")
            deadline = time.monotonic() + window
            while True:
                present[:] = [r for r, key in enumerate(keys) if store.check([key])]
                if len(present) == world or time.monotonic() > deadline:
                    return
                time.sleep(0.05)

        # A frozen rank 0 freezes its store too, and store calls then never return: bound them from outside.
        worker = threading.Thread(target=check_in, name="dcp-atomic-liveness", daemon=True)
        worker.start()
        worker.join(window + 2.0)
        if worker.is_alive() or me not in present:
            return "0 (the rendezvous store on global rank 0 does not answer: rank 0 is dead or frozen)"
        silent = sorted(set(range(world)) - set(present))
        return ", ".join(map(str, silent)) if silent else "none (all ranks checked in; a transient network failure?)"


def _is_peer_failure(error: BaseException) -> bool:
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        marker in text for marker in ("Connection closed by peer", "Connection reset by peer", "Timed out", "timed out",
                                      "timeout", "Broken pipe", "connection refused")
    )


def _raise_typed(error: BaseException) -> NoReturn:
    """Raise what ``_translate`` made, chained only to the cause it kept (DCP's wrapping is noise)."""
    raise error from error.__cause__


def _rank_list(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (f", ... ({len(ranks)} ranks)" if len(ranks) > 8 else "")


def _first_line(error: BaseException) -> str:
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return f"{type(error).__name__}: {shorten(lines[-1], 300) if lines else ''}"


class _SaveFuture(concurrent.futures.Future):
    """An async save's future that knows whether its failure has been reported to anyone."""

    reported = False

    def result(self, timeout: float | None = None) -> Any:
        try:
            return super().result(timeout)
        finally:
            self.reported |= self.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        error = super().exception(timeout)
        self.reported = True
        return error


class _WatchedSavePlanner(AtomicSavePlanner):
    """Ends the planning share at a liveness barrier: staging an async save, or rank 0's retention
    after the previous save, may keep one rank longer than the group timeout."""

    def __init__(self, watch: OpWatch, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.watch = watch

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        try:
            super().set_up_planner(state_dict, storage_meta, is_coordinator)
        except BaseException:
            self.watch.wait_all("plan", quiet=True)
            raise

    def create_local_plan(self):
        return self.watch.run("plan", super().create_local_plan)


class _WatchedWriter(AtomicStorageWriter):
    """Ends each rank's writes at a liveness barrier, so DCP's following gather starts together."""

    def __init__(self, *args: Any, watch: OpWatch, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.watch = watch

    def write_data(self, plan, planner):
        write = super().write_data
        return self.watch.run("write", lambda: write(plan, planner))


class _WatchedReader(AtomicStorageReader):
    """Ends each rank's reads at a liveness barrier, so DCP's following all_gather starts together."""

    def __init__(self, *args: Any, watch: OpWatch, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.watch = watch

    bytes_read = files_read = 0

    def read_data(self, plan, planner):
        """Also sums the stored length of each distinct item this rank loads (for ``on_loaded``)."""
        read = super().read_data

        def counted_read():
            stored = {item.storage_index: self._storage_info(item) for item in plan.items}
            self.bytes_read = sum(info.length for info in stored.values())
            self.files_read = len({info.relative_path for info in stored.values()})
            return read(plan, planner)

        return self.watch.run("read", counted_read)

    def _before_exchange(self, round_index: int, failing: bool) -> None:
        """Peers reading their share are waited for by heartbeat (slow storage is not a dead rank), so the
        round's status collective only starts once every rank is there."""
        self.watch.wait_all(f"share{round_index}", quiet=failing)
