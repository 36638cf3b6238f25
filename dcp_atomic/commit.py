"""The commit protocol: how a finished attempt becomes the visible checkpoint.

P1-P3 of the design, in order, executed by global rank 0 alone inside DCP's
``finish()`` (P2: no other process ever renames, replaces or deletes):

1. every rank has written and fsynced its data files into its own
   ``<step>/<save_id>/`` attempt directory (nothing there is visible yet);
2. DCP's ``.metadata`` is published atomically, then ``manifest.json`` (files,
   sizes, block checksums, identities, layout) by atomic rename / single PUT,
   and the attempt and step directories are fsynced;
3. the marker ``COMMITTED`` — naming the attempt and the manifest's sha256,
   sealed with its own checksum — is created *exclusively* (``link()`` of a
   written temp file on POSIX, put-if-absent on object stores), or, for an
   ``overwrite=True`` re-save, put over the old marker by rename once the new
   attempt is complete;
4. ``LATEST`` is replaced.  It is only a hint: a crash before this step leaves
   the step committed, and the next save or ``latest_step`` repairs it.

A crash at any point before 3 leaves the previous marker (and so the previous
checkpoint) untouched; the orphaned attempt is collectable by ``gc``.

The read side lives here too, because it must agree with the write side on what
counts as committed: a marker that parses, passes its self-checksum and whose
manifest hashes to the digest it names.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from . import failpoints
from .errors import CheckpointNotFoundError, CommitConflictError, CorruptCheckpointError
from .integrity import sha256_hex
from .layout import DCP_METADATA, MANIFEST, RunLayout
from .manifest import Latest, Manifest, Marker, now
from .retry import Deadline, retry_until
from .version import __version__

log = logging.getLogger(__name__)
_warned_roots: set[str] = set()


@dataclass
class Committed:
    """A step as a reader sees it after verification."""

    marker: Marker
    manifest: Manifest
    manifest_sha256: str

    @property
    def step(self) -> int:
        return self.marker.step

    @property
    def save_id(self) -> str:
        return self.marker.save_id


def publish(layout: RunLayout, manifest: Manifest, dcp_metadata: bytes, *, overwrite: bool, timeout: float,
            rank: int = 0) -> Marker:
    """Run steps 2-4 above; returns the marker that is now visible."""
    storage = layout.storage
    step, save_id = manifest.step, manifest.save_id
    attempt = layout.attempt_dir(step, save_id)
    failpoints.hit("commit.before_metadata", rank)
    storage.publish(storage.join(attempt, DCP_METADATA), dcp_metadata)
    failpoints.hit("commit.after_metadata", rank)

    manifest.written_at = now()
    manifest_bytes = manifest.to_json()
    storage.publish(storage.join(attempt, MANIFEST), manifest_bytes)
    storage.sync_dir(attempt)
    storage.sync_dir(layout.step_dir(step))
    failpoints.hit("commit.after_manifest", rank)

    marker = Marker(
        run_id=layout.run_id,
        step=step,
        save_id=save_id,
        manifest=f"{save_id}/{MANIFEST}",
        manifest_sha256=sha256_hex(manifest_bytes),
        committed_at=now(),
        library_version=__version__,
    )
    marker_path = layout.marker(step)
    if not storage.exclusive_create_is_atomic and storage.describe() not in _warned_roots:
        _warned_roots.add(storage.describe())
        log.warning("%s offers no put-if-absent: the commit marker is created check-then-put, which is safe "
                    "for one job per run but cannot arbitrate two jobs committing one step", storage.describe())
    if not storage.create_exclusive(marker_path, marker.to_json()):
        # It exists on the server; this client may not see it yet (NFS negative-lookup cache): wait it out.
        existing = read_marker(layout, step, Deadline(timeout))
        if existing.save_id == save_id:
            log.info("commit marker for step %d already names save %s (an earlier retry)", step, save_id)
        elif overwrite:
            storage.replace(marker_path, marker.to_json())
            log.info("step %d re-saved: marker now names %s (was %s)", step, save_id, existing.save_id)
        else:
            raise CommitConflictError(
                f"step {step} of run {layout.run_id!r} was committed by save {existing.save_id} while save "
                f"{save_id} was writing (two jobs on one run?); nothing of {save_id} is visible. "
                f"Use another run_id or step, or overwrite=True to replace it deliberately.",
                step=step,
                save_id=save_id,
                winner=existing.save_id,
            )
    storage.sync_dir(layout.step_dir(step))
    failpoints.hit("commit.after_marker", rank)
    write_latest(layout, marker)
    failpoints.hit("commit.after_latest", rank)
    return marker


def write_latest(layout: RunLayout, marker: Marker) -> None:
    latest = Latest(run_id=layout.run_id, step=marker.step, save_id=marker.save_id, committed_at=marker.committed_at)
    layout.storage.replace(layout.latest(), latest.to_json())


def _read_marker_once(layout: RunLayout, step: int) -> Marker:
    path = layout.marker(step)
    return Marker.from_json(layout.storage.read_file(path), where=path)


def read_marker(layout: RunLayout, step: int, deadline: Deadline, *, missing_ok: bool = False) -> Marker:
    """The step's marker, waiting out visibility lag and torn reads until ``deadline``.

    With ``missing_ok`` a missing marker is not waited for (a scan of steps that
    may simply be uncommitted) and surfaces as ``FileNotFoundError``.
    """
    path = layout.marker(step)
    retry_on: tuple = (CorruptCheckpointError,) if missing_ok else (FileNotFoundError, CorruptCheckpointError)
    try:
        marker = retry_until(lambda: _read_marker_once(layout, step), deadline=deadline, retry_on=retry_on)
    except FileNotFoundError:
        if missing_ok:
            raise
        raise CheckpointNotFoundError(
            f"step {step} of run {layout.run_id!r} is not committed: no {path} after waiting "
            f"{deadline.seconds:.0f}s (crashed or unfinished save, or a storage cache that is still stale)",
            step=step,
            path=path,
        ) from None
    if marker.run_id != layout.run_id or marker.step != step:
        raise CorruptCheckpointError(
            f"{path}: marker belongs to run {marker.run_id!r} step {marker.step}, not {layout.run_id!r} step {step}",
            path=path,
        )
    return marker


def read_committed(layout: RunLayout, step: int, deadline: Deadline) -> Committed:
    """Marker plus its manifest, the manifest verified against the marker's digest."""
    marker = read_marker(layout, step, deadline)
    path = layout.attempt_file(step, marker.save_id, MANIFEST)

    def load() -> tuple[bytes, str]:
        data = layout.storage.read_file(path)
        digest = sha256_hex(data)
        if digest != marker.manifest_sha256:
            raise CorruptCheckpointError(
                f"{path}: manifest sha256 {digest[:16]}... does not match the commit marker's "
                f"{marker.manifest_sha256[:16]}... (damaged or replaced manifest)",
                path=path,
            )
        return data, digest

    try:
        data, digest = retry_until(load, deadline=deadline, retry_on=(FileNotFoundError, CorruptCheckpointError))
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"{path}: the commit marker of step {step} names this manifest but it cannot be read", path=path
        ) from None
    manifest = Manifest.from_json(data, where=path)
    if (manifest.run_id, manifest.step, manifest.save_id) != (layout.run_id, step, marker.save_id):
        raise CorruptCheckpointError(f"{path}: manifest describes another checkpoint", path=path)
    return Committed(marker=marker, manifest=manifest, manifest_sha256=digest)


def read_latest(layout: RunLayout, deadline: Deadline) -> Latest:
    path = layout.latest()
    try:
        return retry_until(
            lambda: Latest.from_json(layout.storage.read_file(path), where=path),
            deadline=deadline,
            retry_on=(FileNotFoundError, CorruptCheckpointError),
        )
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            f"no checkpoint committed for run {layout.run_id!r}: {path} does not exist "
            f"(waited {deadline.seconds:.0f}s). Pass step= explicitly, or start training from scratch.",
            path=path,
        ) from None
