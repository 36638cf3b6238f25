"""Typed errors of dcp_atomic.

DCP pickles exceptions to carry them from the rank that failed to every other
rank (``CheckpointException``), so every class here must survive a pickle round
trip with its message and details intact.  Messages must also stand on their
own: through plain ``dcp.load`` an error raised in ``read_metadata`` reaches the
user only as text inside an ``AssertionError``.
"""

from __future__ import annotations

from typing import Any


class CheckpointError(Exception):
    """Base class of every error this library raises on purpose."""

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def __reduce__(self):
        return (_rebuild_error, (type(self), self.message, self.details))

    def __str__(self) -> str:
        return f"{type(self).__name__}: {self.message}"


def shorten(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters at a word boundary, marked with an ellipsis: a message cut
    mid-word ("No space left on dev") reads as a different, garbled error."""
    if len(text) <= limit:
        return text
    cut = text[:limit - 1]
    space = cut.rfind(" ")
    return (cut[:space] if space > limit // 2 else cut).rstrip(" ,;:") + "…"


def _rebuild_error(cls: type, message: str, details: dict) -> CheckpointError:
    return cls(message, **details)


class CheckpointNotFoundError(CheckpointError):
    """No committed checkpoint matches the request (step, LATEST, run)."""


class CommitConflictError(CheckpointError):
    """The step is already committed (or another job committed it first)."""


class CorruptCheckpointError(CheckpointError):
    """Bytes on storage do not match what was recorded when they were written."""


class IncompleteStepError(CorruptCheckpointError):
    """A commit was refused because a file the step's manifest names has no verified copy at the destination."""


class RankConsistencyError(CheckpointError):
    """Ranks disagree on who they are or on which checkpoint version they see."""


class ReshardError(CheckpointError):
    """A load would change the parallel layout unsafely, or a key cannot be resharded."""


class StorageError(CheckpointError):
    """The storage backend failed in a way retries did not fix (ENOSPC, EIO, timeouts)."""


class DrainStalledError(StorageError):
    """``wait()``/``close()`` stopped waiting for a drain whose store made no progress for the stall deadline."""


class ConfigurationError(CheckpointError):
    """The writer or reader was used in a way the protocol cannot make safe."""


class ArgumentError(ConfigurationError, ValueError):
    """An argument of the public API out of range or malformed (``details["argument"]`` names it): one type for every
    bad argument, so ``except CheckpointError`` catches the commonest mistakes; also a ``ValueError``, as they were."""


class ArgumentTypeError(ArgumentError, TypeError):
    """An argument of the wrong type (a string for a count, an object for a ``Parallelism``).  A subclass rather than
    making every ``ArgumentError`` a ``TypeError`` too: ``except TypeError`` keeps meaning "a wrong type", while
    ``except ArgumentError`` and ``except ValueError`` (what a wrong type often raised before) still catch it."""


class UnsafeItemError(ConfigurationError):
    """A non-tensor item holds a type the safe-decoding allow-list refuses (P11); the checkpoint itself is intact."""


class TorchVersionError(CheckpointError):
    """A checkpoint written by a torch whose DCP metadata this torch cannot read; its bytes are intact."""


class RankFailureError(CheckpointError):
    """A peer died or froze inside a collective (seen through the process group)."""


class StagingRaceError(CheckpointError):
    """A tensor staged lazily (bounded staging, P16) was changed in place before its bytes were read: an
    ``optimizer.step()`` before ``wait_staged()``.  ``details``: ``step``, ``rank``, ``key``.  Nothing was committed."""
