"""Where a manager's operations report: their statistics (:mod:`dcp_atomic._base.stats`, docs/statistics.md) built
once here and handed to the user's callbacks (:class:`.options.Callbacks`), and the log line of each outcome.

One rule for every report: a callback's own failure is logged and counted (``CheckpointManager.callback_failures``),
never the operation's, and a report is never what fails an operation (a committed save is never reported failed)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any, Callable, Iterator

from .._base.stats import FailureStats, LoadStats, SaveStats, SnapshotStats
from .options import Callbacks, StatsCallback

log = logging.getLogger("dcp_atomic.manager")


class Reports:
    """One manager's reports (every rank builds one; what only rank 0 reports says so)."""

    def __init__(self, callbacks: Callbacks, *, run_id: str, rank: int, world_size: int) -> None:
        self.callbacks, self.run_id, self.rank, self.world_size = callbacks, run_id, rank, world_size
        self.callback_failures = 0
        self._lock = threading.Lock()

    def deliver(self, callback: StatsCallback | None, name: str,
                stats: SaveStats | LoadStats | FailureStats | SnapshotStats) -> None:
        """Hand ``stats`` to a user callback; its failure is logged and counted, never the operation's."""
        if callback is None:
            return
        try:
            callback(stats.to_dict())
        except Exception:
            with self._lock:
                self.callback_failures += 1
            log.exception("the %s callback failed for run %r step %s; the %s's outcome stands", name, self.run_id,
                          stats.step, stats.kind)

    def failure(self, operation: str, step: int | None, error: BaseException, started: float) -> None:
        """``on_failed``; never raises: the failure itself must still reach the caller (an async save's future)."""
        if self.callbacks.on_failed is None:
            return
        try:
            stats = FailureStats.from_error(error, operation=operation, run_id=self.run_id, step=step,
                                            world_size=self.world_size, rank=self.rank,
                                            seconds=time.perf_counter() - started)
        except Exception:
            log.exception("could not describe the failure of %s step %s for on_failed", operation, step)
            return
        self.deliver(self.callbacks.on_failed, "on_failed", stats)

    @contextlib.contextmanager
    def failures_reported(self, operation: str, step: int | None, started: float) -> Iterator[dict[str, Any]]:
        """Report a failure of the enclosed work to ``on_failed``; yields a dict whose ``step`` the work may fill in
        once it knows it (a load of the latest step)."""
        attempt = {"step": step}
        try:
            yield attempt
        except Exception as error:
            self.failure(operation, attempt["step"], error, started)
            raise

    def saved(self, step: int, writer: Any, seconds: float, stage_seconds: float, asynchronous: bool,
              retention: Callable[[int, Any, SaveStats], None]) -> None:
        """Rank 0, once ``step`` is committed: its statistics, ``retention`` run (its failure is logged, put in the
        statistics and retried by the next save: the save is durable, and the other ranks have already returned),
        the log line, ``on_saved``."""
        if self.rank != 0:
            return
        stats = SaveStats.from_writer(writer.last_stats, run_id=self.run_id, step=step, save_id=writer.save_id,
                                      world_size=self.world_size, asynchronous=asynchronous, seconds=seconds,
                                      stage_seconds=stage_seconds)
        staged = writer.live_state
        if staged is not None:  # rank 0's
            stats.stage_call_seconds, stats.stage_wait_seconds = staged.call_seconds, staged.read.wait_seconds
            stats.pool_bytes, stats.peak_host_bytes = staged.staging.pool_bytes, staged.peak_host_bytes
        local = getattr(writer, "last_local_commit", None)
        if local is not None:
            stats.tier, stats.local_commit_seconds, stats.replica_bytes = "local", local.seconds, local.replica_bytes
        try:
            retention(step, writer, stats)
        except Exception as e:  # EBUSY on NFS .nfsXXXX files, EIO, throttled deletes: the next save retries
            stats.retention_error = f"{type(e).__name__}: {e}"
            log.warning("run %r step %d is committed, but retention failed (the next save retries it): %s",
                        self.run_id, step, stats.retention_error, exc_info=True)
        log.info("run %r step %d committed: %s", self.run_id, step,
                 ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in stats.to_dict().items() if k != "ranks"))
        self.deliver(self.callbacks.on_saved, "on_saved", stats)

    def loaded(self, step: int, reader: Any, seconds: float, restored_from: dict[str, Any] | None) -> None:
        """Every rank, its own share: a load a storage tier served (``restored_from``: which one, None with one)."""
        log.info("loaded run %r step %d (save %s) in %.3fs", self.run_id, step, reader.save_id, seconds)
        read = reader.read_stats
        self.deliver(self.callbacks.on_loaded, "on_loaded", LoadStats(
            run_id=self.run_id, step=step, save_id=reader.save_id, world_size=self.world_size, rank=self.rank,
            seconds=seconds, bytes=reader.bytes_read, files=reader.files_read,
            gb_per_s=reader.bytes_read / max(seconds, 1e-9) / 1e9, bytes_from_storage=read.storage_bytes,
            bytes_from_peers=read.peer_bytes_received, bytes_to_peers=read.peer_bytes_sent,
            storage_seconds=read.storage_seconds, exchange_seconds=read.exchange_seconds,
            tier=(restored_from or {}).get("tier"), bytes_from_replicas=(restored_from or {}).get("bytes_fetched", 0)))

    def restored(self, restored: Any, seconds: float) -> None:
        """Every rank, its own share: a load the snapshot tier served (``restored``: what it restored)."""
        log.info("loaded run %r step %d from the %s tier in %.3fs", self.run_id, restored.step, restored.tier, seconds)
        self.deliver(self.callbacks.on_loaded, "on_loaded", LoadStats(
            run_id=self.run_id, step=restored.step, save_id=None, world_size=self.world_size, rank=self.rank,
            seconds=seconds, bytes=restored.bytes, files=0, gb_per_s=restored.bytes / max(seconds, 1e-9) / 1e9,
            bytes_from_storage=0, bytes_from_peers=restored.bytes_fetched, bytes_to_peers=0, storage_seconds=0.0,
            exchange_seconds=0.0, tier=restored.tier, bytes_from_replicas=restored.bytes_fetched))
