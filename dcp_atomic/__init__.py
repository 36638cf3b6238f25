"""dcp_atomic: crash-safe, verified storage for torch.distributed.checkpoint.

Pass :class:`AtomicStorageWriter` / :class:`AtomicStorageReader` to ``dcp.save``
/ ``dcp.async_save`` / ``dcp.load``.  See README.md for the guarantees.
"""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

from .protocol.catalog import latest_step, list_steps, resume_point
from .protocol.commit import ResumePoint
from .protocol.retention_policy import Best, Retention
from .errors import (
    ArgumentError,
    ArgumentTypeError,
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
    StagingRaceError,
    StorageError,
    TorchVersionError,
    UnsafeItemError,
)
from .format.parallelism import Parallelism
from ._base.faces import face
from .version import __version__

# What needs torch is imported on first use, so that `dcp-atomic --help`, `ls` and `show` (and anything that only
# looks at a root) start without it: importing torch costs seconds, a minute on a loaded node.
_lazy, __getattr__, __dir__ = face(__name__, {"manager": ("CheckpointManager",),
                                              "manager.options": ("LocalTierOptions", "MemoryTier", "Callbacks"),
                                              "staging.options": ("Staging",),
                                              "dcp.planners": ("AtomicLoadPlanner", "AtomicSavePlanner"),
                                              "dcp.reader": ("AtomicStorageReader",),
                                              "dcp.writer": ("AtomicStorageWriter",)})

# The modules' paths before the layers had packages (``dcp_atomic.writer``...), kept for one release: importing one
# gives the module itself (so ``monkeypatch`` and ``mock.patch`` of an old path reach the code that runs).  The former
# ``dcp_atomic.manager`` and ``dcp_atomic.exchange`` are their packages now (the first holds the manager itself).
_MOVED = {
    **dict.fromkeys(("arguments", "failpoints", "gc_pause", "progress", "retry", "stats"), "_base"),
    **dict.fromkeys(("codec", "container", "integrity", "layout", "manifest", "parallelism", "safe_pickle"), "format"),
    **dict.fromkeys(("backends", "gcs", "object_retry", "s3", "s3_multipart", "s3_probe", "storage"), "stores"),
    **dict.fromkeys(("catalog", "commit", "lineage", "location", "retention"), "protocol"),
    **dict.fromkeys(("collective", "file_transfer", "liveness"), "exchange"),
    **dict.fromkeys(("identity", "planners", "read_checks", "read_sources", "reader", "reshard", "shared_read",
                     "watched", "writer"), "dcp"),
    **dict.fromkeys(("drain", "local_tier", "placement", "tier_restore"), "tiers"),
    **dict.fromkeys(("audit", "cli", "demo", "export", "importer"), "tools"),
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import dcp_atomic.<old name>`` -> the module at its new path (one object under both names)."""

    def find_spec(self, fullname: str, path: object = None, target: object = None):
        package, _, name = fullname.rpartition(".")
        if package == __name__ and name in _MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        name = spec.name.rpartition(".")[2]
        return importlib.import_module(f"{__name__}.{_MOVED[name]}.{name}")

    def exec_module(self, module) -> None:
        """The module ran already, at its new path; what is left is telling the importer where that is (once per
        process: the old name stays in ``sys.modules``)."""
        old = f"{__name__}.{module.__name__.rpartition('.')[2]}"
        warnings.warn(f"{old} moved to {module.__name__}; the old path goes in the next minor release",
                      DeprecationWarning, stacklevel=2)


sys.meta_path.insert(0, _MovedModules())


__all__ = [
    "LocalTierOptions",
    "MemoryTier",
    "Callbacks",
    "AtomicStorageWriter",
    "AtomicStorageReader",
    "AtomicSavePlanner",
    "AtomicLoadPlanner",
    "Parallelism",
    "list_steps",
    "latest_step",
    "resume_point",
    "ResumePoint",
    "Retention",
    "Best",
    "ArgumentError",
    "ArgumentTypeError",
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
    "Staging",
    "StagingRaceError",
    "StorageError",
    "TorchVersionError",
    "UnsafeItemError",
    "__version__",
]
