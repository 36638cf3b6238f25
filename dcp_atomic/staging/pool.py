"""A bounded pool of host windows: the only host memory bounded staging allocates, for lazily read tensors and for
the small tensors an ``async_save`` copies at the call (packed into windows: :mod:`.live_state`).

Windows are allocated on first use (a pool never used costs nothing) and kept for the next save: pinning host
memory is slow (page-locking every page), so a job pays it once, not per save.  ``acquire`` blocks while every
window is out, which is what bounds the staging: a reader faster than its consumer waits instead of allocating.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch


class WindowPool:
    """At most ``capacity`` host windows of ``window_bytes`` (pinned when ``pinned``)."""

    def __init__(self, capacity: int, window_bytes: int, *, pinned: bool = False) -> None:
        self.capacity = max(1, capacity)
        self.window_bytes = window_bytes
        self.pinned = pinned
        self._free: list[torch.Tensor] = []
        self._allocated = 0
        self._cond = threading.Condition()

    @property
    def allocated_bytes(self) -> int:
        """Host memory the pool holds now (its windows stay allocated between saves)."""
        return self._allocated * self.window_bytes

    def acquire(self) -> torch.Tensor:
        """A window; blocks while every window is out."""
        window = self._take(block=True, keep=0)
        assert window is not None
        return window

    def try_acquire(self, keep: int = 0) -> torch.Tensor | None:
        """A window now, or None: never blocks, and never takes one of the last ``keep`` windows the pool could
        still hand out (free or not yet allocated), which another user of the pool needs to make progress."""
        return self._take(block=False, keep=keep)

    def _take(self, *, block: bool, keep: int) -> torch.Tensor | None:
        with self._cond:
            while block and not self._free and self._allocated >= self.capacity:
                self._cond.wait()
            if not block and len(self._free) + self.capacity - self._allocated <= keep:
                return None
            if self._free:
                return self._free.pop()
            self._allocated += 1
        try:
            return torch.empty(self.window_bytes, dtype=torch.uint8, pin_memory=self.pinned)
        except BaseException:  # out of (pinnable) memory: the window was never there
            with self._cond:
                self._allocated -= 1
                self._cond.notify()
            raise

    def release(self, window: torch.Tensor) -> None:
        with self._cond:
            self._free.append(window)
            self._cond.notify()

    @contextlib.contextmanager
    def lease(self) -> Iterator[torch.Tensor]:
        window = self.acquire()
        try:
            yield window
        finally:
            self.release(window)
