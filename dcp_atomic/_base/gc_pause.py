"""Pausing Python's cyclic garbage collector while metadata is built, moved or parsed.

A checkpoint's metadata is 10^4-10^6 small objects (DCP's plans and ``.metadata``, our manifest items), built
or parsed in one go.  Their allocation keeps triggering full collections that traverse every object of the
process again, which cost more than the work itself (a 10k-item load: ~0.8 s of 2 s).  These objects form no
reference cycles that need collecting during the phase, so collection waits until it ends.

Two kinds of pause, one switch:

* :func:`gc_paused` covers one call (a hook's own work).
* A *lease* covers a whole ``dcp.save`` / ``dcp.load`` on this thread, DCP's collectives between our hooks
  included: they pickle and unpickle every rank's plan, write results and ``.metadata`` (10^4+ objects per
  rank), and with the collector on they set off 5-6 full collections per save at 10k keys per rank.  The user
  calls plain ``dcp.save``, so the lease is driven from the hooks (:func:`hook`): an operation's first hook
  begins it, each of its hooks renews it, and it ends once each participant (our planner, our storage writer
  or reader) is done on this rank: at its last hook, or, for a save on a rank other than the coordinator,
  when the global metadata of DCP's closing broadcast has been unpickled (:func:`leave`, called from the
  writer's ``_GcPauseEndsOnUnpickle``).  A pause begun in one hook and ended in a later one would stay on
  for good if the operation failed in between (a peer raising, a storage error), so a lease also ends, for
  sure, (a) when one of our hooks raises, (b) when the next operation on this thread begins, and (c) when no
  hook has renewed it for :data:`LEASE_SECONDS` (a daemon watchdog).  The cost of a lease that ends early
  is only speed: each hook still pauses its own work.

The switch is one per process, while pauses overlap: an async save plans on its own thread while the training
thread loads or plans the next save.  Each pause saving and restoring ``gc.isenabled()`` on its own would,
when two overlap and the first ends first, leave collection off for good (the second restores the "disabled"
it saw).  So pauses and leases are counted under one lock: the first remembers whether collection was on, the
last one to end turns it back on only then (a user who disabled the collector keeps it disabled).

Why ``gc.disable()`` and not a raised threshold: a raised generation-2 threshold still runs the young
collections, and it too must be put back when a lease ends; the watchdog bounds a lost ``disable`` as
tightly as a lost threshold, so the cheaper pause wins (``benchmarks/profile.py`` times both generations:
stock DCP runs 2,500-3,200 young collections per 10k-key operation).  What a pause defers is not all saved:
the objects an operation keeps are traversed once the lease ends, in a few collections instead of 5-6 full ones.

One limit: a user who turns the collector off *during* a lease gets it back on when the last pause ends (the
switch cannot tell who turned it off); turn it off before saving, or after.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import time
from typing import Iterator

#: seconds a lease outlives the last hook that renewed it: longer than the gaps between two hooks of one
#: operation on a rank (waiting for the coordinator's plan or for the slowest rank's writes, a few seconds
#: at 10^4 keys x 4 ranks); what a failed operation can leave the collector off for at most.
LEASE_SECONDS = 30.0

PLANNER = "planner"  # the participants of a lease: our planner, our storage writer or reader
STORAGE = "storage"

_lock = threading.RLock()  # reentrant: a collection inside a locked section may run finalizers that pause
_changed = threading.Condition(_lock)  # wakes the watchdog when a lease begins
_pauses = 0  # pauses and leases in progress, all threads together
_was_enabled = False  # collection was on when the first of them began
_blocks: dict[int, int] = {}  # thread ident -> its gc_paused blocks in progress (a forked child keeps its own)


class _Lease:
    """One thread's operation: who still has hooks to come, and when the watchdog ends it regardless."""

    __slots__ = ("roles", "deadline", "opening")

    def __init__(self) -> None:
        self.roles: set[str] = set()
        self.deadline = 0.0
        self.opening = False  # only first hooks so far: another participant's first hook joins this operation


_leases: dict[int, _Lease] = {}  # thread ident -> its lease
_watchdog: threading.Thread | None = None


def _pause() -> None:
    global _pauses, _was_enabled
    if _pauses == 0:
        _was_enabled = gc.isenabled()
        gc.disable()
    _pauses += 1


def _resume() -> None:
    global _pauses
    _pauses -= 1
    if _pauses == 0 and _was_enabled:
        gc.enable()


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic collection inside the block (reference counting still frees everything); collection is on
    again once every overlapping pause and lease has ended, unless it was off before the first began."""
    ident = threading.get_ident()
    with _lock:
        _pause()
        _blocks[ident] = _blocks.get(ident, 0) + 1
    try:
        yield
    finally:
        with _lock:
            _blocks[ident] -= 1
            if not _blocks[ident]:
                del _blocks[ident]
            _resume()


def _drop(ident: int) -> None:
    """End ``ident``'s lease (under the lock)."""
    if _leases.pop(ident, None) is not None:
        _resume()


def _watch() -> None:
    """End every lease no hook renewed in time; sleeps until the earliest deadline."""
    with _lock:
        while True:
            now = time.monotonic()
            for ident in [i for i, lease in _leases.items() if lease.deadline <= now]:
                _drop(ident)
            _changed.wait(min(lease.deadline for lease in _leases.values()) - now if _leases else None)


def _enter(role: str, first: bool) -> None:
    global _watchdog
    ident = threading.get_ident()
    with _lock:
        lease = _leases.get(ident)
        if first:
            if lease is None:
                lease = _leases[ident] = _Lease()
                _pause()
                if _watchdog is None:
                    _watchdog = threading.Thread(target=_watch, name="dcp-atomic-gc-lease", daemon=True)
                    _watchdog.start()
                _changed.notify()
            if not lease.opening or role in lease.roles:  # a new operation: what the last one left is over
                lease.roles.clear()
            lease.roles.add(role)
            lease.opening = True
        elif lease is not None:
            lease.opening = False
        if lease is not None:
            lease.deadline = time.monotonic() + LEASE_SECONDS


def _leave(role: str, failed: bool) -> None:
    ident = threading.get_ident()
    with _lock:
        lease = _leases.get(ident)
        if lease is None:
            return
        lease.roles.discard(role)
        if failed or not lease.roles:
            _drop(ident)


def leave(role: str) -> None:
    """``role`` has no hook left in this thread's operation (one that ends outside a hook); no-op without a lease."""
    _leave(role, False)


@contextlib.contextmanager
def hook(role: str, *, first: bool = False, last: bool = False) -> Iterator[None]:
    """One DCP hook of ``role`` (:data:`PLANNER` or :data:`STORAGE`): its own work runs paused; ``first``
    begins (or joins) this thread's lease, any hook renews it, ``last`` ends ``role``'s part in it, and the
    lease ends once no participant is left or as soon as a hook raises (DCP then fails the operation)."""
    _enter(role, first)
    failed = True
    try:
        with gc_paused():
            yield
        failed = False
    finally:
        if last or failed:
            _leave(role, failed)


def leases_held() -> int:
    """Leases in progress in this process (diagnostics and tests)."""
    with _lock:
        return len(_leases)


def _after_fork_in_child() -> None:
    """A forked child has only the forking thread: the parent's leases, watchdog and other threads' pauses are
    not its own (a DataLoader worker forked while an async save's thread sits in a hook must collect)."""
    global _lock, _changed, _watchdog, _pauses
    _lock = threading.RLock()
    _changed = threading.Condition(_lock)
    _watchdog = None
    _leases.clear()
    mine = _blocks.get(threading.get_ident(), 0)
    _blocks.clear()
    if mine:
        _blocks[threading.get_ident()] = mine
    held, _pauses = _pauses, mine
    if held and not mine and _was_enabled:
        gc.enable()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
