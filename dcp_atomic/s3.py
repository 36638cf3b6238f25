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

Some stores accept the conditional headers and silently ignore them, which
would turn the commit into last-writer-wins.  The first control-file write of
a root in a process therefore *probes* the store, next to that first write
(under the run's prefix, where a scoped IAM policy allows writes): a throwaway
conditional create, twice, and a mismatching ``If-Match``.  ``If-None-Match``
must hold for every save; ``If-Match`` only for replacing a marker
(``overwrite=True``).  A probe that fails says why: credentials, permissions,
KMS, the request checksum mode, or conditional writes not implemented —
unless the caller opts out with ``storage_options={"dcp_atomic_unsafe_single_writer": True}``.

Requests that fail with throttling (429/503 SlowDown), a 5xx, a dropped
connection or a stall are retried with exponential backoff and jitter until a
*time* budget is spent (S3 answers SlowDown for minutes while it re-partitions
a prefix); s3fs's and botocore's own retry loops are switched off so there is
exactly one, visible policy.  Each rank also adapts how many requests it keeps
in flight: throttling halves it, successes win it back one at a time.  When the
budget is spent the caller gets a :class:`~dcp_atomic.errors.StorageError`
naming the rank, the key, the HTTP status and what to do.

``storage_options`` keys read here (removed before the rest goes to s3fs):

``dcp_atomic_unsafe_single_writer`` (False)
    skip the probe and use unconditional PUTs (check-then-put for the marker);
    correct only if a single job ever writes the root.
``dcp_atomic_retry_budget_s`` (600)
    how long one request is retried before the save fails.
``dcp_atomic_max_attempts`` (no limit)
    an optional cap on attempts per request, on top of the time budget.
``dcp_atomic_backoff_s`` (0.1), ``dcp_atomic_max_backoff_s`` (10)
    first delay between attempts and its cap (doubling, with jitter).
``dcp_atomic_stall_timeout_s`` (60)
    an attempt that has not completed after this many seconds, plus 4 s per
    MiB it carries, is cancelled and retried (a stalled connection must not
    hang one rank while the others wait in a collective).
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
    alone decides where readers, ``verify`` and ``gc`` look (see :mod:`dcp_atomic.layout`).
"""

from __future__ import annotations

import asyncio
import base64
import errno
import hashlib
import logging
import os
import posixpath
import random
import re
import secrets
import socket
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, TypeVar

from .errors import CheckpointError, CommitConflictError, ConfigurationError, StorageError
from .layout import DATA_PREFIX_PATTERN, MARKER, validate_data_prefixes
from .storage import FsspecStorage, Storage

log = logging.getLogger(__name__)

T = TypeVar("T")

UNSAFE_SINGLE_WRITER = "dcp_atomic_unsafe_single_writer"
MIN_PART_SIZE = 5 << 20  # S3's minimum for every part but the last
DEFAULT_PART_SIZE = 16 << 20
MAX_PARTS = 10_000
PROBE_PREFIX = ".dcp-atomic-probe-"
READ_AHEAD = 1 << 20  # what a small ranged read fetches (see S3Storage._read_ahead)
DEFAULT_UPLOAD_LEASE_S = 6 * 3600.0  # gc's default lease: no save runs longer than this

RETRY_BUDGET_S = 600.0  # S3 answers SlowDown for minutes while it re-partitions a prefix
STALL_TIMEOUT_S = 60.0
STALL_BYTES_PER_S = 256 << 10  # an attempt's deadline grows by 4 s per MiB it uploads or downloads
CHECKSUM_MODE = "dcp_atomic_checksum_mode"
CHECKSUM_MODES = ("when_supported", "when_required")
MIN_BOTOCORE = "1.35.69"  # the first botocore whose PutObject knows IfMatch (IfNoneMatch came earlier)
DATA_PREFIXES = "dcp_atomic_data_prefixes"
DEFAULT_DATA_PREFIXES = 16  # 16 x 3,500 PUT/s once S3 has split them

NOTHING_COMMITTED = "Nothing of this save is committed; the previous checkpoint is intact."
THROTTLE_STATUS = frozenset({429, 503})
THROTTLE_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "TooManyRequests",
                            "RequestLimitExceeded"})
RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})
RETRYABLE_CODES = THROTTLE_CODES | {
    "RequestTimeout", "RequestTimeoutException", "InternalError", "ServiceUnavailable",
    "ConditionalRequestConflict",  # AWS: a concurrent conditional write on the key is in progress; retry
}
AUTH_CODES = frozenset({"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
                        "TokenRefreshRequired", "AuthorizationHeaderMalformed", "InvalidSecurity"})
CHECKSUM_WORDS = ("checksum", "chunked", "trailer", "content-sha256", "content-md5", "baddigest",
                  "invaliddigest", "streaming")


@dataclass(frozen=True)
class ProbeResult:
    """What the probe proved about a store: ``If-None-Match: *`` is always required, ``If-Match`` only to replace."""

    if_match: bool


_probed: dict[tuple[str, str], ProbeResult] = {}  # (endpoint, root) -> what the probe found, per process
_probe_lock = threading.Lock()
_warned_unsafe: set[tuple[str, str]] = set()
_put_object_parameters: set[str] | None = None


# -- classifying failures ----------------------------------------------------------------


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def http_error(exc: BaseException) -> tuple[int | None, str | None, str]:
    """(HTTP status, S3 error code, message) of the S3 response behind ``exc``, if any.

    s3fs translates botocore's ``ClientError`` into builtin exceptions but keeps
    it as ``__cause__``; the response there is the only reliable evidence.
    """
    for e in _chain(exc):
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
    return any(isinstance(e, transport) for e in _chain(exc))


def _is_not_found(exc: BaseException) -> bool:
    status, code, _ = http_error(exc)
    if code == "NoSuchBucket":
        return False
    if status == 404 or code in ("NoSuchKey", "NoSuchUpload", "404", "NotFound"):
        return True
    return status is None and any(isinstance(e, FileNotFoundError) for e in _chain(exc))


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


def _rejects_request(error: StorageError) -> bool:
    """400 / 405 / 501: the store refused the request's form (a header, a checksum), not its state."""
    return error.details.get("status") in (400, 405, 501) or error.details.get("code") in (
        "NotImplemented", "InvalidArgument", "InvalidRequest")


def _probe_failure_class(error: StorageError) -> str | None:
    """Which cause a failed probe request points to: auth, permissions, kms, checksum; None if unclear."""
    status, code = error.details.get("status"), error.details.get("code") or ""
    text = f"{code} {error.details.get('reply_message', '')}".lower()
    if code.startswith("KMS") or "kms" in text:
        return "kms"
    if code in AUTH_CODES or status == 401:
        return "auth"
    if status == 403 or code in ("AccessDenied", "AllAccessDisabled"):
        return "permissions"
    if _rejects_request(error) and any(word in text for word in CHECKSUM_WORDS):
        return "checksum"
    return None


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


class _RequestStalled(TimeoutError):
    """An attempt that did not complete within its stall deadline (cancelled, then retried)."""


class AdaptiveLimit:
    """Requests in flight per rank, adapted to the store: halve on throttling, +1 per window of successes.

    Lives on s3fs's event loop (every method runs there), so it needs no lock.
    A throttled attempt cuts the limit only if it started after the last cut:
    a burst of SlowDowns from one round of requests counts once.
    """

    def __init__(self, ceiling: int) -> None:
        self.ceiling = ceiling
        self.limit = ceiling
        self.in_flight = 0
        self.epoch = 0  # how many cuts so far
        self._successes = 0
        self._changed: asyncio.Condition | None = None

    async def acquire(self) -> int:
        if self._changed is None:
            self._changed = asyncio.Condition()
        async with self._changed:
            await self._changed.wait_for(lambda: self.in_flight < self.limit)
            self.in_flight += 1
        return self.epoch

    async def release(self, epoch: int, *, ok: bool, throttled: bool) -> None:
        async with self._changed:
            self.in_flight -= 1
            if throttled and epoch == self.epoch:
                self.limit = max(1, self.limit // 2)
                self.epoch += 1
                self._successes = 0
                log.info("S3 throttling: at most %d request(s) in flight on this rank now", self.limit)
            elif ok and self.limit < self.ceiling:
                self._successes += 1
                if self._successes >= self.limit:
                    self.limit += 1
                    self._successes = 0
            self._changed.notify_all()


def _rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # noqa: BLE001 - identity for a message only
        pass
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


class _PreconditionFailed(Exception):
    """HTTP 412: the condition of a conditional write did not hold (internal)."""

    def __init__(self, attempts: int) -> None:
        super().__init__(f"precondition failed after {attempts} attempt(s)")
        self.attempts = attempts


# -- the storage ---------------------------------------------------------------------------


class S3Storage(FsspecStorage):
    """S3 through s3fs, with conditional PUTs for the commit, bounded retries and multipart uploads.

    One instance per writer / reader / catalog call: the underlying
    ``S3FileSystem`` is never shared between saves (``skip_instance_cache``)
    and never caches listings, so nothing stale outlives one operation.
    """

    exclusive_create_is_atomic = True

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        options = dict(storage_options or {})  # never mutate the caller's dict
        self._init_args = (url, dict(options))  # what a pickle carries (see __reduce__)
        self.unsafe_single_writer = bool(options.pop(UNSAFE_SINGLE_WRITER, False))
        attempts = options.pop("dcp_atomic_max_attempts", None)
        self.max_attempts = None if attempts is None else int(attempts)
        self.retry_budget_s = float(options.pop("dcp_atomic_retry_budget_s", RETRY_BUDGET_S))
        self.stall_timeout_s = float(options.pop("dcp_atomic_stall_timeout_s", STALL_TIMEOUT_S))
        self.backoff_s = float(options.pop("dcp_atomic_backoff_s", 0.1))
        self.max_backoff_s = float(options.pop("dcp_atomic_max_backoff_s", 10.0))
        self.part_size = int(options.pop("dcp_atomic_part_size", DEFAULT_PART_SIZE))
        self.max_concurrency = int(options.pop("dcp_atomic_max_concurrency", 8))
        self.checksum_mode = options.pop(CHECKSUM_MODE, None)
        try:
            self.data_prefixes = validate_data_prefixes(options.pop(DATA_PREFIXES, DEFAULT_DATA_PREFIXES))
        except ValueError as e:
            raise ConfigurationError(f"{DATA_PREFIXES}: {e}", option=DATA_PREFIXES) from None
        if (self.max_attempts is not None and self.max_attempts < 1) or self.max_concurrency < 1:
            raise ConfigurationError("dcp_atomic_max_attempts and dcp_atomic_max_concurrency must be >= 1")
        if self.retry_budget_s <= 0 or self.stall_timeout_s <= 0:
            raise ConfigurationError("dcp_atomic_retry_budget_s and dcp_atomic_stall_timeout_s must be > 0 seconds")
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
        if self.checksum_mode is not None:
            config.setdefault("request_checksum_calculation", self.checksum_mode)
            config.setdefault("response_checksum_validation", self.checksum_mode)
        options["config_kwargs"] = config
        super().__init__(url, options)
        self.fs.retries = 1
        if self.fs.session is None:  # botocore's model loading costs ~50 ms per fresh session: share one
            self.fs.session = _shared_session(self.fs.kwargs)
            self.fs._session_is_owned = False  # s3fs must not close it with this filesystem
        if self.unsafe_single_writer:
            self.exclusive_create_is_atomic = False
        self._etags: dict[str, str] = {}  # marker path -> ETag of the version last read (for If-Match)
        self._part_slots = threading.BoundedSemaphore(self.max_concurrency)  # parts buffered: bounds memory
        self.requests = AdaptiveLimit(self.max_concurrency)  # requests in flight: adapts to throttling
        self._window = threading.local()  # per reader thread: path, start, data, eof of its read-ahead

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

    def _delay(self, attempt: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)

    async def _attempt(self, call: Callable[[], Awaitable[T]], nbytes: int) -> T:
        deadline = self.stall_timeout_s + nbytes / STALL_BYTES_PER_S
        try:
            return await asyncio.wait_for(call(), deadline)
        except asyncio.TimeoutError as e:
            raise _RequestStalled(
                f"no complete reply within {deadline:.0f}s (dcp_atomic_stall_timeout_s={self.stall_timeout_s:g} "
                f"plus 4 s per MiB): the request was cancelled") from e

    async def _retrying(self, what: str, path: str, call: Callable[[], Awaitable[T]], nbytes: int = 0) -> T:
        """Run ``call`` until it succeeds or the retry budget (time, optionally attempts) is spent.

        Each attempt holds a slot of the rank's adaptive limit and has its own
        stall deadline.  A 412 becomes :class:`_PreconditionFailed` (carrying how
        many attempts were made: a 412 after a retried conditional PUT may be our
        own write), a 404 becomes ``FileNotFoundError`` (callers wait out
        visibility lag on it), anything else that is final becomes :class:`StorageError`.
        """
        started = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            epoch = await self.requests.acquire()
            try:
                result = await self._attempt(call, nbytes)
            except asyncio.CancelledError:
                await self.requests.release(epoch, ok=False, throttled=False)
                raise
            except Exception as e:  # noqa: BLE001 - classified below
                await self.requests.release(epoch, ok=False, throttled=is_throttled(e))
                if is_precondition_failed(e):
                    raise _PreconditionFailed(attempt) from e
                if _is_not_found(e):
                    raise FileNotFoundError(errno.ENOENT, f"no such object: {self._url(path)}", path) from e
                retryable = is_retryable(e)
                delay = self._delay(attempt)
                in_budget = (time.monotonic() - started + delay < self.retry_budget_s
                             and (self.max_attempts is None or attempt < self.max_attempts))
                if retryable and in_budget:
                    log.debug("retrying %s of %s in %.2fs after: %s", what, path, delay, e)
                    await asyncio.sleep(delay)
                    continue
                if not retryable and http_error(e)[0] is None and http_error(e)[1] is None:
                    raise  # not the store's answer: a local bug or misconfiguration, keep its own type
                raise self._storage_error(what, path, e, attempt, time.monotonic() - started) from e
            await self.requests.release(epoch, ok=True, throttled=False)
            return result

    def _storage_error(self, what: str, path: str, e: BaseException, attempts: int, seconds: float) -> StorageError:
        status, code, message = http_error(e)
        rank = _rank()
        if code == "NoSuchBucket":
            hint = "The bucket does not exist: create it or fix the root URL"
        elif status in (401, 403) or code in AUTH_CODES or code == "AccessDenied":
            hint = "The credentials in storage_options / the environment may not write or read this bucket"
        elif is_retryable(e):
            hint = (f"The store kept throttling or failing (or the connection kept dropping or stalling) after "
                    f"{attempts} attempts over {seconds:.1f}s; retry later, or raise dcp_atomic_retry_budget_s "
                    f"(now {self.retry_budget_s:g}) / lower dcp_atomic_max_concurrency in storage_options")
        elif status in (400, 501) and self.checksum_mode != "when_required":
            hint = (f"The store may not accept the request checksums botocore >= 1.36 sends (aws-chunked bodies "
                    f"with trailing checksums over https): pass storage_options={{'{CHECKSUM_MODE}': "
                    f"'when_required'}}; otherwise check the endpoint, bucket and permissions")
        else:
            hint = "The store refused the request; check the endpoint, bucket and permissions"
        if what in ("GET", "HEAD"):
            consequence = "Nothing was loaded from it."
        elif what in ("LIST", "DELETE", "list multipart uploads", "abort multipart upload"):
            consequence = "No checkpoint was changed by the failed request."
        else:
            consequence = NOTHING_COMMITTED
        reply = f"HTTP {status} {code or ''}".strip() if status or code else type(e).__name__
        return StorageError(
            f"rank {rank} on {socket.gethostname()}: S3 {what} of {self._url(path)} at {self.endpoint} failed: "
            f"{reply}: {message.rstrip('.')}. {hint}. {consequence}",
            rank=rank,
            path=self._url(path),
            status=status,
            code=code,
            reply_message=message,
            attempts=attempts,
        )

    async def _call(self, what: str, path: str, method: str, **kwargs: Any) -> dict:
        body = kwargs.get("Body")
        return await self._retrying(what, path, lambda: self.fs._call_s3(method, **kwargs),
                                    len(body) if body is not None else 0)

    async def _put(self, path: str, data: bytes, **conditions: str) -> dict:
        bucket, key = self._split(path)
        return await self._call("PUT", path, "put_object", Bucket=bucket, Key=key, Body=data, **conditions)

    async def _get(self, path: str, offset: int | None = None, length: int | None = None) -> tuple[bytes, str | None]:
        bucket, key = self._split(path)
        extra = {} if offset is None else {"Range": f"bytes={offset}-{offset + length - 1}"}

        async def once() -> tuple[bytes, str | None]:
            response = await self.fs._call_s3("get_object", Bucket=bucket, Key=key, **extra)
            try:
                return await response["Body"].read(), response.get("ETag")
            finally:
                response["Body"].close()

        try:
            return await self._retrying("GET", path, once, length or 0)
        except StorageError as e:
            if e.details.get("status") == 416:  # range starts at or past the end: EOF, like pread
                return b"", None
            raise

    # -- conditional-write probe ---------------------------------------------------------

    def check_commit_support(self, directory: str, *, overwrite: bool = False) -> None:
        """Before a save writes a byte: the store must enforce the conditions its commit will use."""
        self.require_conditional_writes(self.join(directory, "probe"), if_match=overwrite)  # probes in ``directory``

    def require_conditional_writes(self, near: str, *, if_match: bool = False) -> None:
        """Probe once per (endpoint, root) per process that conditional writes are enforced.

        The probe object goes beside ``near`` (the path about to be written, under
        the run's prefix).  ``If-None-Match`` is always required; ``If-Match`` only
        where ``if_match`` (replacing a marker).  Fails closed with
        :class:`ConfigurationError`; skipped in unsafe single-writer mode.
        """
        key = (self.endpoint, self.root)
        if self.unsafe_single_writer:
            if key not in _warned_unsafe:
                _warned_unsafe.add(key)
                log.warning(
                    "%s: dcp_atomic_unsafe_single_writer=True: commit markers are written without conditional "
                    "PUTs; two jobs writing this root at once could both commit one step", self.describe())
            return
        with _probe_lock:
            result = _probed.get(key)
            if result is None:
                result = _probed[key] = self._probe(posixpath.dirname(near))
        if if_match and not result.if_match:
            raise ConfigurationError(
                f"S3 store at {self.endpoint} enforces If-None-Match but not If-Match (probed under "
                f"{self.describe()}): an overwrite=True save replaces a commit marker with If-Match, and without it "
                f"two jobs re-saving one step could both win. Save to a new step instead, or, if exactly one job "
                f"ever writes this root, pass storage_options={{'{UNSAFE_SINGLE_WRITER}': True}}.",
                endpoint=self.endpoint, root=self.root, missing="If-Match",
            )

    def _probe(self, directory: str) -> ProbeResult:
        path = self.join(directory, f"{PROBE_PREFIX}{os.getpid()}-{secrets.token_hex(6)}")
        try:
            try:
                self._run(self._put(path, b"probe-1", IfNoneMatch="*"))
            except _PreconditionFailed:
                pass  # the random key exists already: the condition is evidently enforced
            except StorageError as e:
                raise self._probe_failure(path, "If-None-Match: *", e) from e
            try:
                self._run(self._put(path, b"probe-2", IfNoneMatch="*"))
                raise ConfigurationError(
                    f"S3 store at {self.endpoint} ignores conditional writes: If-None-Match: * (a second create of "
                    f"{self._url(path)} succeeded). Refusing to write checkpoints to {self.describe()}. "
                    f"{self._advice()}", endpoint=self.endpoint, root=self.root, cause="ignored",
                )
            except _PreconditionFailed:
                pass
            if_match = False
            try:
                self._run(self._put(path, b"probe-3", IfMatch='"00000000000000000000000000000000"'))
            except (_PreconditionFailed, FileNotFoundError):
                if_match = True
            except StorageError as e:
                failure = self._probe_failure(path, "If-Match", e)
                if not (isinstance(failure, ConfigurationError) and failure.details["cause"] == "not supported"):
                    raise failure from e
            if not if_match:
                log.warning("S3 store at %s enforces If-None-Match but not If-Match: saves work, overwrite=True "
                            "saves under %s will be refused", self.endpoint, self.describe())
            return ProbeResult(if_match=if_match)
        finally:
            bucket, key = self._split(path)
            try:
                self._run(self._call("DELETE", path, "delete_object", Bucket=bucket, Key=key))
            except Exception as e:  # noqa: BLE001 - a leftover probe object is harmless (gc removes its attempt)
                log.warning("could not delete the probe object %s (it is harmless; delete it by hand or let "
                            "gc remove it): %s", self._url(path), e)

    def _authenticates(self, path: str) -> bool:
        """Whether a bodiless request (HEAD) with these credentials gets past authentication."""
        try:
            self._head_etag(path)
        except StorageError:
            return False
        return True

    def _advice(self) -> str:
        return (f"dcp_atomic commits a checkpoint on S3 with conditional PUTs (If-None-Match: * creates the commit "
                f"marker, If-Match replaces it); without them two jobs saving one step could both commit. Use a "
                f"store that enforces conditional writes (AWS S3, MinIO, SeaweedFS, Ceph RGW recent releases), or, "
                f"if exactly one job ever writes this root, pass storage_options={{'{UNSAFE_SINGLE_WRITER}': True}}.")

    def _probe_failure(self, path: str, header: str, error: StorageError) -> CheckpointError:
        """The true cause of a failed probe PUT, as a :class:`ConfigurationError` (or ``error`` if it is the
        store's state — throttling, 5xx, a missing bucket — rather than its setup)."""
        cause = _probe_failure_class(error)
        if cause == "auth" and self.checksum_mode != "when_required" and self._authenticates(path):
            cause = "checksum"  # the same credentials pass a HEAD: the store misreads the PUT's (chunked) form
        if cause is None and _rejects_request(error):
            try:  # the condition, or anything in any PUT (a checksum header)? A plain PUT tells.
                self._run(self._put(path, b"probe-plain"))
                cause = "not supported"
            except StorageError as plain:
                cause = _probe_failure_class(plain) or (
                    "checksum" if _rejects_request(plain) and self.checksum_mode != "when_required" else None)
        reply = f"HTTP {error.details.get('status')} {error.details.get('code') or ''}".strip()
        where = f"S3 store at {self.endpoint} refused the probe PUT ({header}) of {self._url(path)}: {reply}: " \
                f"{error.details.get('reply_message')}."
        advice = {
            "auth": "The credentials were not accepted: check key / secret / token in storage_options or the "
                    "environment, and the endpoint and region they belong to.",
            "permissions": f"These credentials may not write under {self._url(posixpath.dirname(path))}: grant "
                           "s3:PutObject, s3:GetObject, s3:DeleteObject, s3:ListBucket, s3:AbortMultipartUpload "
                           "and s3:ListBucketMultipartUploads on the checkpoint prefix.",
            "kms": "The bucket encrypts with a KMS key these credentials cannot use: grant kms:GenerateDataKey and "
                   "kms:Decrypt on it, or change the bucket's default encryption.",
            "checksum": f"The store rejects the request checksums botocore >= 1.36 sends by default (aws-chunked "
                        f"bodies with trailing checksums over https, x-amz-checksum-* headers): pass "
                        f"storage_options={{'{CHECKSUM_MODE}': 'when_required'}}.",
            "not supported": f"The store does not implement conditional writes ({header}). {self._advice()}",
        }.get(cause)
        if advice is None:
            return error
        return ConfigurationError(f"{where} {advice}", endpoint=self.endpoint, root=self.root, cause=cause,
                                  status=error.details.get("status"), code=error.details.get("code"))

    # -- Storage primitives --------------------------------------------------------------

    def makedirs(self, path: str) -> None:
        """Object stores have no directories (and s3fs's makedirs would LIST on every rank)."""

    def open_write(self, path: str) -> "S3ObjectWriter":
        return S3ObjectWriter(self, path)

    def close_write(self, stream: "S3ObjectWriter") -> None:
        stream.commit()

    def read_file(self, path: str) -> bytes:
        data, etag = self._run(self._get(path))
        if posixpath.basename(path) == MARKER and etag:
            self._etags[path] = etag  # the version an overwrite=True replace must still find
        return data

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
        if getattr(window, "path", None) != path or not window.start <= offset < window.start + len(window.data):
            return None
        lo = offset - window.start
        return memoryview(window.data)[lo : lo + length]

    def _read_ahead(self, path: str, offset: int) -> bytes:
        """Small reads (an item's header, a small tensor) fetch READ_AHEAD bytes: the reader goes on
        sequentially through the same object, so the next reads are served from memory.  Safe to keep:
        data objects are immutable (a new save_id for every attempt)."""
        data = self._run(self._get(path, offset, READ_AHEAD))[0]
        window = self._window
        window.path, window.start, window.data, window.eof = path, offset, data, len(data) < READ_AHEAD
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
        except _PreconditionFailed:
            return False
        return True

    def _put_settled(self, path: str, data: bytes, **conditions: str) -> None:
        """PUT a commit marker; after a final failure, read it back and report the truth.

        An attempt may be applied with its reply lost, and the retries then fail
        (5xx): "nothing committed" would be a lie if the marker names this save.
        """
        try:
            self._run(self._put(path, data, **conditions))
        except StorageError as e:
            try:
                current = self._current(path)
            except Exception as read_error:  # noqa: BLE001 - reported in the error below
                raise StorageError(
                    f"{e.message.replace(NOTHING_COMMITTED, '')}Whether the marker was written is "
                    f"UNKNOWN: reading {self._url(path)} back failed too ({read_error}). Check with `dcp-atomic "
                    f"show` before re-saving this step.", **{**e.details, "committed": None},
                ) from e
            if current == data:
                log.warning("%s: the PUT reported failure (%s), but the marker holds exactly this save's: an "
                            "earlier attempt was applied and its reply lost; committed", self._url(path),
                            e.details.get("status"))
                return
            if current is not None and "IfNoneMatch" in conditions:
                raise _PreconditionFailed(e.details.get("attempts") or 1) from e  # another save's marker is there
            found = "does not exist" if current is None else "still holds another save's marker"
            raise StorageError(f"{e.message} (Read back: {self._url(path)} {found}: this save is not committed.)",
                               **{**e.details, "committed": False}) from e

    def replace(self, path: str, data: bytes) -> None:
        """Plain PUT, except for a commit marker: ``If-Match`` on the version last read.

        The commit protocol replaces a marker only for ``overwrite=True`` after
        reading it; if another job replaced (or removed) it in between, this
        save must not silently win: :class:`CommitConflictError`.
        """
        marker = posixpath.basename(path) == MARKER
        self.require_conditional_writes(path, if_match=marker)
        if not marker:
            self._run(self._put(path, data))
            return
        if self.unsafe_single_writer:
            self._put_settled(path, data)
            return
        etag = self._etags.get(path) or self._head_etag(path)
        try:
            if etag is None:
                self._put_settled(path, data, IfNoneMatch="*")
            else:
                self._put_settled(path, data, IfMatch=etag)
        except (_PreconditionFailed, FileNotFoundError) as e:
            retried = isinstance(e, _PreconditionFailed) and e.attempts > 1
            if retried and self._current(path) == data:
                return  # our own earlier attempt went through; its reply was lost
            raise CommitConflictError(
                f"{self._url(path)}: the commit marker changed while this save was replacing it (PUT with "
                f"If-Match: {etag} failed): another job re-saved or removed this step at the same time. Nothing "
                "of this save is visible. Read the step again and re-save with overwrite=True if you still "
                "want to replace it.",
                path=self._url(path),
            ) from None
        self._etags.pop(path, None)

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
        """Delete the object ``path`` and everything under ``path/`` (gc, tools; never a training rank)."""
        bucket, key = self._split(path)
        if not key:
            raise ValueError(f"refusing to remove a whole bucket: {path}")
        keys = [key] + self._list_keys(bucket, key.rstrip("/") + "/", path)
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


class S3ObjectWriter:
    """A new object written as a stream; visible only after :meth:`commit` (``close_write``).

    Up to one part it is a single PUT at commit.  Beyond that, a multipart
    upload: created as soon as the first part is full (so a killed rank leaves
    an upload ``abort_stale_uploads`` can find), parts sent in the background
    with at most ``max_concurrency`` in flight per rank (the writer blocks when
    all slots are busy, which bounds memory), completed at commit.  A plain
    :meth:`close` without commit — the writer's error path — aborts the upload.
    """

    def __init__(self, storage: S3Storage, path: str) -> None:
        self.storage = storage
        self.path = path
        self.bucket, self.key = storage._split(path)
        self.size = 0
        self._buffer = bytearray()
        self._upload_id: str | None = None
        self._pending: list[tuple[int, Future]] = []
        self._etags: dict[int, str] = {}
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
                self._etags[number] = future.result()["ETag"]
            else:
                still.append((number, future))
        self._pending = still

    def _send_part(self) -> None:
        storage = self.storage
        self._collect(wait=False)
        if self._upload_id is None:
            reply = storage._run(storage._call("create multipart upload", self.path, "create_multipart_upload",
                                               Bucket=self.bucket, Key=self.key))
            self._upload_id = reply["UploadId"]
        if self._next_part > MAX_PARTS:
            raise StorageError(f"{storage._url(self.path)}: more than {MAX_PARTS} parts", path=self.path)
        number, body = self._next_part, self._buffer  # handed over, never touched again: no copy
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

    def commit(self) -> None:
        """Make the object visible: one PUT, or the final part and CompleteMultipartUpload."""
        if self._closed:
            raise ValueError(f"S3 object writer {self.path} is already closed")
        storage = self.storage
        try:
            if self._upload_id is None:
                storage._run(storage._put(self.path, self._buffer))
            else:
                if self._buffer:
                    self._send_part()
                self._collect(wait=True)
                self._complete()
            self._closed = True
            self._buffer = bytearray()
        except BaseException:
            self.close()
            raise

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


def abort_stale_uploads(storage: Storage, prefix: str, older_than_s: float) -> list[StaleUpload]:
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
    if not isinstance(storage, S3Storage):
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


def _upload_keys(storage: S3Storage, prefix: str) -> Callable[[str], bool]:
    """Which keys lie under ``prefix``, in the classic layout or under any hashed data prefix of the root."""
    key = storage._split(prefix)[1].strip("/")
    root = storage._split(storage.root)[1].strip("/")
    plain = key + "/" if key else ""
    inside = key.startswith(root + "/") if root else bool(key)
    hashed = re.compile(re.escape(root + "/" if root else "") + DATA_PREFIX_PATTERN.pattern + "/"
                        + re.escape(key[len(root):].strip("/") + "/")) if inside else None
    return lambda k: k.startswith(plain) or (hashed is not None and hashed.match(k) is not None)
