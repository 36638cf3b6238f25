"""Reading a committed step as the base of another, and reusing its stored files by link (P15).

Reuse has two users: a save (``dcp.reuse``: which of a rank's items are unchanged since the base step) and the drain
(``tiers.drain``: which local stable files the durable root's previous step already holds).  Both need the same
three things, which live here, below both:

* **the base**: the run's latest committed step below the one being stored (:func:`choose_base`), and one rank's
  own manifest shard of it, read through its marker and manifest as loads read them (:func:`load_base`); none, or
  one that cannot be read, means every byte is stored again (logged), never a failed save or drain;
* **the link**: a stored file reused from the base only through ``Storage.link`` (``link_kind``: a hard link on
  POSIX, a server-side copy on S3 and GCS), then checked against the base's block digests before it counts
  (:func:`link_verified`); a link that fails or a file that does not match is removed and the caller stores the
  bytes itself;
* **which record holds which bytes**: a step that links a base file records the file's whole size and only the items
  it references there (:func:`referencing`); the bytes between them are *dead* in that step: no load, ``verify`` or
  statistic of it reads or counts them (:func:`referenced_bytes`), and a file counts as holding another record's
  bytes when it records every item that record references, at the same place (:func:`holds_referenced`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from .._base.retry import Deadline
from ..errors import CheckpointError, CorruptCheckpointError, StorageError
from ..format.blocks import verify_stored_file
from ..format.layout import RunLayout
from ..format.manifest import FileEntry, ItemExtent, ManifestShard
from .catalog import most_recent, resolve, scan_markers
from .commit import read_committed, read_shard

log = logging.getLogger("dcp_atomic.writer")  # the writer's: what users filter on (the drain's links log here too)

BASE_WAIT_SECONDS = 10.0  # how long a rank waits for the base's control files before it saves in full


def choose_base(layout: RunLayout, step: int, timeout: float) -> tuple[int, str] | None:
    """Coordinator: (step, save_id) of the run's latest committed step below ``step``, or None (a full save).

    ``LATEST`` verified by its marker, as a load of the latest step resolves it; when it names ``step`` or a later
    one (a re-save, a rollback) or cannot be read, the markers (one process, this one) of the steps below.  Either
    way the base's manifest is read here, once: a manifest that is gone (a damaged base) then costs one read and a
    full save, not every rank's wait of ``BASE_WAIT_SECONDS`` for it."""
    try:
        try:
            committed = resolve(layout, None, Deadline(0.0))  # no waiting: the scan below answers when in doubt
            if committed.step < step:
                return committed.step, committed.save_id
        except CheckpointError:
            pass
        newest = most_recent([m for m in scan_markers(layout) if m.step < step])
        if newest is not None:
            read_committed(layout, newest.step, Deadline(0.0))
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


@dataclass(frozen=True)
class Linked:
    """A link that passed its check (:func:`link_verified`): ``checksum`` is the store's checksum of the new object
    where the store reported one, which its caller records so that the next link of it is checked without a
    download (None on POSIX, where a hard link is the same inode)."""

    checksum: str | None


def link_verified(storage: Any, source: str, target: str, entry: FileEntry, *, rank: int, base_step: int, where: str,
                  threads: int) -> Linked | None:
    """The one way a stored file is reused (a save's stable file, a drain's upload): ``storage.link`` it from the
    base step (``link_kind``), then check it: by the store's checksum of the copy against the one ``entry`` recorded
    when the base was written, where the store reports both (S3, :mod:`..stores.object_checksum`: nothing is
    downloaded), else against ``entry``'s block digests; None (logged, nothing left behind) where either fails, and
    the caller writes or uploads the file instead.  ``entry`` is the new step's record of the file: its size, and
    only the items that step references (a save links a base file whose other items changed: their bytes are dead,
    checked by nothing and read by no one)."""
    name = source.rsplit("/", 1)[-1]  # the base's name of the file (a plain file is linked under a stable name)
    try:
        reported = storage.link(source, target)
    except (OSError, StorageError) as e:  # the base removed meanwhile, no hard links, a copy the store refuses
        log.warning("reuse: rank %d could not link %s from step %d by %s (%s); writing it instead",
                    rank, name, base_step, storage.link_kind, _refusal(e))
        return None
    if reported is not None and entry.checksum is not None:  # the store's checksum of the copy: no download
        if reported == entry.checksum:
            return Linked(reported)
        log.warning("reuse: rank %d: the %s of %s from step %d has the store's checksum %s, but the base recorded %s "
                    "when it was written: the base object was changed or damaged in the store, so it is not reused: "
                    "writing it instead. The base step, and every step copied from it, may be damaged: run "
                    "`dcp-atomic verify` on them", rank, storage.link_kind, name, base_step, reported,
                    entry.checksum)
        return _unlink(rank, storage, target)
    try:
        _verify(storage, target, entry, where, threads)
    except CorruptCheckpointError as e:
        log.warning("reuse: rank %d: the base's %s (step %d) does not match its digests, so it is not reused: "
                    "writing it instead. The base step, and every step sharing its file, is damaged: %s", rank,
                    name, base_step, e)
        return _unlink(rank, storage, target)
    except (OSError, StorageError) as e:
        log.warning("reuse: rank %d could not verify the %s of %s from step %d (%s); writing it instead", rank,
                    storage.link_kind, name, base_step, e)
        return _unlink(rank, storage, target)
    return Linked(reported)  # the copy's bytes checked: the store's checksum of it is of good bytes


def _refusal(error: OSError | StorageError) -> str:
    """Why a link was not made, for the warning of its fallback: an ``OSError``'s reason and errno, a store's reply.
    Not a store error's whole message: that is written for a request whose failure ends the save (what is not
    committed, which option to change), and this save writes the file and commits."""
    if isinstance(error, StorageError):
        reply = error.details.get("reply")
        return f"{reply}: {error.details.get('reply_message')}" if reply else error.message
    return f"{error.strerror or error}, errno {error.errno}"


def _unlink(rank: int, storage: Any, target: str) -> None:
    """Remove a link that failed its check (None: the caller writes the file); a link left behind is a typed error,
    never a commit of unverified bytes."""
    try:
        storage.remove(target)
    except (OSError, StorageError) as gone:
        raise StorageError(f"rank {rank} could not remove {target}, linked from a base file that failed its "
                           f"check: {getattr(gone, 'strerror', None) or gone}. Nothing was committed; remove the "
                           "attempt (dcp-atomic gc) and retry the save", rank=rank, path=target,
                           errno=getattr(gone, "errno", None)) from gone
    return None


def base_files(layout: RunLayout, step: int, ranks: list[int]) -> list[tuple[int, str, FileEntry]]:
    """For a copy of ``step`` into ``layout`` from elsewhere (the drain): the data files (plain and stable) that the
    run's latest committed step below it holds for ``ranks``, as (base step, path, record).  Chosen and read as a
    save's base (:func:`choose_base`, each rank's own shard); none where there is no base or it cannot be read
    (logged)."""
    chosen = choose_base(layout, step, 0.0)
    found: list[tuple[int, str, FileEntry]] = []
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
        found += [(base.step, layout.data_file(base.step, base.save_id, entry.name, base.data_prefixes), entry)
                  for entry in (base.shard.files if base is not None else ())]
    return found


def referencing(source: FileEntry, name: str, rank: int, items: list[ItemExtent]) -> FileEntry:
    """The new step's record of the base file ``source`` linked into it as ``name``: the file's whole size (a link
    is the whole file, its store checksum the base's) and, of its items, only ``items``, those the new step
    references (each at its place and with its record in ``source``).  The other bytes of the file are dead in the
    new step: referenced by none of its items, so no load or ``verify`` of it reads them."""
    return FileEntry(name=name, rank=rank, size=source.size, items=list(items), checksum=source.checksum)


def referenced_bytes(entry: FileEntry) -> int:
    """The bytes of a data file that its step references (its items' stored lengths): the file's size less its dead
    bytes (:func:`referencing`).  What a step's statistics count as its bytes."""
    return sum(item.length for item in entry.items)


def holds_referenced(other: FileEntry, entry: FileEntry) -> bool:
    """``other``'s record of a stored file says the bytes that ``entry`` references: the same rank and size, and
    every item of ``entry`` at the same place with the same record (block digests included).  ``other`` may record
    more items: a save that links a base file references only its unchanged ones, the rest is dead
    (:mod:`dcp_atomic.dcp.reuse`), so one file has records of several sizes and the names differ (a plain file is
    linked under a stable name).  The inverse of :func:`referencing`: ``holds_referenced(source, referencing(source, ...))``."""
    if (entry.rank, entry.size) != (other.rank, other.size) or not entry.items:
        return False
    held = {(item.pos, item.key, tuple(item.chunk_offset or ())): item for item in other.items}
    return all(held.get((item.pos, item.key, tuple(item.chunk_offset or ()))) == item for item in entry.items)


def _verify(storage: Any, path: str, entry: FileEntry, where: str, threads: int) -> None:
    """The linked file against the base's digests, at every link, while the save still holds the good bytes to write
    instead.  A hard link may be the only physical copy of these bytes (``keep_last=1``), and rot that spares its
    inode and mtime is found only by reading it (from the page cache: cheaper than the write and fsync it replaces);
    a server-side copy is new bytes that nothing else has checked (ranged GETs: a download, never an upload).  On the
    writer's threads."""
    with storage.open_reader(path) as reader:
        verify_stored_file(entry, reader, where, path=path, threads=threads)
