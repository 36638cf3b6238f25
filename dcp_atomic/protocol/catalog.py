"""Finding committed steps: ``list_steps``, ``latest_step`` and step resolution.

"Latest" is the most recently *committed* step (the marker's commit sequence
number, P10, never a wall clock), not the highest number, so after a rollback
restart the live branch's new steps win over abandoned higher-numbered ones.
Scanning is done by one process (global rank 0, the CLI): hundreds of ranks
listing at once overload object stores, and NFS listings are stale.  Other
ranks read ``LATEST`` and markers by exact name.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from . import commit
# scan_markers lives with the rest of the read side in commit (next_sequence needs it): re-exported as part of
# this module's "finding steps" API, so that commit never imports catalog
from .commit import (SCAN_RETRY_SECONDS, Committed, ResumePoint, commit_order, read_committed, read_latest,  # noqa: F401
                     read_marker, scan_markers, write_latest)
from ..errors import CheckpointNotFoundError, CorruptCheckpointError
from ..format.layout import RunLayout, validate_step
from ..format.manifest import Marker
from .._base import arguments
from .._base.mounts import filesystem_type, local_filesystem
from .._base.retry import Deadline
from ..stores.backends import open_storage
from ..stores.storage import LocalStorage

log = logging.getLogger("dcp_atomic.catalog")  # the name users filter on

DEFAULT_TIMEOUT = 120.0


def most_recent(markers: list[Marker]) -> Marker | None:
    return max(markers, key=commit_order, default=None)


def shows_at_once(layout: RunLayout, path: str) -> bool:
    """Whether a name another process made or removed under ``path`` shows here at once: a POSIX root on a filesystem
    of this machine (ext4, xfs, tmpfs...), where no client cache can hide it, so a missing marker or step is missing
    and nothing is worth waiting for.  Not on NFS or FUSE mounts (their clients cache names), nor object stores."""
    return isinstance(layout.storage, LocalStorage) and local_filesystem(path)


def resolve(layout: RunLayout, step: int | None, deadline: Deadline, *, save_id: str | None = None,
            save_sequence: int | None = None) -> Committed:
    """The committed checkpoint to load: ``step`` itself, or the one ``LATEST`` names.

    A marker older than the ``LATEST`` that led to it, or not naming the
    ``save_id`` the caller was told to load, is a stale cached read (NFS): it is
    re-read until it agrees or the deadline passes.  Unless the caller knows the commit sequence of that save
    (``save_sequence``) and the marker records a later commit of the step: then the save was superseded (the
    step re-saved since), and no wait can bring it back.
    """
    # One stat on a POSIX root (on an object store it would be a LIST by every rank, which ranks never make).
    absent = (step is not None and save_id is None and isinstance(layout.storage, LocalStorage)
              and not layout.storage.is_dir(layout.step_dir(step)))
    if absent and shows_at_once(layout, layout.step_dir(step)):  # no cache can hide it here: nothing to wait for
        raise CheckpointNotFoundError(
            f"step {step} of run {layout.run_id!r} is not committed under {layout.storage.describe()}: its directory "
            f"does not exist on this machine's {filesystem_type(layout.step_dir(step))} filesystem (no cache can hide "
            f"it). `dcp-atomic ls {layout.storage.describe()} {layout.run_id}` lists the committed steps",
            path=layout.step_dir(step), step=step)
    if absent:  # maybe a step another node just wrote (an NFS client caches a missing name for up to a minute)
        log.warning("step %d of run %r is not visible under %s: waiting up to %.0fs in case another node is saving it "
                    "(storage caches lag); pass a shorter timeout= to be answered sooner", step, layout.run_id,
                    layout.storage.describe(), deadline.seconds)
    try:
        return _resolve(layout, step, deadline, save_id, save_sequence)
    except CheckpointNotFoundError as e:
        if not absent:
            raise
        raise CheckpointNotFoundError(f"{e.message.rstrip('.')}; its directory never appeared here. `dcp-atomic ls "
                                      f"{layout.storage.describe()} {layout.run_id}` lists the committed steps",
                                      **e.details) from None


def _resolve(layout: RunLayout, step: int | None, deadline: Deadline, save_id: str | None,
             save_sequence: int | None) -> Committed:
    while True:
        if step is None:
            latest = read_latest(layout, deadline)
            committed = read_committed(layout, latest.step, deadline)
            marker = committed.marker
            current = marker.save_id == latest.save_id or commit_order(marker) >= commit_order(latest)
            expected = f"LATEST names save {latest.save_id} of step {latest.step}"
        else:
            committed = read_committed(layout, step, deadline)
            current = save_id is None or committed.save_id == save_id
            expected = f"save {save_id} was committed for step {step}"
        if current:
            return committed
        sequence = committed.marker.sequence
        if step is not None and save_sequence is not None and sequence is not None and sequence > save_sequence:
            raise CheckpointNotFoundError(
                f"save {save_id} (commit {save_sequence}) of step {step} is gone: the step was saved again since "
                f"(save {committed.save_id}, commit {sequence}), and only that save is kept. Load the step's "
                "current save, or another step",
                path=layout.marker(step), step=step, save_id=save_id,
            )
        if deadline.expired():
            raise CheckpointNotFoundError(
                f"{expected}, but this process still reads a marker naming save {committed.save_id} after "
                f"{deadline.seconds:.0f}s (a storage cache that does not expire?)",
                path=layout.marker(committed.step),
            )
        time.sleep(min(0.05, deadline.remaining()))


def list_steps(root: str | os.PathLike, run_id: str, storage_options: dict[str, Any] | None = None) -> list[int]:
    """Committed steps of ``run_id``, ascending (damaged markers are skipped with a warning); a local root that
    does not exist is a typo, not an empty run (:class:`CheckpointNotFoundError`)."""
    layout = _existing_root(root, run_id, storage_options, "list_steps")
    return [m.step for m in scan_markers(layout)]


def _existing_root(root: str | os.PathLike, run_id: str, storage_options: dict[str, Any] | None,
                   caller: str) -> RunLayout:
    """The run's layout, refusing a local root directory that does not exist (an object store's empty prefix is a
    root nothing was saved to yet: it has no existence of its own to check)."""
    layout = RunLayout(open_storage(root, storage_options), run_id)
    storage = layout.storage
    if isinstance(storage, LocalStorage) and not os.path.isdir(storage.root):
        raise CheckpointNotFoundError(f"{caller}: the root {storage.root} does not exist (a typo? a filesystem not "
                                      "mounted here?); nothing can have been saved there", path=storage.root)
    return layout


def latest_step(
    root: str | os.PathLike,
    run_id: str,
    storage_options: dict[str, Any] | None = None,
    *,
    repair: bool = True,
    timeout: float = 10.0,
    missing_root_ok: bool = False,
) -> int | None:
    """The most recently committed step, or None.  A local root that does not exist is a typo, not an empty run
    (:class:`CheckpointNotFoundError`), unless ``missing_root_ok`` (a job's first resume: the manager, torchtitan).

    Scans the markers (one process), and also reads ``LATEST`` by exact name:
    a client with stale caches may not list a marker that ``LATEST`` already
    names, so a ``LATEST`` newer than the scan is verified against its marker
    and believed.  ``repair`` rewrites a ``LATEST`` that lags behind the
    newest commit, and only ever moves it forward.  A damaged marker raises
    :class:`CorruptCheckpointError` rather than silently choosing an older step.
    """
    timeout = arguments.seconds("latest_step(timeout=...)", timeout)
    arguments.flag("latest_step(repair=...)", repair)
    arguments.flag("latest_step(missing_root_ok=...)", missing_root_ok)
    layout = (RunLayout(open_storage(root, storage_options), run_id) if missing_root_ok
              else _existing_root(root, run_id, storage_options, "latest_step"))
    newest = most_recent(scan_markers(layout, strict=True))
    try:
        current = read_latest(layout, Deadline(min(timeout, SCAN_RETRY_SECONDS)))
    except (CheckpointNotFoundError, CorruptCheckpointError):
        current = None
    if current is not None and (newest is None or commit_order(current) > commit_order(newest)):
        try:
            marker = read_marker(layout, current.step, Deadline(timeout))
            if marker.save_id == current.save_id or commit_order(marker) >= commit_order(current):
                return current.step  # the scan is behind (stale listing); LATEST is verified by its marker
        except CheckpointNotFoundError:
            log.warning("LATEST of run %r names step %d, whose marker does not exist", run_id, current.step)
    if newest is None:
        return None
    if repair and (current is None or commit_order(newest) > commit_order(current)):
        log.warning("LATEST of run %r named %s; moving it forward to step %d (save %s)", run_id,
                    f"step {current.step}" if current else "nothing readable", newest.step, newest.save_id)
        write_latest(layout, newest)
    return newest.step


def resume_point(root: str | os.PathLike, run_id: str, step: int,
                 storage_options: dict[str, Any] | None = None) -> ResumePoint:
    """What a job that loaded ``step`` passes as ``AtomicStorageWriter(resumed_from=...)`` so that its saves
    supersede the steps above ``step`` committed before the load (a rollback, P14).  Call it on the saving
    coordinator (global rank 0) right after the load; ``CheckpointManager.load`` does this itself."""
    validate_step(step, "resume_point(step=...)")
    return commit.resume_point(RunLayout(open_storage(root, storage_options), run_id), step)
