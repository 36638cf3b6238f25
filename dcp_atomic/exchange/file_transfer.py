"""Stored files and memory moved between ranks in bounded memory: the local tier's replicas and restores (P13), the
memory tier's replicas and restores (P16).

A rank's share of a step can be tens of GB.  Sent as one message it would sit in memory on both sides, more than
once (a tensor buffer per message, a copy per part).  Here each (sender, receiver) pair has one stream, the
concatenation of the parts the sender sends it, cut into chunks of at most :data:`CHUNK_BYTES`: the sender reads
each chunk from its file as it goes, the receiver appends it to a spool file in the receiving root.  Small parts
(manifest shards, control files) travel inline and arrive as bytes.  Memory per peer is two chunks (below),
whatever the step's size.  Nothing is trusted on the way: a receiver verifies a spooled file against the block
digests, one block at a time (:func:`.local_tier.check_stored_file`), before the tier moves it into place.

A *direct* part (the memory tier's slot) moves in place: the sender's chunks are slices of its mapping, sent with
no copy, and the receiver receives each chunk straight into the memory its caller's ``land`` gives it (the
holder's preallocated slot), which checks the bytes as they land: no buffer, no spool file, no second pass.

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
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol, Union

import torch
import torch.distributed as dist

from .._base import failpoints
from ..errors import CorruptCheckpointError
from .transport import PeerError, PeerLink

CHUNK_BYTES = 16 << 20  # the most one message holds; a stream holds two per side (on the wire, on disk): 32 MiB
# A direct part's chunks are sent from and received into the caller's memory, so no buffer of this size is held;
# fewer, larger rounds cost gloo less CPU per byte (measured: 64 MiB against 16, benchmarks/memory.py).
DIRECT_CHUNK_BYTES = 64 << 20
_TAG = 0x7E18  # point-to-point tags (lengths, payloads, chunks)
INLINE, FILE, DIRECT = "inline", "file", "direct"  # how a part travels (the stream's index names it)


@dataclass(frozen=True)
class Part:
    """One named part a rank sends: ``data`` in memory, the stored file at ``path`` (sent chunk by chunk and spooled
    on arrival, unless the receiver lands it), or ``view``: memory sent in place, chunk by chunk, no copy (a slot's
    mapping), which the receiver lands in its own memory in place (:class:`Landing`)."""

    name: str
    size: int
    data: bytes | None = None
    path: str | None = None
    view: memoryview | None = field(default=None, compare=False)

    @classmethod
    def inline(cls, name: str, data: bytes) -> "Part":
        return cls(name, len(data), data=data)

    @classmethod
    def direct(cls, name: str, view: memoryview) -> "Part":
        """``view`` (writable, as ``torch.frombuffer`` needs; never written) sent in place; empty travels inline."""
        return cls(name, len(view), view=view) if len(view) else cls.inline(name, b"")

    @property
    def kind(self) -> str:
        return DIRECT if self.view is not None else FILE if self.path is not None else INLINE


class Landing(Protocol):
    """Where a receiver puts a direct part in place (``transfer(land=...)``; the memory tier's
    :class:`~dcp_atomic.memory.slots.InPlaceSlot`): ``view`` is the part's size, writable; each chunk is received
    straight into it, then its ``landed(offset, length)`` hears of it, in order (a check as bytes land).  Its
    ``close()`` releases it; the transfer closes the ones it does not hand back."""

    view: memoryview


@dataclass(frozen=True)
class Spooled:
    """A received file, complete but not yet verified, in the receiving root's spool directory."""

    path: str
    size: int


Received = Union[bytes, Spooled, Landing]


def discard(received: dict[int, dict[str, Received]]) -> None:
    """Remove the spool files nobody kept (a transfer that failed verification, or a step not committed) and close
    the landings (what they hold is the caller's: a slot without its record is never read)."""
    for parts in received.values():
        for part in parts.values():
            if isinstance(part, Spooled):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(part.path)
            elif not isinstance(part, bytes):
                part.close()


def _chunks(index: list[tuple[str, int, str]]) -> Iterator[tuple[int, int | None, int]]:
    """A stream's chunks, the same on both sides from its index: (length, the direct part it lies in or None, its
    offset there).  Inline and file parts are packed together into chunks of :data:`CHUNK_BYTES`; a direct part is
    chunks of its own (:data:`DIRECT_CHUNK_BYTES`), never straddling another part, so each is one slice of its
    memory on both sides."""
    packed = 0
    for part, (_, size, kind) in enumerate(index):
        if kind != DIRECT:
            packed += size
            continue
        for at in range(0, packed, CHUNK_BYTES):
            yield min(CHUNK_BYTES, packed - at), None, 0
        packed = 0
        for at in range(0, size, DIRECT_CHUNK_BYTES):
            yield min(DIRECT_CHUNK_BYTES, size - at), part, at
    for at in range(0, packed, CHUNK_BYTES):
        yield min(CHUNK_BYTES, packed - at), None, 0


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
             consequence: str = "nothing this rank received was kept.",
             land: Callable[[int, str, int, dict[str, Received]], Landing | None] | None = None
             ) -> dict[int, dict[str, Received]]:
    """Send ``outgoing[dst]``'s parts to each ``dst``; receive every part each rank in ``incoming`` sends
    (``incoming[src]`` names the sender in errors).  Files arrive spooled under ``spool_dir``, inline parts as
    bytes; a direct part where ``land(sender, name, size, the sender's parts received so far)`` puts it (the
    :class:`Landing`, handed back), else spooled.  ``land`` may raise ``OSError`` or
    :class:`CorruptCheckpointError`: the stream is then dropped and the error raised like a write's.  Every rank
    involved must call it with matching arguments (``exchange_id`` too: it names the blame keys of a lost peer,
    :meth:`.transport.PeerLink.lost`).  A peer lost on the way raises :class:`.transport.PeerLost` (``what`` and
    ``consequence`` are its message); any other failure, the first ``OSError`` or :class:`CorruptCheckpointError`,
    once every stream is done."""
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
        indexes = exchange_small(link, {dst: json.dumps([[p.name, p.size, p.kind] for p in parts]).encode()
                                        for dst, parts in outgoing.items()}, list(incoming), what)
        senders = {dst: _Sender(parts) for dst, parts in outgoing.items()}
        receivers = {src: _Receiver(indexes[src], spool_dir, f"r{me}-from{src}", incoming[src], setup,
                                    None if land is None else lambda name, size, done, src=src: land(src, name, size,
                                                                                                     done))
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
    """The rounds (module doc): round ``k`` on the wire while round ``k - 1``'s chunks are written (or checked,
    landed in place) and round ``k + 1``'s are read, each into the stream's other buffer."""
    outgoing = {dst: s.next_chunk() for dst, s in senders.items()}
    while True:
        buffers = {src: r.post() for src, r in receivers.items() if r.next_size()}
        chunks = {dst: chunk for dst, chunk in outgoing.items() if chunk is not None}
        if not buffers and not chunks:
            break
        failpoints.hit("transfer.round", link.rank)
        pending = link.start([(dst, chunk, _TAG + 2) for dst, chunk in chunks.items()],
                             [(src, b, _TAG + 2) for src, b in buffers.items()], what)
        for receiver in receivers.values():
            receiver.feed_arrived()
        outgoing = {dst: s.next_chunk() for dst, s in senders.items()}
        pending.wait()
        for src in buffers:
            receivers[src].arrived()
    for receiver in receivers.values():
        receiver.feed_arrived()


def _index(message: bytes, sender: str) -> list[tuple[str, int, str]]:
    try:
        index = [(str(name), int(size), str(kind)) for name, size, kind in json.loads(message)]
        if any(size < 0 or kind not in (INLINE, FILE, DIRECT) for _, size, kind in index):
            raise ValueError("a negative size or an unknown kind of part")
        return index
    except (ValueError, TypeError) as e:  # its sender streams nothing it cannot describe; nothing to drain here
        raise CorruptCheckpointError(f"a malformed transfer index from {sender}: {e}", sender=sender) from None


class _Sender:
    """One stream out: the parts' bytes in order, a chunk at a time (:func:`_chunks`).  A packed chunk is read into
    one of two buffers the stream alternates (a chunk is read while the one before it is on the wire; the one before
    that has been sent); a direct part's chunk is a slice of its memory, sent as it is."""

    def __init__(self, parts: list[Part]) -> None:
        self.parts, self.part, self.offset = parts, 0, 0
        self.error: OSError | None = None
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._turn = 0
        self._plan = _chunks([(p.name, p.size, p.kind) for p in parts])

    def next_chunk(self) -> torch.Tensor | None:
        length, direct, at = next(self._plan, (0, None, 0))
        if length <= 0:
            return None
        if direct is not None:
            return torch.frombuffer(self.parts[direct].view[at:at + length], dtype=torch.uint8)
        chunk = _reuse(self._buffers, self._turn, length)
        self._turn ^= 1
        view, filled = memoryview(chunk.numpy()), 0
        while filled < length:
            part = self.parts[self.part]
            if part.kind == DIRECT:  # sent in its own chunks
                self.part, self.offset = self.part + 1, 0
                continue
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
    """One stream in: inline parts collected in memory, files appended to spool files, direct parts received in
    place where ``land`` puts them (else spooled like files)."""

    def __init__(self, message: bytes, spool_dir: str, prefix: str, sender: str, setup: OSError | None,
                 land: Callable[[str, int, dict[str, Received]], Landing | None] | None = None) -> None:
        self.spool_dir, self.prefix, self.sender, self.land = spool_dir, prefix, sender, land
        self.part, self.offset = 0, 0
        self.done: dict[str, Received] = {}
        self.inline = bytearray()
        self.file = None
        self.landing: Landing | None = None  # the direct part being received in place
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._turn = 0
        self._posted: list[tuple[torch.Tensor, int | None, int]] = []  # posted, not arrived: (buffer, part, at)
        self._arrived: list[tuple[torch.Tensor, int | None, int]] = []  # arrived, not yet fed
        self.error: OSError | CorruptCheckpointError | None = setup  # set: what arrives is dropped
        try:
            self.index = _index(message, sender)
        except CorruptCheckpointError as e:  # a sender we cannot follow streams nothing we expect: expect nothing
            self.index, self.error = [], e
        self._plan = _chunks(self.index)
        self._next = next(self._plan, None)
        self._skip_empty()

    def next_size(self) -> int:
        return 0 if self._next is None else self._next[0]

    def post(self) -> torch.Tensor:
        """Where the next chunk arrives: a slice of its direct part's landing, else one of two buffers per stream,
        alternated (the chunk that arrived into the other one is written while this one fills)."""
        length, direct, at = self._next
        self._next = next(self._plan, None)
        buffer = None
        if direct is not None:
            if at == 0:  # the parts before it are complete, so land() sees them (a record before its bytes)
                self.feed_arrived()
                self._open_landing(direct)
            if self.landing is not None and self.error is None:
                buffer = torch.frombuffer(self.landing.view[at:at + length], dtype=torch.uint8)
        if buffer is None:
            buffer = _reuse(self._buffers, self._turn, length)
            self._turn ^= 1
        self._posted.append((buffer, direct, at))
        return buffer

    def arrived(self) -> None:
        self._arrived.append(self._posted.pop(0))

    def feed_arrived(self) -> None:
        arrived, self._arrived = self._arrived, []
        for buffer, direct, at in arrived:
            if direct is None:
                self._feed(memoryview(buffer.numpy()))
            else:
                self._landed(direct, at, buffer)

    def _open_landing(self, part: int) -> None:
        name, size, _ = self.index[part]
        if self.land is None or self.error is not None:
            return
        try:
            self.landing = self.land(name, size, dict(self.done))
        except (OSError, CorruptCheckpointError) as e:
            self._fail(e)

    def _landed(self, part: int, at: int, buffer: torch.Tensor) -> None:
        """A direct part's chunk arrived: in place (its landing checks it), else spooled like a file's."""
        assert part == self.part and at == self.offset, (part, at, self.part, self.offset)
        length = buffer.numel()
        if self.landing is not None and self.error is None:
            try:
                self.landing.landed(at, length)
            except (OSError, CorruptCheckpointError) as e:
                self._fail(e)
        elif self.error is None:  # no landing asked for: spooled
            self._write(memoryview(buffer.numpy()))
        self.offset += length
        name, size, kind = self.index[self.part]
        if self.offset == size:
            self._finish_part(name, size, kind)
            self._skip_empty()

    def _feed(self, data: memoryview) -> None:
        while data:
            name, size, kind = self.index[self.part]
            take = min(size - self.offset, len(data))
            piece, data = data[:take], data[take:]
            if kind == INLINE:
                self.inline += piece
            else:
                self._write(piece)
            self.offset += take
            if self.offset == size:
                self._finish_part(name, size, kind)
                self._skip_empty()

    def _skip_empty(self) -> None:
        """Empty parts take no bytes of the stream: they are complete as soon as the stream reaches them."""
        while self.part < len(self.index) and self.index[self.part][1] == 0:
            name, _, kind = self.index[self.part]
            self._finish_part(name, 0, kind)

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

    def _fail(self, error: OSError | CorruptCheckpointError) -> None:
        """Drop the rest of the stream: close and remove the part being written now (a full disk needs the space
        back before the next save, not at the next transfer), and close the landing."""
        self.error = error
        if self.file is not None:
            with contextlib.suppress(OSError):
                self.file.close()
            self.file = None
        with contextlib.suppress(OSError):
            os.unlink(self._path())
        self._close_landing()

    def _close_landing(self) -> None:
        landing, self.landing = self.landing, None
        if landing is not None:
            landing.close()

    def _finish_part(self, name: str, size: int, kind: str) -> None:
        if kind == INLINE:
            self.done[name] = bytes(self.inline)
            self.inline = bytearray()
        elif self.landing is not None and self.error is None:
            self.done[name], self.landing = self.landing, None
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
        if self.landing is not None:
            self._close_landing()
            if not discard and self.error is None:
                self.error = OSError(f"the stream from {self.sender} ended inside part {self.part}")
        if discard or self.error is not None:
            for part in range(min(self.part, len(self.index) - 1) + 1):  # every spool file this stream may have made
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.spool_dir, f"{self.prefix}-{part}"))
            for received in self.done.values():
                if not isinstance(received, (bytes, Spooled)):
                    received.close()
            return {}
        return self.done
