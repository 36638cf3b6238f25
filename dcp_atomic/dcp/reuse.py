"""Reuse (P15): a rank's unchanged items are linked (POSIX) or copied server-side (S3, GCS) from the base step, never
written or uploaded again.

* The **base** is the run's latest committed step below the one being saved, chosen by the coordinator
  (:func:`choose_base`, in ``prepare_global_plan``) and told to every rank in its assigned plan, as the save_id is.
* Each rank reads only **its own manifest shard** of the base (:func:`load_base`: marker -> manifest -> shard, the
  chain loads verify).  No base, or one that cannot be read: a full save and one log line, never a failed save.
* **Change is decided by content**: an item whose identity (key, chunk offset, chunk sizes, stored dtype) matches a
  base item is digested first, through the writer's own ``_write_item`` into a sink that stores nothing
  (:class:`_Probe`), so its digests are those of exactly the bytes a write would store; it is unchanged only if
  every field of its record (format, codec, lengths, block digests) equals the base's.  Declarations
  (``requires_grad``, "frozen") never decide.
* **Physically per file**: the unchanged items live in the rank's stable files (``layout.stable_file_name``), in
  canonical order (key, chunk offset), at most ``STABLE_FILE_BYTES`` each.  A stable file of the base whose every item
  is unchanged (same records, so the same bytes at the same offsets) is ``Storage.link()``ed into the new attempt
  under the same name (``link_kind``: a hard link on POSIX, a server-side copy on S3 and GCS), then verified against
  its block digests (:mod:`..format.blocks`, at every link: on POSIX it may be the only copy, on an object store the
  copy is new bytes), and its extents become this save's: no data byte of it is written.  The other unchanged items
  are written into new stable files, so that the next save can link them.  A link that fails (another filesystem, no
  hard links, the base removed meanwhile, a copy the store refuses) or a damaged base file means its items are
  written, logged.

Every step stays whole: a hard link is a second name for one inode and a server-side copy is an object of its own,
so retiring or deleting any step, the base included, leaves the others' bytes in place; readers, ``verify``,
retention, ``gc`` and the drain need nothing new.

Refused (typed, before anything is written): roots that can neither hard-link nor copy in place (generic fsspec
filesystems), compression, ``stock_readable``, DCP plan caching, and the manager's local tier.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from .._base import failpoints
from .._base.retry import Deadline
from ..errors import CheckpointError, ConfigurationError, CorruptCheckpointError, StorageError
from ..format.blocks import verify_stored_file
from ..format.codec import Encoder
from ..format.integrity import block_digest
from ..format.layout import STABLE_FILE_PATTERN, RunLayout, stable_file_name
from ..format.manifest import FileEntry, ItemExtent, ManifestShard
from ..protocol.catalog import most_recent, resolve, scan_markers
from ..protocol.commit import read_committed, read_shard

if TYPE_CHECKING:  # pragma: no cover
    from .writer import _RankWrite

log = logging.getLogger("dcp_atomic.writer")  # the writer's: what users filter on

STATS = ("bytes_written", "bytes_reused")  # the writer's per-rank statistics of reuse, recorded in the manifest
STABLE_FILE_BYTES = 1 << 30  # a stable file's size cap: one changed item costs the rewrite of at most this much
BASE_WAIT_SECONDS = 10.0  # how long a rank waits for the base's control files before it saves in full
# The fields of an item's record that must equal the base's for the item to count as unchanged (its place, pos and
# relative_path, is the file's concern: see _same_file).
_COMPARED = ("kind", "format", "length", "checksums", "block_size", "payload", "codec", "planes", "logical_length",
             "frames", "dtype", "chunk_sizes")



def refuse_unsupported(storage: Any, *, compression: str | None, stock_readable: bool,
                       who: str = "AtomicStorageWriter") -> None:
    """``reuse=True``'s refusals, at construction (the writer's, and the manager's before it builds anything)."""
    if getattr(storage, "link_kind", None) is None:
        raise ConfigurationError(
            f"{who}(reuse=True) on {storage.describe()}: reuse links unchanged files in place (POSIX hard links, "
            "S3 and GCS server-side copies), which this fsspec filesystem cannot do, so it is not supported there. "
            "Use reuse=False there, or a local disk / NFS, s3:// or gs:// root.", root=storage.describe())
    if compression is not None:
        raise ConfigurationError(
            f"{who}(reuse=True, compression={compression!r}): reuse does not support compressed "
            "saves yet. Use compression=None with reuse=True, or reuse=False.")
    if stock_readable:
        raise ConfigurationError(
            f"{who}(reuse=True, stock_readable=True): reuse does not support torch.save containers "
            "yet. Use stock_readable=False with reuse=True, or reuse=False.")


def refuse_plan_caching(rank: int) -> ConfigurationError:
    return ConfigurationError(
        f"rank {rank}: AtomicStorageWriter(reuse=True) with a planner whose enable_plan_caching is on: a replayed "
        "plan cannot carry the base step reuse compares against. Save with enable_plan_caching=False, or "
        "reuse=False. Nothing was written.", rank=rank)


def choose_base(layout: RunLayout, step: int, timeout: float) -> tuple[int, str] | None:
    """Coordinator: (step, save_id) of the run's latest committed step below ``step``, or None (a full save).

    ``LATEST`` verified by its marker, as a load of the latest step resolves it; when it names ``step`` or a later
    one (a re-save, a rollback) or cannot be read, the markers (one process, this one) of the steps below."""
    try:
        try:
            committed = resolve(layout, None, Deadline(0.0))  # no waiting: the scan below answers when in doubt
            if committed.step < step:
                return committed.step, committed.save_id
        except CheckpointError:
            pass
        newest = most_recent([m for m in scan_markers(layout) if m.step < step])
    except (CheckpointError, OSError) as e:
        log.warning("reuse: no base step for step %d of run %r (%s); this save writes every byte", step,
                    layout.run_id, e)
        return None
    if newest is None:
        log.info("reuse: run %r has no committed step below %d; this save writes every byte", layout.run_id, step)
        return None
    return newest.step, newest.save_id


@dataclass
class Base:
    """One rank's view of the base step: its own shard, verified through the base's marker and manifest."""

    step: int
    save_id: str
    shard: ManifestShard
    planned_dtypes: dict[str, str | None]  # key -> the dtype the base's .metadata planned (manifest keys)
    data_prefixes: int = 0  # where the base's data files lie (its manifest's choice, layout.data_file)

    def items(self) -> dict[tuple, tuple[str, ItemExtent]]:
        return {(i.key, tuple(i.chunk_offset or ())): (f.name, i) for f in self.shard.files for i in f.items}


def load_base(layout: RunLayout, rank: int, step: int, save_id: str, timeout: float,
              committed: Any = None) -> Base | None:
    """This rank's shard of the base the coordinator named, or None (logged): then the save is a full one.
    ``committed``: the base's marker and manifest when the caller has read them already (the drain, for several
    ranks)."""
    try:
        deadline = Deadline(min(timeout, BASE_WAIT_SECONDS))
        if committed is None:
            committed = read_committed(layout, step, deadline)
        manifest = committed.manifest
        if committed.save_id != save_id:
            why = f"its marker now names save {committed.save_id}"
        elif not manifest.shards or manifest.shard_of(rank) is None:
            why = "it has no manifest shard of this rank"
        else:
            shard = read_shard(layout, committed, rank, deadline)
            dtypes = {key: record.get("dtype") for key, record in manifest.keys.items()}
            return Base(step=step, save_id=save_id, shard=shard, planned_dtypes=dtypes,
                        data_prefixes=manifest.data_prefixes)
    except (CheckpointError, OSError) as e:
        why = f"it cannot be read: {e}"
    log.warning("reuse: rank %d cannot use step %d (save %s) of run %r as the base (%s); this save writes every byte",
                rank, step, save_id, layout.run_id, why)
    return None


class _Changed(Exception):
    """A probed item's bytes differ from the base's: stop digesting it."""


class _Probe:
    """The sink ``_write_raw_tensor`` writes into when an item is only digested: nothing is stored, and the first
    block whose digest differs from the base's stops the pass (a changed item costs one block, not its size)."""

    def __init__(self, expected: list[str]) -> None:
        self.expected = expected
        self.position = 0
        self._block = 0

    def write_unhashed(self, data) -> None:
        view = memoryview(data).cast("B")
        if self._block >= len(self.expected) or block_digest(view) != self.expected[self._block]:
            raise _Changed()
        self._block += 1
        self.position += len(view)


@dataclass
class Outcome:
    """What reuse decided for one rank's save: the items left to the ordinary files, the stable files to write
    (name, items in canonical order), and the base's stable files linked with their items' results."""

    others: list[WriteItem]
    stable: list[tuple[str, list[WriteItem]]]
    linked: list[WriteResult]
    linked_files: list[FileEntry]


def plan_rank(write: "_RankWrite", items: list[WriteItem], base: Base) -> Outcome:
    """Split this rank's items by content against ``base``; link each stable file of the base whose every item is
    unchanged; put the other unchanged items into new stable files (at most ``STABLE_FILE_BYTES`` each)."""
    writer = write.writer
    base_items = base.items()
    candidates = [(item, base_items[ident][1]) for item in items
                  if item.type != WriteItemType.BYTE_IO and (ident := _identity(item)) in base_items
                  and _may_match(item, base_items[ident][1])]
    with ThreadPoolExecutor(max_workers=max(1, min(writer.thread_count, len(candidates))),
                            thread_name_prefix=f"dcp-atomic-r{write.rank}") as pool:
        probed = list(pool.map(lambda pair: _probe(write, pair[0], pair[1], base), candidates))
    unchanged = {_identity(item): (item, written) for (item, _), written in zip(candidates, probed)
                 if written is not None}
    kept = {id(item) for item, _ in unchanged.values()}
    others = [item for item in items if id(item) not in kept]
    linked: list[WriteResult] = []
    linked_files: list[FileEntry] = []
    for entry in sorted((f for f in base.shard.files if STABLE_FILE_PATTERN.fullmatch(f.name)), key=lambda f: f.name):
        extents = sorted(entry.items, key=lambda i: i.pos)
        pairs = [unchanged.get((e.key, tuple(e.chunk_offset or ()))) for e in extents]
        if not pairs or None in pairs or not _same_file(pairs, entry) or not _link_verified(write, base, entry):
            continue
        linked += [WriteResult(index=item.index, size_in_bytes=extent.length,
                               storage_data=dataclasses.replace(written, relative_path=entry.name, offset=extent.pos))
                   for (item, written), extent in zip(pairs, extents)]
        linked_files.append(entry)
        for item, _ in pairs:
            del unchanged[_identity(item)]
    stable = _new_stable_files(write.rank, sorted(unchanged.items()), {f.name for f in linked_files},
                               writer.thread_count)
    log.info("reuse: rank %d: %d of %d items unchanged since step %d; %d stable file(s) linked (%d bytes not "
             "written), %d written", write.rank, len(kept), len(items), base.step, len(linked_files),
             sum(f.size for f in linked_files), len(stable))
    return Outcome(others, stable, linked, linked_files)


def _new_stable_files(rank: int, unchanged: list, taken: set[str], threads: int) -> list[tuple[str, list[WriteItem]]]:
    """The unchanged items no linked file holds, in canonical order, cut into files of at most ``STABLE_FILE_BYTES``
    and at most a ``threads``-th of their bytes (loads read a rank's files in parallel, one thread a file, so the
    frozen bytes must not end up in one file), one item larger than that a file of its own, under names the linked
    files leave.  The saves after it link these files as they are: the cut is made once."""
    cap = min(STABLE_FILE_BYTES, -(-sum(written.length for _, (_, written) in unchanged) // max(1, threads)))
    groups: list[list[WriteItem]] = []
    size = 0
    for _, (item, written) in unchanged:
        if not groups or size + written.length > cap:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += written.length
    names = (name for j in itertools.count() if (name := stable_file_name(rank, j)) not in taken)
    return [(next(names), group) for group in groups]


def _identity(item: WriteItem) -> tuple:
    return (item.index.fqn, tuple(item.index.offset or ()))


def _may_match(item: WriteItem, extent: ItemExtent) -> bool:
    """Identity beyond (key, offset), before a byte is digested: chunk sizes, and a tensor stored as raw blocks."""
    sizes = item.tensor_data.chunk.sizes if item.tensor_data is not None else None
    return (extent.kind == "tensor" and extent.format == "raw" and sizes is not None
            and extent.chunk_sizes == list(sizes))


def _probe(write: "_RankWrite", item: WriteItem, extent: ItemExtent, base: Base):
    """The item's record as a write would make it, or None where its bytes or record differ from the base's."""
    try:
        written = write._write_item(_Probe(extent.checksums), "", item, Encoder("none")).storage_data
    except _Changed:
        return None
    stored = written.dtype or str(item.tensor_data.properties.dtype)
    if stored != (extent.dtype or base.planned_dtypes.get(item.index.fqn)):
        return None
    if any(getattr(written, f) != getattr(extent, f) for f in _COMPARED):
        return None
    return written


def _same_file(unchanged: list, entry: FileEntry) -> bool:
    """The stable file this save would write for these items (``(item, record)`` in canonical order) is byte for
    byte the base's ``entry``: the same items in the same order at the same offsets with the same records, tiling
    the file."""
    base = sorted(entry.items, key=lambda i: i.pos)
    if len(base) != len(unchanged):
        return False
    pos = 0
    for (item, written), extent in zip(unchanged, base):
        if ((extent.key, tuple(extent.chunk_offset or ())) != _identity(item) or extent.pos != pos
                or any(getattr(written, f) != getattr(extent, f) for f in _COMPARED)):
            return False
        pos += extent.length
    return pos == entry.size


def _link_verified(write: "_RankWrite", base: Base, entry: FileEntry) -> bool:
    """Link the base's stable file into this attempt (:func:`link_verified`); False where that fails: the caller
    writes the file."""
    writer = write.writer
    layout = writer.layout
    source = layout.data_file(base.step, base.save_id, entry.name, base.data_prefixes)
    target = layout.data_file(writer.step, writer.save_id, entry.name, writer.data_prefixes)
    failpoints.hit("reuse.before_link", write.rank, base.step)
    if not link_verified(writer.storage, source, target, entry, rank=write.rank, base_step=base.step,
                         where=f"step {base.step} save {base.save_id} {entry.name}", threads=writer.thread_count):
        return False
    failpoints.hit("reuse.after_link", write.rank, writer.step)
    return True


def link_verified(storage: Any, source: str, target: str, entry: FileEntry, *, rank: int, base_step: int, where: str,
                  threads: int) -> bool:
    """The one way a stored file is reused (a save's stable file, a drain's upload): ``storage.link`` it from the
    base step (``link_kind``), then check it against ``entry``'s block digests; False (logged, nothing left behind)
    where either fails, and the caller writes or uploads the file instead."""
    try:
        storage.link(source, target)
    except (OSError, StorageError) as e:  # the base removed meanwhile, no hard links, a copy the store refuses
        log.warning("reuse: rank %d could not link %s from step %d by %s (%s, errno %s); writing it instead",
                    rank, entry.name, base_step, storage.link_kind, getattr(e, "strerror", None) or e,
                    getattr(e, "errno", None))
        return False
    try:
        _verify(storage, target, entry, where, threads)
    except CorruptCheckpointError as e:
        log.warning("reuse: rank %d: the base's %s (step %d) does not match its digests, so it is not reused: "
                    "writing it instead. The base step, and every step sharing its file, is damaged: %s", rank,
                    entry.name, base_step, e)
        return _unlink(rank, storage, target)
    except (OSError, StorageError) as e:
        log.warning("reuse: rank %d could not verify the %s of %s from step %d (%s); writing it instead", rank,
                    storage.link_kind, entry.name, base_step, e)
        return _unlink(rank, storage, target)
    return True


def _unlink(rank: int, storage: Any, target: str) -> bool:
    """Remove a link that failed its check (False: the caller writes the file); a link left behind is a typed error,
    never a commit of unverified bytes."""
    try:
        storage.remove(target)
    except (OSError, StorageError) as gone:
        raise StorageError(f"rank {rank} could not remove {target}, linked from a base file that failed its "
                           f"check: {getattr(gone, 'strerror', None) or gone}. Nothing was committed; remove the "
                           "attempt (dcp-atomic gc) and retry the save", rank=rank, path=target,
                           errno=getattr(gone, "errno", None)) from gone
    return False


def base_stable_files(layout: RunLayout, step: int, ranks: list[int]) -> dict[str, tuple[int, str, FileEntry]]:
    """For a copy of ``step`` into ``layout`` from elsewhere (the drain): the stable files that the run's latest
    committed step below it holds for ``ranks``, by name -> (base step, path, record).  Chosen and read as a save's
    base (:func:`choose_base`, each rank's own shard); none where there is no base or it cannot be read (logged)."""
    chosen = choose_base(layout, step, 0.0)
    found: dict[str, tuple[int, str, FileEntry]] = {}
    if chosen is None:
        return found
    try:  # the marker and manifest once, for every rank's shard
        committed = read_committed(layout, chosen[0], Deadline(BASE_WAIT_SECONDS))
    except (CheckpointError, OSError) as e:
        log.warning("reuse: step %d of run %r cannot be read as the base (%s); every byte is copied", chosen[0],
                    layout.run_id, e)
        return found
    for rank in ranks:
        base = load_base(layout, rank, *chosen, BASE_WAIT_SECONDS, committed=committed)
        for entry in base.shard.files if base is not None else ():
            if STABLE_FILE_PATTERN.fullmatch(entry.name):
                found[entry.name] = (base.step, layout.data_file(base.step, base.save_id, entry.name,
                                                                 base.data_prefixes), entry)
    return found


def same_stored_file(entry: FileEntry, other: FileEntry) -> bool:
    """Two records of one file say the same bytes: name, rank, size and every item's place and record (block digests
    included)."""
    return ((entry.name, entry.rank, entry.size) == (other.name, other.rank, other.size)
            and sorted(entry.items, key=lambda i: i.pos) == sorted(other.items, key=lambda i: i.pos))


def _verify(storage: Any, path: str, entry: FileEntry, where: str, threads: int) -> None:
    """The linked file against the base's digests, at every link, while the save still holds the good bytes to write
    instead.  A hard link may be the only physical copy of these bytes (``keep_last=1``), and rot that spares its
    inode and mtime is found only by reading it (from the page cache: cheaper than the write and fsync it replaces);
    a server-side copy is new bytes that nothing else has checked (ranged GETs: a download, never an upload).  On the
    writer's threads."""
    with storage.open_reader(path) as reader:
        verify_stored_file(entry, reader, where, path=path, threads=threads)
