"""One rank's memory slots on a RAM-backed directory: the bytes, the commit record, and the one check of both.

A slot is one preallocated data file rewritten in place each time it is reused (no new directory, no fsync, no
rename: tmpfs has nothing to flush, and a step every few seconds cannot afford a directory per step), and beside it
a self-checksummed commit record (:mod:`dcp_atomic.format.slot_record`: one strict parser) naming the run, its lineage, the rank whose share it holds, the
world size, the step, the commit sequence and every item (key, dtype, shape, offset, length, the xxh3 digest of
every 4 MiB block).  The record is what makes the bytes a checkpoint (P3 for slots):

1. retire: the record of the slot about to be reused is deleted before a byte of its data changes;
2. write: the items go into the data file through :class:`SlotSink`, their block digests computed on the way;
3. commit: the record is written last, once the data is complete and global rank 0 gave it its sequence.

A crash after 1 leaves a slot without a record (never loaded); after 2, a slot whose record is missing (never
loaded); a record is only ever beside the bytes it describes.  Bytes that changed since (a flipped bit, a truncated
file) fail :func:`verify_slot`, which checks them with the one check of stored bytes (:mod:`dcp_atomic.format.blocks`).

Layout: ``<path>/<run_id>/r<rank>/slot<k>.data`` and ``slot<k>.commit``; a replica holder keeps its copy of rank
r's slot k under the same name on its own node's path (a node never holds both: replicas go to other failure
domains), so "rank r's share of sequence n" is found the same way wherever it lies.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
from typing import Any, Callable

from .._base import failpoints
from ..errors import CorruptCheckpointError
from ..format.blocks import check_digests, verify_item
from ..format.integrity import BLOCK_SIZE, BlockHasher
from ..format.slot_record import SlotRecord  # the record is format: parsed strictly there

SPOOL_DIR = ".spool"  # what a transfer spools (a resharded restore's old shares); replicas land in place
_SLOT_FILE = re.compile(r"^slot(\d+)\.commit$")
_RANK_DIR = re.compile(r"^r(\d+)$")


def slot_of(where: str) -> tuple[int, int]:
    """(rank, slot) a record's path names (``.../r<rank>/slot<k>.commit``): where an unreadable record belongs."""
    return int(_RANK_DIR.match(os.path.basename(os.path.dirname(where)))[1]), int(_SLOT_FILE.match(
        os.path.basename(where))[1])


def newest_complete(copies: list[tuple[int, int, int, Any]], world_size: int,
                    on_mixed: Callable[[int, list[int]], None] | None = None
                    ) -> tuple[int, int, dict[int, list[Any]]] | None:
    """Which step a restore can assemble from ``copies`` (owner rank, sequence, step, where it lies), each a sound
    one: the newest sequence for which every rank ``0..world_size-1`` has a copy and every copy names the same step,
    as (sequence, step, per rank the places of its copies).  A sequence whose copies name different steps is never
    taken, and ``on_mixed`` hears of every one (older ones too): a record re-sealed with another step cannot mix two
    steps into one restore, nor pass unnoticed."""
    by_sequence: dict[int, dict[int, list[tuple[Any, int]]]] = {}
    for owner, sequence, step, where in copies:
        by_sequence.setdefault(sequence, {}).setdefault(owner, []).append((where, step))
    newest = None
    for sequence in sorted(by_sequence, reverse=True):
        shares = by_sequence[sequence]
        steps = {step for found in shares.values() for _, step in found}
        if len(steps) > 1:
            if on_mixed is not None:
                on_mixed(sequence, sorted(steps))
        elif newest is None and set(shares) == set(range(world_size)):
            newest = sequence, steps.pop(), {rank: [where for where, _ in found] for rank, found in shares.items()}
    return newest


class SlotMaps:
    """The slot files' shared mappings in this process, kept across snapshots: a slot rewritten in place is mapped
    once, so its pages fault in once per job, not at every snapshot (mapped anew, 253 MiB is 65,000 page faults on
    each side of a replica, measured at about a third of its transfer).  A file replaced or resized is mapped
    anew; a view is sent from (never written) or received into."""

    def __init__(self) -> None:
        self._maps: dict[str, tuple[tuple[int, int], mmap.mmap]] = {}

    def view(self, path: str, length: int) -> memoryview:
        """``length`` bytes of ``path``, mapped shared and writable; a file shorter than that is damage, named."""
        fd = os.open(path, os.O_RDWR)
        try:
            stat = os.fstat(fd)
            if stat.st_size < length:
                raise CorruptCheckpointError(f"{path}: {stat.st_size} bytes, its commit record names {length} "
                                             "(truncated)", path=path, torn=True)
            if not length:
                return memoryview(bytearray())
            key = (stat.st_ino, stat.st_size)
            cached = self._maps.get(path)
            if cached is None or cached[0] != key:
                self.forget(path)
                cached = self._maps[path] = key, mmap.mmap(fd, stat.st_size)
        finally:
            os.close(fd)
        return memoryview(cached[1])[:length]

    def forget(self, path: str) -> None:
        cached = self._maps.pop(path, None)
        if cached is not None:
            with contextlib.suppress(BufferError):  # a view still held: the collector unmaps it
                cached[1].close()

    def close(self) -> None:
        for path in list(self._maps):
            self.forget(path)


class SlotDir:
    """The files of one run on one node's memory path: ``<path>/<run_id>``, and their mappings (:class:`SlotMaps`)."""

    def __init__(self, path: str | os.PathLike, run_id: str) -> None:
        self.path = os.fspath(path)
        self.run_dir = os.path.join(self.path, run_id)
        self.maps = SlotMaps()

    def data(self, rank: int, slot: int) -> str:
        return os.path.join(self.run_dir, f"r{rank}", f"slot{slot}.data")

    def record(self, rank: int, slot: int) -> str:
        return os.path.join(self.run_dir, f"r{rank}", f"slot{slot}.commit")

    @property
    def spool(self) -> str:
        return os.path.join(self.run_dir, SPOOL_DIR)

    def retire(self, rank: int, slot: int) -> None:
        """Step 1: the record goes before a byte of the data changes."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.record(rank, slot))

    def remove(self, rank: int, slot: int) -> None:
        """A slot no one will reuse: its record first (:meth:`retire`), then its bytes."""
        self.retire(rank, slot)
        self.maps.forget(self.data(rank, slot))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.data(rank, slot))

    def write_record(self, record: SlotRecord) -> None:
        """Step 3, last: the data is complete.  Replaced whole by a rename, so a crash leaves the old record or the
        new one, never half of one (no fsync: the directory lives in RAM and dies with the node)."""
        path = self.record(record.rank, record.slot)
        partial = f"{path}.partial"
        with open(partial, "wb") as f:
            f.write(record.to_bytes())
        os.replace(partial, path)

    def records(self, rank: int | None = None) -> list[tuple[str, SlotRecord | CorruptCheckpointError]]:
        """Every record on this path (``rank``'s, else any rank's, own or replica), parsed, or the reason it cannot
        be trusted."""
        found: list[tuple[str, SlotRecord | CorruptCheckpointError]] = []
        with contextlib.suppress(FileNotFoundError):
            for rank_dir in sorted(os.listdir(self.run_dir)):
                if not _RANK_DIR.match(rank_dir) or rank_dir != f"r{rank}" and rank is not None:
                    continue
                for name in sorted(os.listdir(os.path.join(self.run_dir, rank_dir))):
                    if not _SLOT_FILE.match(name):
                        continue
                    where = os.path.join(self.run_dir, rank_dir, name)
                    try:
                        with open(where, "rb") as f:
                            found.append((where, SlotRecord.from_bytes(f.read(), where)))
                    except CorruptCheckpointError as e:
                        found.append((where, e))
                    except FileNotFoundError:
                        continue  # retired while listed
        return found

    def held_bytes(self) -> int:
        """Bytes this run's slots take on this path (reused by the next snapshots: free to the budget)."""
        total = 0
        for top, _, names in os.walk(self.run_dir):
            for name in names:
                with contextlib.suppress(FileNotFoundError):
                    total += os.stat(os.path.join(top, name)).st_blocks * 512
        return total


class SlotSink:
    """Where a rank's items go: the slot's data file, rewritten in place, each item's block digests computed as its
    bytes pass.  ``write(index, offset, data)`` puts bytes of item ``index`` at ``offset`` within that item (in order:
    a stager feeds it window by window); ``finish(index)`` closes the item and returns its digests."""

    def __init__(self, path: str, sizes: list[int]) -> None:
        self.path = path
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.sizes = sizes
        self.length = sum(sizes)
        self._hashers = [BlockHasher(BLOCK_SIZE) for _ in sizes]
        self._filled = [0] * len(sizes)
        self._fd = _open_sized(path, self.length)

    def write(self, index: int, offset: int, data: memoryview) -> None:
        if offset != self._filled[index]:
            raise ValueError(f"slot {self.path}: item {index} written at {offset}, expected {self._filled[index]} "
                             "(a sink takes each item's bytes in order)")
        if offset + len(data) > self.sizes[index]:
            raise ValueError(f"slot {self.path}: item {index} overflows its {self.sizes[index]} bytes")
        view, at = memoryview(data).cast("B"), self.offsets[index] + offset
        while view:
            written = os.pwrite(self._fd, view, at)
            view, at = view[written:], at + written
        self._hashers[index].update(data)
        self._filled[index] += len(data)

    def finish(self, index: int) -> tuple[str, ...]:
        if self._filled[index] != self.sizes[index]:
            raise ValueError(f"slot {self.path}: item {index} has {self._filled[index]} of {self.sizes[index]} bytes")
        return tuple(self._hashers[index].finish())

    def close(self) -> None:
        os.close(self._fd)


def _open_sized(path: str, length: int) -> int:
    """A slot's data file opened for writing in place, ``length`` bytes allocated (the same share reuses the file as
    it is: its pages are rewritten, never freed and faulted in anew).  Allocated every time, though its pages mostly
    exist: a file left sparse (a size change or a crash on a full node) mapped and written would be a SIGBUS where
    RAM ran out, never an error."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if os.fstat(fd).st_size != length:
            os.ftruncate(fd, length)
        if length:
            os.posix_fallocate(fd, 0, length)
    except BaseException:
        os.close(fd)
        raise
    return fd


class InPlaceSlot:
    """A slot's copy received in place (a replica at its holder, a share restored into its rank's own slot): the
    preallocated data file mapped writable, which the transport receives into
    (:class:`~dcp_atomic.exchange.file_transfer.Landing`), each item's block digests computed as its bytes land;
    :meth:`check` then judges it as :func:`verify_slot` would, without a second pass.  The caller has retired the
    slot's record first and writes it only after the check (a slot without its record is never restored)."""

    def __init__(self, path: str, record: SlotRecord, maps: SlotMaps, halfway: str) -> None:
        """``maps``: where its mapping is kept; ``halfway``: the failpoint hit once, when part of the bytes landed (a
        kill there leaves a half-received slot without a record)."""
        self.path, self.record, self.halfway = path, record, halfway
        os.close(_open_sized(path, record.length))
        self.view = maps.view(path, record.length)
        self._hashers = [BlockHasher(BLOCK_SIZE) for _ in record.items]
        self._item = self._at = 0

    def landed(self, offset: int, length: int) -> None:
        if offset != self._at:
            raise CorruptCheckpointError(f"{self.path}: bytes landed at {offset}, expected {self._at}", path=self.path)
        end, items = offset + length, self.record.items
        while self._item < len(items):
            item = items[self._item]
            stop = min(end, item.offset + item.nbytes)
            if stop > self._at:
                self._hashers[self._item].update(self.view[self._at:stop])
                self._at = stop
            if self._at < item.offset + item.nbytes:
                break
            self._item += 1
        if offset == 0 and self._at < self.record.length:  # the first chunk landed, more to come
            failpoints.hit(self.halfway, self.record.rank, self.record.step)

    def check(self) -> None:
        """Every block against the record (``CorruptCheckpointError`` naming the item and block), every object item
        decoded by the allow-list: :func:`verify_slot`'s verdict."""
        if self._at != self.record.length:
            raise CorruptCheckpointError(f"{self.path}: {self._at} of {self.record.length} bytes arrived",
                                         path=self.path, torn=True)
        for item, hasher in zip(self.record.items, self._hashers):
            check_digests(item.extent(), hasher.finish(), self._where(item), path=self.path)
        _decode_objects(self.record, self.view, self.path, self._where)

    def _where(self, item) -> str:
        return f"memory slot {self.path} (rank {self.record.rank}, step {self.record.step}) item {item.key!r}"

    def close(self) -> None:
        with contextlib.suppress(BufferError):  # a slice still held (a traceback): the collector releases it
            self.view.release()


@contextlib.contextmanager
def mapped(path: str, length: int):
    """The slot's bytes, read-only and in place (an empty slot is an empty view); a file shorter than its record
    says is damage, named."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < length:
            raise CorruptCheckpointError(f"{path}: {size} bytes, its commit record names {length} (truncated)",
                                         path=path, torn=True)
        if not length:
            yield memoryview(b"")
            return
        m = mmap.mmap(f.fileno(), length, access=mmap.ACCESS_READ)
        view = memoryview(m)
        try:
            yield view
        finally:  # a failure's traceback may still hold slices of it: then the collector unmaps it
            with contextlib.suppress(BufferError):
                view.release()
                m.close()


def verify_slot(record: SlotRecord, path: str) -> None:
    """Every block of every item of ``record`` against the bytes at ``path`` (a :class:`CorruptCheckpointError`
    naming the item and block at the first difference), and every object item decoded by the allow-list, as a
    restore decodes it (an ``UnsafeItemError`` or ``CorruptCheckpointError`` naming it): the one judge of a slot, for
    the restore's scan (which then serves around it) and ``verify --memory`` alike."""
    def where(item) -> str:
        return f"memory slot {path} (rank {record.rank}, step {record.step}) item {item.key!r}"

    with mapped(path, record.length) as data:
        for item in record.items:
            stored = data[item.offset:item.offset + item.nbytes]
            try:
                verify_item(item.extent(), stored, where(item), path=path)
            finally:
                stored.release()
        _decode_objects(record, data, path, where)


def _decode_objects(record: SlotRecord, data: memoryview, path: str, where: Callable[[Any], str]) -> None:
    """Every object item decoded by the allow-list, as a restore decodes it: a hostile pickle whose digests match is
    refused here too."""
    objects = [item for item in record.items if item.kind == "object"]
    if not objects:
        return
    from ..format.safe_pickle import decode_item  # torch: only a judge of objects needs it

    for item in objects:
        decode_item(bytes(data[item.offset:item.offset + item.nbytes]), key=item.key, where=where(item))
