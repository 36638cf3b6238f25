"""S3 and S3-compatible object stores: the commit by conditional PUTs.

Object stores have no rename and no ``link()``; what they do have, since 2024
on AWS (and on MinIO, SeaweedFS, Ceph RGW, ...), are *conditional writes*:

* ``PUT`` with ``If-None-Match: *`` creates a key only if it does not exist
  (HTTP 412 otherwise) — the put-if-absent that ``create_exclusive`` needs, so
  two jobs committing one step cannot both win;
* ``PUT`` with ``If-Match: <etag>`` replaces a key only if it still holds the
  version we read — the compare-and-swap an ``overwrite=True`` re-save needs
  to replace a marker.

Everything else is a single PUT of a complete object (data, ``.metadata``,
``manifest.json``, ``LATEST``), which S3 makes visible atomically.  Large data
objects go up as multipart uploads, parts in parallel with a per-rank bound;
an upload is completed only by :meth:`S3Storage.close_write`, so a failing
writer aborts its upload instead of publishing a truncated object.

"Already exists" is recognised from the HTTP status (412) / error code
(``PreconditionFailed``) on the exception chain, never from the exception
type: s3fs maps the same 412 to ``FileExistsError`` on one server and to
``OSError(EINVAL)`` on another.

Where the rest lives: the probe that proves a store enforces those conditions
before a save writes a byte is :mod:`dcp_atomic.stores.s3_probe`; multipart uploads
and their cleanup are :mod:`dcp_atomic.stores.s3_multipart`; the retry budget, stall
deadlines and adaptive concurrency, shared with GCS, are
:mod:`dcp_atomic.stores.object_retry`.  This module is the operations: one request
each, classified (:class:`S3Errors`) and run under that policy.  s3fs's and
botocore's own retry loops are switched off so there is exactly one, visible
policy, and botocore's socket timeouts are derived from the stall deadline so
that ``dcp_atomic_stall_timeout_s`` is the one that cancels a slow request.

A commit marker PUT whose outcome is unknown (its reply lost, or cancelled
unanswered while the store may still apply it) is settled by reading the
marker back, for as long as a cancelled attempt could still land; if that does
not settle it, the error says "unknown" and what to run, never "not committed".

``storage_options`` keys read here (removed before the rest goes to s3fs):

``dcp_atomic_unsafe_single_writer`` (False)
    skip the probe and use unconditional PUTs (check-then-put for the marker);
    correct only if a single job ever writes the root.
The first six are :class:`~dcp_atomic.stores.object_retry.RetryPolicy`'s, shared with GCS:

``dcp_atomic_retry_budget_s`` (600)
    how long one request is retried before the save fails.
``dcp_atomic_max_attempts`` (no limit)
    an optional cap on attempts per request, on top of the time budget.
``dcp_atomic_backoff_s`` (0.1), ``dcp_atomic_max_backoff_s`` (10)
    first delay between attempts and its cap (doubling, with jitter).
``dcp_atomic_stall_timeout_s`` (60)
    an attempt that has not completed after this many seconds, plus 4 s per
    MiB it carries, is cancelled and retried (a stalled connection must not
    hang one rank while the others wait in a collective).  botocore's read timeout is set to the stall
    deadline of the largest request unless ``config_kwargs`` sets one.
``dcp_atomic_checksum_mode`` (botocore's default, ``"when_supported"``)
    ``"when_required"`` stops botocore >= 1.36 from sending ``aws-chunked``
    bodies with trailing checksums over ``https://``, which MinIO, Ceph RGW,
    GCS, OCI and others reject.
``dcp_atomic_part_size`` (16 MiB, at least 5 MiB)
    multipart part size and ranged-read chunk size.
``dcp_atomic_max_concurrency`` (8)
    part uploads (and ranged reads) in flight per rank, at most; throttling lowers it.
``dcp_atomic_data_prefixes`` (16, 0 = off)
    how many hashed key prefixes (``<root>/_dXX/<run>/...``) a save spreads its data objects over, so
    S3 partitions them once and keeps the split for every later save; recorded in the manifest, which
    alone decides where readers, ``verify`` and ``gc`` look (see :mod:`dcp_atomic.format.layout`).

Why one module of about 700 lines: the S3 operations behind the storage protocol; the retry budget, multipart
hygiene and the conditional-write probe are apart already (:mod:`.object_retry`, :mod:`.s3_multipart`,
:mod:`.s3_probe`).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import os
import posixpath
import threading
from typing import Any, Awaitable, TypeVar

from ..errors import CommitConflictError, ConfigurationError, StorageError
from .._base.key_prefixes import DATA_PREFIX_PATTERN, validate_data_prefixes
from .object_retry import (AdaptiveLimit, ObjectRequests, PreconditionFailed, RetryPolicy, chain,  # noqa: F401
                           copy_source_missing, settle_write)
from .s3_multipart import DEFAULT_UPLOAD_LEASE_S, S3ObjectWriter, StaleUpload, abort_stale_uploads  # noqa: F401
from .s3_probe import (AUTH_CODES, CHECKSUM_MODE, UNSAFE_SINGLE_WRITER, data_prefix_advice, require_conditional_writes,
                       require_data_writes)
from . import object_checksum
from .storage import FsspecStorage
from .._base import internals

log = logging.getLogger("dcp_atomic.s3")  # the name users filter on

T = TypeVar("T")

MIN_PART_SIZE = 5 << 20  # S3's minimum for every part but the last
DEFAULT_PART_SIZE = 16 << 20
SETTLE_S = 5.0  # the least time a marker write cancelled unanswered is read back for before "unknown"
READ_AHEAD = 1 << 20  # what a small ranged read fetches (see S3Storage._read_ahead)

CHECKSUM_MODES = ("when_supported", "when_required")
MIN_BOTOCORE = "1.35.69"  # the first botocore whose PutObject knows IfMatch (IfNoneMatch came earlier)
DATA_PREFIXES = "dcp_atomic_data_prefixes"
DEFAULT_DATA_PREFIXES = 16  # 16 x 3,500 PUT/s once S3 has split them

THROTTLE_STATUS = frozenset({429, 503})
THROTTLE_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "TooManyRequests",
                            "RequestLimitExceeded"})
RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})
RETRYABLE_CODES = THROTTLE_CODES | {
    "RequestTimeout", "RequestTimeoutException", "InternalError", "ServiceUnavailable",
    "ConditionalRequestConflict",  # AWS: a concurrent conditional write on the key is in progress; retry
}

_put_object_parameters: set[str] | None = None


# -- classifying failures ----------------------------------------------------------------


def http_error(exc: BaseException) -> tuple[int | None, str | None, str]:
    """(HTTP status, S3 error code, message) of the S3 response behind ``exc``, if any.

    s3fs translates botocore's ``ClientError`` into builtin exceptions but keeps
    it as ``__cause__``; the response there is the only reliable evidence.
    """
    for e in chain(exc):
        response = getattr(e, "response", None)
        if isinstance(response, dict) and ("Error" in response or "ResponseMetadata" in response):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            error = response.get("Error", {}) or {}
            return status, error.get("Code"), str(error.get("Message") or e)
    return None, None, str(exc)


def is_precondition_failed(exc: BaseException) -> bool:
    status, code, _ = http_error(exc)
    return status == 412 or code == "PreconditionFailed"


def _transport_errors() -> tuple[type[BaseException], ...]:
    errors: tuple[type[BaseException], ...] = (ConnectionError, TimeoutError, asyncio.TimeoutError)
    try:
        from s3fs.core import S3_RETRYABLE_ERRORS  # socket timeouts, botocore HTTP/parse errors, aiohttp payload

        errors += tuple(S3_RETRYABLE_ERRORS)
    except ImportError:  # pragma: no cover - s3fs is required for S3Storage anyway
        pass
    try:
        from botocore.exceptions import ConnectionError as BotoConnectionError

        errors += (BotoConnectionError,)
    except ImportError:  # pragma: no cover
        pass
    return errors


def is_throttled(exc: BaseException) -> bool:
    status, code, _ = http_error(exc)
    return status in THROTTLE_STATUS or code in THROTTLE_CODES


def is_retryable(exc: BaseException) -> bool:
    """Throttling, 5xx, and transport failures (reset, timeout, garbled response) are worth another try."""
    status, code, _ = http_error(exc)
    if status is not None or code is not None:
        return status in RETRYABLE_STATUS or code in RETRYABLE_CODES
    transport = _transport_errors()
    return any(isinstance(e, transport) for e in chain(exc))


def _is_not_found(exc: BaseException) -> bool:
    status, code, _ = http_error(exc)
    if code == "NoSuchBucket":
        return False
    if status == 404 or code in ("NoSuchKey", "NoSuchUpload", "404", "NotFound"):
        return True
    return status is None and any(isinstance(e, FileNotFoundError) for e in chain(exc))


_sessions: dict[tuple[int, str], Any] = {}
_sessions_lock = threading.Lock()


def _shared_session(kwargs: dict[str, Any]) -> Any:
    """One aiobotocore session per process and session options (profile, ...).

    A session only holds configuration and the parsed service model; every
    S3Storage still builds its own client and connections from it, so nothing
    a save could leave behind is shared.
    """
    import aiobotocore.session

    key = (os.getpid(), repr(sorted(kwargs.items())))
    with _sessions_lock:
        session = _sessions.get(key)
        if session is None:
            session = _sessions[key] = aiobotocore.session.AioSession(**kwargs)
        return session


def _put_object_knows_conditions() -> set[str]:
    """The conditional PutObject parameters the installed botocore knows (older ones drop them silently)."""
    global _put_object_parameters
    if _put_object_parameters is None:
        import botocore.loaders

        model = botocore.loaders.create_loader().load_service_model("s3", "service-2")
        members = model["shapes"][model["operations"]["PutObject"]["input"]["shape"]]["members"]
        _put_object_parameters = {"IfNoneMatch", "IfMatch"} & set(members)
    return _put_object_parameters


def _require_botocore_conditions() -> None:
    missing = sorted({"IfNoneMatch", "IfMatch"} - _put_object_knows_conditions())
    if missing:
        import botocore

        raise ConfigurationError(
            f"the installed botocore {botocore.__version__} does not know {' and '.join(missing)} on PutObject: "
            f"it would send the commit marker without its condition, and two jobs could both commit a step. "
            f"Upgrade to botocore >= {MIN_BOTOCORE} (pip install -U s3fs aiobotocore boto3 pulls a matching set).",
            botocore_version=botocore.__version__, missing=missing,
        )


def _add_content_md5(request, **_: Any) -> None:
    """DeleteObjects with Content-MD5: botocore >= 1.36 sends a CRC32 instead, which MinIO, Ceph RGW and
    other stores that predate flexible checksums refuse."""
    body = request.body
    if isinstance(body, (bytes, bytearray)) and "Content-MD5" not in request.headers:
        request.headers["Content-MD5"] = base64.b64encode(hashlib.md5(body).digest()).decode()


class S3Errors:
    """What botocore / s3fs exceptions mean (see :class:`~dcp_atomic.stores.object_retry.ErrorClassifier`)."""

    store = "S3"

    def __init__(self, storage: "S3Storage") -> None:
        self.storage = storage

    def reply(self, exc: BaseException) -> tuple[int | None, str | None, str]:
        return http_error(exc)

    retryable = staticmethod(is_retryable)
    throttled = staticmethod(is_throttled)
    precondition_failed = staticmethod(is_precondition_failed)
    not_found = staticmethod(_is_not_found)

    def hint(self, status: int | None, code: str | None, message: str, url: str) -> str | None:
        if code == "NoSuchBucket":
            return "The bucket does not exist: create it or fix the root URL"
        if status in (401, 403) or code in AUTH_CODES or code == "AccessDenied":
            data = self.storage.data_run_of(url)
            if data is not None:
                return ("The credentials may not write or read this save's data. " + data).rstrip(".")
            return "The credentials in storage_options / the environment may not write or read this bucket"
        if status in (400, 501) and self.storage.checksum_mode != "when_required":
            return (f"The store may not accept the request checksums botocore >= 1.36 sends (aws-chunked bodies "
                    f"with trailing checksums over https): pass storage_options={{'{CHECKSUM_MODE}': "
                    f"'when_required'}}; otherwise check the endpoint, bucket and permissions")
        return None


# -- the storage ---------------------------------------------------------------------------


class S3Storage(FsspecStorage):
    """S3 through s3fs, with conditional PUTs for the commit, bounded retries and multipart uploads.

    One instance per writer / reader / catalog call: the underlying
    ``S3FileSystem`` is never shared between saves (``skip_instance_cache``)
    and never caches listings, so nothing stale outlives one operation.
    """

    exclusive_create_is_atomic = True
    link_kind = "server-side copy"  # CopyObject: reuse (P15) never uploads a byte the bucket already holds
    multipart_uploads = True  # what s3_multipart.abort_stale_uploads asks (it never imports this module)

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        options = dict(storage_options or {})  # never mutate the caller's dict
        self._init_args = (url, dict(options))  # what a pickle carries (see __reduce__)
        self.unsafe_single_writer = bool(options.pop(UNSAFE_SINGLE_WRITER, False))
        self.policy = RetryPolicy.pop_from(options)
        self.max_concurrency = self.policy.max_concurrency
        self.part_size = int(options.pop("dcp_atomic_part_size", DEFAULT_PART_SIZE))
        self.checksum_mode = options.pop(CHECKSUM_MODE, None)
        try:
            self.data_prefixes = validate_data_prefixes(options.pop(DATA_PREFIXES, DEFAULT_DATA_PREFIXES))
        except ValueError as e:
            raise ConfigurationError(f"{DATA_PREFIXES}: {e}", option=DATA_PREFIXES) from None
        if self.checksum_mode not in (None, *CHECKSUM_MODES):
            raise ConfigurationError(f"{CHECKSUM_MODE} must be one of {CHECKSUM_MODES}, got {self.checksum_mode!r}")
        if self.part_size < MIN_PART_SIZE:
            raise ConfigurationError(
                f"dcp_atomic_part_size={self.part_size} is below S3's 5 MiB minimum part size ({MIN_PART_SIZE})"
            )
        if not self.unsafe_single_writer:
            _require_botocore_conditions()
        # No listing cache and no shared instance: a reused S3FileSystem would carry another save's state.
        options["use_listings_cache"] = False
        options["skip_instance_cache"] = True
        # One retry policy, ours: botocore's loop off here, s3fs's below (its `retries` counts attempts).
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("retries", {"total_max_attempts": 1})
        config.setdefault("max_pool_connections", max(10, 2 * self.max_concurrency))
        # Socket timeouts from the stall deadline: s3fs's own (15 s read) would cut a slow reply before ours does.
        connect_timeout, read_timeout = self.policy.socket_timeouts(self.part_size)
        config.setdefault("connect_timeout", connect_timeout)
        config.setdefault("read_timeout", read_timeout)
        if self.checksum_mode is not None:
            config.setdefault("request_checksum_calculation", self.checksum_mode)
            config.setdefault("response_checksum_validation", self.checksum_mode)
        options["config_kwargs"] = config
        super().__init__(url, options)
        self.fs.retries = 1
        if self.fs.session is None:  # botocore's model loading costs ~50 ms per fresh session: share one
            internals.share_s3_session(self.fs, _shared_session(self.fs.kwargs))
        if self.unsafe_single_writer:
            self.exclusive_create_is_atomic = False
        self._part_slots = threading.BoundedSemaphore(self.max_concurrency)  # parts buffered: bounds memory
        self.requests = ObjectRequests(self.policy, S3Errors(self), lambda: self.endpoint)  # budget, deadlines, limit
        self._window = threading.local()  # per reader thread: path, start, data, eof, removals of its read-ahead
        self._removals = 0  # remove() calls so far: a window read before one may hold bytes of a removed object

    # -- plumbing ------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        return (getattr(self.fs, "endpoint_url", None) or self.fs.client_kwargs.get("endpoint_url")
                or "aws")

    def _split(self, path: str) -> tuple[str, str]:
        bucket, key, _ = self.fs.split_path(path)
        return bucket, key

    def _url(self, path: str) -> str:
        return f"s3://{path}"

    def _run(self, coro: Awaitable[T]) -> T:
        """Run a coroutine on s3fs's event loop thread and wait for it.

        One loop per process serves every request (and holds the one adaptive limit): a second loop with
        its own client and pool gained nothing where measured (docs/benchmarks.md, "Where one rank's S3 time goes").
        """
        return asyncio.run_coroutine_threadsafe(coro, self.fs.loop).result()

    def __reduce__(self):
        """Pickle to URL + options (DCP's process-based async executor pickles the writer): the copy
        builds its own client, event loop and limits; nothing of a save in progress travels."""
        return (type(self), self._init_args)

    async def _call(self, what: str, path: str, method: str, **kwargs: Any) -> dict:
        body = kwargs.get("Body")
        return await self.requests.run(what, self._url(path), lambda: internals.s3_call(self.fs, method, **kwargs),
                                       len(body) if body is not None else 0)

    async def _put(self, path: str, data: bytes, **conditions: str) -> dict:
        bucket, key = self._split(path)
        return await self._call("PUT", path, "put_object", Bucket=bucket, Key=key, Body=data, **conditions)

    async def _get(self, path: str, offset: int | None = None, length: int | None = None) -> tuple[bytes, str | None]:
        bucket, key = self._split(path)
        extra = {} if offset is None else {"Range": f"bytes={offset}-{offset + length - 1}"}

        async def once() -> tuple[bytes, str | None]:
            response = await internals.s3_call(self.fs, "get_object", Bucket=bucket, Key=key, **extra)
            try:
                return await response["Body"].read(), response.get("ETag")
            finally:
                response["Body"].close()

        try:
            return await self.requests.run("GET", self._url(path), once, length or 0)
        except StorageError as e:
            if e.details.get("status") == 416:  # range starts at or past the end: EOF, like pread
                return b"", None
            raise

    # -- conditional-write probe ---------------------------------------------------------

    def check_commit_support(self, directory: str, *, overwrite: bool = False) -> None:
        """Before a save writes a byte: the store must enforce the conditions its commit will use, and these
        credentials must be able to write where the data goes (see :mod:`dcp_atomic.stores.s3_probe`)."""
        require_conditional_writes(self, self.join(directory, "probe"), if_match=overwrite)  # probes in ``directory``
        data_dir = self._data_dir_of(directory)
        if data_dir is not None and not self.unsafe_single_writer:
            require_data_writes(self, data_dir, f"_d00.._d{self.data_prefixes - 1:02x}")

    def require_conditional_writes(self, near: str, *, if_match: bool = False) -> None:
        require_conditional_writes(self, near, if_match=if_match)

    def _data_dir_of(self, attempt: str) -> str | None:
        """Where this attempt's data goes under the first hashed prefix (None: beside the manifest)."""
        if not self.data_prefixes:
            return None
        relative = posixpath.relpath(attempt, self.root)
        if relative.startswith(".."):
            return None
        return self.join(self.root, "_d00", relative)

    def data_run_of(self, url: str) -> str | None:
        """For a key under a hashed data prefix, the advice naming those prefixes and their IAM resources."""
        bucket, key = self._split(url[len("s3://"):] if url.startswith("s3://") else url)
        root_key = self._split(self.root)[1].strip("/")
        rest = key[len(root_key):].lstrip("/") if key.startswith(root_key) else None
        parts = (rest or "").split("/")
        if len(parts) < 2 or not DATA_PREFIX_PATTERN.fullmatch(parts[0]):
            return None
        return data_prefix_advice(bucket, root_key, parts[1], "_dXX")

    # -- Storage primitives --------------------------------------------------------------

    def makedirs(self, path: str) -> None:
        """Object stores have no directories (and s3fs's makedirs would LIST on every rank)."""

    def open_write(self, path: str) -> "S3ObjectWriter":
        return S3ObjectWriter(self, path)

    def close_write(self, stream: "S3ObjectWriter") -> str | None:
        return stream.commit()

    def read_file(self, path: str) -> bytes:
        return self._run(self._get(path))[0]

    def link(self, source: str, target: str) -> str | None:
        """One CopyObject (reuse, P15): S3 copies the object inside the bucket, no byte of it passes through this
        process.  The copy is a physical object of its own; it asks for the copy's CRC32 (:mod:`.object_checksum`)
        and returns it, which the caller compares with the one recorded when the source was written (None: the store
        reported none, and the caller verifies the copy against its digests).  ``FileNotFoundError`` where
        ``source`` is gone; S3 refuses a single copy above 5 GiB (a stable file holds at most 64 MiB unless one item
        is larger): :class:`StorageError`, and the caller writes the file instead."""
        source_bucket, source_key = self._split(source)
        bucket, key = self._split(target)
        # a store set to send no checksums (when_required) may refuse the header too
        extra = {} if self.checksum_mode == "when_required" else {"ChecksumAlgorithm": object_checksum.COPY_ALGORITHM}
        try:
            reply = self._run(self._call("COPY", target, "copy_object", Bucket=bucket, Key=key,
                                         CopySource={"Bucket": source_bucket, "Key": source_key}, **extra))
        except FileNotFoundError:
            raise copy_source_missing(self._url(source)) from None
        crc = object_checksum.from_reply(reply.get("CopyObjectResult"))
        return None if crc is None else object_checksum.render(crc)

    def read_versioned(self, path: str) -> tuple[bytes, str | None]:
        """The object and its ETag, from one GET: the version :meth:`replace_if_unchanged` must still find."""
        return self._run(self._get(path))

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        if length <= 0:
            return b""
        hit = self._from_window(path, offset, length)
        if hit is not None and (len(hit) == length or self._window.eof):
            return bytes(hit)
        if length < READ_AHEAD // 4:
            return bytes(self._read_ahead(path, offset)[:length])
        out = bytearray(length)
        filled = self._run(self._get_into(path, offset, memoryview(out)))
        return out if filled == length else out[:filled]

    def readinto_range(self, path: str, offset: int, buffer: memoryview) -> int:
        """Fill ``buffer`` by parallel ranged GETs straight into it; short only at the object's end."""
        buffer = memoryview(buffer).cast("B")
        done = 0
        hit = self._from_window(path, offset, len(buffer))
        if hit is not None:  # the read-ahead of the item's header already holds its first bytes
            buffer[: len(hit)] = hit
            done = len(hit)
            if done == len(buffer) or self._window.eof:
                return done
        rest = len(buffer) - done
        if rest < READ_AHEAD // 4:  # a small tensor straddling the window: read ahead again
            data = self._read_ahead(path, offset + done)[:rest]
            buffer[done : done + len(data)] = data
            return done + len(data)
        return done + self._run(self._get_into(path, offset + done, buffer[done:]))

    def _from_window(self, path: str, offset: int, length: int) -> memoryview | None:
        """The leading part of [offset, offset + length) that this thread's read-ahead window holds."""
        window = self._window
        if (getattr(window, "path", None) != path or window.removals != self._removals
                or not window.start <= offset < window.start + len(window.data)):
            return None
        lo = offset - window.start
        return memoryview(window.data)[lo : lo + length]

    def _read_ahead(self, path: str, offset: int) -> bytes:
        """Small reads (an item's header, a small tensor) fetch READ_AHEAD bytes: the reader goes on
        sequentially through the same object, so the next reads are served from memory.  Safe to keep:
        data objects are immutable (a new save_id for every attempt), and a name reuse removes and writes anew
        invalidates every window (``_removals``)."""
        data = self._run(self._get(path, offset, READ_AHEAD))[0]
        window = self._window
        window.path, window.start, window.data, window.eof = path, offset, data, len(data) < READ_AHEAD
        window.removals = self._removals
        return data

    async def _get_into(self, path: str, offset: int, view: memoryview) -> int:
        """``view`` from ``offset`` as ranged GETs of ``part_size``, at most ``max_concurrency`` in flight."""
        length = len(view)
        if length == 0:
            return 0
        ends: list[int] = []  # where a short read says the object ends

        async def chunk(start: int) -> None:  # in flight: bounded by self.requests
            size = min(self.part_size, length - start)
            data, _ = await self._get(path, offset + start, size)
            view[start : start + len(data)] = data
            if len(data) < size:
                ends.append(start + len(data))

        tasks = [asyncio.ensure_future(chunk(start)) for start in range(0, length, self.part_size)]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            raise
        return min(ends) if ends else length

    def size(self, path: str) -> int:
        bucket, key = self._split(path)
        head = self._run(self._call("HEAD", path, "head_object", Bucket=bucket, Key=key))
        return int(head["ContentLength"])

    def modified(self, path: str) -> float | None:
        bucket, key = self._split(path)
        try:
            head = self._run(self._call("HEAD", path, "head_object", Bucket=bucket, Key=key))
        except FileNotFoundError:
            return None  # a missing key, or a "directory" (a prefix has no time on S3)
        stamp = head.get("LastModified")
        return stamp.timestamp() if stamp is not None else None

    def publish(self, path: str, data: bytes) -> None:
        self.require_conditional_writes(path)
        self._run(self._put(path, data))

    def create_exclusive(self, path: str, data: bytes) -> bool:
        """``If-None-Match: *``; False on 412.  A 412 after a retried PUT may be our own
        earlier attempt: the commit protocol reads the marker back and recognises its save_id."""
        self.require_conditional_writes(path)
        if self.unsafe_single_writer:
            if self._exists(path):
                return False
            self._put_settled(path, data)
            return True
        try:
            self._put_settled(path, data, IfNoneMatch="*")
        except PreconditionFailed:
            return False
        return True

    def _put_settled(self, path: str, data: bytes, **conditions: str) -> None:
        """PUT a commit marker; after a final failure, read it back and report the truth.

        An attempt may be applied with its reply lost, and the retries then fail
        (5xx), or cancelled unanswered and applied later: "nothing committed" would
        be a lie if the marker names this save (see :func:`~dcp_atomic.stores.object_retry.settle_write`).
        """
        try:
            self._run(self._put(path, data, **conditions))
        except StorageError as e:
            settle_write(e, data, lambda: self._current(path), self._url(path),
                         settle_s=max(SETTLE_S, self.policy.stall_timeout_s), create="IfNoneMatch" in conditions,
                         store=f"the store at {self.endpoint}")

    def replace(self, path: str, data: bytes) -> None:
        """One plain PUT."""
        self.require_conditional_writes(path, if_match=False)
        self._run(self._put(path, data))

    def replace_if_unchanged(self, path: str, data: bytes, version: str | None) -> None:
        """``If-Match`` on the ETag ``version`` (a HEAD's when the caller has none; ``If-None-Match: *`` when the
        object is gone).  The commit protocol replaces a marker so (``overwrite=True``, a superseded step) after
        reading it; if another job replaced or removed it in between, this save must not silently win:
        :class:`CommitConflictError`."""
        self.require_conditional_writes(path, if_match=True)
        if self.unsafe_single_writer:
            self._put_settled(path, data)
            return
        etag = version or self._head_etag(path)
        try:
            if etag is None:
                self._put_settled(path, data, IfNoneMatch="*")
            else:
                self._put_settled(path, data, IfMatch=etag)
        except (PreconditionFailed, FileNotFoundError) as e:
            retried = isinstance(e, PreconditionFailed) and e.attempts > 1
            if retried and self._current(path) == data:
                return  # our own earlier attempt went through; its reply was lost
            raise CommitConflictError(
                f"{self._url(path)}: the commit marker changed while this save was replacing it (PUT with "
                f"If-Match: {etag} failed): another job re-saved or removed this step at the same time. Nothing "
                "of this save is visible. Read the step again and re-save with overwrite=True if you still "
                "want to replace it.",
                path=self._url(path),
            ) from None

    def _current(self, path: str) -> bytes | None:
        try:
            return self._run(self._get(path))[0]
        except FileNotFoundError:
            return None

    def _head_etag(self, path: str) -> str | None:
        bucket, key = self._split(path)
        try:
            return self._run(self._call("HEAD", path, "head_object", Bucket=bucket, Key=key)).get("ETag")
        except FileNotFoundError:
            return None

    def _exists(self, path: str) -> bool:
        return self._head_etag(path) is not None

    def list_dir(self, path: str) -> list[str]:
        """One LIST with delimiter (paginated).  Only global rank 0 and the CLI call this."""
        bucket, key = self._split(path)
        prefix = key.rstrip("/") + "/" if key else ""
        names: set[str] = set()
        try:
            for page in self._pages("LIST", path, "list_objects_v2", {"ContinuationToken": "NextContinuationToken"},
                                    Bucket=bucket, Prefix=prefix, Delimiter="/"):
                names.update(p["Prefix"][len(prefix):].rstrip("/") for p in page.get("CommonPrefixes", []) or [])
                names.update(o["Key"][len(prefix):] for o in page.get("Contents", []) or [])
        except FileNotFoundError:
            return []
        names.discard("")
        return sorted(names)

    def _list_keys(self, bucket: str, prefix: str, path: str) -> list[str]:
        return [o["Key"] for page in self._pages("LIST", path, "list_objects_v2",
                                                 {"ContinuationToken": "NextContinuationToken"},
                                                 Bucket=bucket, Prefix=prefix)
                for o in page.get("Contents", []) or []]

    def _pages(self, what: str, path: str, method: str, markers: dict[str, str], **kwargs: Any):
        """The pages of a listing.  ``markers`` maps each request parameter to the reply field that
        continues it; a store that says "truncated" without a new marker ends the listing with a
        warning instead of looping forever."""
        seen: set[tuple] = set()
        while True:
            page = self._run(self._call(what, path, method, **kwargs))
            yield page
            if not page.get("IsTruncated"):
                return
            following = {param: page[reply] for param, reply in markers.items() if page.get(reply)}
            position = tuple(sorted(following.items()))
            if not following or position in seen:
                log.warning("S3 %s of %s at %s: the reply says the listing is truncated but gives no new "
                            "continuation marker (%s); stopping after %d page(s), the listing may be incomplete",
                            what, self._url(path), self.endpoint, ", ".join(markers.values()), len(seen) + 1)
                return
            seen.add(position)
            kwargs.update(following)

    def remove(self, path: str) -> None:
        """Delete the object ``path`` and everything under ``path/`` (gc, tools, and reuse's copy that failed its
        check, whose name the rank then writes anew: no read-ahead window from before survives it).

        Stores backed by a file system (SeaweedFS) keep the folders the deleted objects lay in and list them as
        common prefixes, so a removed step would still be listed (``ls``: partial, ``gc``: abandoned): once the
        objects are gone, those folders are deleted too, deepest first (a folder that is not empty is kept; stores
        without folders answer "no such key", which is ignored)."""
        bucket, key = self._split(path)
        if not key:
            raise ValueError(f"refusing to remove a whole bucket: {path}")
        self._removals += 1
        under = self._list_keys(bucket, key.rstrip("/") + "/", path)
        self._delete_keys(path, bucket, [key] + under)
        if under:
            self._delete_keys(path, bucket, _folders_of(key, under))

    def _delete_keys(self, path: str, bucket: str, keys: list[str]) -> None:
        self._run(self.fs.set_session())
        self.fs.s3.meta.events.register("before-sign.s3.DeleteObjects", _add_content_md5,
                                        unique_id="dcp-atomic-content-md5")
        for i in range(0, len(keys), 1000):
            batch = {"Objects": [{"Key": k} for k in keys[i : i + 1000]], "Quiet": True}
            reply = self._run(self._call("DELETE", path, "delete_objects", Bucket=bucket, Delete=batch))
            failed = [err for err in reply.get("Errors", []) or [] if err.get("Code") != "NoSuchKey"]
            if failed:
                raise StorageError(
                    f"S3 delete under {self._url(path)} failed for {len(failed)} object(s), e.g. "
                    f"{failed[0].get('Key')}: {failed[0].get('Code')} {failed[0].get('Message')}",
                    path=self._url(path),
                )

    def describe(self) -> str:
        return self.url

    def abort_stale_uploads(self, prefix: str, older_than_s: float = DEFAULT_UPLOAD_LEASE_S) -> list["StaleUpload"]:
        """Method form of :func:`abort_stale_uploads` (what ``retention.apply_gc`` looks up)."""
        return abort_stale_uploads(self, prefix, older_than_s)


def _folders_of(key: str, under: list[str]) -> list[str]:
    """The folder keys (``a/b/``) from ``key/`` down to each key's parent in ``under``, deepest first."""
    top = key.rstrip("/")
    folders = {top + "/"}
    for name in under:
        parent = name.rpartition("/")[0]
        while len(parent) > len(top):
            folders.add(parent + "/")
            parent = parent.rpartition("/")[0]
    return sorted(folders, key=lambda f: (-f.count("/"), f))
