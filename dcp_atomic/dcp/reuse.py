"""Reuse (P15): a rank's unchanged items are linked (POSIX) or copied server-side (S3, GCS) from the base step, never
written or uploaded again.

* The **base** is the run's latest committed step below the one being saved, chosen by the coordinator
  (:func:`..protocol.links.choose_base`, in ``prepare_global_plan``) and told to every rank in its assigned plan, as
  the save_id is.
* Each rank reads only **its own manifest shard** of the base (:func:`..protocol.links.load_base`: marker -> manifest
  -> shard, the chain loads verify).  No base, or one that cannot be read: a full save and one log line, never a
  failed save.
* **Change is decided by content**: an item whose identity (key, chunk offset, chunk sizes, stored dtype) matches a
  base item is digested first, through the writer's own encoding (the ``encode`` :func:`plan_rank` is given:
  ``RankWrite.encode_item``) into a sink that stores nothing (:class:`_Probe`), so its digests are those of exactly
  the bytes a write would store; it is unchanged only if every field of its record (format, codec, lengths, block
  digests) equals the base's.  Declarations (``requires_grad``, "frozen") never decide.
* **Physically per file**: each file of the base (stable or plain) whose unchanged items hold at least
  ``LINK_SHARE`` of its bytes is ``Storage.link()``ed into the new attempt (``link_kind``: a hard link on POSIX, a
  server-side copy on S3 and GCS): a stable file under its name, a plain one under a stable name
  (``layout.stable_file_name``), so the first reused save after a plain one links the plain files.  The new step
  records the whole file and only the items it references there, each where it lies
  (:func:`..protocol.links.referencing`); the other bytes of the file (items that changed since) are *dead* in the
  new step.  The link is verified against the referenced items' block digests
  (:func:`..protocol.links.link_verified`, at every link: on POSIX it may be the only copy, on an object store the
  copy is new bytes), and no data byte of it is written.  The other unchanged items (those of files below the
  share) are written into new stable files, in canonical order (key, chunk offset), at most ``STABLE_FILE_BYTES``
  each, so that the next save can link them.  A link that fails (another filesystem, no hard links, the base
  removed meanwhile, a copy the store refuses) or a damaged base file means its items are written, logged.

So one changed element costs its item; a linked file is at most half dead, and a file that falls below the share is
compacted (its live items rewritten) by the save that finds it so.  Every step stays whole: a hard link is a second
name for one inode and a server-side copy is an object of its own, so retiring or deleting any step, the base
included, leaves the others' bytes in place.  Dead bytes are read by no one: a load reads items by their records,
and ``verify`` checks exactly the items its step references (damage in bytes a step does not reference does not
fail it; ``verify`` of a step that does reference them names every step that shares the damaged bytes); retention
and ``gc`` remove steps by name, never by content; the drain links a durable file that holds every item a local one
references (:func:`..protocol.links.holds_referenced`) or uploads the file whole.

Refused (typed, before anything is written): roots that can neither hard-link nor copy in place (generic fsspec
filesystems), ``stock_readable`` and DCP plan caching.  With ``compression`` an item is probed through the save's
own encoder: a block's stored zstd frame is a function of the block and the codec's parameters, so an unchanged
block stores the same frame and its digest decides as for raw bytes (the probe costs the compression of the
candidates, not their write; a zstandard that frames differently makes them "changed": written, never wrong).  The manager's local tier links on each node's
local root, and its drain through the same :func:`..protocol.links.link_verified`.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from .._base import failpoints
from ..errors import ConfigurationError
from ..format.codec import Encoder
from ..format.integrity import BlockSink, block_digest
from ..format.layout import STABLE_FILE_PATTERN, RunLayout, stable_file_name
from ..format.manifest import FileEntry, ItemExtent
from ..protocol.links import Base, link_verified, referenced_bytes, referencing

log = logging.getLogger("dcp_atomic.writer")  # the writer's: what users filter on

STATS = ("bytes_written", "bytes_reused")  # the writer's per-rank statistics of reuse, recorded in the manifest
# A stable file's size cap: one changed item costs its own write plus the rewrite of at most this much of its
# neighbours.  64 MiB by measurement (benchmarks/reuse.py, docs/benchmarks.md: one changed element of a 1 GB base in
# 32 MiB tensors wrote 486 MiB at 1 GiB, 69 MiB at 64 MiB, 39 MiB at 16 MiB); below it the files multiply (links,
# server-side copies per save) for little, and loads read a rank's files in parallel either way.
STABLE_FILE_BYTES = 64 << 20
# A base file (stable or plain) is linked when its unchanged items hold at least this share of its bytes; the rest
# of it is dead in the new step (referenced by no item of it).  So a linked file is at most half dead, a step's files
# hold at most twice the bytes it references, and a file below the share costs the rewrite of less than half of it
# (compaction into new stable files).  Half is that bound, not a tuned value; measured with it (benchmarks/reuse.py,
# docs/benchmarks.md, 1 GB base at world 2): the first reused save after a plain one wrote 1.0% of a step, and three
# kept steps with one changed element held 1.05x one step.
LINK_SHARE = 0.5
# The fields of an item's record that must equal the base's for the item to count as unchanged (its place, pos and
# relative_path, is the file's concern: see _files_to_link).
_COMPARED = ("kind", "format", "length", "checksums", "block_size", "payload", "codec", "planes", "logical_length",
             "frames", "dtype", "chunk_sizes")
# How a save stores one item (``RankWrite.encode_item``): its blocks into the sink, its record (``WrittenItem``) back.
Encode = Callable[[BlockSink, WriteItem, Encoder], Any]


@dataclass(frozen=True)
class ReuseContext:
    """One rank's attempt, as reuse needs it: where linked files go, and how many threads probe and verify."""

    rank: int
    layout: RunLayout
    storage: Any
    step: int
    save_id: str
    data_prefixes: int
    threads: int


def refuse_unsupported(storage: Any, *, stock_readable: bool, who: str = "AtomicStorageWriter") -> None:
    """``reuse=True``'s refusals, at construction (the writer's, and the manager's before it builds anything)."""
    if getattr(storage, "link_kind", None) is None:
        raise ConfigurationError(
            f"{who}(reuse=True) on {storage.describe()}: reuse links unchanged files in place (POSIX hard links, "
            "S3 and GCS server-side copies), which this fsspec filesystem cannot do, so it is not supported there. "
            "Use reuse=False there, or a local disk / NFS, s3:// or gs:// root.", root=storage.describe())
    if stock_readable:
        raise ConfigurationError(
            f"{who}(reuse=True, stock_readable=True): reuse does not support torch.save containers "
            "yet. Use stock_readable=False with reuse=True, or reuse=False.")


def refuse_plan_caching(rank: int) -> ConfigurationError:
    return ConfigurationError(
        f"rank {rank}: AtomicStorageWriter(reuse=True) with a planner whose enable_plan_caching is on: a replayed "
        "plan cannot carry the base step reuse compares against. Save with enable_plan_caching=False, or "
        "reuse=False. Nothing was written.", rank=rank)


class _Changed(Exception):
    """A probed item's bytes differ from the base's: stop digesting it."""


class _Probe:
    """The :class:`BlockSink` a raw tensor's blocks go to when an item is only digested: nothing is stored, and the
    first block whose digest differs from the base's stops the pass (a changed item costs one block, not its size)."""

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
    (name, items in canonical order), and the base files linked (the new step's records of them, only the items
    it references) with their items' results."""

    others: list[WriteItem]
    stable: list[tuple[str, list[WriteItem]]]
    linked: list[WriteResult]
    linked_files: list[FileEntry]


def plan_rank(encode: Encode, new_encoder: Callable[[], Encoder], items: list[WriteItem], base: Base,
              ctx: ReuseContext) -> Outcome:
    """Split this rank's items by content against ``base`` (each candidate's bytes as ``encode`` stores them with
    the save's codec, ``new_encoder()``: a zstd frame of an unchanged block is the same frame, so compressed saves
    compare as exactly as raw ones); link each file of the base (stable or plain) whose unchanged items are at least
    ``LINK_SHARE`` of its bytes, its items referenced where they lie; put the other unchanged items into new stable
    files (at most ``STABLE_FILE_BYTES`` each).  A base that names one item twice (a damaged or re-sealed manifest
    shard) cannot be planned against: this rank writes everything, said in a warning, never a ``KeyError``."""
    named = [(extent.key, tuple(extent.chunk_offset or ())) for entry in base.shard.files for extent in entry.items]
    twice = sorted({ident for ident in named if named.count(ident) > 1}) if len(set(named)) != len(named) else []
    if twice:
        log.warning("reuse: rank %d: base step %d names item(s) %s more than once (a damaged or re-sealed manifest "
                    "shard): this save writes every item in full; `dcp-atomic verify` the base step", ctx.rank,
                    base.step, [key for key, _ in twice[:4]])
        return Outcome(list(items), [], [], [])
    base_items = base.items()
    candidates = [(item, base_items[ident][1]) for item in items
                  if item.type != WriteItemType.BYTE_IO and (ident := _identity(item)) in base_items
                  and _may_match(item, base_items[ident][1])]
    with ThreadPoolExecutor(max_workers=max(1, min(ctx.threads, len(candidates))),
                            thread_name_prefix=f"dcp-atomic-r{ctx.rank}") as pool:
        probed = list(pool.map(lambda pair: _probe(encode, new_encoder(), pair[0], pair[1], base), candidates))
    unchanged = {_identity(item): (item, written) for (item, _), written in zip(candidates, probed)
                 if written is not None}
    kept = {id(item) for item, _ in unchanged.values()}
    others = [item for item in items if id(item) not in kept]
    linked: list[WriteResult] = []
    linked_files: list[FileEntry] = []
    for source, target, held in _files_to_link(base, unchanged, ctx.rank):
        referenced = _link_verified(ctx, base, source, referencing(source, target, ctx.rank,
                                                                   [extent for extent, _ in held]))
        if referenced is None:
            continue
        linked += [WriteResult(index=item.index, size_in_bytes=extent.length,
                               storage_data=dataclasses.replace(written, relative_path=target, offset=extent.pos))
                   for extent, (item, written) in held]
        linked_files.append(referenced)
        for _, (item, _) in held:
            del unchanged[_identity(item)]
    stable = _new_stable_files(ctx.rank, sorted(unchanged.items()), {f.name for f in linked_files}, ctx.threads)
    log.info("reuse: rank %d: %d of %d items unchanged since step %d; %d base file(s) linked (%d bytes not "
             "written, %d of them referenced), %d stable file(s) written", ctx.rank, len(kept), len(items),
             base.step, len(linked_files), sum(f.size for f in linked_files),
             sum(referenced_bytes(f) for f in linked_files), len(stable))
    return Outcome(others, stable, linked, linked_files)


def _files_to_link(base: Base, unchanged: dict, rank: int) -> list[tuple[FileEntry, str, list]]:
    """The base's files worth linking: (the base's record, the name it gets in this attempt, [(extent, (item,
    record))] of its unchanged items).  A file qualifies when its unchanged items are at least ``LINK_SHARE`` of its
    bytes; a stable file keeps its name (the drain matches it), a plain one takes a stable name no kept stable file
    holds (this save's own plain files keep theirs)."""
    chosen = []
    for entry in sorted(base.shard.files, key=lambda f: f.name):
        held = [(extent, unchanged[ident]) for extent in sorted(entry.items, key=lambda i: i.pos)
                if (ident := (extent.key, tuple(extent.chunk_offset or ()))) in unchanged]
        if held and sum(extent.length for extent, _ in held) >= LINK_SHARE * entry.size:
            chosen.append((entry, held))
    taken = {entry.name for entry, _ in chosen if STABLE_FILE_PATTERN.fullmatch(entry.name)}
    names = (name for j in itertools.count() if (name := stable_file_name(rank, j)) not in taken)
    return [(entry, entry.name if entry.name in taken else next(names), held) for entry, held in chosen]


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


def _probe(encode: Encode, encoder: Encoder, item: WriteItem, extent: ItemExtent, base: Base):
    """The item's record as a write would make it, or None where its bytes or record differ from the base's."""
    try:
        written = encode(_Probe(extent.checksums), item, encoder)
    except _Changed:
        return None
    stored = written.dtype or str(item.tensor_data.properties.dtype)
    if stored != (extent.dtype or base.planned_dtypes.get(item.index.fqn)):
        return None
    if any(getattr(written, f) != getattr(extent, f) for f in _COMPARED):
        return None
    return written


def _link_verified(ctx: ReuseContext, base: Base, source: FileEntry, referenced: FileEntry) -> FileEntry | None:
    """Link the base's file ``source`` into this attempt as ``referenced.name``
    (:func:`..protocol.links.link_verified`: the items this step references are checked, the dead bytes between
    them need not match anything): ``referenced`` as this step records it (with the store's checksum of the copy
    where the base recorded none: the next reuse of it is then checked without a download), or None where the link
    fails: the caller writes those items."""
    source_path = ctx.layout.data_file(base.step, base.save_id, source.name, base.data_prefixes)
    target = ctx.layout.data_file(ctx.step, ctx.save_id, referenced.name, ctx.data_prefixes)
    failpoints.hit("reuse.before_link", ctx.rank, base.step)
    linked = link_verified(ctx.storage, source_path, target, referenced, rank=ctx.rank, base_step=base.step,
                           where=f"step {base.step} save {base.save_id} {source.name}", threads=ctx.threads)
    if linked is None:
        return None
    failpoints.hit("reuse.after_link", ctx.rank, ctx.step)
    return dataclasses.replace(referenced, checksum=referenced.checksum or linked.checksum)
