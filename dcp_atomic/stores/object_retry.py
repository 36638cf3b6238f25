"""One retry and deadline policy for object stores (S3, GCS): what a request does on a bad day.

Object stores throttle (429, 503 SlowDown) for minutes while they re-partition
a prefix, answer 5xx, drop connections, and sometimes hold a request without
ever answering.  The SDKs' own loops retry a fixed *count* (botocore 5, s3fs 5,
gcsfs 6: about half a minute) and have no deadline at all (gcsfs passes
``timeout=None``), so one stalled request hangs a rank while the others wait in
a collective.  Each backend switches its SDK's loop off and runs every request
through :class:`ObjectRequests` instead:

* retried with jittered exponential backoff until a *time* budget is spent,
  counted from when the request is first sent (not while it queues for a slot);
* each attempt has a stall deadline (``stall_timeout_s`` plus 4 s per MiB it
  carries) after which it is cancelled and retried;
* a rank keeps at most :class:`AdaptiveLimit` requests in flight, halved by
  throttling and won back by successes;
* the final failure is a :class:`~dcp_atomic.errors.StorageError` naming the
  rank, host, key, HTTP status, what the failure left behind and which option
  to change.  It records how many attempts ended *unanswered* (a stall, a
  dropped connection): such an attempt may still be applied by the store later,
  which the commit marker's settling (see ``s3.py``, ``gcs.py``) must know.

What a failure *means* differs per SDK (botocore's response dicts, gcsfs's
``HttpError``), so each backend passes an :class:`ErrorClassifier`; everything
else here is shared.  This module imports no SDK.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import sys
import random
import socket
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Protocol, TypeVar

from ..errors import ConfigurationError, StorageError

log = logging.getLogger("dcp_atomic.object_retry")  # the name users filter on

T = TypeVar("T")

RETRY_BUDGET_S = 600.0  # S3 answers SlowDown for minutes while it re-partitions a prefix
STALL_TIMEOUT_S = 60.0
STALL_BYTES_PER_S = 256 << 10  # an attempt's deadline grows by 4 s per MiB it uploads or downloads
CONNECT_TIMEOUT_S = 10.0  # an SDK's connect timeout, at most: a refused or silent endpoint is retried sooner
# An endpoint that refuses every connection (a wrong port) or has no address (a wrong host) before it ever answered
# this process is a configuration mistake, not throttling: given up on after this, not the whole retry budget.
UNREACHABLE_BUDGET_S = 15.0
RETRY_NOTICE_S = 10.0  # a request retried this long is logged as in progress (then once a minute)
NOTHING_COMMITTED = "Nothing of this save is committed; the previous checkpoint is intact."
READ_OPERATIONS = ("GET", "HEAD")
HARMLESS_OPERATIONS = ("LIST", "DELETE", "list multipart uploads", "abort multipart upload")


def chain(exc: BaseException | None):
    """``exc`` and its causes / contexts (an SDK keeps the store's answer on a cause)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def unreachable(exc: BaseException) -> bool:
    """The connection was never made: refused (nothing listens on that port) or no such host (DNS)."""
    for e in chain(exc):
        os_error = getattr(e, "os_error", None)  # aiohttp's ClientConnectorError keeps the socket's error here
        for candidate in (e, os_error):
            if isinstance(candidate, (ConnectionRefusedError, socket.gaierror)):
                return True
            if isinstance(candidate, OSError) and candidate.errno in (errno.ECONNREFUSED, errno.EHOSTUNREACH,
                                                                      errno.ENETUNREACH):
                return True
    return False


def current_rank() -> int:
    """This process's global rank, for messages (0 outside a process group).  Asks torch only where it is imported
    already: a process without it (the command line on an object store) has no process group, and importing it
    here would cost a failing request seconds."""
    dist = getattr(sys.modules.get("torch"), "distributed", None)
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # noqa: BLE001 - identity for a message only
        pass
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


class PreconditionFailed(FileExistsError):
    """HTTP 412: the condition of a conditional write did not hold.  ``attempts`` > 1 means the 412 may answer
    our own earlier attempt (applied, its reply lost), so callers read the object back before they report a loss."""

    def __init__(self, attempts: int) -> None:
        super().__init__(errno.EEXIST, f"precondition failed after {attempts} attempt(s)")
        self.attempts = attempts


class RequestStalled(TimeoutError):
    """An attempt that did not complete within its stall deadline (cancelled, then retried)."""


class ErrorClassifier(Protocol):
    """What one SDK's exceptions mean.  ``reply`` is (HTTP status, store error code, message) of the store's
    answer, (None, None, text) where there was none (a stall, a dropped connection, a local error)."""

    store: str  # "S3", "GCS": how messages name the service

    def reply(self, exc: BaseException) -> tuple[int | None, str | None, str]:
        """(HTTP status, store error code, message) of the store's answer that ``exc`` carries."""

    def retryable(self, exc: BaseException) -> bool:
        """A failure another attempt may cure (5xx, throttling, a dropped connection, a stall)."""

    def throttled(self, exc: BaseException) -> bool:
        """The store asked us to slow down (S3's 503 SlowDown, GCS's 429): concurrency backs off."""

    def precondition_failed(self, exc: BaseException) -> bool:
        """HTTP 412: a conditional write found the object there (or changed)."""

    def not_found(self, exc: BaseException) -> bool:
        """The object does not exist (404, NoSuchKey)."""

    def hint(self, status: int | None, code: str | None, message: str, url: str) -> str | None:
        """Advice for a final failure this store explains better than the generic text (None: generic)."""


@dataclass(frozen=True)
class RetryPolicy:
    """The ``dcp_atomic_*`` request options shared by every object store (see docs/s3.md for the table)."""

    retry_budget_s: float = RETRY_BUDGET_S
    max_attempts: int | None = None
    stall_timeout_s: float = STALL_TIMEOUT_S
    backoff_s: float = 0.1
    max_backoff_s: float = 10.0
    max_concurrency: int = 8

    @classmethod
    def pop_from(cls, options: dict[str, Any]) -> "RetryPolicy":
        """Take the policy's keys out of ``options`` (the rest goes to the SDK) and check them."""
        attempts = options.pop("dcp_atomic_max_attempts", None)
        policy = cls(
            retry_budget_s=float(options.pop("dcp_atomic_retry_budget_s", RETRY_BUDGET_S)),
            max_attempts=None if attempts is None else int(attempts),
            stall_timeout_s=float(options.pop("dcp_atomic_stall_timeout_s", STALL_TIMEOUT_S)),
            backoff_s=float(options.pop("dcp_atomic_backoff_s", 0.1)),
            max_backoff_s=float(options.pop("dcp_atomic_max_backoff_s", 10.0)),
            max_concurrency=int(options.pop("dcp_atomic_max_concurrency", 8)),
        )
        if (policy.max_attempts is not None and policy.max_attempts < 1) or policy.max_concurrency < 1:
            raise ConfigurationError("dcp_atomic_max_attempts and dcp_atomic_max_concurrency must be >= 1")
        if policy.retry_budget_s <= 0 or policy.stall_timeout_s <= 0:
            raise ConfigurationError("dcp_atomic_retry_budget_s and dcp_atomic_stall_timeout_s must be > 0 seconds")
        return policy

    def delay(self, attempt: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)

    def stall_deadline(self, nbytes: int) -> float:
        return self.stall_timeout_s + nbytes / STALL_BYTES_PER_S

    def socket_timeouts(self, largest_body: int) -> tuple[float, float]:
        """(connect, read) timeouts for the SDK's sockets: never shorter than the stall deadline of the largest
        request, so the deadline the user set is the one that cancels (s3fs's own 15 s read timeout would
        otherwise cut every slow reply first and be resent as if it were ours)."""
        return min(CONNECT_TIMEOUT_S, self.stall_timeout_s), self.stall_deadline(largest_body) + 1.0


class AdaptiveLimit:
    """Requests in flight per rank, adapted to the store: halve on throttling, +1 per window of successes.

    Lives on the SDK's event loop (every method runs there), so it needs no lock.
    A throttled attempt cuts the limit only if it started after the last cut:
    a burst of throttling answers from one round of requests counts once.
    """

    def __init__(self, ceiling: int, store: str = "S3") -> None:
        self.ceiling = ceiling
        self.limit = ceiling
        self.store = store
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
                log.info("%s throttling: at most %d request(s) in flight on this rank now", self.store, self.limit)
            elif ok and self.limit < self.ceiling:
                self._successes += 1
                if self._successes >= self.limit:
                    self.limit += 1
                    self._successes = 0
            self._changed.notify_all()


class ObjectRequests:
    """Runs one store's requests under a :class:`RetryPolicy` and one rank-wide :class:`AdaptiveLimit`."""

    def __init__(self, policy: RetryPolicy, errors: ErrorClassifier, endpoint: Callable[[], str]) -> None:
        self.policy = policy
        self.errors = errors
        self.endpoint = endpoint
        self.limit = AdaptiveLimit(policy.max_concurrency, errors.store)
        self.answered = False  # the endpoint answered this process once: refusals then are a restart, retried

    async def attempt(self, call: Callable[[], Awaitable[T]], nbytes: int) -> T:
        deadline = self.policy.stall_deadline(nbytes)
        try:
            return await asyncio.wait_for(call(), deadline)
        except asyncio.TimeoutError as e:
            raise RequestStalled(
                f"no complete reply within {deadline:.0f}s (dcp_atomic_stall_timeout_s="
                f"{self.policy.stall_timeout_s:g} plus 4 s per MiB): the request was cancelled") from e

    async def run(self, what: str, url: str, call: Callable[[], Awaitable[T]], nbytes: int = 0) -> T:
        """Run ``call`` until it succeeds or the retry budget (time, optionally attempts) is spent.

        Each attempt holds a slot of the rank's adaptive limit and has its own stall
        deadline; the budget's clock starts when the first attempt is sent.  A 412
        becomes :class:`PreconditionFailed`, a 404 ``FileNotFoundError`` (callers wait
        out visibility lag on it), a final store failure :class:`StorageError`; an
        exception that is not the store's answer (a local bug) keeps its own type.
        """
        errors, policy = self.errors, self.policy
        started: float | None = None
        attempt = unanswered = stalled = 0
        notice_at = RETRY_NOTICE_S
        while True:
            attempt += 1
            epoch = await self.limit.acquire()
            if started is None:
                started = time.monotonic()  # queueing for a slot is not the store's fault
            try:
                result = await self.attempt(call, nbytes)
            except asyncio.CancelledError:
                await self.limit.release(epoch, ok=False, throttled=False)
                raise
            except Exception as e:  # noqa: BLE001 - classified below
                await self.limit.release(epoch, ok=False, throttled=errors.throttled(e))
                if errors.precondition_failed(e):
                    raise PreconditionFailed(attempt) from e
                if errors.not_found(e):
                    raise FileNotFoundError(errno.ENOENT, f"no such object: {url}", url) from e
                status, code, _ = errors.reply(e)
                retryable = errors.retryable(e)
                if retryable and status is None and code is None:
                    unanswered += 1  # the store may still apply it: see StorageError.details["unanswered"]
                    stalled += isinstance(e, RequestStalled)
                delay = policy.delay(attempt)
                elapsed = time.monotonic() - started
                never_reached = not self.answered and unreachable(e)
                budget = min(policy.retry_budget_s, UNREACHABLE_BUDGET_S) if never_reached else policy.retry_budget_s
                in_budget = (elapsed + delay < budget
                             and (policy.max_attempts is None or attempt < policy.max_attempts))
                if retryable and in_budget:
                    if elapsed >= notice_at:
                        log.warning("%s %s of %s: still retrying after %.0fs (attempt %d; gives up after %.0fs): %s",
                                    errors.store, what, url, elapsed, attempt, budget, _first_line(e))
                        notice_at = elapsed + 60.0
                    else:
                        log.debug("retrying %s of %s in %.2fs after: %s", what, url, delay, e)
                    await asyncio.sleep(delay)
                    continue
                if never_reached:
                    raise self.failure(what, url, e, attempt, elapsed, unreachable=True) from e
                if not retryable and status is None and code is None:
                    raise  # not the store's answer: a local bug or misconfiguration, keep its own type
                raise self.failure(what, url, e, attempt, time.monotonic() - started,
                                   unanswered=unanswered, stalled=stalled) from e
            await self.limit.release(epoch, ok=True, throttled=False)
            self.answered = True
            return result

    def failure(self, what: str, url: str, e: BaseException, attempts: int, seconds: float, *,
                unanswered: int = 0, stalled: int = 0, unreachable: bool = False) -> StorageError:
        """The final :class:`StorageError`: who, where, the store's reply, the option to change, what is left."""
        errors, policy = self.errors, self.policy
        status, code, message = errors.reply(e)
        rank = current_rank()
        hint = errors.hint(status, code, message, url)
        if unreachable:
            hint = (f"The endpoint cannot be reached ({attempts} attempts over {seconds:.1f}s, no connection: "
                    f"refused, or no such host): check endpoint_url in storage_options (now {self.endpoint()}) "
                    "and that the server runs")
        if hint is None:
            if status in (401, 403):
                hint = f"The credentials in storage_options / the environment may not write or read {url}"
            elif errors.retryable(e) and stalled and stalled * 2 >= attempts:
                hint = (f"The store kept stalling: {stalled} of {attempts} attempts over {seconds:.1f}s got no "
                        f"complete reply within their deadline; if it is just slow, raise dcp_atomic_stall_timeout_s "
                        f"(now {policy.stall_timeout_s:g}) in storage_options, otherwise check the network to it")
            elif errors.retryable(e):
                hint = (f"The store kept throttling or failing (or the connection kept dropping or stalling) after "
                        f"{attempts} attempts over {seconds:.1f}s; retry later, or raise dcp_atomic_retry_budget_s "
                        f"(now {policy.retry_budget_s:g}) / lower dcp_atomic_max_concurrency in storage_options")
            else:
                hint = "The store refused the request; check the endpoint, bucket and permissions"
        if what in READ_OPERATIONS:
            consequence = "Nothing was loaded from it."
        elif what in HARMLESS_OPERATIONS:
            consequence = "No checkpoint was changed by the failed request."
        else:
            consequence = NOTHING_COMMITTED
        reply = f"HTTP {status} {code or ''}".strip() if status or code else type(e).__name__
        return StorageError(
            f"rank {rank} on {socket.gethostname()}: {errors.store} {what} of {url} at {self.endpoint()} failed: "
            f"{reply}: {message.rstrip('.')}. {hint}. {consequence}",
            rank=rank, path=url, status=status, code=code, reply=reply, reply_message=message, attempts=attempts,
            unanswered=unanswered,
        )


def copy_source_missing(source_url: str) -> FileNotFoundError:
    """A server-side copy answered 404: the object copied *from* is gone (a base step deleted meanwhile).  The
    request is addressed to the copy's target, so its plain 404 would name the new object as the missing one."""
    return FileNotFoundError(errno.ENOENT, f"no such object: {source_url} (the source of the copy)", source_url)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300] if text else ''}"


def settle_write(error: StorageError, data: bytes, read_back: Callable[[], bytes | None], url: str, *,
                 settle_s: float, create: bool, store: str) -> None:
    """After a commit marker's write failed for good, find out what the store holds, and say only what is true.

    Returns if the marker holds ``data`` (an attempt was applied, its reply lost: committed).  Raises
    :class:`PreconditionFailed` for a create that finds another save's marker, and otherwise a
    :class:`StorageError` whose ``committed`` is False (the store answered every attempt and the marker is not
    ours) or None (unknown).  An attempt cancelled unanswered may still be applied by the store later: then
    the marker is read back for ``settle_s`` before "unknown" is reported, never "not committed".
    """
    unanswered = error.details.get("unanswered") or 0
    deadline = time.monotonic() + (settle_s if unanswered else 0.0)
    base = error.message.replace(NOTHING_COMMITTED, "")
    while True:
        try:
            current = read_back()
        except Exception as read_error:  # noqa: BLE001 - reported in the error below
            raise StorageError(
                f"{base}Whether the marker was written is UNKNOWN: reading {url} back failed too ({read_error}). "
                f"Check with `dcp-atomic show <root> <run>` before re-saving this step.",
                **{**error.details, "committed": None},
            ) from error
        if current == data:
            log.warning("%s: the write reported failure (%s), but the marker holds exactly this save's: an "
                        "earlier attempt was applied and its reply lost; committed", url, error.details.get("status"))
            return
        if current is not None or time.monotonic() >= deadline:
            break
        time.sleep(min(0.25, max(0.0, deadline - time.monotonic())))
    if current is not None and create:
        raise PreconditionFailed(error.details.get("attempts") or 1) from error  # another save's marker is there
    if current is None and unanswered:
        raise StorageError(
            f"{base}Whether this save is committed is UNKNOWN: {unanswered} attempt(s) of the marker write were "
            f"cancelled without an answer, and {store} may still apply one; {url} was still absent after "
            f"{settle_s:.0f}s of reading it back. Run `dcp-atomic show <root> <run>` (or `dcp-atomic ls`) before "
            f"re-saving this step: if the step is listed, this save is committed; if not, re-save it.",
            **{**error.details, "committed": None},
        ) from error
    found = "does not exist" if current is None else "still holds another save's marker"
    raise StorageError(f"{error.message} (Read back: {url} {found}: this save is not committed.)",
                       **{**error.details, "committed": False}) from error
