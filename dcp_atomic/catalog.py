"""Finding committed steps: ``list_steps``, ``latest_step`` and step resolution.

"Latest" is the most recently *committed* step (the marker's commit time), not
the highest number, so after a rollback restart the live branch's new steps
win over abandoned higher-numbered ones.  Scanning is done by one process
(global rank 0, the CLI): hundreds of ranks listing at once overload object
stores, and NFS listings are stale.  Other ranks read ``LATEST`` and markers by
exact name.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from .commit import Committed, read_committed, read_latest, write_latest, _read_marker_once
from .errors import CorruptCheckpointError
from .layout import RunLayout, parse_step_dir
from .manifest import Marker
from .retry import Deadline
from .storage import open_storage

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 120.0


def scan_markers(layout: RunLayout) -> list[Marker]:
    """Every valid commit marker of the run, ascending by step (one process only)."""
    markers = []
    for name in layout.storage.list_dir(layout.run_dir):
        step = parse_step_dir(name)
        if step is None:
            continue
        try:
            markers.append(_read_marker_once(layout, step))
        except FileNotFoundError:
            continue  # an attempt that never committed
        except CorruptCheckpointError as e:
            log.warning("ignoring step %d: %s", step, e)
    return sorted(markers, key=lambda m: m.step)


def most_recent(markers: list[Marker]) -> Marker | None:
    return max(markers, key=lambda m: (m.committed_at, m.step), default=None)


def resolve(layout: RunLayout, step: int | None, deadline: Deadline) -> Committed:
    """The committed checkpoint to load: ``step`` itself, or the one ``LATEST`` names.

    A marker older than the ``LATEST`` that led to it is a stale cached read
    (NFS): it is re-read until the two agree or the deadline passes.
    """
    if step is not None:
        return read_committed(layout, step, deadline)
    while True:
        latest = read_latest(layout, deadline)
        committed = read_committed(layout, latest.step, deadline)
        marker = committed.marker
        if marker.save_id == latest.save_id or marker.committed_at >= latest.committed_at:
            return committed
        if deadline.expired():
            raise CorruptCheckpointError(
                f"{layout.latest()} names save {latest.save_id} of step {latest.step}, but the step's marker "
                f"still names the older save {marker.save_id} after {deadline.seconds:.0f}s "
                "(a storage cache that does not expire?)",
                path=layout.latest(),
            )
        time.sleep(min(0.05, deadline.remaining()))


def list_steps(root: str | os.PathLike, run_id: str, storage_options: dict[str, Any] | None = None) -> list[int]:
    """Committed steps of ``run_id``, ascending."""
    layout = RunLayout(open_storage(root, storage_options), run_id)
    return [m.step for m in scan_markers(layout)]


def latest_step(
    root: str | os.PathLike, run_id: str, storage_options: dict[str, Any] | None = None, *, repair: bool = True
) -> int | None:
    """The most recently committed step, or None.  Rewrites a stale ``LATEST`` when ``repair``."""
    layout = RunLayout(open_storage(root, storage_options), run_id)
    newest = most_recent(scan_markers(layout))
    if newest is None:
        return None
    if repair:
        try:
            current = read_latest(layout, Deadline(0))
            stale = (current.step, current.save_id) != (newest.step, newest.save_id)
        except Exception:
            current, stale = None, True
        if stale:
            log.warning(
                "LATEST of run %r named %s; repairing it to step %d (save %s)",
                run_id,
                f"step {current.step}" if current else "nothing readable",
                newest.step,
                newest.save_id,
            )
            write_latest(layout, newest)
    return newest.step
