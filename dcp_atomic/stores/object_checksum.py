"""The store's own checksum of a data object, recorded when it is written, so that a server-side copy (reuse, P15)
is verified by the checksum the store reports for the copy instead of by downloading it.

botocore already computes a CRC32 of every PUT and UploadPart body it sends (``request_checksum_calculation``
``when_supported``, its default), and the store checks it on receipt and returns it.  A single PUT's is the
object's; a multipart object's full-object CRC32 is combined here from its parts' (:func:`combine_crc32`, zlib's
``crc32_combine``), never by reading a byte again.  A ``CopyObject`` that names ``ChecksumAlgorithm=CRC32`` returns
the copy's full-object CRC32 (AWS S3 computes it over the bytes it copies; moto does), which must equal the one
recorded.  Stores that return none (SeaweedFS; a store configured ``when_required``) leave the copy to be verified
by its block digests, as before.  The value is ``"crc32:<8 hex digits>"`` (the manifest shard records it:
``FileEntry.checksum``).

GCS keeps a CRC32C of every object and reports it in the object's metadata, a rewrite's copy included.  The upload
API returns none that gcsfs keeps, so the writer computes the CRC32C of the bytes it sends (:class:`Crc32c`, the C
``google-crc32c`` that gcsfs's dependencies bring) and the copy's is read from its metadata after the rewrite
(``"crc32c:<8 hex digits>"``).  A value of one algorithm never equals one of the other.
"""

from __future__ import annotations

import base64

REPLY_FIELD = "ChecksumCRC32"  # in PutObject, UploadPart and CopyObjectResult replies
COPY_ALGORITHM = "CRC32"


def _gf2_times(matrix: list[int], vector: int) -> int:
    total, row = 0, 0
    while vector:
        if vector & 1:
            total ^= matrix[row]
        vector >>= 1
        row += 1
    return total


def _gf2_square(matrix: list[int]) -> list[int]:
    return [_gf2_times(matrix, matrix[n]) for n in range(32)]


def combine_crc32(first: int, second: int, second_length: int) -> int:
    """The CRC32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)`` (zlib's ``crc32_combine``: O(log n)
    32x32 bit-matrix squarings, no byte read)."""
    if second_length <= 0:
        return first
    operator = [0xEDB88320] + [1 << (n - 1) for n in range(1, 32)]  # appending one zero bit
    for _ in range(3):
        operator = _gf2_square(operator)  # ... one zero byte
    while second_length:  # len(B) zero bytes appended to A, one bit of the length at a time
        if second_length & 1:
            first = _gf2_times(operator, first)
        second_length >>= 1
        if second_length:
            operator = _gf2_square(operator)
    return first ^ second


def from_reply(reply: dict | None) -> int | None:
    """The CRC32 a store's reply (PutObject, UploadPart, CopyObjectResult) reports, or None (none given, or not a
    plain full CRC32: a composite ``...-N`` value)."""
    raw = _four_bytes((reply or {}).get(REPLY_FIELD))
    return None if raw is None else int.from_bytes(raw, "big")


def _four_bytes(value: object) -> bytes | None:
    """A checksum as the stores send it (base64 of 4 big-endian bytes), or None where it is anything else."""
    if not isinstance(value, str):
        return None
    try:
        raw = base64.b64decode(value, validate=True)
    except ValueError:
        return None
    return raw if len(raw) == 4 else None


def of_parts(parts: list[tuple[int | None, int]]) -> str | None:
    """The object's checksum from its parts' (CRC32, length) in order; None where any part's is unknown."""
    if not parts or any(crc is None for crc, _ in parts):
        return None
    total = parts[0][0]
    for crc, length in parts[1:]:
        total = combine_crc32(total, crc, length)
    return render(total)


def render(crc: int) -> str:
    return f"crc32:{crc:08x}"


class Crc32c:
    """The CRC32C of bytes as they are written (GCS's object checksum), or None where ``google-crc32c`` is missing
    (the copy is then verified by its block digests, as on a store that reports no checksum)."""

    def __init__(self) -> None:
        try:
            import google_crc32c
        except ImportError:  # gcsfs's dependencies bring it; a trimmed install only loses the shortcut
            self._checksum = None
        else:
            self._checksum = google_crc32c.Checksum()

    def update(self, data: bytes | bytearray | memoryview) -> None:
        if self._checksum is not None:
            self._checksum.update(data if isinstance(data, bytes) else bytes(data))  # it takes read-only bytes only

    def value(self) -> str | None:
        return None if self._checksum is None else f"crc32c:{self._checksum.digest().hex()}"


def from_gcs_metadata(info: dict | None) -> str | None:
    """An object's CRC32C from its GCS metadata (``crc32c``: base64 of 4 big-endian bytes), or None."""
    raw = _four_bytes((info or {}).get("crc32c"))
    return None if raw is None else f"crc32c:{raw.hex()}"
