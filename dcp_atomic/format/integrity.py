"""Block checksums, computed while bytes are written and checked on every read.

Stock DCP keeps no checksum, so bit rot and torn files load silently.  Here each
item's bytes are cut into fixed-size blocks (``BLOCK_SIZE``, item-relative, so a
block is also the unit a compression frame or a ranged read would use) and each
block gets an xxh3-64 digest.  xxh3 runs at ~26 GB/s on this class of machine,
an order of magnitude above the disk, so checksums cost almost nothing; sha256
(1.8 GB/s) would not.  Small control files (manifest, marker, .metadata) use
sha256 because their digests are also identities that name a version.
"""

from __future__ import annotations

import hashlib
from typing import IO, Protocol

import xxhash


BLOCK_SIZE = 4 << 20
ALGORITHM = "xxh3_64"


def block_digest(data) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class BlockHasher:
    """Digest of consecutive ``block_size`` blocks of a byte stream fed in pieces."""

    def __init__(self, block_size: int = BLOCK_SIZE) -> None:
        self.block_size = block_size
        self.digests: list[str] = []
        self._current = xxhash.xxh3_64()
        self._filled = 0
        self.length = 0

    def update(self, data) -> None:
        view = memoryview(data).cast("B")
        self.length += len(view)
        while view:
            take = min(self.block_size - self._filled, len(view))
            if take == self.block_size:  # whole block: no running state needed
                self.digests.append(block_digest(view[:take]))
            else:
                self._current.update(view[:take])
                self._filled += take
                if self._filled == self.block_size:
                    self.digests.append(self._current.hexdigest())
                    self._current.reset()
                    self._filled = 0
            view = view[take:]

    def finish(self) -> list[str]:
        if self._filled or not self.digests:
            self.digests.append(self._current.hexdigest())
            self._current.reset()
            self._filled = 0
        return self.digests


class BlockSink(Protocol):
    """Where a raw item's stored blocks go: a data file (:class:`HashingWriter`), or reuse's probe, which only
    compares each block's digest with the base step's (``dcp.reuse``).

    Contract: ``write_unhashed`` is called once per stored block, in order (a block is one frame of at most
    ``block_size`` bytes; its digest is the caller's), and ``position`` then counts every byte received.  A sink may
    raise to stop the item early (the probe does at the first block that differs).
    """

    position: int

    def write_unhashed(self, block) -> None:
        """Take one stored block (the protocol's one method; the implementations say what they do with it)."""


class HashingWriter:
    """Write-through wrapper: counts and hashes every byte on its way to ``raw``.

    ``begin_item`` / ``end_item`` delimit one DCP item so its digests are
    item-relative.  For each item it also keeps the first bytes and the
    (offset, length) of every write call, from which :mod:`.container` proves
    where a tensor payload landed.  It implements what ``torch.save`` needs.
    """

    def __init__(self, raw: IO[bytes], block_size: int = BLOCK_SIZE, prefix_capture: int = 64 << 10) -> None:
        self.raw = raw
        self.block_size = block_size
        self.prefix_capture = prefix_capture
        self.position = 0
        self.prefix = bytearray()
        self.writes: list[tuple[int, int]] = []
        self._hasher: BlockHasher | None = None
        self._item_start = 0

    def begin_item(self) -> int:
        self._hasher = BlockHasher(self.block_size)
        self._item_start = self.position
        self.prefix = bytearray()
        self.writes = []
        return self.position

    def end_item(self) -> tuple[int, list[str]]:
        assert self._hasher is not None
        hasher, self._hasher = self._hasher, None
        return hasher.length, hasher.finish()

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if self._hasher is not None:
            self._hasher.update(view)
            relative = self.position - self._item_start
            self.writes.append((relative, len(view)))
            if len(self.prefix) < self.prefix_capture:
                self.prefix += view[: self.prefix_capture - len(self.prefix)]
        self.raw.write(view)
        self.position += len(view)
        return len(view)

    def write_unhashed(self, data) -> None:
        """For frames whose digests the caller computes itself (raw items): :class:`BlockSink`."""
        view = memoryview(data).cast("B")
        self.raw.write(view)
        self.position += len(view)

    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        self.raw.flush()

    def tell(self) -> int:
        return self.position
