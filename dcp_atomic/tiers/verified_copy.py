"""The drain's copy of one data file: streamed, every block checked before any of its bytes leaves (P13, P9).

A local data file is the only copy of its bytes that the durable root will get, and a node's disk may have damaged it
since the save wrote it; copying it first and verifying the copy after would publish the damage (the durable copy
then fails every reader), and reading it twice (verify, then copy) doubles the drain's I/O on the training node's
disk.  So :func:`copy_verified` reads each piece of about :data:`COPY_CHUNK` bytes once, into one reused buffer,
checks every block digest the piece holds (:func:`~..format.blocks.check_block`; a piece never cuts a block), and
only then writes it out: memory is one piece per thread whatever the file's size, and a damaged block stops the
file before any of its bytes is uploaded.  The plan of which files go where is :mod:`.drain_plan`'s.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import CorruptCheckpointError
from ..format.blocks import check_block, file_blocks
from ..format.manifest import FileEntry, ItemExtent
from ..stores.storage import Storage

COPY_CHUNK = 8 << 20  # bytes of a data file a drain thread reads, checks and uploads at a time (a block more
# when one block is larger: a block is never cut, so its bytes are checked before any leaves)


class CopyStopped(Exception):
    """A copy thread gave up because another file of the same upload failed (never the error reported)."""


@dataclass(frozen=True)
class _Block:
    """One block of a data file (:func:`~.blocks.file_blocks`), placed in the file: bytes ``[start, end)``."""

    start: int
    end: int
    item: ItemExtent
    index: int
    what: str


def _blocks(entry: FileEntry, where: str) -> list[_Block]:
    """Every block (or frame) of ``entry``, in file order."""
    blocks = [_Block(item.pos + lo, item.pos + hi, item, index, what)
              for item, what, index, lo, hi in file_blocks(entry, where)]
    blocks.sort(key=lambda b: (b.start, b.end))
    return blocks


def copy_verified(entry: FileEntry, source: str, storage: Storage, target: str,
                  stop: threading.Event | None = None, progress: Callable[[], None] | None = None) -> str | None:
    """Stream a local data file to ``target`` in the durable store in one pass: read a piece (about
    :data:`COPY_CHUNK` bytes, ending where a block ends) into one reused buffer, check every block it holds against
    the shard's digests, then upload it.  An object store gets a multipart upload for a large file.  Memory is one
    piece per thread, whatever the file's size.  A durable file left by a failed earlier attempt is replaced.
    Returns the store's checksum of the uploaded object where it reports one (``Storage.close_write``)."""
    blocks = _blocks(entry, source)
    fd = os.open(source, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size != entry.size:
            raise CorruptCheckpointError(f"{source}: {size} bytes, the shard records {entry.size}", path=source)
        for block in blocks:
            if block.end > size:
                raise CorruptCheckpointError(f"{block.what}: block {block.index} ends at byte {block.end}, past the "
                                             f"end of the {size}-byte file", path=source, block=block.index)
        try:
            stream = storage.open_write(target)
        except FileExistsError:  # the same attempt directory, an earlier try: nothing references it yet
            storage.remove(target)
            stream = storage.open_write(target)
        try:
            buffer = bytearray(min(COPY_CHUNK, size) or 1)
            written = _writeback(stream)
            position, next_block = 0, 0
            while position < size or next_block < len(blocks):
                if stop is not None and stop.is_set():
                    raise CopyStopped()
                end = _piece_end(blocks, next_block, position, min(size, position + COPY_CHUNK))
                if end - position > len(buffer):
                    buffer = bytearray(end - position)  # one block larger than a piece
                view = memoryview(buffer)[:end - position]
                _read_exactly(fd, view, position, source)
                while next_block < len(blocks) and blocks[next_block].end <= end:
                    block = blocks[next_block]
                    data = (view[block.start - position:block.end - position] if block.start >= position
                            else os.pread(fd, block.end - block.start, block.start))  # items overlapping: rare
                    try:
                        check_block(block.item, block.index, data, block.what, path=source)
                    except CorruptCheckpointError as e:
                        raise CorruptCheckpointError(f"{e.message}; this step cannot be drained (a later one can)",
                                                     **e.details) from None
                    next_block += 1
                stream.write(view)
                written(position, end - position)
                position = end
                if progress is not None:
                    progress()
            return storage.close_write(stream)
        except BaseException:
            storage.abort_write(stream)
            raise
    finally:
        os.close(fd)


def _writeback(stream: Any) -> Callable[[int, int], None]:
    """For a stream onto a local file: start writing each uploaded piece to the disk now, and drop it from the page
    cache once written.  Left to the kernel, the pages wait for the final fsync, which then writes the whole file
    while the copy sits idle (4 ranks copying 252 MB each to ext4 on the 2-core VM: 15-50% faster with it); and
    the drain never reads them again, so they should not push the training job's pages out.  Advice only: a
    stream without a file descriptor (an object store's upload) gets nothing, and a refusal is ignored."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        fd = None
    if fd is None or not hasattr(os, "posix_fadvise"):
        return lambda offset, length: None

    def advise(offset: int, length: int) -> None:
        try:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)  # Linux: starts writeback of dirty pages
        except OSError:
            pass

    return advise


def _piece_end(blocks: list[_Block], first: int, position: int, end: int) -> int:
    """Where the piece from ``position`` ends: at ``end``, moved back to the start of a block that ``end`` would cut,
    or on to that block's end when it begins at ``position`` (a block larger than a piece)."""
    for block in blocks[first:]:
        if block.start >= end:
            break
        if block.end > end:  # cut by the piece's end
            return block.start if block.start > position else block.end
    return end


def _read_exactly(fd: int, view: memoryview, offset: int, path: str) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise CorruptCheckpointError(f"{path}: ends at byte {offset + done}, the shard records more (truncated "
                                         "while the drain read it?)", path=path)
        done += n
