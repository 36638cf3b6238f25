"""How ``dcp-atomic`` speaks: one versioned JSON object per answer (``--json``), a failure as one message
(:class:`CliError`), and a byte-count progress line for the commands that copy or re-read a step.

Below every other module of the command line, so that the commands and the parser share these without importing
each other.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any

from ..._base.progress import format_size


#: version of every ``--json`` object this command prints (its ``"schema"`` key); bumped when a field changes
#: meaning or goes away, not when one is added.  See "JSON output" in the README.
JSON_SCHEMA = 1


def emit(body: dict[str, Any]) -> None:
    """One ``--json`` object on stdout, versioned."""
    print(json.dumps({"schema": JSON_SCHEMA, **body}, indent=1))


class CliError(Exception):
    """A failure the command reports as one message (one JSON object with ``--json``), never a traceback."""

    def __init__(self, message: str, code: int = 1, kind: str = "Error") -> None:
        super().__init__(message)
        self.message, self.code, self.kind = message, code, kind


class CopyProgress:
    """A byte-count progress line on stderr (rewritten in place on a terminal) for a copy or re-read that takes a
    while: the first line comes one interval after the start, so a step read in a moment prints none."""

    def __init__(self, total: int, label: str) -> None:
        self.total, self.label, self.done = max(total, 1), label, 0
        self._lock = threading.Lock()
        self._tty = sys.stderr.isatty()
        self._every = 0.1 if self._tty else 2.0
        self._started = self._last = time.monotonic()
        self._printed = False

    def __call__(self, n: int) -> None:
        with self._lock:
            self.done += n
            now = time.monotonic()
            if now - self._last >= self._every or (self._printed and self.done >= self.total):  # ends at 100%
                self._last, self._printed = now, True
                rate = self.done / max(now - self._started, 1e-9)
                line = (f"{self.label}: {100 * self.done / self.total:5.1f}% of {format_size(self.total)} "
                        f"({format_size(rate)}/s)")
                sys.stderr.write(("\r" + line) if self._tty else (line + "\n"))
                sys.stderr.flush()

    def close(self) -> None:
        if self._tty and self._printed:
            sys.stderr.write("\n")


def format_mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def format_age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"
