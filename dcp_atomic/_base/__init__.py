"""Utilities every layer may use and that know nothing of checkpoints: fault points, retries and deadlines, futures that know whether their failure was reported, the
collector pause, progress logs, argument checks, statistics records, the note to a process without a process group
(``world_of_one``), and the one module that touches private names
of torch, s3fs and gcsfs (``internals``)."""

from .faces import face

# The face: what the other layers import from here (tests/guards/test_layers.py holds them to it), by module.
__all__, __getattr__, __dir__ = face(__name__, {
    "arguments": ("arguments",),
    "extras": ("install_advice", "MISSING_EXTRA_EXIT"),
    "faces": ("face",),
    "failpoints": ("failpoints",),
    "futures": ("ReportedFuture",),
    "gc_pause": ("gc_paused", "hook", "leave", "PLANNER", "STORAGE"),
    "internals": ("internals", "MEM_FORMAT_ENCODING"),
    "mounts": ("filesystem_type", "local_filesystem", "ram_backed"),
    "key_prefixes": ("data_prefix", "DATA_PREFIX_PATTERN", "MAX_DATA_PREFIXES", "validate_data_prefixes"),
    "progress": ("format_size", "Progress"),
    "retry": ("Deadline", "REREAD_SECONDS", "retry_until"),
    "stats": ("DrainStats", "FailureStats", "LoadStats", "ReadStats", "SaveStats", "SnapshotStats"),
    "world_of_one": ("world_of_one",),
})
