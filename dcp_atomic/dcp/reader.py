"""``AtomicStorageReader``: load only committed, verified bytes, the same version on every rank.

* ``read_metadata`` (every rank, on its own) resolves the step — ``LATEST`` by
  exact name when ``step=None`` — through its commit marker and manifest with
  bounded retries, then opens DCP's ``.metadata`` only if its sha256 matches the
  manifest, with an allow-list unpickler.
* ``prepare_local_plan`` reads the manifest shards of the files this rank's
  plan reads (no other rank's), checks every item it will read against them
  and puts (step, save_id, manifest digest) in the plan;
  ``prepare_global_plan`` on the coordinator refuses any disagreement and names
  which rank saw what (P5).
* ``read_data`` reads exactly the extents the manifest names (never a listing),
  checks every block against the digests recorded at write time, and copies
  into the destination tensors; files are read in parallel.
* Read once (``share_reads``): a stored item that several ranks need is read and
  verified by one of them and sent to the others over the process group, where
  it is verified again before it is decoded (:mod:`.shared_read`; :mod:`~dcp_atomic.exchange`
  plans and moves it).

Beside this file: :mod:`.read_checks` (``.metadata`` and plans against the
manifest, before a byte is read) and :mod:`.read_sources` (runs of small items,
windows, counted and verified reads).

Why one module of about 690 lines: DCP's load hooks top-down; the checks are :mod:`.read_checks`, shared reads
:mod:`.shared_read`, where bytes come from :mod:`.read_sources`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import logging
import os
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch.futures import Future
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader

from .._base import arguments
from .._base import failpoints
from ..protocol.catalog import DEFAULT_TIMEOUT, resolve
from ..format.codec import Decoder, narrow_tensor_by_index, tensor_bytes
from ..protocol.commit import Committed
from ..errors import ConfigurationError, CorruptCheckpointError, RankConsistencyError
from ..exchange.read_once import SharePlan
from ..exchange.transport import PastTheGather, PeerLost
from .identity import default_thread_count
from ..format.blocks import check_block, verify_blocks_from, verify_item
from ..format.layout import (DCP_METADATA, checked_checkpoint_id, no_location_error, validate_save_id,
                             validate_step)
from ..format.manifest import ItemExtent
from ..format.parallelism import Parallelism
from .planners import LOAD_CONTEXT_ATTR
from .._base.progress import Progress
from .reshard import LoadContext
from .read_checks import Chunk, check_stored_items, decode_chunk, item_id, payload_proven, read_dcp_metadata
from .read_sources import Counted, Window, holds_bytes, item_runs
from .._base.retry import Deadline
from ..format.safe_pickle import safe_byte_item
from .shared_read import SharedReads
from .._base.gc_pause import STORAGE, gc_paused, hook
from .._base.stats import ReadStats
from ..stores.storage import LocalStorage, RangeReader
from ..protocol.location import is_checkpoint_id, open_location, retarget

log = logging.getLogger("dcp_atomic.reader")  # the name users filter on


@dataclass
class _LoadView:
    """Which checkpoint version one rank resolved (travels in ``LoadPlan.storage_data``)."""

    rank: int
    host: str
    pid: int
    step: int
    save_id: str
    manifest_sha256: str
    can_share: bool = False  # collectives on, and this rank's group rank is its DCP rank
    group_size: int = 0  # ranks in the reader's process group (must be DCP's world)
    posix: bool = True  # the storage is a POSIX file system (the default for share_reads=None depends on it)


@dataclass
class _Assignment:
    """What the coordinator hands each rank back in ``LoadPlan.storage_data``: its version and its share."""

    view: _LoadView
    share: SharePlan | None
    exchange_id: str = ""  # names the exchange's keys on the rendezvous store (the same on every rank)


class AtomicStorageReader(SharedReads, StorageReader):
    """Read a committed dcp_atomic checkpoint.

    Args:
        root, run_id, storage_options: as for :class:`AtomicStorageWriter`; ``root`` and ``run_id``
            may be ``None`` and come from ``dcp.load(..., checkpoint_id="<root>/<run_id>/step_<N>")``.
        step: the step to load; ``None`` loads what ``LATEST`` names (a ``checkpoint_id`` sets it).
        parallelism: this job's layout, compared with the saved one (P6).
        allow_reshard: consent to load a checkpoint saved with another tp / pp size.
        verify: check every block's checksum (default True).
        timeout: seconds any wait (visibility lag, retries) may take.
        thread_count: files read in parallel per rank.
        layout_dependent: globs of keys refused when tp / pp changes (besides those declared at save).
        save_id: load exactly this attempt of ``step`` (waits, bounded, until the marker names it); what pins
            one version on every rank of a ``no_dist=True`` load in a multi-rank job (``dcp-atomic show`` prints it).
        save_sequence: the commit sequence of ``save_id`` where the caller recorded it (``dcp-atomic show``, a
            Lightning file): a marker naming a later commit of the step then fails at once (the save was replaced),
            instead of being waited out as a stale cache.
        share_reads: read each stored item once and share it with the other ranks that need it (see
            :mod:`~dcp_atomic.exchange`). ``None`` (default): on where the storage is not a local POSIX file system
            (object stores, where every byte read is a request) or the ranks span several hosts; ``False``:
            every rank reads its own bytes.
        process_group: the group ``dcp.load`` runs on (default: the default group); shared reads need it.
        share_buffer_bytes: at most this many bytes of shared items held per rank at once (besides the
            destination tensors); one larger item is exchanged alone.

    After a load, ``reader.step`` and ``reader.save_id`` say what was loaded and ``reader.read_stats``
    what it cost (bytes from storage and from peers, seconds in each).
    """

    def __init__(
        self,
        root: str | os.PathLike | None = None,
        run_id: str | None = None,
        step: int | None = None,
        *,
        parallelism: Parallelism | None = None,
        allow_reshard: bool = False,
        verify: bool = True,
        timeout: float = DEFAULT_TIMEOUT,
        storage_options: dict[str, Any] | None = None,
        thread_count: int | None = None,
        layout_dependent: Iterable[str] = (),
        save_id: str | None = None,
        save_sequence: int | None = None,
        share_reads: bool | None = None,
        process_group: "dist.ProcessGroup | None" = None,
        share_buffer_bytes: int = 256 << 20,
    ) -> None:
        super().__init__()
        thread_count = arguments.count("AtomicStorageReader(thread_count=...)", thread_count)
        timeout = arguments.seconds("AtomicStorageReader(timeout=...)", timeout)
        allow_reshard = arguments.flag("AtomicStorageReader(allow_reshard=...)", allow_reshard)
        verify = arguments.flag("AtomicStorageReader(verify=...)", verify)
        share_reads = arguments.flag("AtomicStorageReader(share_reads=...)", share_reads, optional=True)
        share_buffer_bytes = arguments.count("AtomicStorageReader(share_buffer_bytes=...)", share_buffer_bytes,
                                             optional=False)
        self.storage_options = storage_options
        self._built_root, self._built_run_id = root, run_id  # what every checkpoint_id must agree with
        self.storage, self.layout = open_location(root, run_id, storage_options)
        self.requested_step = None if step is None else validate_step(step, "AtomicStorageReader(step=...)")
        self.requested_save_id = None if save_id is None else validate_save_id(save_id, "AtomicStorageReader(save_id=...)")
        self.requested_sequence = arguments.count("AtomicStorageReader(save_sequence=...)", save_sequence, minimum=0)
        self.parallelism = arguments.instance("AtomicStorageReader(parallelism=...)", parallelism, Parallelism,
                                              "a dcp_atomic.Parallelism")
        self.allow_reshard = allow_reshard
        self.verify = verify
        self.timeout = timeout
        self.thread_count = thread_count or default_thread_count()
        self.layout_dependent = tuple(layout_dependent)
        self._context: LoadContext | None = None
        self._fresh = False
        self._decoders = threading.local()
        self.step: int | None = None
        self.save_id: str | None = None
        self.committed: Committed | None = None
        self.rank = 0
        self._storage_data: dict = {}
        self._metadata: Metadata | None = None
        self._decoded: Metadata | None = None
        self._extents: dict[tuple, tuple[str, ItemExtent]] = {}  # (key, chunk offset) -> (file, extent)
        self._chunks: dict[tuple, Chunk] = {}  # (key, chunk offset) -> stored sizes and dtype
        self._file_sizes: dict[str, int] = {}
        self.share_reads = share_reads
        self.process_group = process_group
        self.share_buffer_bytes = share_buffer_bytes
        self._use_collectives = True
        self.read_stats = ReadStats()

    # -- resolution (usable on its own: typed errors, no DCP wrapping) ---------------

    def resolve(self) -> Committed:
        """Find and verify the checkpoint this reader will load; raises dcp_atomic's own errors.

        Marker, manifest and DCP ``.metadata`` are all read and cross-checked
        here, so every refusal has its own type (through ``dcp.load`` torch
        would turn a ``read_metadata`` error into an ``AssertionError``).
        """
        with gc_paused():
            return self._resolve()

    def _resolve(self) -> Committed:
        if self.layout is None:
            raise no_location_error(type(self).__name__)
        if self.requested_save_id is not None and self.requested_step is None:
            raise ConfigurationError(f"AtomicStorageReader(save_id={self.requested_save_id!r}) needs the step that "
                                     "save belongs to (step=, or checkpoint_id=<root>/<run>/step_<N>)")
        committed = resolve(self.layout, self.requested_step, Deadline(self.timeout), save_id=self.requested_save_id,
                            save_sequence=self.requested_sequence)
        context = LoadContext(
            where=f"run {self.layout.run_id!r} step {committed.step}",
            saved=committed.manifest.parallelism,
            current=self.parallelism,
            allow_reshard=self.allow_reshard,
            keys=committed.manifest.keys,
            layout_dependent=self.layout_dependent,
        )
        if self.parallelism is not None:  # declared: check now, raising our own type
            context.check_layout()
        self._decoded = self._read_dcp_metadata(committed)
        self._extents, self._chunks, self._file_sizes = {}, {}, {}
        self._context = context
        self.committed = committed
        self._fresh = True
        self.step = committed.step
        self.save_id = committed.save_id
        return committed

    def _read_dcp_metadata(self, committed: Committed) -> Metadata:
        """``.metadata``, opened only if its digest is the manifest's; every tensor's chunks must tile its global
        shape and have the dtype the manifest recorded for its key, and every file it names must be one the manifest
        records.  The items themselves are checked
        against the manifest shards in :meth:`prepare_local_plan`, once this rank's plan says which it reads."""
        path = self.layout.attempt_file(committed.step, committed.save_id, DCP_METADATA)
        return read_dcp_metadata(self.storage, path, committed.manifest)

    def _check_plan_items(self, plan: LoadPlan) -> None:
        """The items this rank reads, against the shards of their files: each must be the one the shard records
        (file, offset, length, kind) and hold exactly its chunk's bytes in the stored dtype.  Checked before a
        byte of data is read, so a bad item never half-fills a destination; O(this rank's share)."""
        committed, metadata = self.committed, self._decoded
        path = self.layout.attempt_file(committed.step, committed.save_id, DCP_METADATA)
        storage = metadata.storage_data or {}
        indexes = {item.storage_index for item in plan.items}
        infos = {index: self._storage_info_of(storage, index) for index in indexes}
        names = {info.relative_path for info in infos.values()}
        committed.load_items(self.layout, names, Deadline(self.timeout))
        extents, chunks = check_stored_items(metadata, committed.manifest, names, infos, path)
        self._extents = extents
        self._chunks = chunks
        self._file_sizes = {f.name: f.size for f in committed.manifest.files if f.name in names}

    @staticmethod
    def _storage_info_of(storage: dict, index: MetadataIndex):
        try:
            return storage[index]
        except KeyError:
            raise CorruptCheckpointError(f"DCP metadata has no storage entry for {index.fqn!r}",
                                         key=index.fqn) from None

    # -- DCP lifecycle -----------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """Retarget to ``<root>/<run_id>/step_<N>`` (DCP calls this when given ``checkpoint_id=``); the next
        load resolves afresh."""
        if checkpoint_id is None:
            if self.layout is None:
                raise no_location_error(type(self).__name__)
            return
        root, run_id, step = checked_checkpoint_id(checkpoint_id, self._built_root, self._built_run_id,
                                                   type(self).__name__)
        if self.requested_save_id is not None and self.requested_step not in (None, step):
            raise ConfigurationError(
                f"checkpoint_id {os.fspath(checkpoint_id)!r} names step {step}, but this reader is pinned to save "
                f"{self.requested_save_id} of step {self.requested_step}: drop save_id= or load that step. "
                "Nothing was read.",
                checkpoint_id=os.fspath(checkpoint_id),
            )
        self.storage, self.layout = retarget(self.storage, self.layout, root, run_id, self.storage_options)
        self.requested_step = step
        self._fresh = False
        self.step = self.save_id = self.committed = None

    def read_metadata(self) -> Metadata:
        # Not the lease's first hook: read_metadata is also called on its own (export, listing keys), where no
        # later hook would end a lease; DCP calls set_up_storage_reader right after it, before any collective.
        with hook(STORAGE):
            return self._read_metadata()

    def _read_metadata(self) -> Metadata:
        # A resolve() the caller just made (the manager does, for typed errors) is used once, not repeated.
        if not self._fresh:
            self.resolve()
        self._fresh = False
        committed, metadata = self.committed, self._decoded
        metadata.storage_meta = StorageMeta(
            checkpoint_id=self.layout.attempt_dir(committed.step, committed.save_id),
            save_id=committed.save_id,
            load_id=uuid.uuid4().hex,
        )
        setattr(metadata, LOAD_CONTEXT_ATTR, self._context)  # AtomicLoadPlanner reads it
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        with hook(STORAGE, first=True):  # the load's lease (gc_pause): ends after read_data
            self._set_up(metadata, is_coordinator, kwargs)

    def _set_up(self, metadata: Metadata, is_coordinator: bool, kwargs: dict) -> None:
        self.rank = kwargs.get("rank", 0 if is_coordinator else -1)
        self._use_collectives = kwargs.get("use_collectives", True)
        self._storage_data = metadata.storage_data or {}
        self._metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        with hook(STORAGE):
            return self._prepare_local_plan(plan)

    def _prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        committed, context = self.committed, self._context
        assert committed is not None and context is not None, "prepare_local_plan() before read_metadata()"
        context.check_layout()  # the layout may have been inferred by AtomicLoadPlanner meanwhile
        if not context.keys_checked:  # without AtomicLoadPlanner: per-key checks on what this rank reads
            context.check_keys({item.dest_index.fqn: None for item in plan.items})
        self._check_plan_items(plan)
        can_share = self._can_share()
        view = _LoadView(self.rank, socket.gethostname(), os.getpid(), committed.step, committed.save_id,
                         committed.manifest_sha256, can_share=can_share,
                         group_size=dist.get_world_size(self.process_group) if can_share else 0,
                         posix=isinstance(self.storage, LocalStorage))
        return dataclasses.replace(plan, storage_data=view)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        with hook(STORAGE):
            return self._prepare_global_plan(plans)

    def _prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        if len(plans) == 1:
            self._refuse_unpinned_lone_load()
        views = [p.storage_data for p in plans]
        if any(not isinstance(v, _LoadView) for v in views):
            raise ConfigurationError("every rank must load with an AtomicStorageReader")
        versions = {(v.step, v.save_id, v.manifest_sha256) for v in views}
        if len(versions) > 1:
            lines = [
                f"rank {i} (host {v.host}, pid {v.pid}) resolved step {v.step} save {v.save_id} "
                f"manifest {v.manifest_sha256[:12]}"
                for i, v in enumerate(views)
            ]
            raise RankConsistencyError(
                f"ranks resolved different checkpoint versions of run {self.layout.run_id!r}; nothing was loaded:\n  "
                + "\n  ".join(lines)
                + "\nA stale storage cache (NFS) or a save that committed during the load is the usual cause: "
                "retry, or pass the same explicit step= on every rank (CheckpointManager.load does this).",
                views=[dataclasses.asdict(v) for v in views],
            )
        shares = self._plan_shares(plans, views)
        exchange_id = uuid.uuid4().hex
        return [dataclasses.replace(p, storage_data=_Assignment(v, None if shares is None else shares[i], exchange_id))
                for i, (p, v) in enumerate(zip(plans, views))]

    def _refuse_unpinned_lone_load(self) -> None:
        """A rank that plans alone (``no_dist=True``, or a one-rank group) while a multi-rank job runs resolves
        its version on its own, and no collective compares the ranks' (P5): ``LATEST`` moves with every commit, and
        a step number does not pin a version either (``overwrite=True``, or a resumed job superseding the step,
        re-saves it between two ranks' loads).  Only a ``save_id`` names one version on every rank."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return
        if self.requested_save_id is not None:
            return
        rank, world = dist.get_rank(), dist.get_world_size()
        run = self.layout.run_id
        asked = "the latest step" if self.requested_step is None else f"step {self.requested_step}"
        raise ConfigurationError(
            f"global rank {rank} of {world} on {socket.gethostname()}: dcp.load(..., no_dist=True) (or on a "
            f"one-rank process group) would resolve {asked} of run {run!r} on this rank alone, and a commit or "
            "re-save of it (overwrite=True, a resumed job) or a stale storage cache between the ranks' loads would "
            "give them different versions. Pin the version: pass the same step and save_id to every rank "
            "(AtomicStorageReader(..., step=N, save_id=S); `dcp-atomic show ROOT RUN N` prints S, or broadcast rank "
            "0's AtomicStorageReader(root, run, N).resolve().save_id), or load with collectives on every rank "
            "(CheckpointManager.load does). Nothing was loaded.",
            rank=rank, world_size=world,
        )

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        with hook(STORAGE, last=True):
            try:
                return self._read_data(plan, planner)
            except PeerLost as e:  # past DCP's gather over the broken group, typed (exchange.PastTheGather)
                raise PastTheGather(e) from None

    def _read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self.read_stats = ReadStats()
        planner_lock = threading.Lock()
        items = plan.items
        self.progress = Progress(f"loading step {self.committed.step}",
                                 sum(self._storage_info(i).length for i in items), self.rank)
        assignment = plan.storage_data if isinstance(plan.storage_data, _Assignment) else None
        share = assignment.share if assignment is not None else None
        # Shared items first: every rank must take part in every round, whatever fails on it afterwards.
        if share is not None:
            shared = share.idents
            mine = [i for i in items if item_id(i.storage_index) in shared]
            if not self._read_shared(share, mine, planner, planner_lock, assignment.exchange_id):
                return _done()  # a peer failed: DCP's gather of read_data raises its error on every rank
            items = [i for i in items if item_id(i.storage_index) not in shared]
        else:
            failpoints.hit("read.before_data", self.rank)
        per_file: dict[str, list[ReadItem]] = {}
        for item in items:
            per_file.setdefault(self._storage_info(item).relative_path, []).append(item)
        started = time.perf_counter()
        self._in_parallel([lambda name=name, items=items: self._read_file(name, items, planner, planner_lock)
                           for name, items in sorted(per_file.items())])
        self.read_stats.storage_seconds += time.perf_counter() - started
        return _done()

    def _in_parallel(self, jobs: list) -> None:
        """Run callables on the reader's threads (inline when one would do); the first failure is raised."""
        if len(jobs) <= 1 or self.thread_count == 1:
            for job in jobs:
                job()
            return
        with ThreadPoolExecutor(max_workers=min(self.thread_count, len(jobs)),
                                thread_name_prefix=f"dcp-atomic-r{self.rank}") as pool:
            for f in [pool.submit(job) for job in jobs]:
                f.result()

    @contextlib.contextmanager
    def _open_data(self, name: str):
        """One data file of the committed attempt, its size checked against the manifest, reads counted."""
        path = self._data_path(name)
        try:
            with self.storage.open_reader(path) as source:
                actual = source.size()
                if actual != self._file_sizes.get(name):
                    raise CorruptCheckpointError(
                        f"{path}: file has {actual} bytes, the manifest recorded {self._file_sizes.get(name)} "
                        "(truncated or replaced); restore it or load another step",
                        path=path,
                    )
                yield Counted(source, self.read_stats)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{path}: data file named by the manifest is missing", path=path) from None

    def storage_meta(self) -> StorageMeta | None:
        return None

    @property
    def checkpoint_id(self) -> str | None:
        if self.layout is None:
            return None
        return self.layout.run_dir if self.step is None else self.layout.step_dir(self.step)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return is_checkpoint_id(checkpoint_id)

    def __getstate__(self) -> dict:
        """Picklable (DCP's process-based executors, frameworks that copy their readers): the per-thread
        decoders are rebuilt on first use."""
        state = self.__dict__.copy()
        del state["_decoders"]
        state.pop("progress", None)  # the last load's (it holds a lock); each read_data makes its own
        state["process_group"] = None  # process groups do not pickle: a copy shares on the default group
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._decoders = threading.local()

    # -- reading -------------------------------------------------------------------------

    def _storage_info(self, item: ReadItem):
        try:
            return self._storage_data[item.storage_index]
        except KeyError:
            raise CorruptCheckpointError(
                f"DCP metadata has no storage entry for {item.storage_index.fqn!r}", key=item.storage_index.fqn
            ) from None

    def _data_path(self, name: str) -> str:
        """From the manifest alone (its ``data_prefixes``), never from this reader's storage options."""
        committed = self.committed
        return self.layout.data_file(committed.step, committed.save_id, name, committed.manifest.data_prefixes)

    def _read_file(self, name: str, items: list[ReadItem], planner: LoadPlanner, planner_lock: threading.Lock) -> None:
        """Every item this rank reads from one data file, through one open handle (one NFS open, not one per item)."""
        with self._open_data(name) as source:
            ordered = sorted(items, key=lambda i: self._storage_info(i).offset)
            for start, end, run in item_runs([(item, self._extents.get(item_id(item.storage_index), (None, None))[1])
                                          for item in ordered]):
                window = source if len(run) == 1 else Window(source, start, end - start)
                for item in run:
                    self._read_item(window, source.path, item, planner, planner_lock)

    def _read_item(self, source: RangeReader, path: str, item: ReadItem, planner: LoadPlanner,
                   planner_lock: threading.Lock) -> None:
        """One item into its destination (from storage, or from bytes a peer sent), counted for progress."""
        self._read_stored_item(source, path, item, planner, planner_lock)
        self.progress.add(self._storage_info(item).length)

    def _read_stored_item(self, source: RangeReader, path: str, item: ReadItem, planner: LoadPlanner,
                          planner_lock: threading.Lock) -> None:
        fqn = item.storage_index.fqn
        ident = item_id(item.storage_index)
        extent = self._extents.get(ident, (None, None))[1]
        what = f"{path} item {fqn!r}"
        if extent is None or (item.type == LoadItemType.TENSOR and ident not in self._chunks):
            raise CorruptCheckpointError(f"{what}: DCP metadata names an item the manifest does not", path=path, key=fqn)
        if extent.format == "raw" and extent.kind == "tensor":
            self._read_raw(source, item, extent, planner, planner_lock, what)
            return
        if self._read_in_place(source, item, extent, planner, planner_lock, what):
            return
        data = source.read_range(extent.pos, extent.length)
        if len(data) != extent.length:
            raise CorruptCheckpointError(
                f"{what}: file is truncated (read {len(data)} of {extent.length} bytes at offset {extent.pos})",
                path=path,
            )
        if self.verify:
            verify_item(extent, data, what, path=path)
        self._deliver(item, data, planner, planner_lock, what)

    def _read_raw(self, source: RangeReader, item: ReadItem, extent: ItemExtent, planner: LoadPlanner,
                  planner_lock: threading.Lock, what: str) -> None:
        """Raw-format tensor: decode only the blocks this read needs, into the destination if it can take them.

        A read that narrows only the first dimension (the usual resharding
        case: another rank count along dim 0) is a contiguous byte range of the
        stored chunk, so only the frames covering it are read and verified.
        Elements are stored in the chunk's stored dtype (another than the
        destination's when a planner cast at save); they are cast on copy, as
        stock DCP does.
        """
        chunk = self._chunks[item_id(item.storage_index)]
        dtype, sizes = chunk.dtype, chunk.sizes
        offsets, lengths = tuple(item.storage_offsets), tuple(item.lengths)
        with planner_lock:
            target = planner.resolve_tensor(item).detach()
        if tuple(target.shape) != lengths:
            raise CorruptCheckpointError(f"{what}: destination shape {tuple(target.shape)} != read {lengths}",
                                         key=item.storage_index.fqn)
        dim0_only = all(o == 0 and n == c for o, n, c in zip(offsets[1:], lengths[1:], sizes[1:]))
        if dim0_only:
            row = dtype.itemsize * math.prod(sizes[1:])
            lo = offsets[0] * row if sizes else 0
            fits = holds_bytes(target, dtype)
            dest = target if fits else torch.empty(lengths, dtype=dtype)
            self._decode(source, extent, lo, lo + dest.nbytes, tensor_bytes(dest), what)
            if dest is not target:
                target.copy_(dest)
        else:
            whole = torch.empty(sizes, dtype=dtype)
            self._decode(source, extent, 0, extent.logical, tensor_bytes(whole), what)
            target.copy_(narrow_tensor_by_index(whole, offsets, lengths))
        with planner_lock:
            planner.commit_tensor(item, target)

    def _decode(self, source: RangeReader, extent: ItemExtent, lo: int, hi: int, out: memoryview, what: str) -> None:
        """Logical bytes [lo, hi) of a raw item into ``out``: read covering frames, verify each, decode.

        Uncompressed blocks that lie wholly inside the range are read straight
        into ``out`` and verified there; only edge blocks and compressed
        frames pass through a buffer.
        """
        if hi <= lo:
            return
        path = source.path
        size = extent.block_size
        first, last = lo // size, (hi - 1) // size
        inside = [i for i in range(first, last + 1) if i * size >= lo and min((i + 1) * size, extent.logical) <= hi]
        if extent.codec == "none" and inside:
            start, end = inside[0] * size, min((inside[-1] + 1) * size, extent.logical)
            target = out[start - lo : end - lo]
            got = source.readinto_range(extent.pos + start, target)
            if got != end - start:
                raise CorruptCheckpointError(
                    f"{what}: file is truncated (read {got} of {end - start} bytes at offset {extent.pos + start})",
                    path=path,
                )
            if self.verify:
                verify_blocks_from(extent, inside[0], target, what, path=path)
            edges = [i for i in (first, last) if i not in inside]
        else:
            edges = list(range(first, last + 1))
        blocks = extent.blocks()
        decoder = self._decoder()
        for i in sorted(set(edges)):
            frame_lo, frame_hi = blocks[i]
            frame = source.read_range(extent.pos + frame_lo, frame_hi - frame_lo)
            if len(frame) != frame_hi - frame_lo:
                raise CorruptCheckpointError(f"{what}: file is truncated (frame {i} at offset "
                                             f"{extent.pos + frame_lo} is short)", path=path)
            if self.verify:
                check_block(extent, i, frame, what, path=path)
            block_lo, block_hi = i * size, min((i + 1) * size, extent.logical)
            want_lo, want_hi = max(lo, block_lo), min(hi, block_hi)
            try:
                if (want_lo, want_hi) == (block_lo, block_hi):
                    decoder.decode_into(frame, extent.planes, out[block_lo - lo : block_hi - lo])
                else:
                    scratch = bytearray(block_hi - block_lo)
                    decoder.decode_into(frame, extent.planes, memoryview(scratch))
                    out[want_lo - lo : want_hi - lo] = scratch[want_lo - block_lo : want_hi - block_lo]
            except ValueError as e:
                # the frame matched its digest, so its recorded layout (block size, planes) is what is wrong
                raise CorruptCheckpointError(f"{what}: frame {i} cannot be decoded ({e})", path=path) from None

    def _decoder(self) -> Decoder:
        decoder = getattr(self._decoders, "decoder", None)
        if decoder is None:
            decoder = self._decoders.decoder = Decoder()
        return decoder

    def _read_in_place(self, source: RangeReader, item: ReadItem, extent: ItemExtent, planner: LoadPlanner,
                       planner_lock: threading.Lock, what: str) -> bool:
        """Read a whole stored chunk's payload straight into its destination tensor.

        Applies when the item is a torch.save container whose payload offset
        was recorded (see :mod:`~dcp_atomic.format.container`) and the destination has the stored
        shape.  A contiguous CPU destination of the stored dtype takes the bytes
        itself; any other (a device tensor, another dtype, a strided view) gets
        them through one host tensor and ``copy_``, never through ``torch.load``
        of a second in-memory copy of the container.  The offset is
        trusted only if the zip entry ``data/0`` provably spans exactly
        ``[payload, payload + nbytes)`` (local header before it, data
        descriptor after it).  Header, payload and trailer are then verified
        as one stream: no temporary tensor, one copy.  Returns False (nothing
        delivered) when it does not apply: the item then loads the stock way.
        """
        if item.type != LoadItemType.TENSOR or extent.payload is None or any(item.storage_offsets):
            return False
        chunk = self._chunks[item_id(item.storage_index)]
        if chunk.sizes != tuple(item.lengths):
            return False
        with planner_lock:
            target = planner.resolve_tensor(item).detach()
        if tuple(target.shape) != chunk.sizes:
            return False
        direct = holds_bytes(target, chunk.dtype)
        host = target if direct else torch.empty(chunk.sizes, dtype=chunk.dtype)
        nbytes = host.nbytes
        tail_start = extent.payload + nbytes
        head = source.read_range(extent.pos, extent.payload)
        tail = source.read_range(extent.pos + tail_start, extent.length - tail_start)
        if len(head) != extent.payload or len(tail) != extent.length - tail_start:
            raise CorruptCheckpointError(
                f"{what}: file is truncated (item of {extent.length} bytes at offset {extent.pos})", path=source.path
            )
        if not payload_proven(head, tail, extent.payload, nbytes):
            return False
        payload = tensor_bytes(host)
        if source.readinto_range(extent.pos + extent.payload, payload) != nbytes:
            raise CorruptCheckpointError(
                f"{what}: file is truncated (item of {extent.length} bytes at offset {extent.pos})", path=source.path
            )
        if self.verify:
            verify_item(extent, [head, payload, tail], what, path=source.path)
        if not direct:
            target.copy_(host)
        with planner_lock:
            planner.commit_tensor(item, target)
        return True

    def _deliver(self, item: ReadItem, data: bytes, planner: LoadPlanner, planner_lock: threading.Lock,
                 what: str) -> None:
        fqn = item.storage_index.fqn
        if item.type == LoadItemType.BYTE_IO:
            with planner_lock:
                planner.load_bytes(item, safe_byte_item(data, key=fqn, where=what))  # P11: no code runs
            return
        tensor = decode_chunk(data, self._chunks[item_id(item.storage_index)], what, fqn)
        tensor = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
        with planner_lock:
            target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise CorruptCheckpointError(
                f"{what}: stored chunk has shape {tuple(tensor.size())}, destination expects {tuple(target.size())}",
                key=fqn,
            )
        target.copy_(tensor)
        with planner_lock:
            planner.commit_tensor(item, target)


def _done() -> Future[None]:
    future: Future[None] = Future()
    future.set_result(None)
    return future


