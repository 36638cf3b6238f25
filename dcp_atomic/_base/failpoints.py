"""Named fault points, inert unless a test arms them.

Crash tests need to stop a process at an exact phase of the protocol ("after the
manifest is published, before the marker exists") without sleeps and races.
Like etcd's gofail and TiKV's fail-rs, the code calls ``failpoints.hit(name)``
at each phase; in production the registry is empty and the call is a dict
lookup.  Tests arm points in-process with :func:`arm` or, for worker processes,
through the environment variable ``DCP_ATOMIC_FAILPOINTS``::

    DCP_ATOMIC_FAILPOINTS="commit.after_manifest=kill;write.mid_data@1=raise"

``name@rank`` limits a point to one rank; ``name#N`` (or ``name@rank#N``) fires
only on the N-th time the point is reached in this process.  Actions: ``kill`` (SIGKILL self),
``stop`` (SIGSTOP self, a frozen rank), ``raise`` (an ``OSError(EIO)``, an
injected I/O error), ``sleep:SECONDS``, and ``flip``, which ``hit`` returns for the
caller to damage the bytes it is about to pass on (a faulty peer).
"""

from __future__ import annotations

import errno
import os
import signal
import time
from typing import Callable

ENV_VAR = "DCP_ATOMIC_FAILPOINTS"

POINTS = frozenset(
    {
        "plan.before_checks",  # coordinator, prepare_global_plan
        "write.before_data",  # every rank, before its first byte
        "write.mid_data",  # every rank, after its first item is written
        "write.after_data",  # every rank, files written and fsynced
        "commit.before_metadata",  # rank 0, finish() entered
        "commit.after_metadata",  # .metadata durable
        "commit.after_manifest",  # manifest published, no marker yet
        "commit.after_marker",  # marker exists, LATEST not yet updated
        "commit.after_latest",  # everything done
        "read.before_data",  # every rank, before reading shard bytes
        "read.exchange_send",  # every rank, a round's items read, before sending them to peers
        "transfer.round",  # every rank moving files to or from a peer (replicas, restores), before each chunk round is posted
        "replicate.send",  # local tier: every rank, its files read back, before sending them to its holders
        "replicate.receive",  # local tier: a holder, one rank's replica verified and kept, not yet reported
        "local.before_marker",  # local tier: a root's leader (local commit, tier restore), before its root's marker
        "drain.before_upload",  # the drain thread of every rank, before it uploads its files (given the step)
        "drain.before_marker",  # the drain's rank 0, control files checked, before the durable marker (the step)
        "drain.after_commit",  # the drain's rank 0, the step durably committed, before it hands out the outcome
        "reuse.before_link",  # every rank saving with reuse, before it links a stable file of the base (the base step)
        "memory.after_retire",  # memory tier: every rank, its oldest slot's record retired, before a byte is rewritten
        "memory.after_slot_write",  # memory tier: every rank, its slot written (no record yet), before the commit thread
        "memory.replica_send",  # memory tier's thread: every rank, slots agreed, before the copies move (the step)
        "memory.replica_retired",  # memory tier's thread: a holder, its replica slot's record retired, before a byte lands
        "memory.replica_half_received",  # a holder: the first chunk of a replica landed in place, more to come (owner, step)
        "memory.restore_check",  # a restoring rank: the copies chosen, before it checks its own and the ranks compare (step)
        "memory.restore_half_received",  # a restoring rank: the first chunk of its share landed in its own slot
        "memory.replica_receive",  # memory tier's thread: every rank, the copies it holds checked as they landed, unnumbered
        "memory.before_record",  # memory tier's thread: every rank, the sequence handed out, before any commit record
        "memory.after_record",  # memory tier's thread: every rank, its records written, before the ranks agree
        "stage.before_copy",  # the stager's thread of every rank, before it reads a live tensor (the step)
        "reuse.after_link",  # every rank saving with reuse, a base file linked and verified, its other files not written
    }
)

_armed: dict[tuple[str, int | None], tuple] = {}  # (name, rank) -> (action or function, on hit N)
_hits: dict[str, int] = {}


def _parse(spec: str) -> dict[tuple[str, int | None], tuple[str, int | None]]:
    armed: dict[tuple[str, int | None], tuple[str, int | None]] = {}
    for entry in filter(None, (part.strip() for part in spec.split(";"))):
        target, _, action = entry.partition("=")
        target, _, nth = target.partition("#")
        name, _, rank = target.partition("@")
        if name not in POINTS:
            raise ValueError(f"unknown failpoint {name!r} in {ENV_VAR}; known: {sorted(POINTS)}")
        armed[(name, int(rank) if rank else None)] = (action or "raise", int(nth) if nth else None)
    return armed


def arm(name: str, action: "str | Callable[[int | None, int | None], object]" = "raise",
        rank: int | None = None) -> None:
    """Arm one point in this process (tests only).  ``action`` may also be a function, called as
    ``action(rank, step)`` where the point is hit (a test's own fault: block, damage, refuse, kill at one step)."""
    if callable(action):
        if name not in POINTS:
            raise ValueError(f"unknown failpoint {name!r}; known: {sorted(POINTS)}")
        _armed[(name, rank)] = (action, None)
        return
    _armed.update(_parse(f"{name}{'' if rank is None else f'@{rank}'}={action}"))


def disarm(name: str) -> None:
    for key in [key for key in _armed if key[0] == name]:
        del _armed[key]


def disarm_all() -> None:
    _armed.clear()
    _hits.clear()


def hit(name: str, rank: int | None = None, step: int | None = None) -> str | None:
    """Run the action armed for ``name`` (and this rank), if any; ``flip`` is returned to the caller."""
    if not _armed:
        return None
    armed = _armed.get((name, rank)) or _armed.get((name, None))
    if armed is None:
        return None
    action, nth = armed
    _hits[name] = _hits.get(name, 0) + 1
    if nth is not None and _hits[name] != nth:
        return None
    if callable(action):
        action(rank, step)
        return None
    if action == "flip":
        return action
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif action.startswith("sleep:"):
        time.sleep(float(action.split(":", 1)[1]))
    elif action == "raise":
        raise OSError(errno.EIO, f"injected I/O error at failpoint {name!r}")
    else:
        raise ValueError(f"unknown failpoint action {action!r} for {name!r}")


def load_from_env() -> None:
    """(Re)read ``DCP_ATOMIC_FAILPOINTS``; for processes forked before it was set."""
    disarm_all()
    _armed.update(_parse(os.environ.get(ENV_VAR, "")))


load_from_env()
