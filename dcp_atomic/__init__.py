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
from .manager import CheckpointManager
from .parallelism import Parallelism
from .planners import AtomicLoadPlanner, AtomicSavePlanner
from .reader import AtomicStorageReader
from .version import __version__
from .writer import AtomicStorageWriter

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
