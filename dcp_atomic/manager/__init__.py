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

import atexit
import concurrent.futures
import contextlib
import functools
import logging
import os
import threading
import time
import weakref
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ..stores.backends import open_storage
from .._base import arguments
from ..protocol.catalog import DEFAULT_TIMEOUT, latest_step as scan_latest_step
from ..exchange.collective import RankAgreement, _first_line, _raise_typed
from ..protocol.commit import (ResumePoint, commit_order, listed_steps, next_sequence, read_committed, read_marker,
                     refuse_committed, resume_point, scan_markers)
from ..errors import (CheckpointError, CheckpointNotFoundError, CommitConflictError, ConfigurationError,
                     RankConsistencyError, StorageError)
from ..format.layout import RunLayout, validate_step
from ..exchange.liveness import Heartbeat, OpWatch
from ..format.manifest import Marker
from ..tiers.drain import Drained, Drainer, DrainJob
from ..protocol.lineage import describe as describe_lineage, ensure_lineage, lineage_path
from ..tiers.local_tier import (LocalWriter, Topology, commit_local, local_markers, merge_held, of_lineage, open_local,
                         remove_failed_attempt,
                         remove_local_step, retain_local, scan_root, sweep_spool)
from ..format.parallelism import Parallelism
from ..dcp.planners import AtomicLoadPlanner, AtomicSavePlanner
from ..protocol.retention import DEFAULT_LEASE_SECONDS, remove_step, retain_after_commit
from .._base.retry import Deadline
from ..tiers.placement import failure_domain as resolve_failure_domain
from .._base.stats import DrainStats, FailureStats, LoadStats, SaveStats
from ..tiers.tier_restore import Durable, assemble, choose, not_found
from ..dcp.watched import WatchedReader, WatchedSavePlanner, WatchedWriter
from ..dcp.writer import AtomicStorageWriter

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


def _exit_without_close(manager: "weakref.ref[CheckpointManager]") -> None:
    """atexit: a two-tier manager never closed must not lose its drain in flight silently (:meth:`_exiting`)."""
    alive = manager()
    if alive is not None:
        try:
            alive._exiting()
        except Exception:  # noqa: BLE001 - at exit: log, never raise past the interpreter's shutdown
            log.exception("dcp_atomic: the exit-time wait for a drain failed")


class _Unset:
    """The type of a keyword's "not given" (``durable_every``'s default depends on ``local_root``)."""

    def __repr__(self) -> str:
        return "<default>"


_UNSET = _Unset()
DEFAULT_DURABLE_EVERY = 1  # with a local tier: every save is also drained (in the background), as torchtitan's


class CheckpointManager(RankAgreement):
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
        local_root: this node's own storage (a local path; each rank passes its node's): saves go there
            first, with ``replicas`` copies of each rank's files on ranks of other failure domains, and
            ``load`` restores from the newest step assemblable from local roots, replicas or ``root``
            (README, "Two tiers").  None: one tier, ``root``, exactly as without it.
        replicas: copies of each rank's files on other failure domains (local tier).
        durable_every: with ``local_root``, every N-th local save is also drained to ``root`` in the
            background (:mod:`.drain`; ``save(durable=)`` decides per save), and ``close()`` drains the last
            local step if it was not (default 1: every save, as torchtitan's integration; training never waits
            for it).  None: only saves with ``durable=True`` -- warned at construction, since node-local disks
            rarely outlive the allocation.
        keep_local, failure_domain: local steps kept per local root (a step being drained, or the newest
            one waiting for its drain, is kept besides), and this rank's failure domain (default
            ``$DCP_ATOMIC_FAILURE_DOMAIN``, else the host name).
        on_drained: callback receiving a drain's statistics (``stats.DrainStats``; rank 0, once the step
            is committed to ``root``).  A failed drain goes to ``on_failed`` (operation ``"drain"``) on
            every rank and is raised once by ``wait()`` / ``close()``.
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
        local_root: str | os.PathLike | None = None,
        replicas: int = 1,
        durable_every: int | None | _Unset = _UNSET,
        keep_local: int = 2,
        failure_domain: str | None = None,
        on_drained: StatsCallback | None = None,
    ) -> None:
        keep_last = arguments.count("CheckpointManager(keep_last=...)", keep_last)
        keep_local = arguments.count("CheckpointManager(keep_local=...)", keep_local, optional=False)
        thread_count = arguments.count("CheckpointManager(thread_count=...)", thread_count)
        timeout = arguments.seconds("CheckpointManager(timeout=...)", timeout)
        work_timeout = arguments.seconds("CheckpointManager(work_timeout=...)", work_timeout)
        lease_seconds = arguments.seconds("CheckpointManager(lease_seconds=...)", lease_seconds)
        allow_divergence = arguments.flag("CheckpointManager(allow_divergence=...)", allow_divergence)
        share_reads = arguments.flag("CheckpointManager(share_reads=...)", share_reads, optional=True)
        defaulted = isinstance(durable_every, _Unset)
        if defaulted:  # durable copies whenever there is a local tier
            durable_every = DEFAULT_DURABLE_EVERY if local_root is not None else None
        durable_every = arguments.count("CheckpointManager(durable_every=...)", durable_every)
        if durable_every is not None and local_root is None:
            raise ConfigurationError(f"durable_every={durable_every} needs local_root: without a local tier every "
                                     "save already goes to the durable root")
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
        self.on_drained = on_drained
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
        self._drain_group: dist.ProcessGroup | None = None
        if self._distributed and process_group is None and local_root is not None:
            # the drain thread's own group (drain.py): created here, on the main thread, on every rank alike;
            # it waits for every rank's upload, so it gets the work's limit, not the liveness one
            self._drain_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=max(timeout, work_timeout)))
            self._owned_groups.append(self._drain_group)
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
        self.local_root, self.keep_local = local_root, keep_local
        self.restored_from: dict[str, Any] | None = None  # after load(): which tier served (see load)
        self._tier: Topology | None = None
        self._local_sequence = 0  # the newest commit sequence this process knows of, both tiers (rank 0 decides)
        self._sequence_known = False
        self.durable_every = durable_every
        self._local_saves = 0  # counts saves for durable_every (identical on every rank: SPMD)
        self._last_undrained: tuple[int, Marker] | None = None  # the newest local save not queued for the drain
        self._drainer: Drainer | None = None
        self._durable_saves: set[str] = set()  # rank 0: save ids known to be in the durable root (see _undrained)
        self._requeued: set[str] = set()  # save ids _undrained queued again: once per process, never in a loop
        self._lineage: str | None = None  # the durable run's lineage (lineage.py): which local steps are this job's
        self._durable_listed: set[int] | None = None  # rank 0, two tiers: the durable root's steps (listed once)
        if local_root is not None:
            self._local = open_local(os.fspath(local_root), run_id)
            try:
                self._tier = Topology.learn(self.rank, self.world_size, resolve_failure_domain(failure_domain),
                                            os.fspath(local_root), replicas, self._group)
                self._lineage = self._on_rank0(self._read_lineage, "read the run's lineage")
            except BaseException:  # refused (too few domains...): nothing of this manager may outlive it
                self._tier = None
                self._release()
                raise
            if not self._distributed or self.world_size == 1 or self._drain_group is not None:
                self._drainer = Drainer(rank=self.rank, world_size=self.world_size, group=self._drain_group,
                                        local=self._local, durable=self.layout, timeout=self.timeout,
                                        where=self.layout.storage.describe(), resumed=lambda: self._resumed,
                                        committed=self._drained, failed=self._drain_failed,
                                        threads=self.thread_count, stall=self.timeout)
                atexit.register(_exit_without_close, weakref.ref(self))
        if local_root is not None and self._drainer is None:  # given process_group= in a world: no drain group
            if not defaulted and durable_every is not None:
                self._release()
                raise ConfigurationError(f"durable_every={durable_every} needs a process group of the drain's own, "
                                         "which the manager cannot create when it is given process_group=; leave "
                                         "process_group out, or save durable steps with a manager without local_root")
            self.durable_every = durable_every = None
            if self.rank == 0:
                log.warning("CheckpointManager(local_root=%r, process_group=...): the drain needs a process group of "
                            "its own, so no step reaches the durable root %s; every step lives only on the nodes' "
                            "local disks. Leave process_group out to keep durable copies.", os.fspath(local_root),
                            self.layout.storage.describe())
        elif local_root is not None and durable_every is None and self.rank == 0:
            log.warning("CheckpointManager(local_root=%r, durable_every=None): only saves with durable=True reach the "
                        "durable root %s; every other step lives only on the nodes' local disks, which are usually "
                        "wiped when the allocation ends. Leave durable_every at its default (%d: every save drains in "
                        "the background) or set it to N to keep durable copies.", os.fspath(local_root),
                        self.layout.storage.describe(), DEFAULT_DURABLE_EVERY)
        self._closed = False

    # -- saving --------------------------------------------------------------------------

    @_operation
    def save(self, step: int, state_dict: dict[str, Any], metadata: dict[str, Any] | None = None,
             durable: bool | None = None) -> int:
        """Save and commit ``step`` synchronously; returns the step.  ``metadata``: a small JSON dict kept with
        the checkpoint (global rank 0's; see :meth:`metadata`).

        Raises the typed error if the save failed.  Before saving, raises the failure of an
        earlier ``async_save`` that nothing has reported yet (see ``async_save``).  With ``local_root``
        the step is committed to the local tier (replicas verified, README "Two tiers"), and queued for the
        background drain to ``root`` if ``durable`` says so (None: the ``durable_every`` policy); the save
        never waits for a drain.  Without ``local_root`` every save is durable and ``durable`` is ignored.
        """
        drain = self._wants_drain(durable)
        self._drain()
        started = time.perf_counter()
        with self._failures_reported("save", step, started):
            self._refuse_conflicts(step)
            watch = self._watch(f"saving step {step}")
            writer = self._writer(step, watch, metadata)
            with self._failed_attempt_removed(step, writer):
                try:
                    dcp.save(state_dict, storage_writer=writer, planner=self._save_planner(watch),
                             process_group=self._group)
                except BaseException as e:  # CheckpointException is a BaseException
                    self._settle_failed_save(e, step, writer, self._ops, watch)
                else:
                    watch.finish()
                self._commit_local(step, writer, self._group, drain)
        self._after_commit(step, writer, time.perf_counter() - started, stage_seconds=0.0, asynchronous=False)
        return step

    @_operation
    def async_save(self, step: int, state_dict: dict[str, Any], metadata: dict[str, Any] | None = None,
                   durable: bool | None = None) -> concurrent.futures.Future:
        """Stage ``state_dict`` to host memory now, write and commit in the background (``metadata``: as ``save``).

        Returns a future that resolves to ``step`` once the save has *committed*
        (and retention ran), or raises the typed error.  A second call first
        waits for the previous save.

        A failure is never swallowed: it is raised once, by the first of the
        returned future's ``result()`` / ``exception()``, ``wait()``, ``close()``,
        or the next ``save`` / ``async_save`` / ``load`` (which then does
        nothing else).  Every rank sees the same failure; call these the same
        way on every rank.  With ``local_root`` the future resolves once the step is local-committed (and
        queued for the drain, ``durable`` as for ``save``), not once it is drained.
        """
        drain = self._wants_drain(durable)
        self._drain()
        op = self._ops
        result = _SaveFuture()
        started = time.perf_counter()
        with self._failures_reported("async_save", step, started):
            self._refuse_conflicts(step)
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
                with self._failed_attempt_removed(step, writer):
                    try:
                        done.result()
                    except BaseException as e:
                        if self._heartbeat is not None:
                            self._heartbeat.gave_up(op)
                        self._settle_failed_save(e, step, writer, op, watch)
                    else:
                        watch.finish()
                    self._commit_local(step, writer, self._async_group, drain)
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
        """Wait for the in-flight save, then for the drains in flight or waiting; return the save's step (None if
        there is none).

        Raises the save's failure unless it was already reported (see ``async_save``), then a drain's
        failure that nothing has raised yet (once, on every rank).
        """
        step = self._drain()
        if self._drainer is not None:
            self._drainer.wait()
        return step

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
            try:
                if self._drainer is not None and self._inflight is None:
                    self._drain_last()
                    self._drainer.wait()  # the last durable step must not be lost to a closing job
            finally:
                self._release()

    def _exiting(self) -> None:
        """The interpreter exits and ``close()`` was never called (:func:`_exit_without_close`): wait for a drain in
        flight, bounded by the stall deadline, and say what became of it; nothing new is started (the peers may be
        gone).  Every rank's exit waits alike, so the drain's collectives still meet."""
        drainer = self._drainer
        if drainer is None or self._closed or not drainer.busy():
            return
        steps = sorted(drainer.protected())
        where = self.layout.storage.describe()
        log.warning("run %r: the process exits without close() while step(s) %s drain to %s; waiting for the drain "
                    "(stall deadline %.0fs)", self.run_id, steps, where, self.timeout)
        try:
            drainer.wait()
        except CheckpointError as e:
            log.error("run %r: exiting without close(): step(s) %s did not reach %s (%s: %s). They stay on these "
                      "nodes' local roots; the next job of this run on them drains the newest such step again (or "
                      "a newer durable save supersedes it). Call close() before exiting to be told in time.",
                      self.run_id, steps, where, type(e).__name__, e)
        else:
            log.warning("run %r: exiting without close(): step(s) %s drained to %s before exit", self.run_id,
                        steps, where)

    def _drain_last(self) -> None:
        """Every rank alike (SPMD): queue the last local step for the drain if no save queued it (``durable_every``
        N > 1), so a job's final state outlives its nodes; ``durable_every=None`` opted out (warned at construction)."""
        last, self._last_undrained = self._last_undrained, None
        if last is None or self.durable_every is None:
            return
        step, marker = last
        if self.rank == 0:
            log.info("run %r: closing; draining the last local step %d to %s", self.run_id, step,
                     self.layout.storage.describe())
        self._drainer.submit(step, marker)

    def _release(self) -> None:
        drainer = self._drainer
        if self._inflight is not None or (drainer is not None and drainer.busy()):
            return  # never destroy the groups under a running save or drain
        if drainer is not None:
            drainer.close()
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
    def load(self, state_dict: dict[str, Any], step: int | None = None, allow_reshard: bool = False,
             save_id: str | None = None) -> int:
        """Load ``step`` (default: the most recent commit) into ``state_dict``; returns the step loaded.
        ``save_id`` (with ``step``): exactly that save of the step, from either tier, or
        :class:`CheckpointNotFoundError` before anything is read (for a record that names one save).

        With ``local_root``: the most recent step (both tiers, by commit sequence) that can be assembled
        completely from the local roots, peers' replicas or the durable root; ``restored_from`` then says
        which tier served (``{"tier", "step", "save_id", "ranks_fetched", "bytes_fetched"}``, every rank its own:
        how many ranks' files (whole, or the items it reads of them) this rank received into its local root from
        another root first, and their stored bytes).

        Before loading, raises the failure of an earlier ``async_save`` that nothing has reported yet.
        """
        if save_id is not None and step is None:
            raise ValueError(f"load(save_id={save_id!r}) needs the step that save belongs to")
        self._drain()
        started = time.perf_counter()
        with self._failures_reported("load", step, started) as attempt:
            root, storage_options, wanted = self.root, self.storage_options, save_id
            local = self._restore_local(step, state_dict, wanted) if self._tier is not None else None
            if local is not None:
                chosen, save_id, resumed = local
                root, storage_options = os.fspath(self.local_root), None
            else:
                chosen, save_id, resumed = self._on_rank0(
                    lambda: self._resolve_step(step, wanted), "resolve the step to load",
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
            reader = WatchedReader(root, self.run_id, chosen, save_id=save_id, parallelism=self.parallelism,
                                    allow_reshard=allow_reshard, timeout=self.timeout / 2,
                                    storage_options=storage_options, thread_count=self.thread_count,
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
            exchange_seconds=reader.read_stats.exchange_seconds,
            tier=None if self._tier is None else (self.restored_from or {}).get("tier"),
            bytes_from_replicas=(self.restored_from or {}).get("bytes_fetched", 0) if self._tier is not None else 0))
        return chosen

    @_operation
    def latest_step(self) -> int | None:
        """The most recently committed step (global rank 0 scans, the others are told)."""
        return self._on_rank0(
            lambda: scan_latest_step(self.root, self.run_id, self.storage_options, timeout=self.timeout,
                                     missing_root_ok=True),
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
    def queue_drain(self, step: int) -> None:
        """Queue the local-committed ``step`` for the drain to ``root`` (again): every rank alike.  For a step whose
        drain failed or whose job stopped before it, that a record still names (Lightning's files); ``wait()``
        then says whether it committed.  Global rank 0 reads the step's local marker and tells the others."""
        if self._drainer is None:
            raise ConfigurationError("queue_drain needs local_root (and, in a world, the manager's own groups)")
        marker = None
        if self.rank == 0:
            try:
                marker = Marker.from_json(self._local.storage.read_file(self._local.marker(step)),
                                          where=self._local.marker(step))
            except (OSError, CheckpointError) as e:
                marker = f"{type(e).__name__}: {e}"
        marker = self._gathered(marker)[0]
        if isinstance(marker, Marker) and not of_lineage([marker], self._lineage):
            raise CommitConflictError(f"step {step} on global rank 0's local root was saved for another durable root "
                                      f"or experiment ({describe_lineage(marker.lineage)}; this job's: "
                                      f"{describe_lineage(self._lineage)}): not drained", step=step)
        if not isinstance(marker, Marker):
            raise CheckpointNotFoundError(f"step {step} of run {self.run_id!r} cannot be drained: global rank 0 has "
                                          f"no local marker of it ({marker})", step=step)
        self._drainer.submit(step, marker)

    @_operation
    def retire(self, steps: list[int]) -> list[int]:
        """Remove ``steps`` from both tiers; every rank calls it alike (each local root's leader drops that root's
        copies, global rank 0 the durable ones), no collective inside.  For an integration whose own records name
        steps (Lightning's files): a step no record names any more.  It first waits for the drains (raising a
        failed one's error, as ``wait()`` does: on every rank alike).  Removal failures are logged, not raised, so
        the ranks never part ways; returns the steps this rank could not remove (a later call retries them, or
        ``dcp-atomic rm``)."""
        if self._drainer is not None:
            self._drainer.wait()  # every rank alike: a drain's outcome reaches every rank (drain.py, step 4)
        failed = []
        for step in steps:
            try:
                if self._tier is not None and self._tier.is_leader:
                    remove_local_step(self._local, step)
                if self.rank == 0:
                    try:
                        remove_step(self.layout, step)
                    except CheckpointNotFoundError:
                        pass  # never drained, or retired already
            except (OSError, CheckpointError) as e:
                failed.append(step)
                log.warning("could not retire step %d of run %r (%s: %s); a later retire or `dcp-atomic rm` removes "
                            "it", step, self.run_id, type(e).__name__, e)
        return failed

    @_operation
    def steps(self, tier: str | None = None) -> list[int]:
        """Committed steps, ascending (global rank 0 scans, the others are told).  ``tier``: ``"durable"``
        (the durable root's), ``"local"`` (local-committed on any local root), or None (either)."""
        if tier not in (None, "local", "durable"):
            raise ValueError(f"tier must be None, 'local' or 'durable', got {tier!r}")
        found: set[int] = set()
        if tier != "local":
            found |= set(self._on_rank0(lambda: [m.step for m in scan_markers(self.layout)], "list committed steps"))
        if tier != "durable" and self._tier is not None:
            mine = of_lineage(local_markers(self._local), self._lineage) if self._tier.is_leader else []
            for steps in self._gathered([m.step for m in mine]):
                found |= set(steps)
        return sorted(found)

    # -- the local tier (README "Two tiers"; local_tier.py, tier_restore.py) -----------------

    def _wants_drain(self, durable: bool | None) -> bool | None:
        """Whether this save is drained to the durable root: ``durable``, else every ``durable_every``-th local save.
        None: not by the policy (``close()`` drains such a step if it is the last, :meth:`_drain_last`)."""
        if durable is not None and not isinstance(durable, bool):
            raise ValueError(f"durable must be True, False or None, got {durable!r}")
        if self._tier is None:
            return False  # one tier: the save itself is durable
        self._local_saves += 1
        wanted = durable if durable is not None else (
            bool(self.durable_every) and self._local_saves % self.durable_every == 0) or None
        if wanted and self._drainer is None:
            raise ConfigurationError("draining to the durable root needs a process group of the drain's own, which "
                                     "the manager cannot create when it is given process_group=; leave "
                                     "process_group out, or save durable steps with a manager without local_root")
        return wanted

    def _drained(self, drained: Drained) -> None:
        """Rank 0, on the drain thread: a step reached the durable root; durable retention, then ``on_drained``."""
        job, marker = drained.job, drained.marker
        self._durable_saves.add(job.save_id)
        if self._durable_listed is not None:
            self._durable_listed.add(job.step)
        log.info("run %r step %d drained to %s (sequence %s, %.1f MiB in %.3fs, attempt %d%s)", self.run_id,
                 job.step, self.layout.storage.describe(), marker.sequence, drained.bytes / 2**20, drained.seconds,
                 drained.attempts, f"; skipped step(s) {drained.skipped}" if drained.skipped else "")
        if self.keep_last is not None:
            try:
                retain_after_commit(self.layout, marker, self.keep_last, lease_seconds=self.lease_seconds)
            except Exception as e:  # the drain is committed; the next one retries
                log.warning("run %r: durable retention after draining step %d failed (the next drain retries it): "
                            "%s", self.run_id, job.step, e)
        self._deliver(self.on_drained, "on_drained", DrainStats(
            run_id=self.run_id, step=job.step, save_id=job.save_id, sequence=marker.sequence,
            world_size=self.world_size, seconds=drained.seconds, queued_seconds=drained.queued_seconds,
            bytes=drained.bytes, files=drained.files, gb_per_s=drained.bytes / max(drained.seconds, 1e-9) / 1e9,
            attempts=drained.attempts, skipped_steps=list(drained.skipped)))

    def _drain_failed(self, job: DrainJob, error: CheckpointError, seconds: float) -> None:
        """Every rank, on the drain thread: a drain failed for good (``wait()`` raises it)."""
        if self.on_failed is None:
            return
        try:
            stats = FailureStats.from_error(error, operation="drain", run_id=self.run_id, step=job.step,
                                            world_size=self.world_size, rank=self.rank, seconds=seconds)
        except Exception:
            log.exception("could not describe the failure of the drain of step %s for on_failed", job.step)
            return
        self._deliver(self.on_failed, "on_failed", stats)

    def _gathered(self, mine: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
        if not self._distributed or self.world_size == 1:
            return [mine]
        everyone: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(everyone, mine, group=group or self._group)
        except BaseException as e:
            _raise_typed(self._translate(e, "exchanging the local tier's state"))
        return everyone

    def _sequence_floor(self) -> int:
        """Rank 0: the newest commit sequence of either tier it knows; the durable root's ``LATEST`` is read once
        per manager (P10 across tiers: a local commit never sorts below a durable one made before it)."""
        if self.rank == 0 and not self._sequence_known:
            try:
                self._local_sequence = max(self._local_sequence, next_sequence(self.layout) - 1)
            except (OSError, CheckpointError) as e:
                log.warning("local tier: could not read the durable root's commit sequence (%s); local commits "
                            "number from the local roots alone", e)
            self._sequence_known = True
        return self._local_sequence

    def _commit_local(self, step: int, writer: AtomicStorageWriter, group: dist.ProcessGroup | None,
                      drain: bool | None = False) -> None:
        """After DCP's save: replicas, rank 0's decision, the local markers, the drain's queue, then local
        retention (which keeps what the drain still needs)."""
        if self._tier is None:
            return
        try:
            drainer, undrained, protected = self._drainer, None, None
            if drainer is not None:
                protected = drainer.protected() if self.rank == 0 else None
                if not drain:  # a drain of this step would supersede an older one's (drain.py, "Falling behind")
                    undrained = self._undrained(protected, group)
                    if undrained is not None:
                        protected |= {undrained.step}
            committed = commit_local(self._tier, self._local, writer, step, group, self._sequence_floor(),
                                     protected, drain=bool(drain), lineage=self._lineage)
            if drainer is not None and not drain:
                undrained = self._gathered(undrained, group)[0]
        except CheckpointError:
            raise
        except BaseException as e:
            _raise_typed(self._translate(e, f"committing step {step} to the local tier"))
        marker, protected = committed.marker, committed.kept
        self._local_sequence = max(self._local_sequence, marker.sequence or 0)
        writer.last_local_commit = committed
        log.info("run %r step %d local-committed (sequence %s, %d replica(s) per rank)%s", self.run_id, step,
                 marker.sequence, len(self._tier.placement.holders[self.rank]), "; queued for the drain" if drain else "")
        self._last_undrained = (step, marker) if drain is None else None  # an explicit durable=False is kept local
        if drain:
            self._drainer.submit(step, marker)
        elif undrained is not None:
            log.warning("run %r: step %d was saved for a durable copy that never committed (its drain failed or the "
                        "job stopped first); it is kept on the local tier and queued for the drain again", self.run_id,
                        undrained.step)
            self._drainer.submit(undrained.step, undrained)
            self._requeued.add(undrained.save_id)
        if self._tier.is_leader:
            try:
                removed = retain_local(self._local, self.keep_local, protected=protected, lineage=self._lineage)
                if removed:
                    log.info("local tier %s: removed step(s) %s (keep_local=%d)", self.local_root, removed,
                             self.keep_local)
            except OSError as e:  # the step is committed; the next save retries
                log.warning("local tier %s: retention failed (the next save retries it): %s", self.local_root, e)

    @contextlib.contextmanager
    def _failed_attempt_removed(self, step: int, writer: AtomicStorageWriter):
        """A local save that fails (ENOSPC on a node, a peer lost, a replica refused) leaves nothing on this rank's
        local root: its attempt directory goes before the error is raised, on every rank (the ranks of a root remove
        the same one; whoever is first), so a disk sized for ``keep_local + 1`` steps keeps saving.  Never a step
        with a marker here: a commit that reached this root is not a failed attempt."""
        try:
            yield
        except BaseException:
            if self._tier is not None and writer.save_id is not None:
                remove_failed_attempt(self._local, step, writer.save_id, self._tier.describe(self.rank))
            raise

    def _undrained(self, queued: set[int] | None, group: dist.ProcessGroup | None) -> Marker | None:
        """Every rank (a collective); rank 0 returns the newest local step saved for a durable copy
        (:attr:`Marker.drain`) that has none and is not queued (its drain failed, or the job stopped before it) --
        the newest durable-pending step, which local retention keeps and the drain takes again.  Each root reports
        its own newest such step: global rank 0's node may have been replaced since (an empty disk), and the step's
        files then sit on the other nodes alone.  An unreadable durable root counts as "none" (kept, retried)."""
        mine = None
        if self._tier.is_leader:
            resumed = self._resumed
            wanted = [m for m in of_lineage(local_markers(self._local), self._lineage)  # nor a rolled-back branch's
                      if m.drain and (resumed is None or not resumed.supersedes(m))]
            mine = wanted[-1] if wanted else None
        reported = [m for m in self._gathered(mine, group) if m is not None]
        if self.rank != 0 or not reported:
            return None
        newest = max(reported, key=commit_order)
        if newest.step in queued:
            return None
        if newest.save_id in self._durable_saves or newest.save_id in self._requeued:
            return None  # drained, or queued again once already by this process (its failure was reported)
        try:
            durable = read_marker(self.layout, newest.step, Deadline(self.timeout), missing_ok=True)
            if durable.save_id == newest.save_id:
                self._durable_saves.add(newest.save_id)  # one durable read per drained step, not per save
                return None
        except (FileNotFoundError, CheckpointError, OSError):
            pass
        return newest

    def _restore_local(self, step: int | None, state_dict: dict[str, Any],
                       save_id: str | None = None) -> tuple[int, str, ResumePoint] | None:
        """Choose the step to restore (both tiers); for a local one, each rank receives into its root what its
        load of ``state_dict`` reads there and the root lacks.  Returns (step, save_id, resume point) to load from
        the local root, or None to load the durable tier's choice."""
        tier = self._tier
        watch = self._watch("scanning the local tier")
        mates = [r for r in range(self.world_size) if tier.leader(r) == tier.leader(self.rank)]
        share = (mates.index(self.rank), len(mates))  # the ranks of a root verify it in parallel, a share each
        if tier.is_leader:
            swept = sweep_spool(self._local)
            if swept:
                log.info("local tier %s: removed %d file(s) an interrupted restore left: %s", self.local_root,
                         len(swept), ", ".join(sorted(swept)[:4]))
        held = watch.run("scan", lambda: scan_root(self._local, share=share, lineage=self._lineage))
        foreign = ([m.step for m in of_lineage(local_markers(self._local), self._lineage, foreign=True)]
                   if tier.is_leader else [])
        gathered = self._gathered((step, held, foreign))
        watch.finish()
        if self.rank == 0:
            self._report_foreign({rank: steps for rank, (_, _, steps) in enumerate(gathered) if steps})
        gathered = [(request, held) for request, held, _ in gathered]
        asked = {request for request, _ in gathered}
        if len(asked) > 1:
            raise RankConsistencyError(f"restoring run {self.run_id!r}: the ranks asked for different steps "
                                       f"({sorted(asked, key=str)}), so none loads. Every rank must call load alike.")
        reports = {leader: merge_held([held for rank, (_, held) in enumerate(gathered) if tier.leader(rank) == leader])
                   for leader in tier.leaders}
        outcome = None
        if self.rank == 0:
            declared = self.parallelism.to_dict() if self.parallelism is not None else None
            try:
                outcome = ("ok", choose(tier, reports, self._durable_candidate(step), self.world_size, declared, step,
                                    save_id))
            except CheckpointError as e:
                outcome = ("error", e)
            except Exception as e:  # the durable root's storage, say: every rank must hear of it
                outcome = ("error", StorageError(f"global rank 0 could not choose the step to restore: "
                                                 f"{_first_line(e)}", rank=0))
        status, choice = self._gathered(outcome)[0]
        if status == "error":
            raise choice
        newest = max([self._local_sequence, choice.sequence or 0]
                     + [h.sequence or 0 for held in reports.values() for h in held])
        self._local_sequence = newest  # a save after this restore numbers above everything seen (P10, P14)
        for why in choice.skipped:
            log.warning("restore of run %r: %s", self.run_id, why)
        if choice.tier == "none":
            raise not_found(self.run_id, choice, self.layout.storage.describe())
        if choice.tier == "durable":
            self.restored_from = {"tier": "durable", "step": choice.step, "save_id": choice.save_id, "ranks_fetched": 0,
                                  "bytes_fetched": 0}
            log.info("run %r: restoring step %d from the durable tier (%s)%s", self.run_id, choice.step,
                     self.layout.storage.describe(), " because no newer local step is complete" if choice.skipped else "")
            return None
        try:
            fetched, fetched_bytes = assemble(tier, self._local, choice, self._group, state_dict)
        except CheckpointError:
            raise
        except BaseException as e:
            _raise_typed(self._translate(e, f"assembling local step {choice.step}"))
        self.restored_from = {"tier": "local", "step": choice.step, "save_id": choice.save_id, "ranks_fetched": fetched,
                              "bytes_fetched": fetched_bytes}
        log.info("run %r: restoring step %d from the local tier (sequence %s; this rank received %d byte(s) of %d "
                 "rank(s)' files it reads)", self.run_id, choice.step, choice.sequence, fetched_bytes, fetched)
        return choice.step, choice.save_id, ResumePoint(step=choice.step, sequence=newest)

    def _read_lineage(self) -> str | None:
        """Rank 0: the durable run's lineage id, created by its first two-tier manager (:mod:`.lineage`).  A durable
        root that cannot be written now (full, unreachable) must not stop local saves: None, loudly (this job's
        local steps then carry no lineage: only a job that has none either takes them, never one of a lineage)."""
        try:
            return ensure_lineage(self.layout)
        except OSError as e:
            log.warning("local tier: could not read or create %s, which says which node-local steps belong to run "
                        "%r (%s); this job's local steps record no lineage: a later job that reads the run's lineage "
                        "will not restore them (they are named, not deleted), and this job takes only local steps "
                        "that record none either", lineage_path(self.layout), self.run_id, e)
            return None

    def _report_foreign(self, foreign: dict[int, list[int]]) -> None:
        """Rank 0: local steps another lineage left on the nodes (another experiment with this run id, another
        durable root): named, never loaded, never deleted."""
        for leader, steps in foreign.items():
            root = f"{self._tier.hosts[leader]}:{os.path.join(self._tier.roots[leader], self.run_id)}"
            log.warning(
                "local tier %s holds step(s) %s of run %r saved for another durable root or experiment (this job's is "
                "%s, %s): they are not loaded and not deleted. If nothing needs them, remove them on that node: "
                "rm -rf %s", root, steps, self.run_id, describe_lineage(self._lineage), lineage_path(self.layout),
                " ".join(os.path.join(self._tier.roots[leader], self.run_id, f"step_{s:010d}") for s in steps[:8]))

    def _durable_candidate(self, step: int | None) -> Durable | None:
        """Rank 0: the durable tier's newest commit (or ``step``'s), None when it has none."""
        try:
            asked = step is not None
            if step is None:
                step = scan_latest_step(self.root, self.run_id, self.storage_options, timeout=self.timeout,
                                        missing_root_ok=True)
                if step is None:
                    return None
            elif not self.layout.storage.is_dir(self.layout.step_dir(step)):
                return None
            # A step asked for by number may hold only an attempt a failed or killed drain left, never marked: not
            # waited for.  The step LATEST names has a marker: waited for (visibility lag on NFS).
            marker = read_marker(self.layout, step, Deadline(self.timeout), missing_ok=asked)
        except (CheckpointNotFoundError, FileNotFoundError):
            return None
        return Durable(step=step, save_id=marker.save_id, sequence=marker.sequence)

    # -- internals ------------------------------------------------------------------------

    def _refuse_conflicts(self, step: int) -> None:
        """Before a save writes anything, on every rank alike: global rank 0 applies the commit rule
        (:func:`~.commit.refuse_committed`: only a step this job abandoned by resuming below it may be saved again)
        to the step's commit in each tier the save reaches, and every rank raises the same ``CommitConflictError``
        -- from ``save``/``async_save`` itself, not later from a drain.  The writers check again as they plan."""
        def check() -> None:
            validate_step(step)
            tiers = [(self._local, f"the local root {self.local_root}")] if self._tier is not None else []
            tiers.append((self.layout, f"the durable root {self.layout.storage.describe()}"))
            for tier, (layout, where) in enumerate(tiers):
                marker = self._committed_marker(layout, step)
                local = self._tier is not None and tier == 0
                if marker is not None and local and of_lineage([marker], self._lineage, foreign=True):
                    step_dir = self._local.step_dir(step)
                    raise CommitConflictError(
                        f"step {step} of run {self.run_id!r} on {where} was saved for another durable root or "
                        f"experiment ({describe_lineage(marker.lineage)}; this job's: "
                        f"{describe_lineage(self._lineage)}, {lineage_path(self.layout)}): it is not this job's to replace, and nothing was written. "
                        f"Save another step, use another run_id, or, if nothing needs it, remove it on every node: "
                        f"rm -rf {step_dir}", step=step, committed=marker.save_id)
                if marker is not None:
                    refuse_committed(marker, step, self.run_id, self._resumed, where)

        self._on_rank0(check, "check that the step is not committed yet", request=f"save step {step}")

    def _committed_marker(self, layout: RunLayout, step: int) -> Marker | None:
        """Rank 0: ``layout``'s marker of ``step``, or None.  With a local tier the durable root is listed once per
        manager (saves must not wait for the durable store each time) and read only for a step that listing (or a
        drain of this manager since) names; an unreadable root is warned about and counts as "not committed" (the
        drain's commit still refuses a conflict)."""
        if layout is self.layout and self._tier is not None:
            if self._durable_listed is None:
                try:
                    self._durable_listed = set(listed_steps(self.layout))
                except (OSError, CheckpointError) as e:
                    log.warning("could not list the steps of %s (%s); a save of a step committed there is refused "
                                "only by its drain", self.layout.storage.describe(), e)
                    self._durable_listed = set()
            if step not in self._durable_listed:
                return None
        try:
            return read_marker(layout, step, Deadline(self.timeout), missing_ok=True)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StorageError(f"could not read the marker of step {step} in {layout.storage.describe()} to check "
                               f"that the step is not committed yet: {e}", step=step, path=layout.marker(step)) from e

    def _writer(self, step: int, watch: OpWatch, metadata: dict[str, Any] | None = None) -> AtomicStorageWriter:
        validate_step(step)
        if self._tier is not None:
            writer = LocalWriter(os.fspath(self.local_root), self.run_id, step, parallelism=self.parallelism,
                                 metadata=metadata, compression=self.compression, thread_count=self.thread_count,
                                 resumed_from=self._resumed, timeout=self.timeout, watch=watch)
            writer.topology = self._tier
            return writer
        return WatchedWriter(self.root, self.run_id, step, parallelism=self.parallelism, metadata=metadata,
                              compression=self.compression, thread_count=self.thread_count, resumed_from=self._resumed,
                              timeout=self.timeout, storage_options=self.storage_options, watch=watch)

    def _save_planner(self, watch: OpWatch) -> AtomicSavePlanner:
        return WatchedSavePlanner(watch, divergence=self.divergence)

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

    def _resolve_step(self, step: int | None,
                      wanted: str | None = None) -> tuple[int | None, str | None, ResumePoint | None]:
        """(step, save_id, resume point) to load, decided by rank 0: every rank then waits for that exact
        attempt, and the resume point says which later steps this job's saves may supersede (P14)."""
        if step is None:
            step = scan_latest_step(self.root, self.run_id, self.storage_options, timeout=self.timeout,
                                    missing_root_ok=True)
            if step is None:
                return None, None, None
        validate_step(step)
        if not self.layout.storage.is_dir(self.layout.step_dir(step)):  # no trace of it: nothing to wait for (P9)
            raise CheckpointNotFoundError(
                f"run {self.run_id!r} has no step {step} ({self.layout.step_dir(step)} does not exist); "
                "manager.steps() lists the committed ones", step=step)
        save_id = read_marker(self.layout, step, Deadline(self.timeout)).save_id
        if wanted is not None and save_id != wanted:
            raise CheckpointNotFoundError(
                f"step {step} of run {self.run_id!r} holds save {save_id}, not the requested save {wanted} (the step "
                "was saved again since); nothing was loaded", step=step, save_id=wanted)
        return step, save_id, resume_point(self.layout, step)

    def _after_commit(self, step: int, writer: AtomicStorageWriter, seconds: float, stage_seconds: float,
                      asynchronous: bool) -> None:
        """Rank 0's bookkeeping once ``step`` is committed; nothing here may fail the save (it is durable,
        and the other ranks have already returned): errors are logged and counted instead."""
        if self.rank != 0:
            return
        stats = SaveStats.from_writer(writer.last_stats, run_id=self.run_id, step=step, save_id=writer.save_id,
                                      world_size=self.world_size, asynchronous=asynchronous, seconds=seconds,
                                      stage_seconds=stage_seconds)
        local = getattr(writer, "last_local_commit", None)
        if local is not None:
            stats.tier, stats.local_commit_seconds, stats.replica_bytes = "local", local.seconds, local.replica_bytes
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
        if self.keep_last is None or writer.last_marker is None:  # a local commit: retained per root (keep_local)
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
        (a liveness verdict first: the gloo error that followed it names nobody).  A local save has no marker
        until after DCP returns, so there is nothing to settle."""
        if writer.save_id is not None and self._tier is None:
            try:  # rank 0 may have just created it on another client: allow for visibility lag
                marker = read_marker(self.layout, step, Deadline(min(self.timeout, 5.0)))
                if marker.save_id == writer.save_id:
                    log.warning("step %d: DCP reported a failure (%s) after the commit; the marker names this "
                                "save (%s), so the checkpoint IS committed", step, _first_line(error), writer.save_id)
                    return
            except Exception:
                pass
        _raise_typed(watch.verdict or self._translate(error, f"saving step {step}"))

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
