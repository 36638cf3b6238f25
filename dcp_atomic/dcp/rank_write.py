"""One rank's share of a save: its items encoded, hashed and written into ``threads`` data files at once.

:class:`~.writer.AtomicStorageWriter` follows DCP's lifecycle; its ``write_data`` hands the rank's items here
(:class:`RankWrite`) and publishes what comes back.  What this module decides:

* **which file** each item goes to: largest first into the least loaded of ``threads`` files (similar byte counts,
  so the threads finish together); with reuse (P15), the unchanged items first into stable files or linked from
  the base (:mod:`.reuse`);
* **how an item is stored** (:meth:`RankWrite.encode_item`, the one encoding a write and reuse's probe share):
  non-tensor items as bytes, tensors as raw blocks (:mod:`..format.codec`, optionally zstd) or, with
  ``stock_readable``, as torch.save containers; every stored block's digest goes into the item's record
  (:class:`WrittenItem`), so the manifest shard can be checked block by block at every read;
* **what a failure looks like**: the first real cause (never the abort it caused in the other threads), typed,
  naming the rank, host and path (:func:`storage_error`).
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from .._base import failpoints
from .._base.progress import Progress
from ..errors import CheckpointError, ConfigurationError, StorageError
from ..format.codec import Encoder, HostBuffer, host_blocks, plane_width, tensor_bytes
from ..format.container import find_payload
from ..format.integrity import BlockSink, HashingWriter, block_digest
from ..format.layout import data_file_name
from ..format.manifest import ShardRef
from ..format.safe_pickle import load_refusal
from ..protocol.links import Base, referenced_bytes
from ..staging import WindowPool
from .reuse import ReuseContext, plan_rank

log = logging.getLogger("dcp_atomic.writer")  # the name users filter on


@dataclass(frozen=True)
class StoredForm:
    """How a save stores each item: the writer's arguments, the same for every item of the save."""

    block_size: int
    compression: str | None = None
    compression_level: int | None = None
    stock_readable: bool = False
    chunk_sizes: bool = False  # record each tensor's chunk sizes: reuse identifies items by them (P15)

    def encoder(self) -> Encoder:
        """A new encoder of this form's codec (one per file or probe: zstd compressors are not shared)."""
        return Encoder(self.compression or "none", self.compression_level)


@dataclass
class WrittenItem:
    """``WriteResult.storage_data``: where an item went and its block digests."""

    offset: int
    length: int
    kind: str
    format: str
    checksums: list[str]
    block_size: int
    payload: int | None = None
    codec: str = "none"
    planes: int = 1
    logical_length: int | None = None
    frames: list[int] | None = None
    dtype: str | None = None  # the dtype stored, when the planner resolved another than it planned
    chunk_sizes: list[int] | None = None  # with reuse: the chunk's sizes (ItemExtent.chunk_sizes)
    relative_path: str = ""  # the data file: set by the file's writer (a probe's item has none)


@dataclass
class RankStats:
    """What one rank wrote, for the coordinator's manifest and ``last_stats`` (travels in the last WriteResult)."""

    rank: int
    host: str
    files: dict[str, int] = field(default_factory=dict)  # name -> size
    checksums: dict[str, str] = field(default_factory=dict)  # name -> the store's checksum (stores.object_checksum)
    bytes: int = 0  # this rank's items in this step: bytes_written + bytes_reused
    bytes_written: int = 0  # by this save
    bytes_reused: int = 0  # the items it references in files linked from the base step (reuse, P15), not written
    items: int = 0
    write_seconds: float = 0.0
    fsync_seconds: float = 0.0
    threads: int = 1
    shard: ShardRef | None = None  # this rank's manifest shard, as the manifest names it
    step: int | None = None  # the attempt this rank wrote (checked against the coordinator's plan in finish)
    save_id: str | None = None
    # key -> the dtypes this rank stored its chunks of that key as, for keys of which the planner cast a chunk
    # ("save as bf16"); the coordinator records them in the manifest (Manifest.stored_dtypes)
    casts: dict[str, set[str]] = field(default_factory=dict)


class RankWrite:
    """One rank's share of a save: ``ctx.threads`` files written concurrently into the attempt ``ctx`` names, each
    item stored as ``form`` says; with ``base`` (reuse, P15) the unchanged items are planned first (:mod:`.reuse`).
    ``pool``: bounded staging's windows (of at least one block each), through which device tensors are copied to the
    host instead of each thread's own buffer, so that all threads together stay within the pool."""

    def __init__(self, ctx: ReuseContext, planner: SavePlanner, form: StoredForm, base: Base | None = None,
                 pool: WindowPool | None = None) -> None:
        self.ctx = ctx
        self.pool = pool
        self.planner = planner
        self.form = form
        self.base = base
        self.rank = ctx.rank
        self.attempt = ctx.layout.attempt_dir(ctx.step, ctx.save_id)
        self.stats = RankStats(rank=self.rank, host=socket.gethostname(), threads=ctx.threads)
        self._host_buffers = threading.local()  # per writer thread: one host buffer for device tensors
        self._first_item = threading.Event()
        self._lock = threading.Lock()
        self._failed = threading.Event()
        self._stored: dict[str, set[str]] = {}  # key -> the dtypes this rank stored its chunks of it as
        self._cast: set[str] = set()  # keys of which the planner cast a chunk

    def run(self, items: list[WriteItem]) -> tuple[list[WriteResult], RankStats]:
        storage = self.ctx.storage
        failpoints.hit("write.before_data", self.rank)
        try:
            storage.makedirs(self.attempt)
        except OSError as e:
            raise storage_error(e, self.rank, e.filename or self.attempt) from e
        started = time.monotonic()
        results: list[WriteResult] = []
        self.progress = Progress(f"saving step {self.ctx.step}", sum(_planned_bytes(i) for i in items), self.rank)
        rest, stable = self._reuse(items, results) if self.base is not None else (items, [])
        buckets = [b for b in _split_by_size(rest, self.ctx.threads) if b] or ([] if stable or results else [[]])
        files = [(data_file_name(self.rank, k), bucket) for k, bucket in enumerate(buckets)] + stable
        with ThreadPoolExecutor(max_workers=max(1, len(files)), thread_name_prefix=f"dcp-atomic-w{self.rank}") as pool:
            futures = [pool.submit(self._write_file, name, bucket) for name, bucket in files]
            errors = []
            for f in futures:
                try:
                    results.extend(f.result())
                except BaseException as e:  # collect all, raise the first
                    errors.append(e)
        if errors:
            raise self._first_cause(errors)
        self.stats.write_seconds = time.monotonic() - started
        self.stats.items = len(items)
        self.stats.casts = {key: self._stored[key] for key in self._cast}
        failpoints.hit("write.after_data", self.rank)
        return results, self.stats

    def _first_cause(self, errors: list[BaseException]) -> BaseException:
        """The failure that stopped this rank, never the ``_Aborted`` it caused in the other threads."""
        real = [e for e in errors if not isinstance(e, _Aborted)] or errors
        first, others = real[0], real[1:]
        if not others:
            return first
        also = f" ({len(others)} more writer thread(s) of rank {self.rank} failed too; the next: {others[0]})"
        if isinstance(first, CheckpointError):
            amended = type(first)(first.message + also, **first.details)
            amended.__cause__ = first
            return amended
        first.add_note(also.strip(" ()"))
        return first

    def _reuse(self, items: list[WriteItem], results: list[WriteResult]):
        """Reuse (:mod:`.reuse`): (the items for the ordinary files, [(the stable file, its items)] to write or []);
        a file linked from the base adds its items' results to ``results`` instead."""
        outcome = plan_rank(self.encode_item, self.form.encoder, items, self.base, self.ctx)
        results.extend(outcome.linked)
        for entry in outcome.linked_files:
            self.stats.files[entry.name] = entry.size
            if entry.checksum is not None:  # a copy's equals its source's (protocol/links.link_verified)
                self.stats.checksums[entry.name] = entry.checksum
            referenced = referenced_bytes(entry)  # a linked file's dead bytes are no one's
            self.stats.bytes += referenced
            self.stats.bytes_reused += referenced
        written = {id(item) for item in outcome.others} | {id(item) for _, group in outcome.stable for item in group}
        self.progress.add(sum(_planned_bytes(item) for item in items if id(item) not in written))  # the linked ones
        return outcome.others, outcome.stable

    def _write_file(self, name: str, bucket: list[WriteItem]) -> list[WriteResult]:
        ctx = self.ctx
        storage = ctx.storage
        path = ctx.layout.data_file(ctx.step, ctx.save_id, name, ctx.data_prefixes)
        encoder = self.form.encoder()
        results = []
        try:
            raw = storage.open_write(path)
            try:
                out = HashingWriter(raw, self.form.block_size)
                with _without_zip_crc32():
                    for item in bucket:
                        if self._failed.is_set():
                            raise _Aborted()
                        written = self.encode_item(out, item, encoder)
                        written.relative_path = name
                        results.append(WriteResult(index=item.index, size_in_bytes=written.length,
                                                   storage_data=written))
                        self.progress.add(_planned_bytes(item))
                        if not self._first_item.is_set():
                            self._first_item.set()
                            failpoints.hit("write.mid_data", self.rank)
            except BaseException:
                # Closing flushes what is buffered: on a full disk that fails again and would hide (or, for
                # _Aborted, impersonate) what stopped this file.  The file is abandoned either way.
                with contextlib.suppress(OSError):
                    storage.abort_write(raw)
                raise
            fsync_started = time.monotonic()
            checksum = storage.close_write(raw)
            with self._lock:
                self.stats.fsync_seconds += time.monotonic() - fsync_started
                self.stats.files[name] = out.position
                if checksum is not None:
                    self.stats.checksums[name] = checksum
                self.stats.bytes += out.position
                self.stats.bytes_written += out.position
        except _Aborted:
            raise
        except OSError as e:
            self._failed.set()
            raise storage_error(e, self.rank, path) from e
        except BaseException:
            self._failed.set()
            raise
        return results

    def encode_item(self, sink: BlockSink, item: WriteItem, encoder: Encoder) -> WrittenItem:
        """Resolve ``item`` through the planner and store it into ``sink``; its record, without a file.

        The one encoding of a save: reuse's probe (:mod:`.reuse`) calls it too, so the digests it compares are those
        of exactly the bytes a write would store.  Raw tensors need only a :class:`BlockSink`; bytes and torch.save
        containers (never probed) need a :class:`HashingWriter`, which hashes what they write."""
        data = self.planner.resolve_data(item)
        block_size = self.form.block_size
        if item.type == WriteItemType.BYTE_IO:
            if not isinstance(data, io.BytesIO):
                raise self._refuse_resolved(item, data, "io.BytesIO")
            _warn_if_load_refuses(data.getbuffer(), item.index.fqn, self.rank)
            start = sink.begin_item()
            sink.write(data.getbuffer())
            length, checksums = sink.end_item()
            written = WrittenItem(start, length, "bytes", "raw", checksums, block_size)
        else:
            tensor = self._as_planned(item, data)
            if self.form.stock_readable:
                start = sink.begin_item()
                tensor = _host_copy(tensor)
                torch.save(tensor, sink)
                payload = find_payload(bytes(sink.prefix), sink.writes, tensor.nbytes)
                length, checksums = sink.end_item()
                written = WrittenItem(start, length, "tensor", "torch_save", checksums, block_size, payload)
            else:
                written = self._write_raw_tensor(sink, tensor, encoder)
            if self.form.chunk_sizes:
                written.chunk_sizes = list(item.tensor_data.chunk.sizes)
            with self._lock:
                self._stored.setdefault(item.index.fqn, set()).add(str(tensor.dtype))
            if tensor.dtype != item.tensor_data.properties.dtype:
                written.dtype = str(tensor.dtype)
                with self._lock:
                    self._cast.add(item.index.fqn)
        return written

    def _as_planned(self, item: WriteItem, data: Any) -> torch.Tensor:
        """The resolved tensor in the planned shape.  ``.metadata`` records the plan; a planner may resolve
        another dtype ("save as bf16": recorded, cast at load as stock DCP does) or shape (stored as planned,
        same bytes), but other elements than planned could only load as garbage."""
        sizes = item.tensor_data.chunk.sizes
        if not isinstance(data, torch.Tensor) or data.numel() != sizes.numel():
            raise self._refuse_resolved(item, data, f"{item.tensor_data.properties.dtype} {tuple(sizes)}")
        return data if data.shape == sizes else data.reshape(sizes)

    def _refuse_resolved(self, item: WriteItem, data: Any, planned: str) -> ConfigurationError:
        got = f"{data.dtype} {tuple(data.shape)}" if isinstance(data, torch.Tensor) else f"a {type(data).__name__}"
        where = "" if item.index.offset is None else f" (chunk at {tuple(item.index.offset)})"
        return ConfigurationError(
            f"rank {self.rank}: {type(self.planner).__name__}.resolve_data returned {got} for {item.index.fqn!r}"
            f"{where}, planned as {planned}. A planner may resolve another dtype or shape, never other elements: "
            "fix resolve_data. Nothing was committed.",
            rank=self.rank, key=item.index.fqn,
        )

    def _write_raw_tensor(self, sink: BlockSink, tensor: torch.Tensor, encoder: Encoder) -> WrittenItem:
        """Block by block: stage (device tensors), encode, hash the stored frame, write.

        The bytes stored are the tensor's value: a lazily conjugated or negated view is resolved first (its
        memory holds the other value).  A small uncompressed CPU tensor is one block written as it lies.
        """
        tensor = tensor.detach().resolve_conj().resolve_neg()
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        block_size = self.form.block_size
        start = sink.position
        if encoder.codec == "none" and tensor.device.type == "cpu" and tensor.nbytes <= block_size:
            view = tensor_bytes(tensor)
            sink.write_unhashed(view)
            return WrittenItem(start, len(view), "tensor", "raw", [block_digest(view)], block_size, None,
                               logical_length=len(view))
        width = plane_width(tensor.dtype) if encoder.codec == "zstd" else 1
        frames: list[int] = []
        checksums: list[str] = []
        compressed = False
        with self._host_buffer(tensor) as buffer:
            for block in host_blocks(tensor, block_size, buffer):
                stored = encoder.encode(block, width)
                compressed |= len(stored) != len(block)
                checksums.append(block_digest(stored))
                frames.append(len(stored))
                sink.write_unhashed(stored)
        if not frames:  # zero-size tensor: one empty block
            checksums, frames = [block_digest(b"")], [0]
        length = sink.position - start
        return WrittenItem(start, length, "tensor", "raw", checksums, block_size, None,
                           codec="zstd" if compressed else "none", planes=width if compressed else 1,
                           logical_length=tensor.nbytes, frames=frames if compressed else None)

    @contextlib.contextmanager
    def _host_buffer(self, tensor: torch.Tensor):
        """Where a device tensor's blocks land on the host: a window of the staging pool for the tensor's copy, else
        this thread's own buffer; None for a CPU tensor (read in place)."""
        if tensor.device.type == "cpu":
            yield None
        elif self.pool is not None:
            with self.pool.lease() as window:
                yield window
        else:
            if getattr(self._host_buffers, "buffer", None) is None:
                self._host_buffers.buffer = HostBuffer(self.form.block_size).buffer
            yield self._host_buffers.buffer


@contextlib.contextmanager
def _without_zip_crc32():
    """torch.save's zip CRC32 is a third of its CPU time, and redundant: every block already has an
    xxh3 digest, and torch.load does not check the CRC.  The option is per thread in torch 2.13;
    it is restored afterwards in case another version makes it global."""
    setter = getattr(torch.serialization, "set_crc32_options", None)
    if setter is None:
        yield
        return
    previous = torch.serialization.get_crc32_options()
    setter(False)
    try:
        yield
    finally:
        setter(previous)


class _Aborted(Exception):
    """Another writer thread of this rank failed; stop early."""


_warned_keys: set[str] = set()


def _warn_if_load_refuses(data: memoryview, key: str, rank: int) -> None:
    """A non-tensor item the load's allow-list (P11) will refuse is saved, with a warning naming the fix now,
    once per key and process, rather than found at the first resume."""
    if key in _warned_keys:
        return
    refusal = load_refusal(data, key=key)
    if refusal is not None:
        _warned_keys.add(key)
        log.warning("rank %d: saving %r, which a load will refuse unless the type is allowed there: %s. Save plain "
                    "types (dicts, lists, tensors, numbers, strings) under this key, or allow the type at load.",
                    rank, key, refusal)


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor whose storage holds exactly its elements (torch.save writes whole storages).

    Device tensors are copied to host one item at a time, so extra host memory
    is bounded by the largest item, not the whole state.  A lazily conjugated or
    negated view is resolved: the payload the reader copies in place must be the value.
    """
    tensor = tensor.detach().resolve_conj().resolve_neg()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu", non_blocking=False)
    if tensor.untyped_storage().nbytes() != tensor.nbytes or not tensor.is_contiguous():
        tensor = tensor.contiguous().clone()
    return tensor


def _split_by_size(items: list[WriteItem], bins: int) -> list[list[WriteItem]]:
    """Largest-first greedy packing, so each writer thread gets a similar byte count."""
    buckets: list[list[WriteItem]] = [[] for _ in range(bins)]
    loads = [0] * bins
    for item in sorted(items, key=_planned_bytes, reverse=True):
        k = loads.index(min(loads))
        buckets[k].append(item)
        loads[k] += max(_planned_bytes(item), 1)
    return buckets


def _planned_bytes(item: WriteItem) -> int:
    """An item's size before encoding, as planned (non-tensor items: unknown until resolved, counted as 0)."""
    if item.tensor_data is None:
        return 0
    return item.tensor_data.size.numel() * item.tensor_data.properties.dtype.itemsize


def storage_error(e: OSError, rank: int, path: str, phase: str = "writing") -> StorageError:
    hint = {
        errno.ENOSPC: "the filesystem is full: free space or point root elsewhere",
        errno.EDQUOT: "the disk quota is exhausted",
        errno.EROFS: "the filesystem is read-only",
        errno.EEXIST: "the file already exists (two saves with one save_id?)",
    }.get(e.errno or 0, "check the storage and retry the save")
    return StorageError(
        f"rank {rank} on {socket.gethostname()} failed {phase} {path}: {e.strerror or e} "
        f"(errno {e.errno}); {hint}. Nothing was committed; the previous checkpoint is intact.",
        rank=rank,
        path=path,
        errno=e.errno,
    )
