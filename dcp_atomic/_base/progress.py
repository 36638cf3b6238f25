"""Progress lines for long saves and loads.

A rank that writes or reads 100+ GB on busy storage is silent for many minutes, and a silent job looks hung:
operators kill it, or cannot tell a slow rank from a stuck one.  Each rank therefore logs, at INFO and at most
once every ``DCP_ATOMIC_PROGRESS_SECONDS`` (default 30; 0 turns the lines off), how much of its own share is
done and at what rate.  Short operations never log: the first line comes only after that interval.
"""

from __future__ import annotations

import logging
import os
import threading
import time

log = logging.getLogger("dcp_atomic.progress")

DEFAULT_INTERVAL_SECONDS = 30.0


def interval_seconds() -> float:
    try:
        return max(0.0, float(os.environ.get("DCP_ATOMIC_PROGRESS_SECONDS", DEFAULT_INTERVAL_SECONDS)))
    except ValueError:
        return DEFAULT_INTERVAL_SECONDS


class Progress:
    """Bytes done of one rank's share of an operation; thread-safe (every writer or reader thread adds)."""

    def __init__(self, what: str, total_bytes: int, rank: int) -> None:
        self.what, self.total, self.rank = what, total_bytes, rank
        self.every = interval_seconds()
        self.done = 0
        self.started = self._last = time.monotonic()
        self._lock = threading.Lock()

    def add(self, nbytes: int) -> None:
        if not self.every:
            return
        with self._lock:
            self.done += nbytes
            now = time.monotonic()
            if now - self._last < self.every:
                return
            self._last = now
            done, elapsed = self.done, now - self.started
        share = f" of {format_size(self.total)} ({100 * done / self.total:.0f}%)" if self.total else ""
        log.info("rank %d %s: %s%s in %.0fs, %.0f MiB/s", self.rank, self.what, format_size(done), share, elapsed,
                 done / 2**20 / max(elapsed, 1e-9))


def format_size(nbytes: float) -> str:
    """A byte count in the unit that shows it: a step of a few KiB reads "12.0 KiB", not "0.00 GB"."""
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.2f} GiB"
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"
