"""Bounded waiting: every wait of the library ends by its ``timeout`` (P8).

NFS attribute, dentry and negative-lookup caches lag by seconds; object-store
listings lag too.  A missing or torn control file is therefore retried with
exponential backoff until a deadline, never trusted after a single
``exists()``, and never waited on forever.
"""

from __future__ import annotations

import random
import time
from typing import Callable, TypeVar

T = TypeVar("T")


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
    first_delay: float = 0.02,
    max_delay: float = 1.0,
) -> T:
    """Call ``attempt`` until it returns, retrying ``retry_on`` errors until ``deadline``.

    The last error is re-raised when time is up, so callers turn it into a typed
    error that says what was still missing.
    """
    delay = first_delay
    while True:
        try:
            return attempt()
        except retry_on:
            if deadline.expired():
                raise
            time.sleep(min(delay, deadline.remaining()) * random.uniform(0.8, 1.0))
            delay = min(delay * 2, max_delay)
