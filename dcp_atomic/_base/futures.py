"""A background operation's future that knows whether its failure has reached anyone.

An ``async_save`` or a memory snapshot runs on another thread; its failure must be raised exactly once -- by the
future's ``result()``/``exception()`` if the caller asks, else by the next ``wait()``, ``close()`` or operation --
never swallowed and never raised twice.  The future records whether it has been reported.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any


class ReportedFuture(concurrent.futures.Future):
    """A future whose ``reported`` says whether its outcome has been read by the caller (or raised for it)."""

    reported = False
    step: int | None = None  # the step it saves or snapshots (what an exit without close() names)

    def result(self, timeout: float | None = None) -> Any:
        try:
            return super().result(timeout)
        finally:
            self.reported |= self.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        error = super().exception(timeout)
        self.reported = True
        return error
