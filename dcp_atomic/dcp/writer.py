"""``AtomicStorageWriter``: DCP's StorageWriter with versioned attempts and one commit.

Lifecycle, as DCP calls it (names follow DCP's hooks):

* ``set_up_storage_writer`` (every rank) starts a fresh save;
* ``prepare_local_plan`` (every rank) stashes this rank's identity in the plan;
* ``prepare_global_plan`` (coordinator) checks every identity (P7), refuses a
  step that is already committed unless ``overwrite=True``, and picks the
  ``save_id`` that every rank then writes under — all before a byte is written
  (with DCP's plan caching, ranks replay a cached plan instead: each derives the
  save_id from it and a count of saves, and ``finish`` checks they agree);
* ``write_data`` (every rank) writes ``thread_count`` files in parallel into the
  attempt directory (:mod:`.rank_write`), hashing blocks as they go, fsyncs them,
  and publishes its own manifest shard (items and block digests); only the shard's
  digest and each item's (file, offset, length) travel to the coordinator;
* ``finish`` (coordinator, only if every rank succeeded) runs the commit
  protocol of :mod:`dcp_atomic.protocol.commit`.

Tensor items are raw blocks by default (:mod:`~dcp_atomic.format.codec`: the faster format, optionally
zstd-compressed); with ``stock_readable=True`` they are ``torch.save`` containers, exactly
as stock DCP writes them, so torch's own ``FileSystemReader`` can open an attempt directory.

Why one module of about 570 lines: DCP's save hooks in the order DCP calls them, read top-down; one rank's file
writing is :mod:`.rank_write`, the checks are :mod:`.identity` and :mod:`.reshard`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import socket
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult

from .._base import arguments, internals
from ..protocol import commit
from .._base import failpoints
from ..protocol.catalog import DEFAULT_TIMEOUT
from ..errors import ArgumentError, ConfigurationError, RankConsistencyError
from . import plan_cache
from . import reuse as _reuse
from .identity import check_identities, default_thread_count, local_identity
from .rank_write import RankStats, RankWrite, StoredForm, storage_error
from .._base.gc_pause import STORAGE, hook, leave
from ..format.integrity import BLOCK_SIZE, sha256_hex
from ..format.layout import DCP_METADATA, checked_checkpoint_id, new_save_id, no_location_error, validate_step
from ..protocol.location import is_checkpoint_id, open_location, retarget
from ..protocol.links import choose_base, load_base
from ..format.manifest import FileEntry, ItemExtent, Manifest, ManifestShard, ShardRef, check_user_metadata, now
from ..format.parallelism import Parallelism
from ..staging import LiveState
from .reshard import ItemSummary, SaveReport, check_save, summarize_items
from ..version import __version__

log = logging.getLogger("dcp_atomic.writer")  # the name users filter on

DCP_METADATA_VERSION = "1.0.0"  # the .metadata version stock FileSystemReader expects
_STATS_FQN = "__dcp_atomic_rank_stats__"  # sentinel WriteResult carrying per-rank stats to finish()


def rank_stats_result(rank: int, stats: RankStats) -> WriteResult:
    """The sentinel result that carries ``rank``'s statistics to the coordinator's ``finish``, after its items' results
    (DCP gathers only ``WriteResult`` lists; benchmarks build the coordinator's input with it too)."""
    return WriteResult(index=MetadataIndex(f"{_STATS_FQN}/{rank}"), size_in_bytes=0, storage_data=stats)


@dataclass
class _LocalPlanData:
    """What a rank tells the coordinator about itself (travels in ``SavePlan.storage_data``)."""

    identity: dict[str, Any]
    items: ItemSummary | None  # per key (reshard.summarize_items); None: a cached plan, no items
    report: SaveReport | None  # content summary from AtomicSavePlanner, if used


@dataclass
class _AssignedPlanData:
    """What the coordinator hands each rank: the attempt it writes into.

    DCP's plan caching replays this object on every later save of the series: ``save_id`` is the series' first
    save_id and ``number`` the save it was assigned for; each save derives its own id (:func:`.plan_cache.advance`).
    """

    save_id: str
    rank: int
    step: int
    data_prefixes: int = 0  # where every rank puts its data (layout.data_prefix): one choice, recorded in the manifest
    number: int = 1
    base_step: int | None = None  # reuse (P15): the committed step each rank compares its items against
    base_save_id: str | None = None


_MANIFEST_STATS = ("rank", "bytes", "items", "write_seconds", "fsync_seconds", "threads")  # per rank


class AtomicStorageWriter(StorageWriter):
    """Write one DCP checkpoint as an immutable attempt, committed by global rank 0 alone.

    Args:
        root: local/NFS directory or fsspec URL holding all runs.
        run_id: run name; ``[A-Za-z0-9][A-Za-z0-9._-]{0,127}``.
        step: training step; the checkpoint lands in ``<root>/<run_id>/step_{step:010d}/``.
            Any of the three may be ``None`` and come from ``dcp.save(..., checkpoint_id=
            "<root>/<run_id>/step_<N>")`` (or ``step-<N>``), which must agree with those given.
        parallelism: the job's layout, recorded for reshard checks at load.
        compression: ``None`` or ``"zstd"`` (byte-plane grouped, per-block frames; implies the raw format).
        compression_level: ``None`` for the tuned fast profile (see codec.py), or a zstd level.
        thread_count: files (and writer threads) per rank.
        overwrite: replace an already committed step (after the new attempt is complete).
        metadata: a small JSON dict stored in the manifest (``dcp-atomic show`` prints it,
            ``CheckpointManager.metadata(step)`` returns it); only global rank 0's is recorded.
        resumed_from: where this job resumed (``commit.resume_point(layout, step)`` after loading ``step``; the
            manager and the framework integrations set it): a save of a step above it that the abandoned branch
            committed supersedes that step instead of raising ``CommitConflictError`` (P14).
        stock_readable: ``True`` writes each tensor as a torch.save container so torch's own
            FileSystemReader opens the attempt (interop); the default ``False`` writes raw blocks,
            the faster format (Concepts, "Formats and compression", for the measurements).
        timeout: seconds any wait of this writer may take.
        storage_options: fsspec options (e.g. an S3 endpoint).
        reuse: store only what changed since the run's latest committed step below this one (P15,
            :mod:`.reuse`): each rank's unchanged items (compared by their block digests) are referenced where
            they lie in that step's files, each file linked when they hold at least half its bytes (a hard link on
            POSIX roots, a server-side copy on S3 and GCS; the rest of the file is dead in the new step, read by
            no one), the others written into stable files; with ``compression`` the zstd frames' digests decide. Refused on other fsspec
            filesystems, with ``stock_readable`` and DCP plan caching. Default off (Concepts, "Reuse").
        live_state: the manager's bounded staging of this save (``CheckpointManager(staging=...)``, Concepts, "Bounded
            staging"): DCP was handed the live state (:class:`~dcp_atomic.staging.LiveState`), so device tensors are
            read through its pool, and once this rank has read every tensor, a tensor changed in place meanwhile
            fails the save (``StagingRaceError``) and the live tensors are released for ``wait_staged()``.
    """

    def __init__(
        self,
        root: str | os.PathLike | None = None,
        run_id: str | None = None,
        step: int | None = None,
        *,
        parallelism: Parallelism | None = None,
        compression: str | None = None,
        compression_level: int | None = None,
        thread_count: int | None = None,
        overwrite: bool = False,
        resumed_from: commit.ResumePoint | None = None,
        metadata: dict[str, Any] | None = None,
        stock_readable: bool = False,
        timeout: float = DEFAULT_TIMEOUT,
        storage_options: dict[str, Any] | None = None,
        block_size: int = BLOCK_SIZE,
        reuse: bool = False,
        live_state: LiveState | None = None,
        copy_of_sequence: int | None = None,
    ) -> None:
        super().__init__()
        arguments.choice("AtomicStorageWriter(compression=...)", compression, (None, "zstd"))
        if stock_readable and compression is not None:
            raise ConfigurationError(
                "stock_readable=True cannot be compressed: torch's FileSystemReader only reads torch.save "
                "containers; use compression=None, or stock_readable=False"
            )
        arguments.instance("AtomicStorageWriter(parallelism=...)", parallelism, Parallelism, "a dcp_atomic.Parallelism")
        thread_count = arguments.count("AtomicStorageWriter(thread_count=...)", thread_count)
        timeout = arguments.seconds("AtomicStorageWriter(timeout=...)", timeout)
        overwrite = arguments.flag("AtomicStorageWriter(overwrite=...)", overwrite)
        stock_readable = arguments.flag("AtomicStorageWriter(stock_readable=...)", stock_readable)
        block_size = arguments.count("AtomicStorageWriter(block_size=...)", block_size, optional=False)
        self.reuse = arguments.flag("AtomicStorageWriter(reuse=...)", reuse)
        self.live_state = arguments.instance("AtomicStorageWriter(live_state=...)", live_state, LiveState,
                                             "a dcp_atomic.staging.LiveState")
        # the manager's memory tier: this save copies the snapshot of that commit sequence (Manifest.copy_of_sequence)
        self.copy_of_sequence = arguments.count("AtomicStorageWriter(copy_of_sequence=...)", copy_of_sequence)
        self.storage_options = storage_options
        self._built_root, self._built_run_id = root, run_id  # what every checkpoint_id must agree with
        self.storage, self.layout = open_location(root, run_id, storage_options)
        if self.reuse and self.storage is not None:  # without a location yet: checked where reset() gives one
            _reuse.refuse_unsupported(self.storage, stock_readable=stock_readable)
        self.step = None if step is None else validate_step(step, "AtomicStorageWriter(step=...)")
        self.parallelism = parallelism
        self.compression = compression
        self.compression_level = compression_level
        self.thread_count = thread_count or default_thread_count()
        self.overwrite = overwrite
        self.resumed_from = resumed_from
        try:
            self.metadata = check_user_metadata(metadata)
        except ValueError as e:
            raise ArgumentError(f"AtomicStorageWriter(metadata=...): {e}", argument="AtomicStorageWriter(metadata=...)"
                                ) from None
        self.stock_readable = stock_readable
        self.timeout = timeout
        self.block_size = block_size
        self.save_id: str | None = None
        self.data_prefixes = 0  # the coordinator's choice for the save in progress (see prepare_global_plan)
        self.rank = 0
        self.is_coordinator = True
        self.use_collectives = True
        self.last_marker = None
        self.last_stats: dict[str, Any] | None = None  # coordinator only, after a commit
        self._identities: list[dict] = []
        self._keys: dict[str, dict] = {}
        self._started_at = 0.0

    # -- DCP lifecycle -----------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """Retarget to ``<root>/<run_id>/step_<N>`` (DCP calls this when given ``checkpoint_id=``).

        Only the location changes: every save is a fresh attempt anyway (``set_up_storage_writer``).
        """
        if checkpoint_id is None:
            if self.layout is None or self.step is None:
                raise no_location_error(type(self).__name__)
            return
        root, run_id, step = checked_checkpoint_id(checkpoint_id, self._built_root, self._built_run_id,
                                                   type(self).__name__)
        self.storage, self.layout = retarget(self.storage, self.layout, root, run_id, self.storage_options)
        if self.reuse:
            _reuse.refuse_unsupported(self.storage, stock_readable=self.stock_readable)
        self.step = step

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        with hook(STORAGE, first=True):  # the save's lease (gc_pause): ends after this rank's last hook
            self._set_up(is_coordinator, kwargs)

    def _set_up(self, is_coordinator: bool, kwargs: dict) -> None:
        if self.layout is None or self.step is None:
            raise no_location_error(type(self).__name__)
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank", 0 if is_coordinator else -1)
        self.use_collectives = kwargs.get("use_collectives", True)
        self.save_id = None
        self.last_marker = None
        self._identities = []
        self._started_at = now()
        self._series: plan_cache.Series | None = None  # coordinator: the series this save belongs to (prepare_global_plan)
        self._planned_save_id: str | None = None
        self._dcp_caches_before = internals.coordinator_plan_caches() if is_coordinator else None

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        with hook(STORAGE):
            return self._prepare_local_plan(plan)

    def _prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        report = plan.storage_data if isinstance(plan.storage_data, SaveReport) else None
        layout = self.parallelism or (report.parallelism if report else None)
        identity = local_identity(self.rank, layout.to_dict() if layout else None,
                                  declared=self.parallelism is not None)
        items = summarize_items(plan.items) if plan.usable else None  # a cached plan is sent without its items
        return dataclasses.replace(plan, storage_data=_LocalPlanData(identity=identity, items=items, report=report))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Checks, then the attempt.  With DCP's plan caching, ranks whose plan is unchanged replay their cached
        one: the save continues that series (its next number), and what they last reported stands in.

        A refusal here (a committed step, an identity or content check, the attempt's storage) puts DCP's
        coordinator caches back as they were before this save.  DCP filled them in ``create_global_plan``, but no
        rank's own cache advanced (``finish_plan`` comes after): left filled, the next save would tell every rank
        to replay a plan it never cached (KeyError), or its previous plan under the refused save's metadata (a
        committed checkpoint missing keys)."""
        try:
            with hook(STORAGE):
                failpoints.hit("plan.before_checks", self.rank)
                return self._plan(plans)
        except BaseException:
            if self._dcp_caches_before is not None:
                internals.restore_coordinator_plan_caches(self._dcp_caches_before)
            raise

    def _plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        replayed = not all(plan.usable for plan in plans)  # those ranks replay their cached plan: same series
        cached = [position for position, plan in enumerate(plans) if not plan.usable
                  or isinstance(plan.storage_data, _LocalPlanData) and plan.storage_data.items is None]
        named = plan_cache.named_cache(plan.storage_data.report for plan in plans
                                       if isinstance(plan.storage_data, _LocalPlanData))
        known = plan_cache.replayed(named) if cached else None
        if cached and (known is None or len(known.plans) != len(plans)):
            raise ConfigurationError(
                f"rank {cached[0]} sent a DCP plan cached by a save this coordinator did not plan with dcp_atomic "
                "(another storage writer, or another world): save with DefaultSavePlanner(enable_plan_caching=False) "
                "once, or restart the job"
            )
        ranks = [self._rank_plan(position, plan, known) for position, plan in enumerate(plans)]
        self._identities = [plan.identity for plan in ranks]
        self._refuse_partial_world(len(plans))
        check_identities(self._identities)
        if replayed and all(a is b for a, b in zip(ranks, known.plans)):
            self._keys = known.keys  # nothing new reached the coordinator: the last checks stand
        else:
            self._keys = check_save([plan.items for plan in ranks], [plan.report for plan in ranks])
        replacing = self.overwrite or self._refuse_committed_step()
        if replayed:
            first, number = known.first_save_id, plan_cache.next_number(known)
        else:
            first, number = new_save_id(), 1
        self._series = plan_cache.Series(first, ranks, self._keys, named=named is not None)  # remembered in write_data
        save_id = self._planned_save_id = plan_cache.save_id_of(first, number)
        attempt = self.layout.attempt_dir(self.step, save_id)
        try:  # refuses a store the commit cannot work on now, not after all the data
            commit.claim_attempt(self.layout, self.step, save_id, started_at=self._started_at, overwrite=replacing,
                                 world_size=len(plans))
        except OSError as e:
            raise storage_error(e, self.rank, e.filename or attempt, phase="creating the attempt") from e
        prefixes = 0 if self.stock_readable else getattr(self.storage, "data_prefixes", 0)  # stock: data by .metadata
        base_step, base_save_id = (choose_base(self.layout, self.step, self.timeout) if self.reuse else None) \
            or (None, None)
        return [
            dataclasses.replace(plan, storage_data=_AssignedPlanData(save_id=first, rank=i, step=self.step,
                                                                     data_prefixes=prefixes, number=number,
                                                                     base_step=base_step, base_save_id=base_save_id))
            for i, plan in enumerate(plans)
        ]

    def _rank_plan(self, position: int, plan: SavePlan, series: plan_cache.Series | None) -> _LocalPlanData:
        """What rank ``position`` reported, completed from its last full report where its plan was cached."""
        data = plan.storage_data
        if isinstance(data, _LocalPlanData) and data.items is not None:
            return data
        if series is not None and (isinstance(data, _LocalPlanData) or data is None and not plan.usable):
            cached = series.plans[position]
            return cached if data is None else dataclasses.replace(data, items=cached.items)
        raise ConfigurationError(
            f"the local plan of rank {position} carries no dcp_atomic identity: "
            "every rank must save with an AtomicStorageWriter"
        )

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        # 10^4+ item records and results per rank.  Another rank's lease lasts until DCP's broadcast of the
        # global metadata has been unpickled (_GcPauseEndsOnUnpickle); without collectives, until its own finish.
        with hook(STORAGE):
            return self._write_data(plan, planner)

    def _write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        assigned = plan.storage_data
        if not isinstance(assigned, _AssignedPlanData):
            raise ConfigurationError(
                f"rank {self.rank}: this save plan was not assigned by an AtomicStorageWriter coordinator (a DCP "
                "plan cached by a save through another storage writer?): save once with "
                "DefaultSavePlanner(enable_plan_caching=False), or restart the job"
            )
        caching = internals.caches_plans(planner)
        # first: every rank counts every save, even one that fails
        number = plan_cache.advance(assigned.save_id, assigned.number, caching)
        if caching and self.reuse:
            raise _reuse.refuse_plan_caching(self.rank)
        if number == assigned.number and assigned.step != self.step:  # a replayed plan's step is stale: see finish
            raise ConfigurationError(f"rank {self.rank} writer is for step {self.step}, coordinator chose {assigned.step}")
        if caching and self._series is not None:  # the coordinator: ranks now cache this series
            plan_cache.remember(planner, self._series)
        assigned = dataclasses.replace(assigned, save_id=plan_cache.save_id_of(assigned.save_id, number), step=self.step)
        self.save_id = assigned.save_id
        self.data_prefixes = assigned.data_prefixes
        self.rank = assigned.rank
        try:
            results, stats = self._rank_write(assigned, planner).run(plan.items)
        except BaseException:
            if self.live_state is not None:  # nothing reads the live tensors any more: wait_staged() returns
                self.live_state.release()
            raise
        if self.live_state is not None:  # before the shard is published: a torn tensor must not reach the commit
            self.live_state.finished_reading(assigned.step, assigned.rank)
        stats.shard = self._publish_shard(assigned, results, stats)
        stats.step, stats.save_id = assigned.step, assigned.save_id
        results = [  # the coordinator needs only what DCP's .metadata records
            WriteResult(r.index, r.size_in_bytes, internals.StorageInfo(r.storage_data.relative_path,
                                                                        r.storage_data.offset, r.storage_data.length))
            for r in results
        ]
        future: Future[list[WriteResult]] = Future()
        future.set_result(results + [rank_stats_result(self.rank, stats)])
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        with hook(STORAGE, last=True):
            self._commit(metadata, results)
            if self.use_collectives and len(results) > 1:  # DCP broadcasts it to the other ranks next
                metadata.version = _GcPauseEndsOnUnpickle(metadata.version)

    def _commit(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        stats: list[RankStats] = []
        storage_data: dict[MetadataIndex, Any] = {}
        for position, rank_results in enumerate(results):  # each rank's statistics come last (see write_data)
            if not rank_results or not isinstance(rank_results[-1].storage_data, RankStats):
                raise ConfigurationError(f"the write results of rank {position} carry no dcp_atomic statistics: "
                                         "every rank must save with an AtomicStorageWriter")
            stats.append(rank_results[-1].storage_data)
            storage_data.update({r.index: r.storage_data for r in rank_results[:-1]})
        save_id = self._planned_save_id
        assert save_id is not None, "finish() before prepare_global_plan()"
        _refuse_diverged_attempts(self.step, save_id, stats)
        attempt = self.layout.attempt_dir(self.step, save_id)
        metadata.version = DCP_METADATA_VERSION
        metadata.storage_data = storage_data
        metadata.storage_meta = StorageMeta(checkpoint_id=str(attempt), save_id=save_id)
        metadata_bytes = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
        manifest = self._manifest(save_id, stats, len(results), metadata_bytes, _stored_dtypes(metadata, results, stats))
        started = time.monotonic()
        try:
            self.last_marker = self._publish(manifest, metadata_bytes)
        except OSError as e:
            raise storage_error(e, self.rank, e.filename or attempt, phase="committing") from e
        # bytes: what the step's items hold (written + reused); a file linked from the base may hold dead bytes too
        self.last_stats = {"bytes": sum(s.bytes for s in stats), "files": len(manifest.files),
                           "bytes_written": sum(s.bytes_written for s in stats),
                           "bytes_reused": sum(s.bytes_reused for s in stats),
                           "commit_seconds": time.monotonic() - started,
                           "ranks": [{**m, "host": s.host, "files": s.files} for m, s in
                                     zip(manifest.stats, sorted(stats, key=lambda s: s.rank))]}
        log.info(
            "committed run %s step %d save %s: %d files, %.1f MiB, commit %.3fs",
            self.layout.run_id, self.step, save_id, len(manifest.files), manifest.total_bytes / 2**20,
            time.monotonic() - started,
        )

    def _publish(self, manifest: Manifest, metadata_bytes: bytes):
        """The commit (steps 2-4 of :mod:`~dcp_atomic.protocol.commit`); returns the marker.  The hook where the local tier
        (:mod:`~dcp_atomic.tiers.local_tier`) publishes the control files without a marker, which it records only once every
        rank's replicas are verified."""
        return commit.publish(self.layout, manifest, metadata_bytes, overwrite=self.overwrite, timeout=self.timeout,
                              rank=self.rank, resumed=self.resumed_from)

    def storage_meta(self) -> StorageMeta | None:
        return None

    @property
    def checkpoint_id(self) -> str | None:
        return None if self.layout is None or self.step is None else self.layout.step_dir(self.step)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return is_checkpoint_id(checkpoint_id)

    # -- helpers -----------------------------------------------------------------------

    def _refuse_partial_world(self, plans: int) -> None:
        """One commit must hold every rank's shards; DCP's modes that plan per rank would commit a part as whole."""
        if not (dist.is_available() and dist.is_initialized()) or plans == dist.get_world_size():
            return
        world, rank = dist.get_world_size(), dist.get_rank()
        mode = ("use_collectives=False" if not self.use_collectives
                else "no_dist=True (or a process group smaller than the world)")
        raise ConfigurationError(
            f"global rank {rank} on {socket.gethostname()}: dcp.save(..., {mode}) plans {plans} of the {world} "
            "ranks, so its checkpoint would hold only their shards and still load as complete. Call dcp.save on "
            "every rank with use_collectives=True, without no_dist, on a process group spanning every rank (DCP "
            "writes replicated tensors once). Nothing was written.",
            rank=rank, plans=plans, world_size=world,
        )

    def _refuse_committed_step(self) -> bool:
        """Refuse a committed step unless this job abandoned it by resuming below it (P14); True: superseding."""
        try:
            marker = commit.read_marker_once(self.layout, self.step)
        except FileNotFoundError:
            return False
        except OSError as e:  # e.g. a file where the step directory belongs
            raise storage_error(e, self.rank, e.filename or self.layout.marker(self.step),
                                 phase="checking whether the step is committed") from e
        return commit.refuse_committed(marker, self.step, self.layout.run_id, self.resumed_from,
                                       self.layout.storage.describe())

    def _rank_write(self, assigned: _AssignedPlanData, planner: SavePlanner) -> RankWrite:
        """This rank's share of the save (:mod:`.rank_write`): the attempt it writes into, the form of its items, and
        with reuse its own shard of the base step the coordinator chose."""
        ctx = _reuse.ReuseContext(rank=assigned.rank, layout=self.layout, storage=self.storage, step=assigned.step,
                                  save_id=assigned.save_id, data_prefixes=assigned.data_prefixes,
                                  threads=self.thread_count)
        form = StoredForm(self.block_size, self.compression, self.compression_level, self.stock_readable,
                          chunk_sizes=self.reuse)
        base = None
        if self.reuse and assigned.base_step is not None:
            base = load_base(self.layout, assigned.rank, assigned.base_step, assigned.base_save_id, self.timeout)
        return RankWrite(ctx, planner, form, base, pool=None if self.live_state is None else self.live_state.pool)

    def _publish_shard(self, assigned: _AssignedPlanData, results: list[WriteResult], stats: RankStats) -> ShardRef:
        """This rank's record of what it wrote, durable beside its data before the coordinator may commit."""
        files = {name: FileEntry(name=name, rank=assigned.rank, size=size, checksum=stats.checksums.get(name))
                 for name, size in stats.files.items()}
        for result in results:
            index, written = result.index, result.storage_data
            files[written.relative_path].items.append(ItemExtent(
                key=index.fqn, chunk_offset=None if index.offset is None else list(index.offset), kind=written.kind,
                format=written.format, pos=written.offset, length=written.length, checksums=written.checksums,
                block_size=written.block_size, payload=written.payload, codec=written.codec, planes=written.planes,
                logical_length=written.logical_length, frames=written.frames, dtype=written.dtype,
                chunk_sizes=written.chunk_sizes,
            ))
        for entry in files.values():
            entry.items.sort(key=lambda i: i.pos)
        shard = ManifestShard(self.layout.run_id, assigned.step, assigned.save_id, assigned.rank,
                              sorted(files.values(), key=lambda f: f.name))
        try:
            return commit.publish_shard(self.layout, shard)
        except OSError as e:
            raise storage_error(e, assigned.rank, e.filename or self.layout.attempt_dir(assigned.step,
                                                                                           assigned.save_id)) from e

    def _manifest(self, save_id: str, stats: list[RankStats], world: int, metadata_bytes: bytes,
                  stored_dtypes: dict[str, list[str]]) -> Manifest:
        """O(world + keys): per-rank files and shard digests, identities, per-key records; no item lists."""
        files = [FileEntry(name=name, rank=s.rank, size=size) for s in stats for name, size in s.files.items()]
        return Manifest(
            run_id=self.layout.run_id,
            step=self.step,
            save_id=save_id,
            world_size=world,
            parallelism=self._identities[0]["parallelism"] if self._identities else None,
            # every rank's read of the whole manifest grows with these: the layout each rank declared is the
            # manifest's own (check_identities refused any other), hosts are in ``ranks``, files in ``files``
            ranks=[{k: v for k, v in ident.items() if k != "parallelism"} for ident in self._identities],
            files=sorted(files, key=lambda f: (f.rank, f.name)),
            dcp_metadata={"name": DCP_METADATA, "size": len(metadata_bytes), "sha256": sha256_hex(metadata_bytes)},
            versions={"dcp_atomic": __version__, "torch": torch.__version__},
            started_at=self._started_at,
            written_at=now(),
            stats=[{k: getattr(s, k) for k in _MANIFEST_STATS + _reuse.STATS}
                   for s in sorted(stats, key=lambda s: s.rank)],
            keys=self._keys,
            data_prefixes=self.data_prefixes,
            shards=sorted((s.shard for s in stats), key=lambda ref: ref.rank),
            user_metadata=self.metadata,
            stored_dtypes=stored_dtypes,
            copy_of_sequence=self.copy_of_sequence,
        )


def _stored_dtypes(metadata: Metadata, results: list[list[WriteResult]],
                   stats: list[RankStats]) -> dict[str, list[str]]:
    """Key -> every dtype its chunks are stored as, for each key a planner cast on some rank.  The manifest holds
    it so that a load can tell a recorded cast from a shard whose item dtype was changed after the commit."""
    cast: dict[str, set[str]] = {}
    for s in stats:
        for key, dtypes in s.casts.items():
            cast.setdefault(key, set()).update(dtypes)
    if cast:
        for rank_results, s in zip(results, stats):  # a rank that wrote chunks of a cast key without casting any
            for key in {r.index.fqn for r in rank_results[:-1]} & cast.keys() - s.casts.keys():
                cast[key].add(str(metadata.state_dict_metadata[key].properties.dtype))
    return {key: sorted(dtypes) for key, dtypes in sorted(cast.items())}


class _GcPauseEndsOnUnpickle(str):
    """The committed metadata's version, as the coordinator's ``finish`` hands it to DCP for its broadcast.

    The other ranks have no hook after ``write_data``, yet their save's last and largest unpickling is still to
    come: the global metadata (every rank's items) in that broadcast.  ``version`` is Metadata's last field, so
    unpickling this string is the last thing of it; it ends the receiving rank's part in its lease
    (:mod:`~dcp_atomic._base.gc_pause`) there.  Only the first pickling (the broadcast, right after ``finish``) carries the
    signal: the Metadata that ``dcp.save`` returns pickles afterwards as a plain string."""

    def __reduce__(self):
        if self.__dict__.get("_sent"):
            return str, (str(self),)
        self._sent = True
        return _metadata_received, (str(self),)


def _metadata_received(version: str) -> str:
    leave(STORAGE)
    return version


def _refuse_diverged_attempts(step: int, save_id: str, stats: list[RankStats]) -> None:
    """Every rank must have written the attempt the coordinator planned: with cached plans each rank derives it."""
    wrote = {s.rank: (s.step, s.save_id) for s in stats}
    if all(attempt == (step, save_id) for attempt in wrote.values()):
        return
    groups: dict[tuple, list[int]] = {}
    for rank, attempt in sorted(wrote.items()):
        groups.setdefault(attempt, []).append(rank)
    seen = "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))} wrote step {a[0]} save {a[1]}"
                     for a, r in groups.items())
    raise RankConsistencyError(
        f"ranks wrote different attempts, the coordinator planned step {step} save {save_id}: {seen}. With DCP "
        "plan caching each rank derives the save_id from its cached plan and its count of the series' saves: a "
        "writer built for another step, or a rank that missed a save of the series, diverges. Nothing was "
        "committed (the attempts are collectable by gc). Give every rank's writer the same step; a rank that "
        "missed a save needs the job restarted (DCP's plan caches live in each process).",
        step=step, save_id=save_id, ranks=sorted(rank for rank, attempt in wrote.items() if attempt != (step, save_id)),
    )

