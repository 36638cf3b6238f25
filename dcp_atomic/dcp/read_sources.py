"""Where a loading rank's stored bytes come from, and the check every one of them passes.

Small items lying back to back in a data file are fetched with one request per run (an object store charges
per request, and 10^4 small tensors were 10^4 round trips); a :class:`Window` serves a run's items from one
buffer, or a shared item's bytes a peer sent; :class:`Counted` sums what storage served (``read_stats``); every
stored extent is verified against the block digests recorded when it was written (P4) before it is decoded or
sent on.
"""

from __future__ import annotations

import threading
from typing import Iterable

import torch
from torch.distributed.checkpoint.planner import ReadItem

from ..errors import CorruptCheckpointError
from ..format.manifest import ItemExtent
from .._base.stats import ReadStats
from ..stores.storage import RangeReader

SMALL_ITEM = 1 << 20  # items up to this size are read in runs of consecutive items,
RUN_BYTES = 8 << 20  # each run at most this long: one request per run


def item_runs(items: list[tuple[ReadItem, ItemExtent | None]]) -> Iterable[tuple[int, int, list[ReadItem]]]:
    """Items (by file offset) grouped into (start, end, items) runs of small items lying back to back (or read
    twice), each run to be fetched with one request; any other item is a run of its own."""
    run: list[ReadItem] = []
    start = end = 0
    joinable = False  # the run so far is of small items
    for item, extent in items:
        small = extent is not None and extent.length <= SMALL_ITEM
        if joinable and small and extent.pos <= end and max(end, extent.pos + extent.length) - start <= RUN_BYTES:
            run.append(item)
            end = max(end, extent.pos + extent.length)
            continue
        if run:
            yield start, end, run
        run, joinable = [item], small
        start, end = (extent.pos, extent.pos + extent.length) if extent is not None else (0, 0)
    if run:
        yield start, end, run


class Window:
    """One byte range of a data file, fetched with one request and served from memory.

    A run of small consecutive items costs one syscall (one ranged GET on an
    object store) instead of one per item.  Verification is unchanged: each
    item checks its own block digests on the bytes served to it.  Reads outside
    the range (or past a short read at a truncated end) go to the file itself.
    """

    def __init__(self, source: RangeReader, start: int, length: int) -> None:
        self.source, self.path, self.start = source, source.path, start
        buffer = memoryview(bytearray(length))
        self.data = buffer[: source.readinto_range(start, buffer)]

    @classmethod
    def held(cls, path: str, start: int, data: memoryview) -> "Window":
        """Bytes already in memory (a shared item): there is no file behind them to fall back on."""
        window = cls.__new__(cls)
        window.source, window.path, window.start, window.data = None, path, start, data
        return window

    def _piece(self, offset: int, length: int) -> memoryview | None:
        lo = offset - self.start
        if 0 <= lo and lo + length <= len(self.data):
            return self.data[lo : lo + length]
        if self.source is None:
            raise CorruptCheckpointError(f"{self.path}: read of {length} bytes at offset {offset} lies outside the "
                                         "shared item's bytes (its recorded layout is inconsistent)", path=self.path)
        return None

    def read_range(self, offset: int, length: int) -> bytes:
        piece = self._piece(offset, length)
        return self.source.read_range(offset, length) if piece is None else bytes(piece)

    def readinto_range(self, offset: int, buffer: memoryview) -> int:
        piece = self._piece(offset, len(buffer))
        if piece is None:
            return self.source.readinto_range(offset, buffer)
        buffer[:] = piece
        return len(piece)


class Counted:
    """A data file's reader that adds every byte it returns to the load's ``ReadStats`` (threads share them)."""

    _lock = threading.Lock()

    def __init__(self, source: RangeReader, stats: ReadStats) -> None:
        self.source, self.path, self.stats = source, source.path, stats

    def _count(self, n: int) -> int:
        with self._lock:
            self.stats.storage_bytes += n
        return n

    def read_range(self, offset: int, length: int) -> bytes:
        data = self.source.read_range(offset, length)
        self._count(len(data))
        return data

    def readinto_range(self, offset: int, buffer: memoryview) -> int:
        return self._count(self.source.readinto_range(offset, buffer))


def holds_bytes(target: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether stored bytes of ``dtype`` can be read straight into ``target``'s memory: a contiguous CPU tensor of
    that dtype whose memory is its value (not a lazily conjugated or negated view)."""
    return (target.is_cpu and target.dtype == dtype and target.is_contiguous() and not target.is_conj()
            and not target.is_neg())
