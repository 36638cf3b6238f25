"""``AtomicStorageReader``: load only committed, verified bytes, the same version on every rank.

* ``read_metadata`` (every rank, on its own) resolves the step — ``LATEST`` by
  exact name when ``step=None`` — through its commit marker and manifest with
  bounded retries, then opens DCP's ``.metadata`` only if its sha256 matches the
  manifest, with an allow-list unpickler.
* ``prepare_local_plan`` puts (step, save_id, manifest digest) in the plan;
  ``prepare_global_plan`` on the coordinator refuses any disagreement and names
  which rank saw what (P5).
* ``read_data`` reads exactly the extents the manifest names (never a listing),
  checks every block against the digests recorded at write time, and copies
  into the destination tensors; files are read in parallel.
"""

from __future__ import annotations

import dataclasses
import io
import math
import logging
import os
import socket
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import zstandard
from torch.futures import Future
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.distributed._shard._utils import narrow_tensor_by_index

from . import failpoints
from .catalog import DEFAULT_TIMEOUT, resolve
from .codec import Decoder, tensor_bytes
from .commit import Committed
from .errors import ConfigurationError, CorruptCheckpointError, RankConsistencyError
from .identity import default_thread_count
from .integrity import sha256_hex, verify_blocks, verify_segments
from .layout import DCP_METADATA, RunLayout, validate_data_file_name
from .manifest import ItemExtent
from .parallelism import Parallelism
from .planners import LOAD_CONTEXT_ATTR
from .reshard import LoadContext
from .retry import Deadline
from .safe_pickle import load_dcp_metadata
from .storage import open_storage

log = logging.getLogger(__name__)


@dataclass
class _LoadView:
    """Which checkpoint version one rank resolved (travels in ``LoadPlan.storage_data``)."""

    rank: int
    host: str
    pid: int
    step: int
    save_id: str
    manifest_sha256: str


class AtomicStorageReader(StorageReader):
    """Read a committed dcp_atomic checkpoint.

    Args:
        root, run_id, storage_options: as for :class:`AtomicStorageWriter`.
        step: the step to load; ``None`` loads what ``LATEST`` names.
        parallelism: this job's layout, compared with the saved one (P6).
        allow_reshard: consent to load a checkpoint saved with another tp / pp size.
        verify: check every block's checksum (default True).
        timeout: seconds any wait (visibility lag, retries) may take.
        thread_count: files read in parallel per rank.
        layout_dependent: globs of keys refused when tp / pp changes (besides those declared at save).
        save_id: load exactly this attempt of ``step`` (waits, bounded, until the marker names it).

    After a load, ``reader.step`` and ``reader.save_id`` say what was loaded.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        run_id: str,
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
    ) -> None:
        super().__init__()
        self.storage = open_storage(root, storage_options)
        self.layout = RunLayout(self.storage, run_id)
        self.requested_step = step
        self.requested_save_id = save_id
        self.parallelism = parallelism
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
        self._extents: dict[tuple[str, int], ItemExtent] = {}
        self._file_sizes: dict[str, int] = {}

    # -- resolution (usable on its own: typed errors, no DCP wrapping) ---------------

    def resolve(self) -> Committed:
        """Find and verify the checkpoint this reader will load; raises dcp_atomic's own errors.

        Marker, manifest and DCP ``.metadata`` are all read and cross-checked
        here, so every refusal has its own type (through ``dcp.load`` torch
        would turn a ``read_metadata`` error into an ``AssertionError``).
        """
        committed = resolve(self.layout, self.requested_step, Deadline(self.timeout), save_id=self.requested_save_id)
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
        self._context = context
        self.committed = committed
        self._fresh = True
        self.step = committed.step
        self.save_id = committed.save_id
        return committed

    def _read_dcp_metadata(self, committed: Committed) -> Metadata:
        """``.metadata``, opened only if its digest is the manifest's, and every extent it names checked."""
        expected = committed.manifest.dcp_metadata
        path = self.layout.attempt_file(committed.step, committed.save_id, DCP_METADATA)
        try:
            data = self.storage.read_file(path)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{path}: committed checkpoint lacks DCP metadata", path=path) from None
        if len(data) != expected["size"] or sha256_hex(data) != expected["sha256"]:
            raise CorruptCheckpointError(
                f"{path}: DCP metadata does not match the manifest (size {len(data)} vs {expected['size']} or "
                "sha256 differs); refusing to unpickle it",
                path=path,
            )
        metadata = load_dcp_metadata(data, where=path)
        extents = committed.manifest.extent_index()
        for index, info in (metadata.storage_data or {}).items():
            name = getattr(info, "relative_path", None)
            extent = extents.get((name, getattr(info, "offset", None)))
            if extent is None or extent.length != getattr(info, "length", None):
                raise CorruptCheckpointError(
                    f"{path}: entry {getattr(index, 'fqn', index)!r} names {name!r} at offset "
                    f"{getattr(info, 'offset', None)}, which the manifest does not record; refusing to read it",
                    path=path,
                )
        self._extents = extents
        self._file_sizes = {f.name: f.size for f in committed.manifest.files}
        return metadata

    # -- DCP lifecycle -----------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            raise ConfigurationError(
                "AtomicStorageReader finds its checkpoint from root/run_id/step; do not pass checkpoint_id to dcp.load"
            )

    def read_metadata(self) -> Metadata:
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
        self.rank = kwargs.get("rank", 0 if is_coordinator else -1)
        self._storage_data = metadata.storage_data or {}
        self._metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        committed, context = self.committed, self._context
        assert committed is not None and context is not None, "prepare_local_plan() before read_metadata()"
        context.check_layout()  # the layout may have been inferred by AtomicLoadPlanner meanwhile
        if not context.keys_checked:  # without AtomicLoadPlanner: per-key checks on what this rank reads
            context.check_keys({item.dest_index.fqn: None for item in plan.items})
        view = _LoadView(self.rank, socket.gethostname(), os.getpid(), committed.step, committed.save_id,
                         committed.manifest_sha256)
        return dataclasses.replace(plan, storage_data=view)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
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
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        failpoints.hit("read.before_data", self.rank)
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self._storage_info(item).relative_path, []).append(item)
        planner_lock = threading.Lock()
        jobs = sorted(per_file.items())
        if len(jobs) <= 1 or self.thread_count == 1:
            for name, items in jobs:
                self._read_file(name, items, planner, planner_lock)
        else:
            with ThreadPoolExecutor(max_workers=min(self.thread_count, len(jobs)),
                                    thread_name_prefix=f"dcp-atomic-r{self.rank}") as pool:
                for f in [pool.submit(self._read_file, name, items, planner, planner_lock) for name, items in jobs]:
                    f.result()
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def storage_meta(self) -> StorageMeta | None:
        return None

    @property
    def checkpoint_id(self) -> str:
        return self.layout.run_dir if self.step is None else self.layout.step_dir(self.step)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False

    # -- reading -------------------------------------------------------------------------

    def _storage_info(self, item: ReadItem):
        try:
            return self._storage_data[item.storage_index]
        except KeyError:
            raise CorruptCheckpointError(
                f"DCP metadata has no storage entry for {item.storage_index.fqn!r}", key=item.storage_index.fqn
            ) from None

    def _read_file(self, name: str, items: list[ReadItem], planner: LoadPlanner, planner_lock: threading.Lock) -> None:
        committed = self.committed
        assert committed is not None
        path = self.layout.data_file(committed.step, committed.save_id, name)
        try:
            actual = self.storage.size(path)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{path}: data file named by the manifest is missing", path=path) from None
        if actual != self._file_sizes.get(name):
            raise CorruptCheckpointError(
                f"{path}: file has {actual} bytes, the manifest recorded {self._file_sizes.get(name)} "
                "(truncated or replaced); restore it or load another step",
                path=path,
            )
        for item in sorted(items, key=lambda i: self._storage_info(i).offset):
            info = self._storage_info(item)
            extent = self._extents.get((name, info.offset))
            what = f"{path} item {item.storage_index.fqn!r}"
            if extent is None or extent.length != info.length:
                raise CorruptCheckpointError(f"{what}: DCP metadata names an extent the manifest does not", path=path)
            if extent.format == "raw" and extent.kind == "tensor":
                self._read_raw(path, item, extent, planner, planner_lock, what)
                continue
            if self._read_in_place(path, item, extent, planner, planner_lock, what):
                continue
            try:
                data = self.storage.read_range(path, extent.pos, extent.length)
            except FileNotFoundError:
                raise CorruptCheckpointError(f"{path}: data file named by the manifest is missing", path=path) from None
            if len(data) != extent.length:
                raise CorruptCheckpointError(
                    f"{what}: file is truncated (read {len(data)} of {extent.length} bytes at offset {extent.pos})",
                    path=path,
                )
            if self.verify:
                verify_blocks(data, extent.checksums, extent.block_size, what=what)
            self._deliver(item, extent, data, planner, planner_lock, what)

    def _read_raw(self, path: str, item: ReadItem, extent: ItemExtent, planner: LoadPlanner,
                  planner_lock: threading.Lock, what: str) -> None:
        """Raw-format tensor: decode only the blocks this read needs, into the destination if it can take them.

        A read that narrows only the first dimension (the usual resharding
        case: another rank count along dim 0) is a contiguous byte range of the
        stored chunk, so only the frames covering it are read and verified.
        """
        stored = self._metadata.state_dict_metadata[item.storage_index.fqn]
        chunk = next(c for c in stored.chunks if c.offsets == item.storage_index.offset)
        dtype, sizes = stored.properties.dtype, tuple(chunk.sizes)
        offsets, lengths = tuple(item.storage_offsets), tuple(item.lengths)
        with planner_lock:
            target = planner.resolve_tensor(item).detach()
        if tuple(target.shape) != lengths:
            raise CorruptCheckpointError(f"{what}: destination shape {tuple(target.shape)} != read {lengths}")
        element = torch.empty((), dtype=dtype).element_size()
        dim0_only = all(o == 0 and n == c for o, n, c in zip(offsets[1:], lengths[1:], sizes[1:]))
        if dim0_only:
            row = element * math.prod(sizes[1:])
            lo = offsets[0] * row if sizes else 0
            fits = (target.device.type == "cpu" and target.is_contiguous() and target.dtype == dtype)
            dest = target if fits else torch.empty(lengths, dtype=dtype)
            self._decode(path, extent, lo, lo + dest.nbytes, tensor_bytes(dest), what)
            if dest is not target:
                target.copy_(dest)
        else:
            whole = torch.empty(sizes, dtype=dtype)
            self._decode(path, extent, 0, extent.logical, tensor_bytes(whole), what)
            target.copy_(narrow_tensor_by_index(whole, offsets, lengths))
        with planner_lock:
            planner.commit_tensor(item, target)

    def _decode(self, path: str, extent: ItemExtent, lo: int, hi: int, out: memoryview, what: str) -> None:
        """Logical bytes [lo, hi) of a raw item into ``out``: read covering frames, verify each, decode.

        Uncompressed blocks that lie wholly inside the range are read straight
        into ``out`` and verified there; only edge blocks and compressed
        frames pass through a buffer.
        """
        if hi <= lo:
            return
        size = extent.block_size
        first, last = lo // size, (hi - 1) // size
        inside = [i for i in range(first, last + 1) if i * size >= lo and min((i + 1) * size, extent.logical) <= hi]
        if extent.codec == "none" and inside:
            start, end = inside[0] * size, min((inside[-1] + 1) * size, extent.logical)
            target = out[start - lo : end - lo]
            got = self.storage.readinto_range(path, extent.pos + start, target)
            if got != end - start:
                raise CorruptCheckpointError(
                    f"{what}: file is truncated (read {got} of {end - start} bytes at offset {extent.pos + start})",
                    path=path,
                )
            if self.verify:
                verify_blocks(target, extent.checksums, size, what=what, first_block=inside[0])
            edges = [i for i in (first, last) if i not in inside]
        else:
            edges = list(range(first, last + 1))
        bounds = extent.frame_offsets()
        decoder = self._decoder()
        for i in sorted(set(edges)):
            frame = self.storage.read_range(path, extent.pos + bounds[i], bounds[i + 1] - bounds[i])
            if len(frame) != bounds[i + 1] - bounds[i]:
                raise CorruptCheckpointError(f"{what}: file is truncated (frame {i} at offset "
                                             f"{extent.pos + bounds[i]} is short)", path=path)
            if self.verify:
                verify_blocks(frame, extent.checksums, size, what=what, first_block=i)
            block_lo, block_hi = i * size, min((i + 1) * size, extent.logical)
            want_lo, want_hi = max(lo, block_lo), min(hi, block_hi)
            try:
                if (want_lo, want_hi) == (block_lo, block_hi):
                    decoder.decode_into(frame, extent.planes, out[block_lo - lo : block_hi - lo])
                else:
                    scratch = bytearray(block_hi - block_lo)
                    decoder.decode_into(frame, extent.planes, memoryview(scratch))
                    out[want_lo - lo : want_hi - lo] = scratch[want_lo - block_lo : want_hi - block_lo]
            except (ValueError, zstandard.ZstdError) as e:
                raise CorruptCheckpointError(f"{what}: frame {i} cannot be decoded ({e})", path=path) from None

    def _decoder(self) -> Decoder:
        decoder = getattr(self._decoders, "decoder", None)
        if decoder is None:
            decoder = self._decoders.decoder = Decoder()
        return decoder

    def _read_in_place(self, path: str, item: ReadItem, extent: ItemExtent, planner: LoadPlanner,
                       planner_lock: threading.Lock, what: str) -> bool:
        """Read a whole stored chunk's payload straight into its destination tensor.

        Applies when the item is a torch.save container whose payload offset
        was recorded (see :mod:`.container`) and the destination is a
        contiguous CPU tensor of the stored dtype and shape.  Header, payload
        and trailer are then verified as one stream: no temporary tensor, one copy.
        Returns False (nothing read) when it does not apply.
        """
        if item.type != LoadItemType.TENSOR or extent.payload is None or any(item.storage_offsets):
            return False
        stored = self._metadata.state_dict_metadata.get(item.storage_index.fqn) if self._metadata else None
        chunk = next((c for c in getattr(stored, "chunks", ()) if c.offsets == item.storage_index.offset), None)
        if chunk is None or tuple(chunk.sizes) != tuple(item.lengths):
            return False
        with planner_lock:
            target = planner.resolve_tensor(item).detach()
        if (target.device.type != "cpu" or not target.is_contiguous() or target.dtype != stored.properties.dtype
                or tuple(target.shape) != tuple(item.lengths)):
            return False
        nbytes = target.nbytes
        tail_start = extent.payload + nbytes
        if tail_start > extent.length:
            raise CorruptCheckpointError(f"{what}: recorded payload does not fit its item", path=path)
        head = self.storage.read_range(path, extent.pos, extent.payload)
        payload = tensor_bytes(target)
        got = self.storage.readinto_range(path, extent.pos + extent.payload, payload)
        tail = self.storage.read_range(path, extent.pos + tail_start, extent.length - tail_start)
        if len(head) != extent.payload or got != nbytes or len(tail) != extent.length - tail_start:
            raise CorruptCheckpointError(
                f"{what}: file is truncated (item of {extent.length} bytes at offset {extent.pos})", path=path
            )
        if self.verify:
            verify_segments([head, payload, tail], extent.checksums, extent.block_size, what=what)
        with planner_lock:
            planner.commit_tensor(item, target)
        return True

    def _deliver(self, item: ReadItem, extent: ItemExtent, data: bytes, planner: LoadPlanner,
                 planner_lock: threading.Lock, what: str) -> None:
        if item.type == LoadItemType.BYTE_IO:
            with planner_lock:
                planner.load_bytes(item, io.BytesIO(data))
            return
        try:
            tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as e:
            raise CorruptCheckpointError(f"{what}: cannot decode tensor ({e})", key=item.storage_index.fqn) from None
        tensor = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
        with planner_lock:
            target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise CorruptCheckpointError(
                f"{what}: stored chunk has shape {tuple(tensor.size())}, destination expects {tuple(target.size())}",
                key=item.storage_index.fqn,
            )
        target.copy_(tensor)
        with planner_lock:
            planner.commit_tensor(item, target)
