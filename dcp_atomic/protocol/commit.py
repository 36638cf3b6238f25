"""The commit protocol: how a finished attempt becomes the visible checkpoint.

P1-P3 of the design, in order, executed by global rank 0 alone (P2: no other process ever renames, replaces or
deletes).  One sequence for every committer: a save (inside DCP's ``finish()``), an import, the drain's durable
commit (:mod:`~dcp_atomic.tiers.drain`); the local tier runs steps 0-2 and records its markers with :func:`record_local_marker`
under the same completeness rule.  What differs between them is a :class:`CommitPolicy`, never a restated step:

0. :func:`claim_attempt`: the attempt directory ``<step>/<save_id>/`` and its ``ATTEMPT`` claim, before any data
   (``gc``'s lease judges an uncommitted attempt by it);
1. every rank writes and fsyncs its data files and its ``manifest.<rank>.json`` shard of items and block
   checksums into the attempt (nothing there is visible yet);
2. :func:`publish_control`: DCP's ``.metadata``, then ``manifest.json`` (files, sizes, identities, layout, and the
   sha256 of each rank's shard), each published atomically, then the attempt and step directories fsynced; a copy
   of a step another root holds (the drain, a replica or restored root) publishes the same files, each checked
   against the manifest first, through :func:`copy_control`;
3. :func:`commit_step`: the marker ``COMMITTED`` (naming the attempt and the manifest's sha256, sealed with its
   own checksum), through :func:`place_marker`, which first refuses it unless every file the manifest names was
   verified (:func:`require_complete`), then creates it *exclusively* (``link()`` of a written temp file on POSIX,
   put-if-absent on object stores), or replaces the old one for an ``overwrite=True`` re-save or a save
   superseding a step of a branch the job abandoned (P14, :class:`ResumePoint`); then the claim must still be
   there, else the marker is withdrawn;
4. ``LATEST`` is replaced.  It is only a hint: a crash before this step leaves
   the step committed, and ``latest_step`` repairs it.

"Most recent" is decided by the marker's commit ``sequence`` (P10), never by
comparing the wall clocks of the hosts that committed; see :func:`next_sequence`.

A crash at any point before 3 leaves the previous marker (and so the previous
checkpoint) untouched; the orphaned attempt is collectable by ``gc``.

The read side lives here too, because it must agree with the write side on what
counts as committed: a marker that parses, passes its self-checksum and whose
manifest hashes to the digest it names; shards are read only when needed
(:meth:`Committed.load_items`), each checked against the digest the manifest names.  A file that is not visible yet is
waited for until the deadline; one that is visible but damaged gets a short
re-read and is then reported (P9).

Why one module of about 700 lines: the steps every committer shares and the readers of what they write (marker,
``LATEST``), together so the sequence reads once, in order.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Callable, Iterable

from .._base import failpoints
from ..errors import (CheckpointError, CheckpointNotFoundError, CommitConflictError, CorruptCheckpointError,
                     IncompleteStepError, StorageError)
from ..format.integrity import sha256_hex
from ..format.layout import ATTEMPT, DCP_METADATA, MANIFEST, RunLayout, parse_step_dir
from ..format.manifest import (INLINE_ITEMS, RANKS_FILE, Latest, Manifest, ManifestShard, Marker, RankRecords, ShardRef,
                               now, shard_name)
from .._base.retry import REREAD_SECONDS, Deadline, retry_until
from ..version import __version__

log = logging.getLogger("dcp_atomic.commit")  # the name users filter on
_warned_roots: set[str] = set()
SCAN_RETRY_SECONDS = 1.0  # how long a scan re-reads a marker that looks torn
_last_sequence: dict[str, int] = {}  # run directory -> the last sequence this process committed there


def commit_order(record: Marker | Latest) -> tuple[bool, int, float, int]:
    """Sort key of commits (P10): by sequence; records from before sequences existed rank below every sequenced
    one and among themselves by commit time, as that version ordered them."""
    return (record.sequence is not None, record.sequence or 0, record.committed_at, record.step)


# where dcp_atomic 0.x before Manifest.copy_of_sequence recorded a durable copy's snapshot sequence (still read)
COPY_OF_MEMORY_SEQUENCE = "dcp_atomic.copy_of_memory_sequence"


def memory_order(marker: Marker, manifest: Manifest) -> int:
    """The sequence a memory restore compares a commit of another tier by.  A copy of a memory snapshot
    (``MemoryTier(durable_every=)``, its manifest's ``copy_of_sequence`` naming the snapshot's sequence) commits after
    the snapshots taken while it was saved, with a higher sequence and the same bytes as its own snapshot: it counts as
    that snapshot, so memory's newer steps still win and memory's own copy of the same step wins the tie."""
    copied = manifest.copy_of_sequence
    if copied is None:  # written before the field: the key in its metadata (user keys of that prefix are refused)
        copied = (manifest.user_metadata or {}).get(COPY_OF_MEMORY_SEQUENCE)
    return copied if isinstance(copied, int) and not isinstance(copied, bool) else marker.sequence or 0


@dataclass(frozen=True)
class ResumePoint:
    """Where a job resumed (P14): it loaded ``step`` while the run's newest commit had sequence ``sequence``.

    Steps above ``step`` that were committed by then belong to the branch the job abandoned (a rollback, or a
    restart after one), so its own saves of those steps supersede them: a new attempt, a marker with a higher
    sequence, the old attempt left for ``gc``.  A step committed *after* the resume (a higher sequence) is
    another job's work on the same run and is still refused (``CommitConflictError``), as is ``step`` itself.
    """

    step: int
    sequence: int

    def supersedes(self, marker: Marker) -> bool:
        return marker.step > self.step and (marker.sequence or 0) <= self.sequence

    def describe(self) -> str:
        return f"resumed from step {self.step} (commit sequence {self.sequence})"


def refuse_committed(marker: Marker, step: int, run_id: str, resumed: ResumePoint | None, where: str) -> bool:
    """The one rule for saving ``step`` where ``where`` already holds it committed (``marker``): a job that abandoned
    it by resuming below it supersedes it (True, P14); anything else -- a fresh job, a step committed after this
    job's resume point, by it or another job -- is :class:`CommitConflictError` before anything is written."""
    if resumed is not None and resumed.supersedes(marker):
        log.info("step %d of run %r (save %s, %s) belongs to the branch abandoned when this job %s: this save "
                 "supersedes it", step, run_id, marker.save_id, where, resumed.describe())
        return True
    hint = ("Save a new step, load an earlier step first to roll back (it then supersedes the abandoned "
            "steps above it), or pass AtomicStorageWriter(overwrite=True) to replace it (plain DCP saves).")
    if resumed is not None:
        hint = (f"This job {resumed.describe()}, and step {step} was committed after that (sequence "
                f"{marker.sequence}), by this job or by another one saving into the same run. Save a new "
                "step, or use another run_id.")
    raise CommitConflictError(f"step {step} of run {run_id!r} is already committed in {where} (save "
                              f"{marker.save_id}); nothing was written. {hint}", step=step, committed=marker.save_id)


def resume_point(layout: RunLayout, step: int) -> ResumePoint:
    """The :class:`ResumePoint` of loading ``step`` now (global rank 0, once per resume: one listing).

    ``LATEST`` alone can lag behind a marker (a crash between a step's marker and ``LATEST``): that step was
    committed before the resume too, so it belongs to the abandoned branch, and the next commit must number
    above it.  So every marker is read once, and the newest number found becomes this process's floor."""
    newest = max([next_sequence(layout) - 1] + [m.sequence for m in scan_markers(layout) if m.sequence is not None])
    _last_sequence[layout.run_dir] = max(_last_sequence.get(layout.run_dir, 0), newest)
    return ResumePoint(step=step, sequence=newest)


@dataclass
class Committed:
    """A step as a reader sees it after verification."""

    marker: Marker
    manifest: Manifest
    manifest_sha256: str
    _loaded: set[int] = field(default_factory=set, repr=False)  # ranks whose shard items are attached

    @property
    def step(self) -> int:
        return self.marker.step

    @property
    def save_id(self) -> str:
        return self.marker.save_id

    def load_items(self, layout: RunLayout, names: Iterable[str] | None, deadline: Deadline) -> None:
        """Attach the items of the data files ``names`` (None: all) to ``manifest.files``, reading only their
        ranks' shards, each once.  Schema 1 manifests hold their items already."""
        if not self.manifest.shards:
            return
        wanted = None if names is None else set(names)
        ranks = {f.rank for f in self.manifest.files if wanted is None or f.name in wanted} - self._loaded
        for rank in sorted(ranks):
            shard = read_shard(layout, self, rank, deadline)
            by_name = {f.name: f for f in shard.files}
            for entry in self.manifest.files:
                if entry.rank == rank:
                    entry.items = by_name[entry.name].items
            self._loaded.add(rank)

    def load_rank_records(self, layout: RunLayout, deadline: Deadline) -> None:
        """Fill ``manifest.ranks`` / ``manifest.stats`` from ``ranks.json`` (checked against its digest) where the
        manifest keeps them there; for ``show`` and ``verify``, never needed to load."""
        ref = self.manifest.ranks_file
        if ref is None or self.manifest.ranks or self.manifest.stats:
            return
        path = layout.attempt_file(self.step, self.save_id, ref["name"])
        data = _read_sealed(layout, path, ref["size"], ref["sha256"], deadline, what="ranks file")
        records = RankRecords.from_json(data, where=path)
        self.manifest.ranks, self.manifest.stats = records.ranks, records.stats


@dataclass(frozen=True)
class Evidence:
    """What a committer has seen of a step at its destination: each file (data file or manifest shard) that was
    written or copied there *and verified in this attempt*, with who did it ("rank 3 wrote it", "rank 1 copied it
    from node1:/nvme"), and ``looked_in``: the places that were searched, for the error when one is missing.

    Every marker goes through :func:`require_complete` with one: the marker is the promise that every file the
    manifest names is there, so no path (a save, the drain, a local commit, a restore, an import) may place one on
    its own judgement.  A drain by fewer ranks than wrote the step once committed half a step this way."""

    verified: dict[str, str]
    looked_in: str = ""

    @classmethod
    def written(cls, manifest: Manifest) -> "Evidence":
        """A save's own: every rank reported the files it wrote and fsynced, each digest computed while writing
        (the manifest is built from those reports, its shards published by the ranks themselves)."""
        names = {f.name: f"rank {f.rank} wrote it" for f in manifest.files}
        names.update({s.name: f"rank {s.rank} wrote it" for s in manifest.shards})
        return cls(names, "the ranks' write results")

    @classmethod
    def on_roots(cls, verified: dict[str, str], roots: list[str]) -> "Evidence":
        """The local tier's (a local commit, a drain, a restore): files verified on these local roots."""
        return cls(verified, "the local roots of " + ", ".join(roots))


def missing_files(manifest: Manifest, evidence: Evidence) -> list[tuple[int, str]]:
    """(rank, name) of each file ``manifest`` names (every rank's data files and manifest shards, and a shard for
    each of its ``world_size`` ranks) that ``evidence`` does not hold."""
    named = [(f.rank, f.name) for f in manifest.files] + [(s.rank, s.name) for s in manifest.shards]
    if not manifest.requires(INLINE_ITEMS):  # schema 1 had no shards
        named += [(r, shard_name(r)) for r in range(manifest.world_size) if manifest.shard_of(r) is None]
    seen: set[str] = set()
    missing = []
    for rank, name in named:
        if name not in seen and name not in evidence.verified:
            missing.append((rank, name))
        seen.add(name)
    return missing


def require_complete(manifest: Manifest, evidence: Evidence, where: str) -> None:
    """The completeness rule of every commit: refuse (:class:`IncompleteStepError`, naming each missing file, the
    rank it belongs to and where it was looked for) unless every file the manifest names was verified."""
    missing = missing_files(manifest, evidence)
    if not missing:
        return
    listed = ", ".join(f"{name} (rank {rank})" for rank, name in missing[:8]) + (
        f" and {len(missing) - 8} more" if len(missing) > 8 else "")
    raise IncompleteStepError(
        f"{where}: step {manifest.step} (save {manifest.save_id}, {manifest.world_size} ranks) is not complete: no "
        f"verified copy of {len(missing)} file(s) its manifest names: {listed}; looked in "
        f"{evidence.looked_in or 'nowhere'}. No marker was written: the previous step stays the newest; the files "
        "must be on a root this job can read (a node that held them was replaced?)",
        step=manifest.step, save_id=manifest.save_id, files=[n for _, n in missing[:64]],
        ranks=sorted({r for r, _ in missing}))


def publish_shard(layout: RunLayout, shard: ManifestShard) -> ShardRef:
    """Write one rank's shard durably beside its data (the rank itself does this); returns how the manifest
    names it."""
    data = shard.to_json()
    name = shard_name(shard.rank)
    layout.storage.publish(layout.attempt_file(shard.step, shard.save_id, name), data)
    return ShardRef(rank=shard.rank, name=name, size=len(data), sha256=sha256_hex(data))


def write_shards(layout: RunLayout, manifest: Manifest) -> None:
    """Shards for a manifest built with its items inline (``import``): one per rank, named in ``manifest.shards``."""
    if manifest.shards or manifest.requires(INLINE_ITEMS):
        return
    manifest.shards = [
        publish_shard(layout, ManifestShard(layout.run_id, manifest.step, manifest.save_id, r,
                                            [f for f in manifest.files if f.rank == r]))
        for r in range(manifest.world_size)
    ]


def write_rank_records(layout: RunLayout, manifest: Manifest) -> None:
    """Write the manifest's per-rank identities and statistics to ``ranks.json``, which the manifest then seals
    (its JSON form leaves them out)."""
    if manifest.ranks_file is not None or manifest.requires(INLINE_ITEMS):
        return
    data = RankRecords(manifest.ranks, manifest.stats).to_json()
    layout.storage.publish(layout.attempt_file(manifest.step, manifest.save_id, RANKS_FILE), data)
    manifest.ranks_file = {"name": RANKS_FILE, "size": len(data), "sha256": sha256_hex(data)}


def claim_attempt(layout: RunLayout, step: int, save_id: str, *, started_at: float, overwrite: bool = False,
                  **details) -> None:
    """Step 0 of every committer into a root (a save, an import, the drain): the attempt directory and its
    ``ATTEMPT`` claim, before any data.  ``gc`` and ``rm`` judge an uncommitted attempt by its claim's age (the
    lease), and :func:`commit_step` checks after the marker that the claim is still there: an attempt without one
    could be collected while it is written.  Refuses a store the commit cannot work on before any data is sent."""
    storage = layout.storage
    attempt = layout.attempt_dir(step, save_id)
    claim = {"save_id": save_id, "step": step, "host": socket.gethostname(), "pid": os.getpid(),
             "started_at": started_at, "library_version": __version__, **details}
    storage.makedirs(attempt)
    storage.check_commit_support(attempt, overwrite=overwrite)
    storage.publish(storage.join(attempt, ATTEMPT), json.dumps(claim, indent=1, sort_keys=True).encode())


def read_claim(layout: RunLayout, step: int, save_id: str) -> dict | None:
    """An attempt's ``ATTEMPT`` claim as :func:`claim_attempt` wrote it (``started_at``, ``drained_from``, ...), or
    None when it is missing or unreadable: a claim is a record of who started the attempt, never a commit's proof."""
    try:
        claim = json.loads(layout.storage.read_file(layout.attempt_file(step, save_id, ATTEMPT)))
    except (OSError, ValueError):
        return None
    return claim if isinstance(claim, dict) else None


def publish_control(layout: RunLayout, manifest: Manifest, dcp_metadata: bytes, *, rank: int = 0) -> bytes:
    """Step 2, for a root's marker to name (a save's, the local tier's): the shards of a manifest built with its
    items inline (:func:`write_shards`), ``ranks.json``, ``.metadata``, then ``manifest.json``, and the attempt and
    step directories synced.  Returns the manifest's bytes (the marker names their digest)."""
    storage = layout.storage
    attempt = layout.attempt_dir(manifest.step, manifest.save_id)
    write_shards(layout, manifest)
    write_rank_records(layout, manifest)
    failpoints.hit("commit.before_metadata", rank)
    storage.publish(storage.join(attempt, DCP_METADATA), dcp_metadata)
    failpoints.hit("commit.after_metadata", rank)
    manifest.written_at = now()
    manifest_bytes = manifest.to_json()
    storage.publish(storage.join(attempt, MANIFEST), manifest_bytes)
    storage.sync_dir(attempt)
    storage.sync_dir(layout.step_dir(manifest.step))
    failpoints.hit("commit.after_manifest", rank)
    return manifest_bytes


def copy_control(read: Callable[[str], bytes], layout: RunLayout, manifest: Manifest, manifest_bytes: bytes, *,
                 source: str) -> None:
    """Step 2, for a copy of a step another root holds (the drain's upload, a replica root's or a restore's control
    files): each of the manifest's :meth:`~.Manifest.control_files`, as ``read(name)`` returns it, checked against
    the manifest before any is published, then ``manifest.json`` (``manifest_bytes``: their seal, which the marker
    names) last, and the attempt directory synced.  ``source`` names where ``read`` reads, for the error."""
    storage = layout.storage
    attempt = layout.attempt_dir(manifest.step, manifest.save_id)
    files = []
    for name, size, sha256 in manifest.control_files():
        data = read(name)
        if len(data) != size or sha256_hex(data) != sha256:
            raise CorruptCheckpointError(
                f"{source}: {name} does not match the manifest of step {manifest.step} (save {manifest.save_id}): "
                f"{len(data)} bytes, the manifest records {size}, or the sha256 differs; nothing was copied to "
                f"{attempt}. This copy of the step cannot be used (a later step can)", path=source, step=manifest.step)
        files.append((name, data))
    storage.makedirs(attempt)
    for name, data in files:
        storage.publish(storage.join(attempt, name), data)
    storage.publish(storage.join(attempt, MANIFEST), manifest_bytes)
    storage.sync_dir(attempt)


@dataclass(frozen=True)
class CommitPolicy:
    """What differs between the durable committers (a save, an import, the drain); the sequence does not.

    ``what`` starts their log lines and errors ("commit", "drain of step 7"); ``conflict_message(existing)`` says
    what stays where when another save holds the step; ``latest_if_newest``: ``LATEST`` moves only when this
    commit's sequence is the newest (the drain commits a step with its local sequence, which a later direct save
    may have passed: ``LATEST`` never moves back)."""

    what: str
    conflict_message: Callable[[Marker], str]
    overwrite: bool = False
    resumed: ResumePoint | None = None
    latest_if_newest: bool = False
    rank: int = 0


def commit_step(layout: RunLayout, marker: Marker, manifest: Manifest, evidence: Evidence, policy: CommitPolicy,
                *, timeout: float) -> Marker:
    """Steps 3-4 for every durable committer: the marker (:func:`place_marker`: completeness, then created
    exclusively), the attempt's claim still there (:func:`_refuse_removed_under`), then ``LATEST``.  Returns the
    marker now visible.  A failure after the marker is a :class:`StorageError` with ``committed=True``: the step
    is committed, only ``LATEST`` lags (``latest_step()`` repairs it; a retry accepts the marker it placed)."""
    try:
        marker = place_marker(layout, marker, manifest, evidence, overwrite=policy.overwrite,
                              resumed=policy.resumed, timeout=timeout, conflict_message=policy.conflict_message,
                              what=policy.what)
    except FileNotFoundError:  # the step directory went (POSIX): say so if the attempt went with it
        _refuse_removed_under(layout, marker)
        raise
    _refuse_removed_under(layout, marker)
    if marker.sequence is not None:
        _last_sequence[layout.run_dir] = max(marker.sequence, _last_sequence.get(layout.run_dir, 0))
    failpoints.hit("commit.after_marker", policy.rank)
    try:
        newest = _latest_sequence(layout) if policy.latest_if_newest else None
        if newest is not None and (marker.sequence or 0) < newest:
            log.warning("%s: step %d (sequence %s) is committed to %s, but LATEST stays on a newer commit (sequence "
                        "%d)", policy.what, marker.step, marker.sequence, layout.storage.describe(), newest)
            return marker
        write_latest(layout, marker)
    except (OSError, CheckpointError) as e:
        reason = getattr(e, "message", None) or getattr(e, "strerror", None) or str(e)
        raise StorageError(
            f"{policy.what}: the step is committed to the durable root ({layout.marker(marker.step)}), but "
            f"global rank 0 could not update {layout.latest()}: {reason.rstrip('.')}. Until LATEST is written, readers that ask for the "
            "latest step by LATEST get an older one (latest_step() repairs it).", step=marker.step, rank=policy.rank,
            path=layout.latest(), committed=True) from e
    failpoints.hit("commit.after_latest", policy.rank)
    return marker


def _latest_sequence(layout: RunLayout) -> int | None:
    """The sequence ``LATEST`` names, or None (missing, or written before sequences, or damaged: replaced)."""
    try:
        return _read_latest_once(layout).sequence
    except (FileNotFoundError, CorruptCheckpointError):
        return None


def publish(layout: RunLayout, manifest: Manifest, dcp_metadata: bytes, *, overwrite: bool, timeout: float,
            rank: int = 0, resumed: ResumePoint | None = None, evidence: Evidence | None = None) -> Marker:
    """A save's or an import's commit, steps 2-4: :func:`publish_control`, then :func:`commit_step`.  An existing
    marker is replaced with ``overwrite``, or when ``resumed`` says it belongs to the branch this job abandoned
    (judged on the marker read now, so a step another job committed since the writer's own check is still
    refused)."""
    step, save_id = manifest.step, manifest.save_id
    manifest_bytes = publish_control(layout, manifest, dcp_metadata, rank=rank)
    marker = Marker.for_manifest(layout.run_id, manifest, sha256_hex(manifest_bytes), next_sequence(layout))

    def conflict(existing: Marker) -> str:
        return (f"step {step} of run {layout.run_id!r} was committed by save {existing.save_id} while save "
                f"{save_id} was writing (two jobs on one run?); nothing of {save_id} is visible. "
                f"Use another run_id or step, or AtomicStorageWriter(overwrite=True) to replace it deliberately"
                + (f" ({resumed.describe()}; this commit is newer than that)." if resumed is not None else "."))

    policy = CommitPolicy(what="commit", conflict_message=conflict, overwrite=overwrite, resumed=resumed, rank=rank)
    return commit_step(layout, marker, manifest, evidence or Evidence.written(manifest), policy, timeout=timeout)


def _refuse_removed_under(layout: RunLayout, marker: Marker) -> None:
    """After the marker: the attempt's claim (written before any data) and its manifest are still there, else
    something removed the attempt while it committed (``gc`` with a lease shorter than the save, which removes the
    claim before it re-reads the marker and deletes; ``rm -r``; a tool that ignores leases): the marker is
    withdrawn and the save fails, so it never reports success, nor moves ``LATEST``, over files that are gone.
    Two small requests per commit, no data read."""
    claim = layout.attempt_file(marker.step, marker.save_id, ATTEMPT)
    for gone in (claim, layout.attempt_file(marker.step, marker.save_id, MANIFEST)):
        try:
            layout.storage.size(gone)
        except FileNotFoundError:
            break
    else:
        return
    try:
        if read_marker_once(layout, marker.step).save_id == marker.save_id:
            layout.storage.remove(layout.marker(marker.step))
    except (OSError, CheckpointError):
        pass
    raise StorageError(f"step {marker.step} of run {layout.run_id!r}: the attempt {marker.save_id} was removed while "
                       f"it committed ({gone} is gone: `dcp-atomic gc` with a lease (--lease-hours) shorter than this "
                       "save took, `rm`, or a tool that ignores in-flight saves); its marker was withdrawn, LATEST "
                       "was not moved, and nothing of this save is visible. Save again, and give gc a lease longer "
                       "than a save takes.", step=marker.step, path=gone, committed=False)


def place_marker(layout: RunLayout, marker: Marker, manifest: Manifest, evidence: Evidence, *, overwrite: bool,
                 resumed: ResumePoint | None, timeout: float, conflict_message: Callable[[Marker], str],
                 what: str) -> Marker:
    """Step 3 for every durable committer (a save's :func:`publish`, the drain's durable commit): make ``marker``
    the step's marker; returns the marker now visible, after the step directory is synced.

    First :func:`require_complete`: ``manifest`` (the one ``marker`` names, by digest) against ``evidence``.

    Created exclusively, so two jobs committing one step cannot both win.  If a marker is there already: the same
    save's (an earlier attempt whose reply was lost) is accepted as it is; another save's is replaced only with
    ``overwrite`` or when ``resumed`` says it belongs to the branch this job abandoned (judged on the marker read
    now, so a step another job committed since the caller's own check is still refused); otherwise
    :class:`CommitConflictError` with ``conflict_message(existing)``, the caller's words for what stays where.
    ``what`` starts the log lines ("commit", "drain"), so an operator can tell which committer acted.
    """
    storage, step = layout.storage, marker.step
    if (manifest.run_id, manifest.step, manifest.save_id) != (marker.run_id, step, marker.save_id):
        raise CorruptCheckpointError(f"{what}: the marker of step {step} (save {marker.save_id}) would name another "
                                     f"save's manifest ({manifest.save_id})", step=step)
    require_complete(manifest, evidence, f"{what} to {storage.describe()}")
    marker_path = layout.marker(step)
    visible = marker
    if not storage.exclusive_create_is_atomic and storage.describe() not in _warned_roots:
        _warned_roots.add(storage.describe())
        log.warning("%s offers no put-if-absent: the commit marker is created check-then-put, which is safe "
                    "for one job per run but cannot arbitrate two jobs committing one step", storage.describe())
    if not storage.create_exclusive(marker_path, marker.to_json()):
        # It exists on the server; this client may not see it yet (NFS negative-lookup cache): wait it out.
        existing, version = _read_marker(layout, step, Deadline(timeout))
        if existing.save_id == marker.save_id:
            log.info("%s: the marker of step %d already names save %s (an earlier attempt)", what, step,
                     marker.save_id)
            visible = existing
        elif overwrite or (resumed is not None and resumed.supersedes(existing)):
            storage.replace_if_unchanged(marker_path, marker.to_json(), version)  # not over another job's
            why = "re-saved" if overwrite else f"superseded ({resumed.describe()})"
            log.info("%s: step %d %s in %s: marker now names %s (was %s)", what, step, why, storage.describe(),
                     marker.save_id, existing.save_id)
        else:
            raise CommitConflictError(conflict_message(existing), step=step, save_id=marker.save_id,
                                      winner=existing.save_id)
    storage.sync_dir(layout.step_dir(step))
    return visible


def note_sequence(layout: RunLayout, sequence: int) -> None:
    """Record that a commit of ``layout``'s run took ``sequence`` outside its root (a memory snapshot, a local commit):
    this process's next commit there numbers above it (P10: one sequence for every committer)."""
    _last_sequence[layout.run_dir] = max(sequence, _last_sequence.get(layout.run_dir, 0))


def known_sequence(layout: RunLayout) -> int:
    """The newest sequence this process committed or noted for ``layout``'s run (0: none), read without I/O."""
    return _last_sequence.get(layout.run_dir, 0)


def next_sequence(layout: RunLayout) -> int:
    """The sequence number of the commit global rank 0 is about to make: the newest one it can find, + 1.

    Cheap and by exact name: ``LATEST``, the marker it names (an ``overwrite=True`` re-save of that step may have
    replaced it and crashed before ``LATEST``), and the last number this process committed to the run.  A
    ``LATEST`` without a number (written before sequences existed) or a damaged one makes rank 0, the one process
    that may list, scan the markers once.  A missing ``LATEST`` is a run's first commit: no listing, number 1.

    Guaranteed: numbers increase along every chain of commits in which each ``LATEST`` was written, or repaired by
    ``latest_step()`` (``CheckpointManager`` calls it on every resume), or the commits came from one process.
    A crash between another step's marker and ``LATEST``, followed by a new job that resumes without
    ``latest_step()``, can give its first commit the orphan's number; :func:`commit_order` then falls back to
    commit time for that pair.
    """
    return max(_last_sequence.get(layout.run_dir, 0), root_sequence(layout)) + 1


def root_sequence(layout: RunLayout) -> int:
    """The newest commit sequence in ``layout``'s root itself (0: none), without the numbers this process only noted
    (:func:`note_sequence`): what another tier's commit is compared with (a memory snapshot numbered above an
    incomplete newer one is not a durable commit).  By exact name as :func:`next_sequence` says."""
    found = []
    try:
        latest: Latest | None = retry_until(lambda: _read_latest_once(layout), deadline=Deadline(REREAD_SECONDS),
                                            retry_on=(), reread_on=(CorruptCheckpointError,))
    except FileNotFoundError:
        return 0
    except CorruptCheckpointError:
        latest = None
    if latest is not None and latest.sequence is not None:
        found.append(latest.sequence)
        try:
            found.append(read_marker_once(layout, latest.step).sequence)
        except (FileNotFoundError, CorruptCheckpointError):
            pass  # deleted or damaged since: LATEST's own number stands
    else:
        found.extend(m.sequence for m in scan_markers(layout))
    return max((n for n in found if n is not None), default=0)


def _read_sealed(layout: RunLayout, path: str, size: int, sha256: str, deadline: Deadline, *, what: str,
                 **details) -> bytes:
    """A file the manifest names by size and sha256: missing is visibility lag until the deadline, damage gets
    a short re-read (P9), then a typed error."""

    def load() -> bytes:
        data = layout.storage.read_file(path)
        if len(data) != size or sha256_hex(data) != sha256:
            raise CorruptCheckpointError(
                f"{path}: {what} does not match the manifest (size {len(data)} vs {size} or sha256 differs): "
                "damaged or replaced; restore it or load another step", path=path, **details)
        return data

    try:
        return retry_until(load, deadline=deadline, retry_on=(FileNotFoundError,), reread_on=(CorruptCheckpointError,))
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path}: the manifest names this {what} but it cannot be read", path=path,
                                     **details) from None


def read_shard(layout: RunLayout, committed: Committed, rank: int, deadline: Deadline) -> ManifestShard:
    """Rank ``rank``'s shard, verified against the manifest: digest, size, identity and its files."""
    manifest = committed.manifest
    ref = manifest.shard_of(rank)
    path = layout.attempt_file(committed.step, committed.save_id, ref.name)
    data = _read_sealed(layout, path, ref.size, ref.sha256, deadline, what=f"manifest shard of rank {rank}", rank=rank)
    shard = ManifestShard.from_json(data, where=path)
    recorded = sorted((f.name, f.size) for f in manifest.files if f.rank == rank)
    if ((shard.run_id, shard.step, shard.save_id, shard.rank) != (manifest.run_id, manifest.step, manifest.save_id, rank)
            or sorted((f.name, f.size) for f in shard.files) != recorded):
        raise CorruptCheckpointError(f"{path}: shard describes another checkpoint, rank or set of files than the "
                                     f"manifest records for rank {rank}", path=path, rank=rank)
    return shard


def record_local_marker(layout: RunLayout, marker_bytes: bytes, manifest: Manifest, evidence: Evidence,
                        where: str, rank: int) -> None:
    """A local root's copy of a marker rank 0 decided (the local commit, a restore): the same completeness rule as
    :func:`place_marker`, over the whole tier (a root holds its ranks' files and their replicas, not the step).
    Replaced, not created exclusively: local markers are rank 0's records (:mod:`~dcp_atomic.tiers.local_tier`).  ``rank``: the
    recording rank, for the kill point every path that records a local marker shares."""
    marker = Marker.from_json(marker_bytes, where=where)
    if (marker.step, marker.save_id) != (manifest.step, manifest.save_id):
        raise CorruptCheckpointError(f"{where}: the marker names save {marker.save_id}, the manifest is of "
                                     f"{manifest.save_id}", step=marker.step)
    require_complete(manifest, evidence, where)
    failpoints.hit("local.before_marker", rank)
    layout.storage.replace(layout.marker(marker.step), marker_bytes)


def write_latest(layout: RunLayout, marker: Marker) -> None:
    latest = Latest(run_id=layout.run_id, step=marker.step, save_id=marker.save_id, committed_at=marker.committed_at,
                    sequence=marker.sequence)
    layout.storage.replace(layout.latest(), latest.to_json())


def read_marker_once(layout: RunLayout, step: int) -> Marker:
    """The step's marker as it is now, one read, no wait (``FileNotFoundError`` when there is none): what a writer
    checks before it saves a step (:func:`refuse_committed`)."""
    return _read_versioned_marker_once(layout, step)[0]


def _read_versioned_marker_once(layout: RunLayout, step: int) -> tuple[Marker, str | None]:
    path = layout.marker(step)
    data, version = layout.storage.read_versioned(path)
    return Marker.from_json(data, where=path), version


def _read_latest_once(layout: RunLayout) -> Latest:
    path = layout.latest()
    return Latest.from_json(layout.storage.read_file(path), where=path)


def read_marker(layout: RunLayout, step: int, deadline: Deadline, *, missing_ok: bool = False) -> Marker:
    """The step's marker, waiting out visibility lag until ``deadline``.

    A marker that fails its self-checksum or does not parse (torn by a
    concurrent replace, or damaged) is re-read for a moment, then reported.
    With ``missing_ok`` a missing marker is not waited for (a scan of steps that
    may simply be uncommitted) and surfaces as ``FileNotFoundError``.
    """
    return _read_marker(layout, step, deadline, missing_ok=missing_ok)[0]


def _read_marker(layout: RunLayout, step: int, deadline: Deadline, *,
                 missing_ok: bool = False) -> tuple[Marker, str | None]:
    """:func:`read_marker`, with the version the store read it at (what a replace of it must still find)."""
    path = layout.marker(step)
    try:
        marker, version = retry_until(lambda: _read_versioned_marker_once(layout, step), deadline=deadline,
                             retry_on=() if missing_ok else (FileNotFoundError,), reread_on=(CorruptCheckpointError,))
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
    return marker, version


def listed_steps(layout: RunLayout) -> list[int]:
    """The steps that have a directory in the run, committed or not, from one listing (both tiers scan so)."""
    return [step for step in map(parse_step_dir, layout.storage.list_dir(layout.run_dir)) if step is not None]


def scan_markers(layout: RunLayout, *, strict: bool = False,
                 unreadable: list[tuple[int, str]] | None = None) -> list[Marker]:
    """Every valid commit marker of the run, ascending by step (one process only).

    A marker that fails validation is re-read for a moment (it may be a torn
    read of one being replaced); if it stays bad it is skipped with a warning
    and appended to ``unreadable`` as (step, reason), or, with ``strict``,
    raised: a resume decision must not quietly fall back to an older step
    because the newest marker is damaged.
    """
    markers = []
    for step in listed_steps(layout):
        try:
            markers.append(read_marker(layout, step, Deadline(SCAN_RETRY_SECONDS), missing_ok=True))
        except FileNotFoundError:
            continue  # an attempt that never committed
        except CorruptCheckpointError as e:
            if strict:
                raise CorruptCheckpointError(
                    f"{e.message}. The newest commit cannot be determined while this marker is damaged: restore "
                    f"it, delete that step (dcp-atomic gc / rm), or load an explicit step",
                    **e.details,
                ) from None
            log.warning("ignoring step %d: %s", step, e)
            if unreadable is not None:
                unreadable.append((step, e.message))
    return sorted(markers, key=lambda m: m.step)


def read_committed(layout: RunLayout, step: int, deadline: Deadline) -> Committed:
    """Marker plus its manifest, the manifest verified against the marker's digest."""
    marker = read_marker(layout, step, deadline)
    manifest, digest = read_manifest(layout, marker, deadline)
    return Committed(marker=marker, manifest=manifest, manifest_sha256=digest)


def read_manifest(layout: RunLayout, marker: Marker, deadline: Deadline) -> tuple[Manifest, str]:
    """The manifest ``marker`` names and its sha256, verified against the marker's digest (one read by exact
    name: retention reads a kept step's metric this way without re-reading the marker it holds)."""
    step = marker.step
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

    try:  # the marker names it, so a missing manifest is lag; a damaged one gets a short re-read (P9)
        data, digest = retry_until(load, deadline=deadline, retry_on=(FileNotFoundError,),
                                   reread_on=(CorruptCheckpointError,))
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"{path}: the commit marker of step {step} names this manifest but it cannot be read", path=path
        ) from None
    manifest = Manifest.from_json(data, where=path)
    if (manifest.run_id, manifest.step, manifest.save_id) != (layout.run_id, step, marker.save_id):
        raise CorruptCheckpointError(f"{path}: manifest describes another checkpoint", path=path)
    return manifest, digest


def read_latest(layout: RunLayout, deadline: Deadline) -> Latest:
    """``LATEST`` by exact name.  A missing one is waited for only while the run shows a trace of a save (P9).

    ``LATEST`` is legitimately missing while a run's first commit is between its
    marker and ``LATEST``, or before a repair.  So at the first miss the run
    directory is listed once (one request, only on a run without ``LATEST``): no
    step directory means nothing was ever saved there, reported at once.
    """
    path = layout.latest()
    listed = False

    def attempt() -> Latest:
        nonlocal listed
        try:
            return _read_latest_once(layout)
        except FileNotFoundError:
            if not listed:
                listed = True
                if not any(parse_step_dir(name) is not None for name in layout.storage.list_dir(layout.run_dir)):
                    raise CheckpointNotFoundError(
                        f"no checkpoint committed for run {layout.run_id!r}: nothing was ever saved there "
                        f"({layout.run_dir} holds no step directory and no LATEST). Check root and run_id, or start "
                        f"training from scratch.",
                        path=path,
                    ) from None
            raise

    try:
        return retry_until(attempt, deadline=deadline, retry_on=(FileNotFoundError,),
                           reread_on=(CorruptCheckpointError,))
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            f"no checkpoint committed for run {layout.run_id!r}: {path} does not exist "
            f"(waited {deadline.seconds:.0f}s). Pass step= explicitly, or start training from scratch.",
            path=path,
        ) from None
