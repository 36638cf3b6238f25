"""Where the raw tensor bytes sit inside a ``torch.save`` container.

Stock-readable items are ``torch.save`` zip archives, as stock DCP writes them.
Loading them the stock way (``torch.load`` into a temporary tensor, then copy)
allocates and copies every byte twice.  The writer therefore records, per item,
the offset of the tensor payload inside the archive: the zip entry
``<archive>/data/0`` is written uncompressed and contiguous, so the reader can
``pread`` it straight into the destination tensor and hash the header, payload
and trailer as one stream.  The offset is found from what the writer itself
wrote (the single write call of exactly ``nbytes``) and confirmed against the
zip local header that must precede it; if either check fails, no offset is
recorded and the item loads the stock way.
"""

from __future__ import annotations

import struct

LOCAL_HEADER = struct.Struct("<4s5H3I2H")  # zip local file header, 30 bytes
LOCAL_SIGNATURE = b"PK\x03\x04"
PREFIX_CAPTURE = 64 << 10  # the header region of an archive is ~1 KB; payloads start early


def find_payload(prefix: bytes, writes: list[tuple[int, int]], nbytes: int) -> int | None:
    """Offset of the tensor payload in an item, or None if it cannot be proven."""
    if nbytes == 0:
        return None
    for offset, length in writes:
        if length != nbytes or offset > len(prefix):
            continue
        start = 0
        while True:
            start = prefix.find(LOCAL_SIGNATURE, start, offset)
            if start < 0 or start + LOCAL_HEADER.size > offset:
                break
            fields = LOCAL_HEADER.unpack_from(prefix, start)
            compression, name_len, extra_len = fields[3], fields[9], fields[10]
            name_end = start + LOCAL_HEADER.size + name_len
            if (
                compression == 0
                and name_end + extra_len == offset
                and prefix[start + LOCAL_HEADER.size : name_end].endswith(b"/data/0")
            ):
                return offset
            start += 1
    return None
