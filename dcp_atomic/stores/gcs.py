"""Google Cloud Storage through gcsfs: the commit by generation preconditions.

GCS numbers every write of an object (its *generation*) and checks a
precondition on it in the same request, atomically, for every client:

* ``ifGenerationMatch=0`` writes only if the object does not exist (HTTP 412
  otherwise): the put-if-absent ``create_exclusive`` needs, so two jobs
  committing one step cannot both win (gcsfs: ``pipe_file(..., mode="create")``);
* ``ifGenerationMatch=<g>`` writes only if the object still is generation
  ``g``: the compare-and-swap with which an ``overwrite=True`` re-save replaces
  the marker it read.

Every HTTP request gcsfs makes goes through one policy, the S3 backend's
(:mod:`dcp_atomic.stores.object_retry`), installed at gcsfs's single request function
in place of gcsfs's own loop (6 attempts, ~34 s, then a raw ``HttpError``, and
no deadline: gcsfs passes ``timeout=None``, so a stalled request hung the rank):
throttling (429), 5xx, dropped connections and stalls are retried for a time
budget with a per-attempt stall deadline and an adaptive number of requests in
flight, and a final failure is a :class:`~dcp_atomic.errors.StorageError`
naming rank, host, object, status and what is (not) committed.  The same
``dcp_atomic_*`` options as on S3 set it (``dcp_atomic_retry_budget_s``,
``dcp_atomic_stall_timeout_s``, ...); they are removed before the rest goes to gcsfs.

A 412 after a retried write may be our own write, so the content is read back
before anyone is told they lost; a marker write that failed for good is settled
by reading it back (committed, another's, or "unknown" with what to run).
Everything else is :class:`FsspecStorage`: data objects are single or
resumable uploads, visible only once complete.

The filesystem is gcsfs's JSON-API one, never the "extended" class newer gcsfs
registers for ``gs://``: that one first asks the storage-control gRPC API for
each bucket's type, outside the policy above and its deadline (30-60 s per
new filesystem against an endpoint that does not answer, a warning on every
command), for zonal-bucket features this backend does not use.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import IO, Any
from urllib.parse import quote, unquote

from ..errors import CommitConflictError, ConfigurationError, StorageError
from . import object_checksum
from .object_retry import ObjectRequests, RetryPolicy, chain, copy_source_missing, settle_write
from .storage import FsspecStorage
from .._base import internals

#: a multipart/related upload (metadata, then the bytes): the one request that carries ifGenerationMatch
_BOUNDARY = "==dcp-atomic=="
SETTLE_S = 5.0  # the least time a marker write cancelled unanswered is read back for before "unknown"
RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
THROTTLE_STATUS = frozenset({429, 503})
_OBJECT_PATH = re.compile(r"(?:^|/)b/([^/?]+)/o/([^?]+)")


class GCSErrors:
    """What gcsfs's exceptions mean (see :class:`~dcp_atomic.stores.object_retry.ErrorClassifier`).

    gcsfs turns most replies into ``HttpError`` with the status as ``code``, but a
    404 into ``FileNotFoundError``, a 412 into ``FileExistsError``, a 403 into
    ``OSError("Forbidden...")`` and a 502 into ``requests``' ``ProxyError``.
    """

    store = "GCS"

    def reply(self, exc: BaseException) -> tuple[int | None, str | None, str]:
        from gcsfs.retry import HttpError
        from requests.exceptions import ProxyError

        for e in chain(exc):
            if isinstance(e, HttpError) and e.code is not None:
                try:
                    return int(e.code), None, str(e.message)
                except (TypeError, ValueError):
                    return None, str(e.code), str(e.message)
            if isinstance(e, FileNotFoundError):
                return 404, None, str(e)
            if isinstance(e, FileExistsError):
                return 412, None, str(e)
            if isinstance(e, ProxyError):
                return 502, None, "bad gateway"
            if type(e) is OSError and str(e).startswith("Forbidden"):
                return 403, None, str(e)
        return None, None, str(exc)

    def retryable(self, exc: BaseException) -> bool:
        status, _, _ = self.reply(exc)
        if status is not None:
            return status in RETRYABLE_STATUS
        import aiohttp

        transport = (ConnectionError, TimeoutError, asyncio.TimeoutError, aiohttp.ClientError)
        return any(isinstance(e, transport) for e in chain(exc))

    def throttled(self, exc: BaseException) -> bool:
        return self.reply(exc)[0] in THROTTLE_STATUS

    def precondition_failed(self, exc: BaseException) -> bool:
        return self.reply(exc)[0] == 412

    def not_found(self, exc: BaseException) -> bool:
        return self.reply(exc)[0] == 404

    def hint(self, status: int | None, code: str | None, message: str, url: str) -> str | None:
        if status in (401, 403):
            return (f"The credentials (storage_options 'token', or the environment's) may not write or read {url}: "
                    f"grant storage.objects.create, get, delete and list on the bucket")
        return None


def _object_url(path: str, args: tuple, kwargs: dict) -> str:
    """``gs://bucket/key`` of a gcsfs request, for messages (the request path where that cannot be told)."""
    target = path.format(*[quote(str(a), safe="") for a in args]) if args else path
    found = _OBJECT_PATH.search(target)
    if found:
        return f"gs://{unquote(found.group(1))}/{unquote(found.group(2))}"
    bucket = re.search(r"/b/([^/?]+)/o", target)
    name = re.search(r"[?&]name=([^&]+)", target)
    key = unquote(name.group(1)) if name else kwargs.get("name")
    data, metadata = kwargs.get("data"), kwargs.get("json")
    if key is None and isinstance(metadata, dict):
        key = metadata.get("name")
    if key is None and isinstance(data, (bytes, bytearray)):  # a multipart upload names its object in its first part
        named = re.search(rb'"name": "((?:[^"\\]|\\.)*)"', bytes(data[:4096]))
        key = json.loads(b'"' + named.group(1) + b'"') if named else None
    if bucket is not None and key is not None:
        return f"gs://{unquote(bucket.group(1))}/{key}"
    return target


class GCSStorage(FsspecStorage):
    """GCS via gcsfs, with the commit marker created and replaced under generation preconditions."""

    exclusive_create_is_atomic = True
    link_kind = "server-side copy"  # objects.rewrite: reuse (P15) never uploads a byte the bucket already holds

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        options = dict(storage_options or {})  # never mutate the caller's dict
        self._init_args = (url, dict(options))  # what a pickle carries (see __reduce__)
        self.policy = RetryPolicy.pop_from(options)
        # No shared instance and no listing cache: a reused filesystem would carry another save's state.
        super().__init__(url, {"skip_instance_cache": True, "use_listings_cache": False, **options},
                         fs_class=internals.gcs_json_filesystem())
        if not internals.gcs_creates_exclusively(self.fs):
            raise ConfigurationError(
                f"{url}: the installed gcsfs cannot create an object only if it is "
                "absent (pipe_file has no mode='create'), so two jobs could both commit one step. Upgrade: "
                "pip install -U 'gcsfs>=2025.2'", root=url)
        self.requests = ObjectRequests(self.policy, GCSErrors(), lambda: self.endpoint)
        self._install_policy()

    @property
    def endpoint(self) -> str:
        return internals.gcs_location(self.fs) or "gcs"

    def __reduce__(self):
        """Pickle to URL + options (DCP's process-based async executor): the copy builds its own client and policy."""
        return (type(self), self._init_args)

    def _install_policy(self) -> None:
        """Route every request of this filesystem through our policy instead of gcsfs's retry loop: each makes one
        attempt, which :class:`ObjectRequests` repeats, bounds and reports."""

        async def route(once, method, path, *args, **kwargs):
            data = kwargs.get("data")
            nbytes = len(data) if isinstance(data, (bytes, bytearray, memoryview)) else 0
            return await self.requests.run(method, _object_url(path, args, kwargs), once, nbytes)

        internals.gcs_route_requests(self.fs, route)

    def _url(self, path: str) -> str:
        return f"gs://{path}"

    def read_versioned(self, path: str) -> tuple[bytes, str | None]:
        """The object and its generation, from one GET: what :meth:`replace_if_unchanged` must still find."""
        headers, data = self.fs.call("GET", self.fs.url(path))
        return data, headers.get("X-Goog-Generation") or None

    def open_write(self, path: str) -> IO[bytes]:
        return _Checksummed(self.fs.open(path, "wb"))

    def close_write(self, stream: "_Checksummed") -> str | None:
        """Complete the upload; the CRC32C of the bytes sent (:mod:`.object_checksum`), which GCS's own must equal."""
        stream.close()
        return stream.crc32c.value()

    def link(self, source: str, target: str) -> str | None:
        """A server-side rewrite (gcsfs ``cp_file``, reuse, P15): GCS copies the object, no byte of it passes through
        this process; each request goes through this store's retry policy.  Returns the copy's CRC32C from its
        metadata (one small request; the caller compares it with the one recorded at write, instead of downloading
        the copy).  ``FileNotFoundError`` where ``source`` is gone."""
        try:
            self.fs.cp_file(source, target)
        except FileNotFoundError:
            raise copy_source_missing(self._url(source)) from None
        return object_checksum.from_gcs_metadata(self.fs.info(target))

    def create_exclusive(self, path: str, data: bytes) -> bool:
        try:
            try:
                self.fs.pipe_file(path, data, mode="create")
            except StorageError as e:
                self._settle(e, path, data, create=True)
        except FileExistsError:
            return False  # possibly our own retried write: the commit protocol reads the marker back
        return True

    def _settle(self, error: StorageError, path: str, data: bytes, *, create: bool) -> None:
        """A marker write failed for good: report what the store holds, never a false "not committed"."""
        settle_write(error, data, lambda: self._current(path), self._url(path),
                     settle_s=max(SETTLE_S, self.policy.stall_timeout_s), create=create, store="GCS")

    def replace(self, path: str, data: bytes) -> None:
        """One plain write."""
        self.fs.pipe_file(path, data)

    def replace_if_unchanged(self, path: str, data: bytes, version: str | None) -> None:
        """Only over the generation ``version`` (the current one's when the caller has none)."""
        generation = version or self._generation(path)
        try:
            try:
                self._upload_if_generation(path, data, generation)
            except StorageError as e:
                self._settle(e, path, data, create=False)
        except FileExistsError:  # PreconditionFailed: a 412, possibly answering our own retried write
            if self._current(path) == data:
                return  # an earlier attempt of this write went through; its reply was lost
            raise CommitConflictError(
                f"{self._url(path)}: the commit marker changed while this save was replacing it (write with "
                f"ifGenerationMatch={generation} failed): another job re-saved or removed this step at the same "
                "time. Nothing of this save is visible. Read the step again and re-save with overwrite=True if "
                "you still want to replace it.",
                path=self._url(path),
            ) from None

    def _generation(self, path: str) -> str:
        """The object's current generation; "0" (must not exist) if there is none."""
        try:
            return str(self.fs.info(path)["generation"])
        except FileNotFoundError:
            return "0"

    def _current(self, path: str) -> bytes | None:
        try:
            return self.fs.cat_file(path)
        except FileNotFoundError:
            return None

    def _upload_if_generation(self, path: str, data: bytes, generation: str) -> None:
        """One multipart upload with ``ifGenerationMatch`` (gcsfs offers only ``0``, as ``mode="create"``)."""
        bucket, key, _ = self.fs.split_path(path)
        head = (f"--{_BOUNDARY}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n{json.dumps({'name': key})}"
                f"\r\n--{_BOUNDARY}\r\nContent-Type: application/octet-stream\r\n\r\n")
        body = head.encode() + data + f"\r\n--{_BOUNDARY}--".encode()
        self.fs.call("POST", f"{internals.gcs_location(self.fs)}/upload/storage/v1/b/{quote(bucket)}/o", uploadType="multipart",
                     headers={"Content-Type": f'multipart/related; boundary="{_BOUNDARY}"'}, data=body,
                     json_out=True, ifGenerationMatch=generation)
        self.fs.invalidate_cache(path)


class _Checksummed:
    """A gcsfs upload stream that computes the CRC32C of what is written through it (everything else is the
    stream's: ``discard`` on abort, ``close`` to complete)."""

    def __init__(self, stream: IO[bytes]) -> None:
        self._stream = stream
        self.crc32c = object_checksum.Crc32c()

    def write(self, data: bytes | bytearray | memoryview) -> int:
        self.crc32c.update(data)
        return self._stream.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)
