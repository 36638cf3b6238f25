"""Stored files moved between ranks in bounded memory: the local tier's replicas and its restores (P13).

A rank's share of a step can be tens of GB.  Sent as one message it would sit in memory on both sides, more than
once (a tensor buffer per message, a copy per part).  Here each (sender, receiver) pair has one stream, the
concatenation of the parts the sender sends it, cut into chunks of at most :data:`CHUNK_BYTES`: the sender reads
each chunk from its file as it goes, the receiver appends it to a spool file in the receiving root.  Small parts
(manifest shards, control files) travel inline and arrive as bytes.  Memory per peer is two chunks (below),
whatever the step's size.  Nothing is trusted on the way: a receiver verifies a spooled file against the block
digests, one block at a time (:func:`.local_tier.check_stored_file`), before the tier moves it into place.

Order: every pair first exchanges its index (names, sizes); round ``k`` then carries chunk ``k`` of every stream,
every send and receive of a round posted before any is waited for, so no order can deadlock (gloo pairs the
``k``-th send of a pair with its ``k``-th receive).  While round ``k`` is on the wire, each rank writes the chunks
round ``k - 1`` brought and reads the chunks round ``k + 1`` sends (gloo moves the bytes on its own threads): the
disk and the network overlap instead of taking turns, for two buffers per stream on each side instead of one.
A read or write that fails mid-stream does not stop the stream (the peer still waits for its bytes): zeros go
out in place of what could not be read, the receiver drops what it cannot write, and the first error is raised
once every round is done.

Every message goes over the one transport (:class:`.transport.PeerLink`): a peer that dies or freezes mid-stream
is a :class:`.transport.PeerLost` naming it, raised within ``timeout``, with this rank's spool files removed.  The
caller must raise it rather than run another collective on the broken group.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
from dataclasses import dataclass
from typing import Union

import torch
import torch.distributed as dist

from .._base import failpoints
from ..errors import CorruptCheckpointError
from .transport import PeerError, PeerLink

CHUNK_BYTES = 16 << 20  # the most one message holds; a stream holds two per side (on the wire, on disk): 32 MiB
_TAG = 0x7E18  # point-to-point tags (lengths, payloads, chunks)


@dataclass(frozen=True)
class Part:
    """One named part a rank sends: ``data`` in memory, or the stored file at ``path`` (sent chunk by chunk and
    spooled on arrival)."""

    name: str
    size: int
    data: bytes | None = None
    path: str | None = None

    @classmethod
    def inline(cls, name: str, data: bytes) -> "Part":
        return cls(name, len(data), data=data)


@dataclass(frozen=True)
class Spooled:
    """A received file, complete but not yet verified, in the receiving root's spool directory."""

    path: str
    size: int


Received = Union[bytes, Spooled]


def discard(received: dict[int, dict[str, Received]]) -> None:
    """Remove the spool files nobody kept (a transfer that failed verification, or a step not committed)."""
    for parts in received.values():
        for part in parts.values():
            if isinstance(part, Spooled):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(part.path)


_SERIAL = itertools.count()  # transfers in this process: with the caller's name, one exchange id on every rank


def exchange_small(link: PeerLink, outgoing: dict[int, bytes], incoming: list[int], what: str) -> dict[int, bytes]:
    """One small message to each ``outgoing`` rank and from each ``incoming`` rank; lengths first, so a receiver
    sizes its buffer exactly.  For indexes and control data: files go through :func:`transfer`."""
    sizes = {src: torch.zeros(1, dtype=torch.int64) for src in incoming}
    link.start([(dst, torch.tensor([len(data)], dtype=torch.int64), _TAG) for dst, data in outgoing.items()],
               [(src, t, _TAG) for src, t in sizes.items()], what).wait()
    buffers = {src: torch.empty(int(t.item()), dtype=torch.uint8) for src, t in sizes.items()}
    link.start([(dst, torch.frombuffer(bytearray(data), dtype=torch.uint8), _TAG + 1)
                for dst, data in outgoing.items() if data],
               [(src, b, _TAG + 1) for src, b in buffers.items() if b.numel()], what).wait()
    return {src: b.numpy().tobytes() for src, b in buffers.items()}


def transfer(outgoing: dict[int, list[Part]], incoming: dict[int, str], group, spool_dir: str, *,
             what: str = "moving files between ranks", timeout: float = 60.0, exchange_id: str = "files",
             consequence: str = "nothing this rank received was kept.") -> dict[int, dict[str, Received]]:
    """Send ``outgoing[dst]``'s parts to each ``dst``; receive every part each rank in ``incoming`` sends
    (``incoming[src]`` names the sender in errors).  Files arrive spooled under ``spool_dir``, inline parts as
    bytes.  Every rank involved must call it with matching arguments (``exchange_id`` too: it names the blame
    keys of a lost peer, :meth:`.transport.PeerLink.lost`).  A peer lost on the way raises
    :class:`.transport.PeerLost` (``what`` and ``consequence`` are its message); any other failure, the first
    ``OSError`` or :class:`CorruptCheckpointError`, once every stream is done."""
    if not dist.is_initialized():  # one process without a process group: there is no peer to move anything to
        if outgoing or incoming:
            raise ValueError("transfer between ranks without an initialised process group")
        return {}
    link = PeerLink(group, timeout, f"{exchange_id}/{next(_SERIAL)}")
    me = link.rank
    setup: OSError | None = None
    try:  # a failure here must not skip the exchange: the peers would wait for it until the group times out
        os.makedirs(spool_dir, exist_ok=True)
        for stale in os.listdir(spool_dir):  # this rank's leftovers from a transfer a crash interrupted
            if stale.startswith(f"r{me}-"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(spool_dir, stale))
    except OSError as e:
        e.filename = e.filename or spool_dir
        setup = e
    receivers: dict[int, _Receiver] = {}
    try:
        indexes = exchange_small(link, {dst: json.dumps([[p.name, p.size, p.path is not None] for p in parts]).encode()
                                        for dst, parts in outgoing.items()}, list(incoming), what)
        senders = {dst: _Sender(parts) for dst, parts in outgoing.items()}
        receivers = {src: _Receiver(indexes[src], spool_dir, f"r{me}-from{src}", incoming[src], setup)
                     for src in incoming}
        _stream(link, senders, receivers, what)
    except BaseException as e:
        for r in receivers.values():
            r.close(discard=True)
        if isinstance(e, PeerError):
            raise link.lost(e, what, consequence) from None
        raise
    received = {src: r.close() for src, r in receivers.items()}
    error = next((e for e in [setup, *(s.error for s in senders.values()), *(r.error for r in receivers.values())]
                  if e), None)
    if error is not None:
        discard(received)
        raise error
    return received


def _stream(link: PeerLink, senders: dict[int, "_Sender"], receivers: dict[int, "_Receiver"], what: str) -> None:
    """The rounds (module doc): round ``k`` on the wire while round ``k - 1``'s chunks are written and round
    ``k + 1``'s are read, each into the stream's other buffer."""
    arrived: list[tuple[_Receiver, torch.Tensor]] = []
    outgoing = {dst: s.next_chunk() for dst, s in senders.items()}
    while True:
        buffers = {src: r.post(n) for src, r in receivers.items() if (n := r.next_size())}
        chunks = {dst: chunk for dst, chunk in outgoing.items() if chunk is not None}
        if not buffers and not chunks:
            break
        failpoints.hit("transfer.round", link.rank)
        pending = link.start([(dst, chunk, _TAG + 2) for dst, chunk in chunks.items()],
                             [(src, b, _TAG + 2) for src, b in buffers.items()], what)
        for receiver, buffer in arrived:
            receiver.feed(memoryview(buffer.numpy()))
        outgoing = {dst: s.next_chunk() for dst, s in senders.items()}
        pending.wait()
        arrived = [(receivers[src], buffer) for src, buffer in buffers.items()]
    for receiver, buffer in arrived:
        receiver.feed(memoryview(buffer.numpy()))


def _index(message: bytes, sender: str) -> list[tuple[str, int, bool]]:
    try:
        index = [(str(name), int(size), bool(spooled)) for name, size, spooled in json.loads(message)]
        if any(size < 0 for _, size, _ in index):
            raise ValueError("a negative size")
        return index
    except (ValueError, TypeError) as e:  # its sender streams nothing it cannot describe; nothing to drain here
        raise CorruptCheckpointError(f"a malformed transfer index from {sender}: {e}", sender=sender) from None


class _Sender:
    """One stream out: the parts' bytes in order, a chunk at a time, read into two buffers the stream alternates
    (a chunk is read while the one before it is on the wire; the one before that has been sent)."""

    def __init__(self, parts: list[Part]) -> None:
        self.parts, self.part, self.offset = parts, 0, 0
        self.error: OSError | None = None
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._turn = 0

    def next_chunk(self) -> torch.Tensor | None:
        length = min(CHUNK_BYTES, sum(p.size for p in self.parts[self.part:]) - self.offset)
        if length <= 0:
            return None
        chunk = _reuse(self._buffers, self._turn, length)
        self._turn ^= 1
        view, filled = memoryview(chunk.numpy()), 0
        while filled < length:
            part = self.parts[self.part]
            take = min(part.size - self.offset, length - filled)
            self._read(part, self.offset, view[filled:filled + take])
            filled += take
            self.offset += take
            if self.offset == part.size:
                self.part, self.offset = self.part + 1, 0
        return chunk

    def _read(self, part: Part, offset: int, into: memoryview) -> None:
        if part.data is not None:
            into[:] = part.data[offset:offset + len(into)]
            return
        if self.error is None:
            try:
                fd = os.open(part.path, os.O_RDONLY)
                try:
                    got = os.preadv(fd, [into], offset)
                finally:
                    os.close(fd)
                if got == len(into):
                    return
                raise OSError(f"{part.path}: {got} bytes at offset {offset}, expected {len(into)} (truncated?)")
            except OSError as e:
                self.error = e
        into[:] = bytes(len(into))  # the peer waits for these bytes; the receiver's check refuses them


def _reuse(buffers: list[torch.Tensor | None], turn: int, length: int) -> torch.Tensor:
    """``length`` bytes of the stream's buffer ``turn``, allocated once at the first chunk's size."""
    buffer = buffers[turn]
    if buffer is None or buffer.numel() < length:
        buffer = buffers[turn] = torch.empty(length, dtype=torch.uint8)
    return buffer[:length]


class _Receiver:
    """One stream in: inline parts collected in memory, files appended to spool files."""

    def __init__(self, message: bytes, spool_dir: str, prefix: str, sender: str, setup: OSError | None) -> None:
        self.spool_dir, self.prefix, self.sender = spool_dir, prefix, sender
        self.part, self.offset = 0, 0
        self.done: dict[str, Received] = {}
        self.inline = bytearray()
        self.file = None
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._turn = 0
        self.error: OSError | CorruptCheckpointError | None = setup  # set: what arrives is dropped
        try:
            self.index = _index(message, sender)
        except CorruptCheckpointError as e:  # a sender we cannot follow streams nothing we expect: expect nothing
            self.index, self.error = [], e
        self.remaining = sum(size for _, size, _ in self.index)
        self.unposted = self.remaining  # bytes no receive has been posted for yet
        self._skip_empty()

    def next_size(self) -> int:
        return min(self.unposted, CHUNK_BYTES)

    def post(self, length: int) -> torch.Tensor:
        """Where the next chunk arrives: two buffers per stream, alternated (the chunk that arrived into the other
        one is written while this one fills)."""
        self.unposted -= length
        buffer = _reuse(self._buffers, self._turn, length)
        self._turn ^= 1
        return buffer

    def feed(self, data: memoryview) -> None:
        self.remaining -= len(data)
        while data:
            name, size, spooled = self.index[self.part]
            take = min(size - self.offset, len(data))
            piece, data = data[:take], data[take:]
            if not spooled:
                self.inline += piece
            else:
                self._write(piece)
            self.offset += take
            if self.offset == size:
                self._finish_part(name, size, spooled)
                self._skip_empty()

    def _skip_empty(self) -> None:
        """Empty parts take no bytes of the stream: they are complete as soon as the stream reaches them."""
        while self.part < len(self.index) and self.index[self.part][1] == 0:
            name, _, spooled = self.index[self.part]
            self._finish_part(name, 0, spooled)

    def _path(self) -> str:
        return os.path.join(self.spool_dir, f"{self.prefix}-{self.part}")

    def _write(self, piece: memoryview) -> None:
        if self.error is not None:
            return
        try:
            if self.file is None:
                self.file = open(self._path(), "wb")
            self.file.write(piece)
        except OSError as e:
            e.filename = e.filename or self._path()
            self._fail(e)

    def _fail(self, error: OSError) -> None:
        """Drop the rest of the stream: close and remove the part being written now (a full disk needs the space
        back before the next save, not at the next transfer)."""
        self.error = error
        if self.file is not None:
            with contextlib.suppress(OSError):
                self.file.close()
            self.file = None
        with contextlib.suppress(OSError):
            os.unlink(self._path())

    def _finish_part(self, name: str, size: int, spooled: bool) -> None:
        if not spooled:
            self.done[name] = bytes(self.inline)
            self.inline = bytearray()
        elif self.error is None:
            try:
                if self.file is None:
                    self.file = open(self._path(), "wb")
                self.file.flush()
                os.fsync(self.file.fileno())
                self.file.close()
                self.file = None
                self.done[name] = Spooled(self._path(), size)
            except OSError as e:
                e.filename = e.filename or self._path()
                self._fail(e)
        self.part, self.offset = self.part + 1, 0

    def close(self, discard: bool = False) -> dict[str, Received]:
        if self.file is not None:
            with contextlib.suppress(OSError):
                self.file.close()
            self.file = None
            if not discard and self.error is None:  # the stream ended inside a part: a bug, never kept
                self.error = OSError(f"the stream from {self.sender} ended inside part {self.part}")
        if discard or self.error is not None:
            for part in range(min(self.part, len(self.index) - 1) + 1):  # every spool file this stream may have made
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.spool_dir, f"{self.prefix}-{part}"))
            return {}
        return self.done

