"""The raw item format: tensor bytes in fixed-size blocks, optionally zstd with byte planes.

Why raw: a ``torch.save`` container per item (stock DCP's format) costs a zip
writer pass and a CRC32 over every byte on save; raw blocks are written as they
lie in memory.  Why blocks: each block (``block_size`` logical bytes, 4 MiB by
default) is one checksum and one compression frame, so a ranged read under
resharding reads, verifies and decompresses exactly the blocks it touches.

Why byte planes: in a float tensor the high bytes (sign, exponent) of
neighbouring elements are alike while the low mantissa bytes are noise.  Stored
element by element, zstd sees them interleaved; grouped into planes (all first
bytes, then all second bytes, ...) the exponent planes compress well.  Measured
on real MiniLM weights: bf16 1.28x plain, 1.46x planes; fp32 1.09x / 1.21x.

A frame whose stored length equals its logical length is stored raw (zstd
did not help it): that rule needs no flag and makes per-frame fallback free.
"""

from __future__ import annotations

import struct
from typing import Iterator

import torch
import zstandard

#: a frame compressing worse than this is stored raw instead
RAW_FALLBACK_RATIO = 0.97


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """Writable byte view of a contiguous CPU tensor's memory (no copy, any dtype).

    Through a uint8 view and numpy: ~2 us, where a ctypes array of the tensor's
    size took ~10 us and cached one new ctypes type per distinct size.  A lazily
    conjugated or negated tensor is refused (numpy raises): its memory is not its value.
    """
    assert tensor.device.type == "cpu" and tensor.is_contiguous()
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


def plane_width(dtype: torch.dtype) -> int:
    """Bytes per element to split into planes; 1 means no split."""
    if dtype.is_floating_point and not dtype.is_complex:
        return max(dtype.itemsize, 1)
    return 1


_INT_OF_WIDTH = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def to_planes(block: memoryview, width: int, out: torch.Tensor | None = None,
              work: torch.Tensor | None = None) -> torch.Tensor:
    """Plane-grouped copy of ``block``: ``width`` rows, row j holding byte j of every element.

    Bit shifts on the integer view are vectorised (a strided byte transpose is
    ~4x slower); ``out`` / ``work`` let a caller reuse buffers across blocks.
    """
    words = torch.frombuffer(block, dtype=_INT_OF_WIDTH[width])
    n = words.numel()
    planes = out[: width * n].view(width, n) if out is not None else torch.empty((width, n), dtype=torch.uint8)
    shifted = work[:n] if work is not None else torch.empty_like(words)
    for j in range(width):
        torch.bitwise_right_shift(words, 8 * j, out=shifted)
        planes[j].copy_(shifted.bitwise_and_(0xFF))
    return planes


def from_planes(data: memoryview, width: int, out: memoryview, work: torch.Tensor | None = None) -> None:
    """Interleave planes back into ``out`` (len(out) == len(data))."""
    if width == 1:
        out[:] = data
        return
    kind = _INT_OF_WIDTH[width]
    planes = torch.frombuffer(data, dtype=torch.uint8).view(width, -1)
    words = torch.frombuffer(out, dtype=kind)
    shifted = work[: words.numel()] if work is not None else torch.empty_like(words)
    words.copy_(planes[0])
    for j in range(1, width):
        shifted.copy_(planes[j])
        words.bitwise_or_(shifted.bitwise_left_shift_(8 * j))


def _scratch(cache: dict[int, torch.Tensor], width: int, n: int) -> torch.Tensor:
    """A reusable integer buffer of at least ``n`` elements of ``width`` bytes."""
    buffer = cache.get(width)
    if buffer is None or buffer.numel() < n:
        buffer = cache[width] = torch.empty(n, dtype=_INT_OF_WIDTH[width])
    return buffer


def default_zstd_params() -> zstandard.ZstdCompressionParameters:
    """zstd's "fast" strategy with a tiny hash table and long minimum matches.

    Exponent planes are low-entropy but have few long matches, so zstd's level 1
    match finder spends its time for nothing.  On the exponent plane of random bf16
    weights (``python -m benchmarks.primitives``): level 1 0.25 GB/s at 2.71x, this
    profile 0.67 GB/s at 2.94x.  An explicit ``compression_level`` selects zstd's own
    levels instead.
    """
    return zstandard.ZstdCompressionParameters(strategy=zstandard.STRATEGY_FAST, window_log=17, hash_log=6,
                                               min_match=7, chain_log=6, search_log=1, target_length=0)


_PLANE_HEADER = struct.Struct("<I")  # stored length of one plane's segment


class Encoder:
    """Encodes one block into one frame.  Per writer thread (zstd contexts are not thread-safe).

    Frame layout: for ``width == 1``, a zstd frame (or the raw block).  For byte
    planes, ``width`` little-endian uint32 segment lengths, then each plane's
    segment: zstd, or the raw plane where zstd does not help (the noisy
    mantissa planes).  If the whole frame would not be smaller, the raw block.
    """

    def __init__(self, codec: str, level: int | None = None) -> None:
        self.codec = codec
        if codec == "zstd":
            self._zstd = (zstandard.ZstdCompressor(compression_params=default_zstd_params()) if level is None
                          else zstandard.ZstdCompressor(level=level))
        else:
            self._zstd = None
        self._planes = torch.empty(0, dtype=torch.uint8)  # reused across blocks: no per-block allocations
        self._work: dict[int, torch.Tensor] = {}

    def _squeeze(self, data) -> bytes | memoryview:
        packed = self._zstd.compress(data)
        return packed if len(packed) < RAW_FALLBACK_RATIO * len(data) else data

    def encode(self, block: memoryview, width: int) -> bytes | memoryview:
        if self._zstd is None:
            return block
        if width == 1:
            return self._squeeze(block)
        if self._planes.numel() < len(block):
            self._planes = torch.empty(len(block), dtype=torch.uint8)
        work = _scratch(self._work, width, len(block) // width)
        planes = to_planes(block, width, self._planes, work)
        view = tensor_bytes(planes)
        n = len(block) // width
        segments = [self._squeeze(view[j * n : (j + 1) * n]) for j in range(width)]
        size = width * _PLANE_HEADER.size + sum(len(seg) for seg in segments)
        if size >= RAW_FALLBACK_RATIO * len(block):
            return block
        return b"".join([_PLANE_HEADER.pack(len(seg)) for seg in segments] + [bytes(seg) for seg in segments])


class Decoder:
    """Per reader thread; decodes a frame into the destination's memory."""

    def __init__(self) -> None:
        self._zstd = zstandard.ZstdDecompressor()
        self._scratch = torch.empty(0, dtype=torch.uint8)
        self._work: dict[int, torch.Tensor] = {}

    def _inflate_into(self, stored, out: memoryview) -> None:
        if len(stored) == len(out):  # stored raw
            out[:] = stored
            return
        filled = 0
        with self._zstd.stream_reader(stored) as reader:
            while filled < len(out):
                n = reader.readinto(out[filled:])
                if not n:
                    break
                filled += n
            if filled != len(out) or reader.read(1):
                raise ValueError(f"frame does not decompress to its recorded {len(out)} bytes")

    def decode_into(self, stored: bytes | memoryview, width: int, out: memoryview) -> None:
        """Fill ``out`` (one frame's logical bytes) from its stored form; any damage is a ``ValueError``.

        The reader and ``verify`` both decode through here, so they cannot disagree on what is damaged.
        """
        try:
            self._decode_into(memoryview(stored).cast("B"), width, out)
        except (RuntimeError, struct.error, zstandard.ZstdError) as e:
            raise ValueError(f"{type(e).__name__}: {e}") from None

    def _decode_into(self, stored: memoryview, width: int, out: memoryview) -> None:
        if width == 1 or len(stored) == len(out):
            self._inflate_into(stored, out)
            return
        if self._scratch.numel() < len(out):
            self._scratch = torch.empty(len(out), dtype=torch.uint8)
        planes = tensor_bytes(self._scratch)[: len(out)]
        n = len(out) // width
        header = width * _PLANE_HEADER.size
        lengths = [_PLANE_HEADER.unpack_from(stored, j * _PLANE_HEADER.size)[0] for j in range(width)]
        if header + sum(lengths) != len(stored):
            raise ValueError("frame's plane lengths do not add up to its stored size")
        position = header
        for j, length in enumerate(lengths):
            self._inflate_into(stored[position : position + length], planes[j * n : (j + 1) * n])
            position += length
        from_planes(planes, width, out, _scratch(self._work, width, n))


def host_blocks(tensor: torch.Tensor, block_size: int, buffer: torch.Tensor | None = None) -> Iterator[memoryview]:
    """The tensor's bytes in ``block_size`` pieces, on the host.

    CPU tensors are viewed in place.  Device tensors are copied block by block
    through one reusable host buffer (``buffer``: a uint8 tensor of at least ``block_size`` bytes, pinned when CUDA
    is present: the writer thread's :class:`HostBuffer`, or a window of bounded staging's pool), so the extra host
    memory per writer thread is one block, not a copy of the state.
    """
    nbytes = tensor.nbytes
    if tensor.device.type == "cpu":
        view = tensor_bytes(tensor)
        for start in range(0, nbytes, block_size):
            yield view[start : start + block_size]
        return
    buffer = buffer if buffer is not None else HostBuffer(block_size).buffer
    flat = tensor.reshape(-1).view(torch.uint8)
    for start in range(0, nbytes, block_size):
        piece = flat[start : start + block_size]
        host = buffer[: piece.numel()]
        host.copy_(piece, non_blocking=False)  # synchronous: the buffer is reused right after
        yield tensor_bytes(host)


class HostBuffer:
    """One host buffer per writer thread for device-to-host copies (pinned if CUDA is available)."""

    def __init__(self, block_size: int) -> None:
        pin = torch.cuda.is_available()
        self.buffer = torch.empty(block_size, dtype=torch.uint8, pin_memory=pin)


def narrow_tensor_by_index(tensor: torch.Tensor, offsets, lengths) -> torch.Tensor:
    """The view of ``tensor`` at ``offsets`` spanning ``lengths``: the part of a stored chunk a read item asks for.

    Ours rather than torch's private ``torch.distributed._shard._utils`` helper of the same name, which may move
    or change between releases.  A view, never a copy; dims taken whole are left alone."""
    for dim, (start, length) in enumerate(zip(offsets, lengths)):
        if length != tensor.size(dim):
            tensor = tensor.narrow(dim, start, length)
    return tensor
