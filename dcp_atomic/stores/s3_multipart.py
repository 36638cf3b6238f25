"""S3 multipart uploads: how a large object goes up without ever being visible half-written, and what is
left to clean when that fails.

A data object larger than one part is a multipart upload: created as soon as
its first part is full, parts sent in parallel with a per-rank bound, completed
only by the writer's commit (``close_write``); a failing writer aborts it.
Uploads nobody completes or aborts still cost money:

* a lost CreateMultipartUpload reply: the retry makes a second upload and the
  first one is orphaned. A create that took more than one attempt therefore
  aborts every other upload of its key (data keys are unique to one rank of one
  save, so any other upload there is one our retries superseded);
* a killed rank cannot abort its own uploads: :func:`abort_stale_uploads`
  (``dcp-atomic gc``) aborts those older than a lease.

Functions here take the :class:`~dcp_atomic.stores.s3.S3Storage` they work on; this
module never imports it (s3.py imports this one).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import StorageError
from .._base.key_prefixes import DATA_PREFIX_PATTERN
from .._base import internals
from . import object_checksum

log = logging.getLogger("dcp_atomic.s3_multipart")  # the name users filter on

MAX_PARTS = 10_000
DEFAULT_UPLOAD_LEASE_S = 6 * 3600.0  # gc's default lease: no save runs longer than this


class S3ObjectWriter:
    """A new object written as a stream; visible only after :meth:`commit` (``close_write``).

    Up to one part it is a single PUT at commit.  Beyond that, a multipart
    upload: created as soon as the first part is full (so a killed rank leaves
    an upload ``abort_stale_uploads`` can find), parts sent in the background
    with at most ``max_concurrency`` in flight per rank (the writer blocks when
    all slots are busy, which bounds memory), completed at commit.  A plain
    :meth:`close` without commit — the writer's error path — aborts the upload.
    """

    def __init__(self, storage, path: str) -> None:
        self.storage = storage
        self.path = path
        self.bucket, self.key = storage._split(path)
        self.size = 0
        self._buffer = bytearray()
        self._upload_id: str | None = None
        self._pending: list[tuple[int, Future]] = []
        self._etags: dict[int, str] = {}
        self._crcs: dict[int, tuple[int | None, int]] = {}  # part -> (its CRC32 as the store reported it, length)
        self._next_part = 1
        self._closed = False

    def writable(self) -> bool:
        return True

    def _part_size(self) -> int:
        # Double the part size every 1000 parts so one object can outgrow S3's 10,000-part limit.
        return self.storage.part_size << min((self._next_part - 1) // 1000, 12)

    def write(self, data) -> int:
        if self._closed:
            raise ValueError(f"write to closed S3 object writer {self.path}")
        view = memoryview(data).cast("B")
        n = len(view)
        while view:
            room = self._part_size() - len(self._buffer)
            self._buffer += view[:room]
            view = view[room:]
            if len(self._buffer) >= self._part_size():
                self._send_part()
        self.size += n
        return n

    def flush(self) -> None:
        """Parts below S3's 5 MiB minimum cannot be sent early; surface failed part uploads instead."""
        self._collect(wait=False)

    def tell(self) -> int:
        return self.size

    def _collect(self, wait: bool) -> None:
        """Record finished parts; raise the first failure."""
        still = []
        for number, future in self._pending:
            if wait or future.done():
                reply = future.result()
                self._etags[number] = reply["ETag"]
                self._crcs[number] = (object_checksum.from_reply(reply), self._crcs[number][1])
            else:
                still.append((number, future))
        self._pending = still

    def _send_part(self) -> None:
        storage = self.storage
        self._collect(wait=False)
        if self._upload_id is None:
            self._upload_id = self._create()
        if self._next_part > MAX_PARTS:
            raise StorageError(f"{storage._url(self.path)}: more than {MAX_PARTS} parts", path=self.path)
        number, body = self._next_part, self._buffer  # handed over, never touched again: no copy
        self._crcs[number] = (None, len(body))
        self._next_part += 1
        self._buffer = bytearray()
        storage._part_slots.acquire()  # backpressure: at most max_concurrency parts in flight per rank
        try:
            future = asyncio.run_coroutine_threadsafe(
                storage._call(f"upload of part {number}", self.path, "upload_part", Bucket=self.bucket,
                              Key=self.key, UploadId=self._upload_id, PartNumber=number, Body=body),
                storage.fs.loop,
            )
        except BaseException:
            storage._part_slots.release()
            raise
        future.add_done_callback(lambda _: storage._part_slots.release())
        self._pending.append((number, future))

    def _create(self) -> str:
        """CreateMultipartUpload; if it took retries, abort the uploads they superseded."""
        storage, sent = self.storage, 0

        async def once() -> dict:
            nonlocal sent
            sent += 1
            return await internals.s3_call(storage.fs, "create_multipart_upload", Bucket=self.bucket, Key=self.key)

        upload_id = storage._run(storage.requests.run("create multipart upload", storage._url(self.path), once))[
            "UploadId"]
        if sent > 1:
            self._abort_superseded(upload_id)
        return upload_id

    def _abort_superseded(self, ours: str) -> None:
        """An attempt whose reply was lost may have created an upload nobody knows the id of: abort every upload of
        this key but ours (the key belongs to this writer alone).  Best effort: gc's lease covers what is left."""
        storage = self.storage
        try:
            pages = storage._pages("list multipart uploads", self.path, "list_multipart_uploads",
                                   {"KeyMarker": "NextKeyMarker", "UploadIdMarker": "NextUploadIdMarker"},
                                   Bucket=self.bucket, Prefix=self.key)
            for page in pages:
                for upload in page.get("Uploads", []) or []:
                    if upload["Key"] != self.key or upload["UploadId"] == ours:
                        continue
                    try:
                        storage._run(storage._call("abort multipart upload", self.path, "abort_multipart_upload",
                                                   Bucket=self.bucket, Key=self.key, UploadId=upload["UploadId"]))
                    except FileNotFoundError:
                        pass
                    log.info("aborted multipart upload %s of %s: a retried create superseded it",
                             upload["UploadId"], storage._url(self.path))
        except Exception as e:  # noqa: BLE001 - gc's abort_stale_uploads aborts what is left after its lease
            log.warning("could not abort the multipart uploads superseded by a retried create of %s (gc's "
                        "abort_stale_uploads will, after its lease): %s", storage._url(self.path), e)

    def commit(self) -> str | None:
        """Make the object visible: one PUT, or the final part and CompleteMultipartUpload.  Returns the object's
        checksum as the store reported it (:mod:`.object_checksum`), None where it reported none."""
        if self._closed:
            raise ValueError(f"S3 object writer {self.path} is already closed")
        storage = self.storage
        try:
            if self._upload_id is None:
                reply = storage._run(storage._put(self.path, self._buffer))
                parts = [(object_checksum.from_reply(reply), len(self._buffer))]
            else:
                if self._buffer:
                    self._send_part()
                self._collect(wait=True)
                self._complete()
                parts = [self._crcs[n] for n in sorted(self._crcs)]
            self._closed = True
            self._buffer = bytearray()
        except BaseException:
            self.close()
            raise
        return object_checksum.of_parts(parts)

    def _complete(self) -> None:
        storage = self.storage
        parts = [{"PartNumber": n, "ETag": self._etags[n]} for n in sorted(self._etags)]
        try:
            storage._run(storage._call("complete multipart upload", self.path, "complete_multipart_upload",
                                       Bucket=self.bucket, Key=self.key, UploadId=self._upload_id,
                                       MultipartUpload={"Parts": parts}))
        except FileNotFoundError:
            # NoSuchUpload on a retry: an earlier attempt completed it and its reply was lost.
            try:
                if storage.size(self.path) == self.size:
                    self._upload_id = None
                    return
            except FileNotFoundError:
                pass
            raise
        self._upload_id = None

    def close(self) -> None:
        """Without :meth:`commit`: abandon the object (abort the multipart upload, best effort)."""
        if self._closed:
            return
        self._closed = True
        self._buffer = bytearray()
        for _, future in self._pending:
            future.cancel()
        for _, future in self._pending:
            try:
                future.result(timeout=30)
            except BaseException:  # noqa: BLE001 - cancelled or failed: either way, abort below
                pass
        self._pending = []
        if self._upload_id is not None:
            upload_id, self._upload_id = self._upload_id, None
            storage = self.storage
            try:
                storage._run(storage._call("abort multipart upload", self.path, "abort_multipart_upload",
                                           Bucket=self.bucket, Key=self.key, UploadId=upload_id))
            except FileNotFoundError:
                pass
            except Exception as e:  # noqa: BLE001 - we are already failing; gc aborts what is left
                log.warning("could not abort multipart upload %s of %s (gc's abort_stale_uploads will): %s",
                            upload_id, storage._url(self.path), e)

    def __enter__(self) -> "S3ObjectWriter":
        return self

    def __exit__(self, exc_type, *_: Any) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.close()


# -- multipart cleanup (gc) ----------------------------------------------------------------


@dataclass
class StaleUpload:
    """An incomplete multipart upload that :func:`abort_stale_uploads` aborted."""

    path: str
    upload_id: str
    age_s: float


def abort_stale_uploads(storage, prefix: str, older_than_s: float) -> list[StaleUpload]:
    """Abort incomplete multipart uploads under ``prefix`` started more than ``older_than_s`` ago.

    A rank killed mid-save cannot abort its own uploads; their parts are billed
    until someone does.  ``prefix`` is a storage path (e.g. ``layout.run_dir``);
    only keys under ``prefix/`` are touched, and, for a path under the root, the
    same place under every hashed data prefix (``<root>/_dXX/<run>/``: an upload
    makes no object, so no listing of the root shows its prefix).  ``older_than_s`` is the lease that
    protects saves still running: make it longer than any save (and than the
    clock skew between this machine and the store, whose clock dates uploads).
    Returns what was aborted; a no-op (empty list) on storage without multipart uploads.
    """
    if not getattr(storage, "multipart_uploads", False):
        return []
    bucket, _ = storage._split(prefix)
    wanted = _upload_keys(storage, prefix)
    now = time.time()
    aborted: list[StaleUpload] = []
    # No Prefix parameter: MinIO, for one, matches it only against whole keys; filter here instead.
    pages = storage._pages("list multipart uploads", prefix, "list_multipart_uploads",
                           {"KeyMarker": "NextKeyMarker", "UploadIdMarker": "NextUploadIdMarker"}, Bucket=bucket)
    for page in pages:
        for upload in page.get("Uploads", []) or []:
            if not wanted(upload["Key"]):
                continue
            initiated = upload.get("Initiated")
            age = now - initiated.timestamp() if initiated is not None else float("inf")
            if age < older_than_s:
                continue
            path = f"{bucket}/{upload['Key']}"
            try:
                storage._run(storage._call("abort multipart upload", path, "abort_multipart_upload",
                                           Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"]))
            except FileNotFoundError:
                continue  # completed or aborted meanwhile
            aborted.append(StaleUpload(path=f"s3://{path}", upload_id=upload["UploadId"], age_s=age))
    return aborted


def _upload_keys(storage, prefix: str) -> Callable[[str], bool]:
    """Which keys lie under ``prefix``, in the classic layout or under any hashed data prefix of the root."""
    key = storage._split(prefix)[1].strip("/")
    root = storage._split(storage.root)[1].strip("/")
    plain = key + "/" if key else ""
    inside = key.startswith(root + "/") if root else bool(key)
    hashed = re.compile(re.escape(root + "/" if root else "") + DATA_PREFIX_PATTERN.pattern + "/"
                        + re.escape(key[len(root):].strip("/") + "/")) if inside else None
    return lambda k: k.startswith(plain) or (hashed is not None and hashed.match(k) is not None)
