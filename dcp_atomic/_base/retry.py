"""Bounded waiting: every wait of the library ends by its ``timeout`` (P8).

NFS attribute, dentry and negative-lookup caches lag by seconds; object-store
listings lag too.  A file that is not visible yet is therefore retried with
exponential backoff until a deadline, never trusted after a single
``exists()``, and never waited on forever.  A file that *is* visible but fails
its digest or does not parse is damage, not lag (P9): it gets one short re-read
window, then the error is reported.
"""

from __future__ import annotations

import random
import time
from typing import Callable, TypeVar

T = TypeVar("T")

#: How long a visible file that fails its digest or does not parse is re-read before it is reported (P9).
#: Write-once files (manifest.json, .metadata) are never legitimately replaced, so this only covers a read racing
#: the rename that published them.  LATEST and markers can be replaced (overwrite=True), and an NFS client with a
#: stale attribute cache reads the new content cut to the old size until that cache expires.  On real NFS
#: close-to-open revalidation ends this at the next open; the bindfs emulation, harsher, keeps it up to its cache
#: timeout: tests/stores/test_stale_cache.py (1-2 s caches) fails without a window and passes with this same second.
REREAD_SECONDS = 1.0


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.expires = time.monotonic() + seconds

    def remaining(self) -> float:
        return max(0.0, self.expires - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self.expires


def retry_until(
    attempt: Callable[[], T],
    *,
    deadline: Deadline,
    retry_on: tuple[type[BaseException], ...],
    reread_on: tuple[type[BaseException], ...] = (),
    first_delay: float = 0.02,
    max_delay: float = 1.0,
) -> T:
    """Call ``attempt`` until it returns, retrying ``retry_on`` errors (lag) until ``deadline``.

    ``reread_on`` errors (damage) are retried only for ``REREAD_SECONDS`` after
    the first one, within the deadline.  The last error is re-raised when time is
    up, so callers turn it into a typed error that says what was still wrong.
    """
    delay = first_delay
    reread: Deadline | None = None
    while True:
        try:
            return attempt()
        except reread_on:
            reread = reread or Deadline(min(REREAD_SECONDS, deadline.remaining()))
            if reread.expired():
                raise
            wait = reread.remaining()
        except retry_on:
            if deadline.expired():
                raise
            wait = deadline.remaining()
        time.sleep(min(delay, wait) * random.uniform(0.8, 1.0))
        delay = min(delay * 2, max_delay)
