"""dcp_atomic: crash-safe, verified storage for torch.distributed.checkpoint.

Pass :class:`AtomicStorageWriter` / :class:`AtomicStorageReader` to ``dcp.save``
/ ``dcp.async_save`` / ``dcp.load``.  See README.md for the guarantees.
"""

from .catalog import latest_step, list_steps, resume_point
from .commit import ResumePoint
from .errors import (
    ArgumentError,
    CheckpointError,
    CheckpointNotFoundError,
    CommitConflictError,
    ConfigurationError,
    CorruptCheckpointError,
    DrainStalledError,
    IncompleteStepError,
    RankConsistencyError,
    RankFailureError,
    ReshardError,
    StorageError,
    TorchVersionError,
    UnsafeItemError,
)
from .parallelism import Parallelism
from .version import __version__

# What needs torch is imported on first use, so that `dcp-atomic --help`, `ls` and `show` (and anything that only
# looks at a root) start without it: importing torch costs seconds, a minute on a loaded node.
_LAZY = {"CheckpointManager": ".manager", "AtomicLoadPlanner": ".planners", "AtomicSavePlanner": ".planners",
         "AtomicStorageReader": ".reader", "AtomicStorageWriter": ".writer"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

__all__ = [
    "AtomicStorageWriter",
    "AtomicStorageReader",
    "AtomicSavePlanner",
    "AtomicLoadPlanner",
    "Parallelism",
    "list_steps",
    "latest_step",
    "resume_point",
    "ResumePoint",
    "ArgumentError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CommitConflictError",
    "ConfigurationError",
    "CorruptCheckpointError",
    "DrainStalledError",
    "IncompleteStepError",
    "RankConsistencyError",
    "RankFailureError",
    "CheckpointManager",
    "ReshardError",
    "StorageError",
    "TorchVersionError",
    "UnsafeItemError",
    "__version__",
]
