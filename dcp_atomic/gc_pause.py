"""Pausing Python's cyclic garbage collector while metadata is built or parsed.

A checkpoint's metadata is 10^4-10^6 small objects (DCP's plans and ``.metadata``, our manifest items), built
or parsed in one go.  Their allocation keeps triggering full collections that traverse every object of the
process again, which cost more than the work itself (a 10k-item load: ~0.8 s of 2 s).  These objects form no
reference cycles that need collecting during the phase, so collection waits until it ends.

The collector's switch is one per process, while pauses overlap: an async save plans on its own thread while
the training thread loads or plans the next save.  Each pause saving and restoring ``gc.isenabled()`` on its
own would, when two overlap and the first ends first, leave collection off for good (the second restores the
"disabled" it saw).  So pauses are counted under a lock: the first one remembers whether collection was on,
the last one to end turns it back on only then.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from typing import Iterator

_lock = threading.Lock()
_pauses = 0  # pauses in progress, all threads together
_was_enabled = False  # collection was on when the first of them began


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic collection inside the block (reference counting still frees everything); collection is on
    again once every overlapping pause has ended, unless it was off before the first began."""
    global _pauses, _was_enabled
    with _lock:
        if _pauses == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _pauses += 1
    try:
        yield
    finally:
        with _lock:
            _pauses -= 1
            if _pauses == 0 and _was_enabled:
                gc.enable()
