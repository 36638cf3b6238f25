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
  collectives start only when every rank is there (:mod:`~dcp_atomic.exchange.liveness`);
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
  ``on_failed``, in the versioned schema of :mod:`~dcp_atomic._base.stats` (docs/statistics.md).

What the tiers change is asked of two objects built once, in ``__init__``, each behind one interface with a "none"
(:mod:`.tiering`): the storage tiers' policy (``DurableOnly``; :mod:`.two_tier`: the local tier and its drain) and the
snapshot tier (``NoSnapshots``; :mod:`.snapshot_tier`: the memory tier), which each operation consults at fixed
points: no method asks which tiers exist.

Why one module of about 600 lines: the public class, read end to end by users (210 lines are their documentation);
its collaborators are the tiers, the storage halves of a save and a load, the reports and the process groups
(:mod:`.tiering`, :mod:`.two_tier`, :mod:`.snapshot_tier`, :mod:`.saving`, :mod:`.loading`, :mod:`.reports`,
:mod:`.groups`), liveness (:mod:`dcp_atomic.exchange.liveness`) and retention (:mod:`dcp_atomic.protocol.retention`).
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import time
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..stores.backends import open_storage
from .._base import arguments
from ..protocol.catalog import DEFAULT_TIMEOUT
from ..exchange.collective import RankAgreement, first_line
from ..protocol.commit import ResumePoint, scan_markers
from ..errors import CheckpointError, CheckpointNotFoundError, ConfigurationError
from ..format.layout import RunLayout, validate_save_id, validate_step
from ..exchange.liveness import Heartbeat, OpWatch
from ..format.parallelism import Parallelism
from ..protocol.retention import DEFAULT_LEASE_SECONDS, remove_step
from ..protocol.retention_policy import Retention
from .._base import internals
from ..dcp.reuse import refuse_unsupported
from ..format.integrity import BLOCK_SIZE
from ..staging import Stager, Staging, WindowPool, gate_optimizer_steps
from ..memory import Restored, SnapshotFuture
from ..tiers import failure_domain as resolve_failure_domain
from .options import UNSET, Callbacks, LocalTierOptions, MemoryTier, StatsCallback, grouped
from .snapshot_tier import DurableCopySaves, MemorySnapshotTier
from .groups import ProcessGroups
from .loading import StorageLoads
from .saving import Saves, committed_marker
from .reports import Reports
from .tiering import DurableOnly, NoSnapshots, SnapshotTier, TierContext, TierPolicy
from .two_tier import TwoTier

log = logging.getLogger("dcp_atomic.manager")  # the package's name: callers filter on it

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
    """A manager never closed must not lose what is in flight silently (:meth:`CheckpointManager._wait_at_exit`)."""
    alive = manager()
    if alive is not None and not alive._closed:
        try:
            alive._wait_at_exit()
        except Exception:  # noqa: BLE001 - at exit: log, never raise past the interpreter's shutdown
            log.exception("dcp_atomic: the exit-time wait failed")


class CheckpointManager(RankAgreement):
    """Save every N steps in the background, keep the last K, resume; every rank builds one.

    Args:
        root, run_id, storage_options: where checkpoints live (see AtomicStorageWriter).
        parallelism: this job's layout (None: inferred from DTensor meshes where possible).
        keep_last: keep this many most recently committed steps (None: keep all); short for
            ``retention=Retention(keep_last=N)``.
        retention: what the durable root keeps (:class:`~dcp_atomic.Retention`: ``keep_last``, ``keep_every``,
            ``keep_period``, ``best``; the union of what each keeps, and always the newest commit).  Giving it
            with ``keep_last`` is an ``ArgumentError``.  The local tier keeps its own count (``keep_local``).
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
        callbacks: where each operation's statistics go (:class:`~.options.Callbacks`: ``on_saved``,
            ``on_loaded``, ``on_failed``, ``on_drained``).  An exception in any callback is logged and counted in
            ``callback_failures``; the operation's outcome stands.
        lease_seconds: age after which an uncommitted attempt counts as abandoned.
        share_reads: read each stored item once and send it to the other ranks that need it
            (``AtomicStorageReader(share_reads=...)``; default: on for object stores and for ranks on
            several hosts).
        local: the local tier (:class:`~.options.LocalTierOptions`: ``local_root``, ``replicas``,
            ``durable_every``, ``keep_local``, ``failure_domain``): saves go to each node's own storage first, are
            replicated to other failure domains and drained to ``root`` in the background; ``load`` restores from the
            newest step assemblable from local roots, replicas or ``root`` (Concepts, "Two tiers").  None: one tier,
            ``root``.
        local_root, replicas, durable_every, keep_local, failure_domain, on_saved, on_loaded, on_failed, on_drained:
            deprecated (a ``DeprecationWarning`` each; they go in the next minor release): the flat form of
            ``local`` and ``callbacks``.  Passing a group both ways is an ``ArgumentError``.
        reuse: each save stores only what changed since the run's latest committed step below it; what did not
            is linked from that step (hard links on POSIX roots, server-side copies on S3 and GCS;
            ``AtomicStorageWriter(reuse=True)``, Concepts, "Reuse"); with ``local_root`` in the local roots, and the
            drain links what the durable root's previous step holds instead of uploading it. Default off.
        staging: bounded staging for ``async_save`` (:class:`~dcp_atomic.staging.Staging`, Concepts, "Bounded
            staging"): no whole host copy of the state; the live tensors are read after the call returns, and
            :meth:`wait_staged` says when they may change again.  None: DCP stages a host copy of the state.
        memory: the memory tier (:class:`~.options.MemoryTier`: ``path``, ``every``, ``replicas``, ``slots``,
            ``budget_bytes``): :meth:`snapshot` keeps every rank's state in RAM with verified copies on other failure
            domains, and ``load()`` restores the newest memory-committed step unless another tier holds a newer
            commit (docs: "The memory tier").  Needs the manager's own process groups (refused with
            ``process_group=``).  None: no memory tier.
    """

    _instances = 0
    _saves: Saves | None = None  # set in __init__ once the tiers are built (a refused tier releases before)

    def __init__(
        self,
        root: str | os.PathLike,
        run_id: str,
        *,
        parallelism: Parallelism | None = None,
        keep_last: int | None = None,
        retention: Retention | None = None,
        compression: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        work_timeout: float = DEFAULT_WORK_TIMEOUT,
        storage_options: dict[str, Any] | None = None,
        process_group: dist.ProcessGroup | None = None,
        thread_count: int | None = None,
        local: LocalTierOptions | None = None,
        callbacks: Callbacks | None = None,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        allow_divergence: bool = False,
        share_reads: bool | None = None,
        reuse: bool = False,
        staging: Staging | None = None,
        memory: MemoryTier | None = None,
        # deprecated: the flat form of ``local`` and ``callbacks`` (for one release)
        local_root: str | os.PathLike | None = UNSET,
        replicas: int = UNSET,
        durable_every: int | None = UNSET,
        keep_local: int = UNSET,
        failure_domain: str | None = UNSET,
        on_saved: StatsCallback | None = UNSET,
        on_loaded: StatsCallback | None = UNSET,
        on_failed: StatsCallback | None = UNSET,
        on_drained: StatsCallback | None = UNSET,
    ) -> None:
        local, callbacks = grouped(local, callbacks, {
            "local_root": local_root, "replicas": replicas, "durable_every": durable_every, "keep_local": keep_local,
            "failure_domain": failure_domain, "on_saved": on_saved, "on_loaded": on_loaded, "on_failed": on_failed,
            "on_drained": on_drained})
        keep_last = arguments.count("CheckpointManager(keep_last=...)", keep_last)
        arguments.instance("CheckpointManager(retention=...)", retention, Retention, "a dcp_atomic.Retention")
        if retention is not None and keep_last is not None:
            raise arguments.refused("CheckpointManager(keep_last=...)", keep_last, "None when retention= is given",
                                    then=f"put it in the policy: retention=Retention(keep_last={keep_last}, ...)")
        thread_count = arguments.count("CheckpointManager(thread_count=...)", thread_count)
        timeout = arguments.seconds("CheckpointManager(timeout=...)", timeout)
        work_timeout = arguments.seconds("CheckpointManager(work_timeout=...)", work_timeout)
        lease_seconds = arguments.seconds("CheckpointManager(lease_seconds=...)", lease_seconds)
        allow_divergence = arguments.flag("CheckpointManager(allow_divergence=...)", allow_divergence)
        share_reads = arguments.flag("CheckpointManager(share_reads=...)", share_reads, optional=True)
        reuse = arguments.flag("CheckpointManager(reuse=...)", reuse)
        arguments.instance("CheckpointManager(parallelism=...)", parallelism, Parallelism, "a dcp_atomic.Parallelism")
        arguments.instance("CheckpointManager(staging=...)", staging, Staging, "a dcp_atomic.Staging")
        arguments.instance("CheckpointManager(memory=...)", memory, MemoryTier, "a dcp_atomic.MemoryTier")
        self.root, self.run_id = root, run_id
        self.storage_options = storage_options
        self.layout = RunLayout(open_storage(root, storage_options), run_id)
        self.reuse = reuse
        self.staging = staging
        # the writer copies device tensors block by block: the pool's windows are blocks (kept between saves)
        self._staging_pool = None if staging is None else WindowPool(
            staging.pool_bytes // BLOCK_SIZE, BLOCK_SIZE, pinned=torch.cuda.is_available())
        # every torch.optim step waits for the staged copies first (an optimizer may write through p.data)
        self._optimizer_gate = None if staging is None else gate_optimizer_steps(self.wait_staged)
        if reuse:  # the writer's own refusals (fsspec filesystems), before any process group is made
            refuse_unsupported(self.layout.storage, stock_readable=False, who="CheckpointManager")
        self.parallelism = parallelism
        self.retention = retention if retention is not None else Retention(keep_last=keep_last)
        self.keep_last = self.retention.keep_last
        self.compression = compression
        self.timeout = timeout
        self.work_timeout = work_timeout
        self._reports = Reports(callbacks, run_id=run_id, rank=0, world_size=1)  # its rank and world: below
        self.thread_count = thread_count
        self.lease_seconds = lease_seconds
        self.share_reads = share_reads
        self.divergence = "warn" if allow_divergence else "raise"
        self._distributed = dist.is_available() and dist.is_initialized()
        self._groups = ProcessGroups.make(process_group, local=local is not None, memory=memory is not None,
                                          timeout=timeout, work_timeout=work_timeout)
        self._group, self._async_group = self._groups.main, self._groups.background
        self._drain_group, self._memory_group = self._groups.drain, self._groups.memory
        self.rank = dist.get_rank(self._group) if self._distributed else 0
        self.world_size = dist.get_world_size(self._group) if self._distributed else 1
        self._reports.rank, self._reports.world_size = self.rank, self.world_size
        self._resumed: ResumePoint | None = None  # set by load(): see AtomicStorageWriter(resumed_from=)
        self._ops = 0  # operation counter: identical on all ranks (SPMD), names liveness keys
        CheckpointManager._instances += 1
        self._instance = CheckpointManager._instances
        self._heartbeat: Heartbeat | None = None
        if self._distributed and self.world_size > 1:
            self._heartbeat = Heartbeat(internals.default_store(),
                                        f"dcp_atomic/{run_id}/{self._instance}", dist.get_rank(),
                                        dist.get_process_group_ranks(self._group), timeout)
        self.local = local
        self.local_root = local.local_root if local is not None else None
        self.memory = memory
        self._memory: SnapshotTier = NoSnapshots()  # the memory tier is built last: a refused tier's _release()
        # the tiers' differences live in one policy, picked here; DurableOnly also until TwoTier is set up, so that
        # the _release() of a refused local tier finds one
        self._tier: TierPolicy = DurableOnly(root, run_id, storage_options)
        if local is not None:
            try:
                self._tier = TwoTier(self._tier_context(), local)
            except BaseException:  # refused (too few domains...): nothing of this manager may outlive it
                self._release()
                raise
        self._loads = StorageLoads(self._tier_context(), self._tier, parallelism=self.parallelism,
                                   share_reads=share_reads, resolve_everywhere=self._resolve_everywhere)
        self._saves = Saves(self._tier_context(), self._tier, self._reports, async_group=self._async_group,
                            staging=staging, staging_pool=self._staging_pool, parallelism=self.parallelism,
                            compression=self.compression, reuse=reuse, divergence=self.divergence,
                            operation=lambda: self._ops)
        if memory is not None:
            try:
                self._memory = MemorySnapshotTier(
                    self._tier_context(), memory, lineage=self._tier.lineage, local_sequence=self._tier.local_sequence,
                    domain=resolve_failure_domain(local.failure_domain if local is not None else None),
                    stager=None if staging is None else Stager(staging, self._staging_pool),
                    copies=DurableCopySaves(start=self._saves.durable_copy, failed=self._saves.failed,
                                            busy=self._saves.busy, wait=self._saves.wait_for_async_save),
                    parallelism=self.parallelism)
            except BaseException:
                self._release()
                raise
        self.durable_every = self._tier.durable_every  # None where no drain can run
        self._closed = False
        internals.before_thread_pools_stop(_exit_without_close, weakref.ref(self))

    def _tier_context(self) -> TierContext:
        """What the local tier uses of this manager (:class:`.TierContext`), built once."""
        return TierContext(
            rank=self.rank, world_size=self.world_size, run_id=self.run_id, root=self.root,
            storage_options=self.storage_options, layout=self.layout, timeout=self.timeout,
            work_timeout=self.work_timeout, thread_count=self.thread_count,
            retention=self.retention, lease_seconds=self.lease_seconds, group=self._group,
            drain_group=self._drain_group, memory_group=self._memory_group, heartbeat=self._heartbeat,
            callbacks=self.callbacks, translate=self._translate, on_rank0=self._on_rank0, watch=self._watch,
            resumed=lambda: self._resumed, deliver=self._reports.deliver,
            committed_marker=lambda layout, step: committed_marker(layout, step, self.timeout))

    @property
    def restored_from(self) -> dict[str, Any] | None:
        """After ``load()``: which tier served it (see :meth:`load`); None with one tier and no memory tier (with a
        memory tier and no local one, ``"durable"`` when the durable root served)."""
        return self._memory.restored_from or self._tier.restored_from

    @property
    def callbacks(self) -> Callbacks:
        """Where each operation's statistics go (the ``callbacks`` given)."""
        return self._reports.callbacks

    @property
    def callback_failures(self) -> int:
        """Callbacks that raised (each logged); the operations' outcomes stood."""
        return self._reports.callback_failures

    @property
    def snapshots_skipped(self) -> int:
        """Snapshots due while the previous one was still in flight: skipped, never queued (0 without a memory
        tier)."""
        return self._memory.snapshots_skipped

    # -- saving --------------------------------------------------------------------------

    @_operation
    def save(self, step: int, state_dict: dict[str, Any], metadata: dict[str, Any] | None = None,
             durable: bool | None = None) -> int:
        """Save and commit ``step`` synchronously; returns the step.  ``metadata``: a small JSON dict kept with
        the checkpoint (global rank 0's; see :meth:`metadata`).

        Raises the typed error if the save failed.  Before saving, raises the failure of an
        earlier ``async_save`` that nothing has reported yet (see ``async_save``).  With ``local_root``
        the step is committed to the local tier (replicas verified, Concepts, "Two tiers"), and queued for the
        background drain to ``root`` if ``durable`` says so (None: the ``durable_every`` policy); the save
        never waits for a drain.  Without ``local_root`` every save is durable and ``durable`` is ignored.
        """
        validate_step(step, "CheckpointManager.save(step=...)")
        arguments.user_metadata("CheckpointManager.save(metadata=...)", metadata)
        return self._saves.save(step, state_dict, metadata, self._wants_drain(durable))

    @_operation
    def async_save(self, step: int, state_dict: dict[str, Any], metadata: dict[str, Any] | None = None,
                   durable: bool | None = None) -> concurrent.futures.Future:
        """Stage ``state_dict`` to host memory now, write and commit in the background (``metadata``: as ``save``).

        With ``staging``, nothing but the eager items is copied now: the live tensors are read in the background
        through the pool, so call :meth:`wait_staged` before changing them (``optimizer.step()``); a tensor changed
        in place before that fails this save on every rank with ``StagingRaceError``, nothing committed.

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
        validate_step(step, "CheckpointManager.async_save(step=...)")
        arguments.user_metadata("CheckpointManager.async_save(metadata=...)", metadata)
        return self._saves.async_save(step, state_dict, metadata, self._wants_drain(durable))

    def wait_staged(self) -> float:
        """Block until this rank's writer has read every live tensor of the ``async_save`` in flight, and the
        stager every live tensor of the latest ``snapshot`` (with ``staging``), so that they may change
        (``optimizer.step()``); returns the seconds waited, ``0.0`` at once with nothing in flight or without
        ``staging``.  Each rank waits for its own copies (a rank reads only its own tensors), so no collective:
        call it on any rank, any number of times.  The outcome still arrives through the future."""
        return self._saves.wait_staged() + self._memory.wait_staged()

    @_operation
    def snapshot(self, step: int, state_dict: dict[str, Any]) -> SnapshotFuture:
        """Snapshot ``state_dict`` into the memory tier (``memory=MemoryTier(...)``), every rank alike: every
        ``every``-th call copies this rank's items into its oldest slot now, then, in the background, sends verified
        copies to ``replicas`` other failure domains and takes the next commit sequence from global rank 0.

        Returns a future that resolves to ``step`` once the snapshot is memory-committed on every rank, or raises the
        same typed error on every rank (a lost peer: ``PeerLost`` naming it).  A call that takes no snapshot (not
        due, or the previous one still in flight: counted in ``snapshots_skipped``, never queued) returns a resolved
        future with ``skipped`` set.  The state dict may change as soon as this returns.
        """
        validate_step(step, "CheckpointManager.snapshot(step=...)")
        return self._memory.snapshot(step, state_dict)

    def wait(self) -> int | None:
        """Wait for the in-flight save, then for the drains in flight or waiting; return the save's step (None if
        there is none).

        Raises the save's failure unless it was already reported (see ``async_save``), then a drain's
        failure that nothing has raised yet (once, on every rank).
        """
        step = self._saves.wait_for_async_save()
        self._memory.finish()
        self._tier.wait()
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
            self._saves.wait_for_async_save()
            self._memory.finish()
        finally:
            try:
                if self._saves.inflight is None:
                    self._tier.drain_last_and_wait()
            finally:
                self._release()

    def _wait_at_exit(self) -> None:
        """The main thread ended without ``close()``: what is in flight (a snapshot, a save -- a memory slot's
        durable copy too --, then the drains) finishes, each bounded by its own deadline, on every rank alike so its
        collectives still meet, and the log says what became of it, a failure nothing reported included.  Nothing
        new starts: the peers may be gone."""
        for what, inflight, wait in (("the memory snapshot", self._memory.in_flight(), self._memory.wait),
                                     ("the save", self._saves.inflight, self._saves.wait_for_async_save)):
            if inflight is None or (inflight.done() and inflight.reported):
                continue
            waiting = not inflight.done()
            if waiting:
                log.warning("run %r: the process exits without close() while %s of step %s is in flight; waiting "
                            "for it", self.run_id, what, inflight.step)
            try:
                wait()  # the one rule: its failure is raised once, unless something reported it already
            except Exception as e:  # noqa: BLE001 - at exit: logged, and the drains are still waited for
                log.error("run %r: exiting without close(): %s of step %s failed (%s); nothing else reported it. "
                          "The newest committed step is what the next job restores. Call close() before exiting to "
                          "be told in time.", self.run_id, what, inflight.step, first_line(e))
            else:
                if waiting:
                    log.warning("run %r: exiting without close(): %s of step %s committed before exit",
                                self.run_id, what, inflight.step)
        self._tier.wait_at_exit()

    def _release(self) -> None:
        saving = self._saves is not None and self._saves.inflight is not None
        if saving or self._tier.busy() or self._memory.busy():
            return  # never destroy the groups under a running save, drain or snapshot
        self._tier.close()
        self._memory.close()
        if getattr(self, "_optimizer_gate", None) is not None:
            self._optimizer_gate.remove()
            self._optimizer_gate = None
        self._closed = True
        if self._heartbeat is not None:
            self._heartbeat.close()
        self._groups.destroy()

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
        another root first, and their stored bytes).  With ``memory=``: the memory tier first (``"tier"``
        ``"memory"``/``"memory-replica"``, plus ``"sequence"`` and ``"resharded_from"``: the world size that took a
        snapshot this job of another size resharded, else None).  Another world size reshards from any tier, under
        the layout policy (a tensor/pipeline/expert-parallel change needs ``allow_reshard=True``).

        Before loading, raises the failure of an earlier ``async_save`` that nothing has reported yet.
        """
        if step is not None:
            validate_step(step, "CheckpointManager.load(step=...)")
        if save_id is not None:
            validate_save_id(save_id, "CheckpointManager.load(save_id=...)")
        if save_id is not None and step is None:
            raise arguments.refused("CheckpointManager.load(save_id=...)", save_id, "None without a step",
                                    then="pass step= too, the step that save belongs to")
        self._saves.wait_for_async_save()
        started = time.perf_counter()
        with self._reports.failures_reported("load", step, started):
            restored = self._memory.restore(state_dict, step, save_id, allow_reshard)
        if restored is not None:
            return self._restored_from_memory(restored, started)
        with self._reports.failures_reported("load", step, started) as attempt:
            chosen, reader, resumed, by_local = self._loads.load(state_dict, step, save_id, allow_reshard, attempt)
        self._resumed = resumed  # P14: later saves supersede the steps above it that this load abandoned
        self._memory.loaded_elsewhere(chosen, reader.save_id, served_by_local=by_local)
        self._reports.loaded(chosen, reader, time.perf_counter() - started, self.restored_from)
        return chosen

    def _restored_from_memory(self, restored: Restored, started: float) -> int:
        """A load the memory tier served: the resume point (P14: later saves and snapshots supersede the steps above
        it), ``on_loaded``."""
        self._resumed = self._on_rank0(lambda: self._loads.resumed_at(restored.step), "read the resume point")
        self._reports.restored(restored, time.perf_counter() - started)
        return restored.step

    @_operation
    def latest_step(self) -> int | None:
        """The most recently committed step (global rank 0 scans, the others are told)."""
        return self._on_rank0(self._loads.latest, "find the latest step")

    @_operation
    def metadata(self, step: int | None = None) -> dict[str, Any]:
        """The metadata saved with ``step`` (default: the most recent commit); ``{}`` when none was given.
        Global rank 0 reads the verified manifest and tells the others."""
        return self._on_rank0(lambda: self._loads.metadata(step), "read a step's metadata",
                              request="the latest step" if step is None else f"step {step}")

    @_operation
    def queue_drain(self, step: int) -> None:
        """Queue the local-committed ``step`` for the drain to ``root`` (again): every rank alike.  For a step whose
        drain failed or whose job stopped before it, that a record still names (Lightning's files); ``wait()``
        then says whether it committed.  Global rank 0 reads the step's local marker and tells the others."""
        self._tier.queue_drain(step)

    @_operation
    def retire(self, steps: list[int]) -> list[int]:
        """Remove ``steps`` from both tiers; every rank calls it alike (each local root's leader drops that root's
        copies, global rank 0 the durable ones), no collective inside.  For an integration whose own records name
        steps (Lightning's files): a step no record names any more.  It first waits for the drains (raising a
        failed one's error, as ``wait()`` does: on every rank alike).  Removal failures are logged, not raised, so
        the ranks never part ways; returns the steps this rank could not remove (a later call retries them, or
        ``dcp-atomic rm``)."""
        self._tier.wait()  # every rank alike: a drain's outcome reaches every rank (drain.py, step 4)
        failed = []
        for step in steps:
            try:
                self._tier.retire(step)
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
        arguments.choice("CheckpointManager.steps(tier=...)", tier, (None, "local", "durable"))
        found: set[int] = set()
        if tier != "local":
            found |= set(self._on_rank0(lambda: [m.step for m in scan_markers(self.layout)], "list committed steps"))
        if tier != "durable":
            found |= self._tier.local_steps()
        return sorted(found)

    # -- internals ------------------------------------------------------------------------

    def _wants_drain(self, durable: bool | None) -> bool | None:
        """Whether this save is also drained to the durable root (:meth:`.TierPolicy.drain_decision`)."""
        arguments.flag("CheckpointManager.save(durable=...)", durable, optional=True)
        return self._tier.drain_decision(durable)

    def _watch(self, what: str) -> OpWatch:
        return OpWatch(self._heartbeat, self._ops, self.work_timeout, what)
