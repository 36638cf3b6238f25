"""The one check of stored bytes against the digests their writer recorded.

Every path that trusts stored bytes goes through here: the DCP reader (whole items, payloads read in place,
the edge blocks of a narrowed read), shared reads, ``dcp-atomic verify``, the drain's copy, the local tier's
replicas and restores, and reuse's check of a file it links (:func:`verify_stored_file`, for a whole file).  Blocks are located only by :meth:`ItemExtent.blocks`, so one extent has one meaning
for all of them, and damage reads the same wherever it is found: the item, the block, its byte range.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import xxhash

from ..errors import CorruptCheckpointError
from .integrity import ALGORITHM, block_digest
from .manifest import FileEntry, ItemExtent


def check_block(item: ItemExtent, index: int, data, what: str, *, path: str | None = None) -> None:
    """Block ``index`` of ``item`` (its stored bytes: a frame, for a compressed item) against its digest."""
    lo, hi = item.blocks()[index]
    if len(data) != hi - lo:
        raise CorruptCheckpointError(f"{what}: block {index} is {len(data)} bytes, the shard records {hi - lo} "
                                     "(truncated?)", path=path or what, block=index)
    _compare(block_digest(data), item, index, lo, hi, what, path)


def verify_item(item: ItemExtent, stored, what: str, *, path: str | None = None) -> None:
    """Every block of one stored item.  ``stored``: its bytes, or consecutive pieces of them (header, payload read
    in place, trailer): a block that straddles pieces is hashed as a stream, nothing is copied."""
    pieces = [memoryview(p).cast("B") for p in (stored if isinstance(stored, (list, tuple)) else [stored])]
    total = sum(len(p) for p in pieces)
    if total != item.length:
        raise CorruptCheckpointError(f"{what}: {total} bytes, the shard records {item.length}", path=path or what)
    if len(pieces) == 1:
        verify_blocks_from(item, 0, pieces[0], what, path=path)
        return
    hasher = xxhash.xxh3_64()
    piece, offset = 0, 0
    for index, (lo, hi) in enumerate(item.blocks()):
        need = hi - lo
        while need:
            take = min(need, len(pieces[piece]) - offset)
            hasher.update(pieces[piece][offset:offset + take])
            need, offset = need - take, offset + take
            if offset == len(pieces[piece]):
                piece, offset = piece + 1, 0
        _compare(hasher.hexdigest(), item, index, lo, hi, what, path)
        hasher.reset()


def check_digests(item: ItemExtent, digests: list[str], what: str, *, path: str | None = None) -> None:
    """An item's block digests computed as its bytes passed (received in place, hashed as they landed) against the
    recorded ones: the verdict :func:`verify_item` gives, without a second pass over the bytes."""
    blocks = item.blocks()
    if len(digests) != len(blocks):
        raise CorruptCheckpointError(f"{what}: {len(digests)} blocks arrived, the record names {len(blocks)}",
                                     path=path or what)
    for index, (lo, hi) in enumerate(blocks):
        _compare(digests[index], item, index, lo, hi, what, path)


def verify_blocks_from(item: ItemExtent, first: int, data, what: str, *, path: str | None = None) -> None:
    """Consecutive blocks of ``item`` from block ``first``, whose stored bytes ``data`` holds exactly (a ranged
    read: whole blocks, from a block's start to a block's end)."""
    view = memoryview(data).cast("B")
    blocks = item.blocks()
    if first >= len(blocks):
        raise CorruptCheckpointError(f"{what}: block {first} does not exist (the item has {len(blocks)})",
                                     path=path or what, block=first)
    base, checked, count = blocks[first][0], 0, 0
    for index in range(first, len(blocks)):
        lo, hi = blocks[index]
        if hi - base > len(view):
            break
        _compare(block_digest(view[lo - base:hi - base]), item, index, lo, hi, what, path)
        checked, count = hi - base, count + 1
        if checked == len(view):
            break
    if not count or checked != len(view):
        raise CorruptCheckpointError(f"{what}: {len(view)} bytes from block {first} do not end where a block ends "
                                     f"(truncated, or more than the item holds)", path=path or what, block=first)


def file_blocks(entry: FileEntry, where: str):
    """``(item, its name for errors, block index, start, end)`` of every stored block of a data file, item by
    item, ``start``/``end`` item-relative: what a streaming check (a copy, a read one block at a time) walks."""
    for item in entry.items:
        what = f"{where} item {item.key!r}"
        for index, (lo, hi) in enumerate(item.blocks()):
            yield item, what, index, lo, hi


def verify_stored_file(entry: FileEntry, reader, where: str, *, path: str | None = None, threads: int = 1) -> None:
    """A whole data file, through ``reader`` (``size()``, ``readinto_range(offset, buffer)``: the stores' range
    readers), against its shard's digests: its size, then every block, one block at a time in each of ``threads``
    threads, each a contiguous run of blocks with one buffer (memory stays a block a thread whatever the file's
    size; this module does no I/O of its own)."""
    size = reader.size()
    if size != entry.size:
        raise CorruptCheckpointError(f"{where}: {size} bytes, the shard records {entry.size}", path=path or where)
    blocks = list(file_blocks(entry, where))
    largest = max((item.block_size for item in entry.items), default=0)

    def check(run: list) -> None:
        buffer = memoryview(bytearray(largest))
        for item, what, index, lo, hi in run:
            if hi - lo > len(buffer):  # a compressed frame larger than its block
                buffer = memoryview(bytearray(hi - lo))
            got = reader.readinto_range(item.pos + lo, buffer[:hi - lo])
            check_block(item, index, buffer[:got], what, path=path or where)

    share = max(1, -(-len(blocks) // max(1, threads)))
    runs = [blocks[k:k + share] for k in range(0, len(blocks), share)]
    if len(runs) <= 1:
        for run in runs:
            check(run)
        return
    with ThreadPoolExecutor(max_workers=len(runs), thread_name_prefix="dcp-atomic-check") as pool:
        list(pool.map(check, runs))  # the first damaged block's error, raised here


def _compare(actual: str, item: ItemExtent, index: int, lo: int, hi: int, what: str, path: str | None) -> None:
    expected = item.checksums[index]
    if actual != expected:
        raise CorruptCheckpointError(
            f"{what}: block {index} (bytes {lo}..{hi} of the item) does not match its digest (checksum mismatch: "
            f"expected {ALGORITHM} {expected}, got {actual}); the file was modified or damaged after it was written "
            "— restore it or load another step", path=path or what, block=index)
