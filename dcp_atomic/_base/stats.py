"""The statistics ``CheckpointManager`` hands to ``on_saved``, ``on_loaded`` and ``on_failed``.

These dataclasses are the schema; docs/statistics.md documents each field (type, unit, meaning) and the
tests hold the two together.  Callbacks receive ``to_dict()``, plain JSON-able data a logger takes as it is.
Fields are only ever added; renaming, removing or retyping one bumps ``SCHEMA_VERSION``.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

SCHEMA_VERSION = 1


class _Stats:
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _rate(nbytes: int | None, seconds: float) -> float | None:
    return None if nbytes is None else nbytes / max(seconds, 1e-9) / 1e9


@dataclass
class RankSaveStats(_Stats):
    """One rank's share of a save, as the writer recorded it in the manifest."""

    rank: int
    host: str
    bytes: int
    files: int
    items: int
    write_seconds: float
    fsync_seconds: float
    threads: int
    bytes_written: int = 0
    bytes_reused: int = 0

    @classmethod
    def from_manifest(cls, record: dict[str, Any]) -> "RankSaveStats":
        """From a manifest ``stats`` record, where ``files`` maps each file name to its size (records written before
        reuse existed lack ``bytes_written`` / ``bytes_reused``: every byte was written)."""
        return cls(rank=int(record["rank"]), host=str(record.get("host", "")), bytes=int(record["bytes"]),
                   files=len(record.get("files", {})), items=int(record["items"]),
                   write_seconds=float(record["write_seconds"]), fsync_seconds=float(record["fsync_seconds"]),
                   threads=int(record.get("threads", 1)),
                   bytes_written=int(record.get("bytes_written", record["bytes"])),
                   bytes_reused=int(record.get("bytes_reused", 0)))


@dataclass
class SaveStats(_Stats):
    """A committed save, on rank 0.  Writer figures are None when the commit was confirmed from the marker
    after DCP reported a failure: the writer's own figures never came back then."""

    run_id: str
    step: int
    save_id: str
    world_size: int
    asynchronous: bool
    seconds: float
    stage_seconds: float
    commit_seconds: float | None
    bytes: int | None
    files: int | None
    gb_per_s: float | None
    ranks: list[RankSaveStats] = field(default_factory=list)
    retention_error: str | None = None
    unreadable_steps: list[int] = field(default_factory=list)
    tier: str = "durable"
    local_commit_seconds: float | None = None
    replica_bytes: int | None = None
    bytes_written: int | None = None
    bytes_reused: int | None = None
    stage_call_seconds: float | None = None
    stage_wait_seconds: float | None = None
    pool_bytes: int | None = None
    peak_host_bytes: int | None = None
    schema_version: int = SCHEMA_VERSION
    kind: str = "save"

    @classmethod
    def from_writer(cls, writer_stats: dict[str, Any] | None, **known: Any) -> "SaveStats":
        """``known`` holds the manager's own fields; ``writer_stats`` is the writer's ``last_stats``."""
        figures = writer_stats or {}
        nbytes = figures.get("bytes")
        return cls(commit_seconds=figures.get("commit_seconds"), bytes=nbytes, files=figures.get("files"),
                   bytes_written=figures.get("bytes_written", nbytes), bytes_reused=figures.get("bytes_reused"),
                   gb_per_s=_rate(nbytes, known["seconds"]),
                   ranks=sorted((RankSaveStats.from_manifest(r) for r in figures.get("ranks", [])),
                                key=lambda r: r.rank), **known)


@dataclass
class LoadStats(_Stats):
    """One rank's share of a load, on that rank."""

    run_id: str
    step: int
    save_id: str
    world_size: int
    rank: int
    seconds: float
    bytes: int
    files: int
    gb_per_s: float
    bytes_from_storage: int = 0
    bytes_from_peers: int = 0
    bytes_to_peers: int = 0
    storage_seconds: float = 0.0
    exchange_seconds: float = 0.0
    tier: str | None = None
    bytes_from_replicas: int = 0
    schema_version: int = SCHEMA_VERSION
    kind: str = "load"


@dataclass
class DrainStats(_Stats):
    """A local step committed to the durable root by the background drain, on rank 0 (README "Two tiers")."""

    run_id: str
    step: int
    save_id: str
    sequence: int | None
    world_size: int
    seconds: float
    queued_seconds: float
    bytes: int
    files: int
    gb_per_s: float
    attempts: int
    skipped_steps: list[int] = field(default_factory=list)
    bytes_reused: int = 0  # of ``bytes``: linked from the durable root's previous step (reuse), not uploaded
    schema_version: int = SCHEMA_VERSION
    kind: str = "drain"


@dataclass
class SnapshotStats(_Stats):
    """A memory-committed snapshot (the memory tier), on every rank with its own share: what the call blocked the
    training loop for, how long until the step was memory-committed, and the bytes it moved."""

    run_id: str
    step: int
    sequence: int
    world_size: int
    rank: int
    slot: int
    call_seconds: float  # inside snapshot(): the slot written; the caller's state may change after it
    committed_seconds: float  # from the call to memory-committed on every rank (replicas verified, records written)
    bytes: int  # this rank's share, written into its slot
    replica_bytes_sent: int  # this rank's share times the holders it went to
    replica_bytes_received: int  # other ranks' shares this rank verified and keeps as replicas
    gb_per_s: float  # bytes over call_seconds
    snapshots_skipped: int  # so far: due while the previous one was in flight (``manager.snapshots_skipped``)
    schema_version: int = SCHEMA_VERSION
    kind: str = "snapshot"


@dataclass
class ReadStats(_Stats):
    """What one rank's ``read_data`` cost (``AtomicStorageReader.read_stats`` after a load)."""

    storage_bytes: int = 0  # bytes read from storage (data files), counted as they arrive
    storage_seconds: float = 0.0  # wall time of this rank's storage reads (its own items and its share)
    peer_bytes_received: int = 0  # stored bytes received from peers (shared reads)
    peer_bytes_sent: int = 0  # stored bytes sent to peers
    exchange_seconds: float = 0.0  # wall time of the exchange rounds (status collective and transfers)
    shared_items: int = 0  # stored items this rank got through the exchange (read for peers or received)
    rounds: int = 0  # exchange rounds (0: reads were not shared)


@dataclass
class FailureStats(_Stats):
    """A failed save, async save, load or drain, on each rank that raises it."""

    operation: str
    run_id: str
    step: int | None
    world_size: int
    rank: int
    seconds: float
    error_type: str
    message: str
    ranks: list[int] = field(default_factory=list)
    path: str | None = None
    schema_version: int = SCHEMA_VERSION
    kind: str = "failure"

    @classmethod
    def from_error(cls, error: BaseException, **known: Any) -> "FailureStats":
        details = getattr(error, "details", {}) or {}
        path = details.get("path")
        return cls(error_type=type(error).__name__, message=str(error), ranks=blamed_ranks(details),
                   path=None if path is None else str(path), **known)


def blamed_ranks(details: dict[str, Any]) -> list[int]:
    """The ranks a typed error names as failed: the silent ranks of a RankFailureError (its ``rank`` is the
    observer), else ``ranks``, else ``rank``."""
    if isinstance(details.get("silent"), str):  # "1, 3", "0 (the rendezvous store ...)", "none (...)"
        return [int(r) for r in re.findall(r"\d+", details["silent"].split("(")[0])]
    if isinstance(details.get("ranks"), (list, tuple)):
        return sorted(int(r) for r in details["ranks"])
    if isinstance(details.get("rank"), int) and details["rank"] >= 0:
        return [details["rank"]]
    return []
