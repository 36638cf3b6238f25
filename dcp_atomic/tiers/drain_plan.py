"""One drain round's work, free of the thread that runs it (:mod:`.drain`): steps 2 and 3 of its protocol.

What a local root holds of a step (:func:`held_ranks`), rank 0's plan of who uploads what (:func:`plan_uploads`),
a rank's upload of its share (:func:`upload_ranks`, each data file through :mod:`.verified_copy`, the control
files through :func:`upload_control`) and rank 0's durable commit (:func:`commit_durable`).  Plain functions of the
roots and the job: the queue, the stall clock and the collectives that hand their results between ranks are the
:class:`~.drain.Drainer`'s, so each step here can be run and tested in one process.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from .._base import failpoints
from ..protocol.links import base_files, holds_referenced, link_verified
from ..errors import (CheckpointError, CommitConflictError, CorruptCheckpointError, DrainStalledError,
                      IncompleteStepError, StorageError)
from ..exchange.stall import StallClock
from ..format.integrity import sha256_hex
from ..format.layout import MANIFEST, STABLE_FILE_PATTERN, RunLayout
from ..format.manifest import FileEntry, Manifest, Marker, shard_name
from ..protocol.commit import CommitPolicy, Evidence, ResumePoint, commit_step, copy_control
from .local_tier import check_shard, read_manifest
from .verified_copy import CopyStopped, copy_verified


@dataclass(frozen=True)
class DrainJob:
    """One local-committed step to copy.  ``index`` numbers submissions; it is the same on every rank (SPMD)."""

    index: int
    step: int
    save_id: str
    manifest_sha256: str
    sequence: int | None

    @property
    def key(self) -> str:
        """The job as the stall clock's verdict cell names it once committed (:mod:`~..exchange.stall`)."""
        return f"{self.step}:{self.save_id}"


@dataclass
class Uploaded:
    """One rank's share of a drain attempt."""

    error: CheckpointError | None = None
    bytes: int = 0
    files: int = 0
    bytes_reused: int = 0  # of ``bytes``: linked from the durable root's previous step (reuse), not uploaded
    verified: dict[str, str] = field(default_factory=dict)  # file name -> how it got there (the commit's evidence)
    # durable path -> the store's checksum of the data object this rank wrote there, where the store reported one:
    # what the next drain's link of it is checked by, without a download (:func:`upload_ranks`'s ``stored``)
    checksums: dict[str, str] = field(default_factory=dict)
    manifest: bytes | None = None  # the control uploader's (Plan.control): kept by rank 0, never gathered


@dataclass(frozen=True)
class Holding:
    """What one local root holds of a drain's step: the ranks whose manifest shard and data files are there, and
    whether its control files (the manifest the local marker names, ``.metadata``, ``ranks.json``) are."""

    ranks: list[int]
    control: bool


@dataclass(frozen=True)
class Plan:
    """Rank 0's plan for one attempt: which drain rank uploads which source ranks' files, and which one uploads the
    control files (None: no root holds them, and the commit refuses the step)."""

    sources: dict[int, list[int]]
    control: int | None


def held_ranks(local: RunLayout, job: DrainJob) -> Holding:
    """What this local root holds of ``job``'s step at the recorded sizes (its own primary files, or replicas):
    what this rank could upload.  Sizes only, from the manifest: the upload checks every block as it reads
    (:func:`~.verified_copy.copy_verified`) and every control file's digest, so a damaged copy still fails there."""
    try:
        manifest = _local_manifest(local, job)
    except (OSError, CheckpointError):
        return Holding([], False)  # no local copy of the step here (a replaced node): others upload
    sizes: dict[int, list[tuple[str, int]]] = {}
    for f in manifest.files:
        sizes.setdefault(f.rank, []).append((local.data_file(job.step, job.save_id, f.name, manifest.data_prefixes),
                                             f.size))
    held = []
    for rank in range(manifest.world_size):
        ref = manifest.shard_of(rank)
        shard = [(local.attempt_file(job.step, job.save_id, ref.name), ref.size)] if ref is not None else []
        if ref is not None and _all_there(sizes.get(rank, []) + shard):
            held.append(rank)
    control = _all_there([(local.attempt_file(job.step, job.save_id, name), size)
                          for name, size, _ in manifest.control_files()])
    return Holding(held, control)


def _all_there(files: list[tuple[str, int]]) -> bool:
    try:
        return all(os.path.getsize(path) == size for path, size in files)
    except OSError:
        return False


def plan_uploads(held: list[Holding]) -> Plan:
    """Rank 0: which drain rank uploads which source rank's files, from what each drain rank's root holds
    (:func:`held_ranks`).  A rank uploads its own files where it holds them (the common case: one pass over its own
    disk, as before); every other source rank goes to the least-loaded rank that holds it, so a resized job (or one
    with a replaced node) drains from replicas.  The control files go from rank 0's root where it holds them, else
    from the first root that does (global rank 0's node replaced).  A source rank no root holds is left out: the
    commit's completeness check (:func:`~.commit.require_complete`) then refuses the step, naming its files."""
    plan: dict[int, list[int]] = {rank: [] for rank in range(len(held))}
    sources = sorted({r for holding in held for r in holding.ranks})
    for source in sources:
        if source < len(held) and source in held[source].ranks:
            plan[source].append(source)
    for source in sources:
        if source < len(held) and source in held[source].ranks:
            continue
        holders = [rank for rank, holding in enumerate(held) if source in holding.ranks]
        plan[min(holders, key=lambda rank: (len(plan[rank]), rank))].append(source)
    return Plan(plan, next((rank for rank, holding in enumerate(held) if holding.control), None))


def upload_ranks(local: RunLayout, durable: RunLayout, job: DrainJob, sources: list[int], rank: int,
                 threads: int = 1, progress: Callable[[], None] | None = None, control: bool = False,
                 stored: dict[str, str] | None = None) -> Uploaded:
    """Step 2: copy the shards and data files of the ranks ``sources`` of ``job`` from this local root, ``threads``
    files at a time, each block checked as it is read; a shard goes last, once every file it names is up; then, with
    ``control``, the control files (:func:`upload_control`).  Returns the files uploaded, by name, as the commit's
    evidence.  ``progress()`` is called after each piece uploaded (the stall clock of :meth:`~.drain.Drainer.wait`).

    ``stored``: the store's checksums of the objects earlier drains of this job wrote (``Uploaded.checksums``).  A
    drained step's shard is the local one verbatim, which records no store checksum, so a file linked from the
    durable base (reuse) is checked by the one the store reported when this job uploaded it; a base this job did
    not write (a restart, another rank's upload) is downloaded and checked against its block digests."""
    uploaded = Uploaded()
    if not sources and not control:
        return uploaded
    manifest = _local_manifest(local, job)
    storage = durable.storage
    storage.makedirs(durable.attempt_dir(job.step, job.save_id))
    shards, copies = [], []
    for source in sources:
        shard_path = local.attempt_file(job.step, job.save_id, shard_name(source))
        shard_bytes = local.storage.read_file(shard_path)
        shard = check_shard(manifest, source, shard_bytes, shard_path)
        shards.append((source, shard_bytes))
        for entry in shard.files:
            src = local.data_file(job.step, job.save_id, entry.name, manifest.data_prefixes)
            target = durable.data_file(job.step, job.save_id, entry.name, manifest.data_prefixes)
            if manifest.data_prefixes:
                storage.makedirs(target.rsplit("/", 1)[0])
            copies.append((entry, src, target))
    stop = threading.Event()  # one file failed: the others stop at their next piece
    reusable = _reusable(durable, job, sources, [entry for entry, _, _ in copies], stored or {})
    linked: dict[str, str] = {}  # file name -> how it got there, for the files linked instead of uploaded

    def copy(entry: FileEntry, source: str, target: str) -> None:
        try:
            base = reusable.get(entry.name)
            if base is not None:
                step, path, checksum = base
                made = link_verified(storage, path, target, dataclasses.replace(entry, checksum=checksum), rank=rank,
                                     base_step=step, where=f"durable step {step} {entry.name}", threads=1)
                if made is not None:
                    how = ("checked by the store's checksum" if checksum is not None and made.checksum
                           else "every block checked")
                    linked[entry.name] = f"rank {rank} linked it ({storage.link_kind}) from durable step {step}, {how}"
                    if made.checksum is not None:
                        uploaded.checksums[target] = made.checksum
                    return
            checksum = copy_verified(entry, source, storage, target, stop, progress)
            if checksum is not None:
                uploaded.checksums[target] = checksum
        except OSError as e:  # name the file, not only the directory (a short write carries no file name)
            e.filename = e.filename or target
            stop.set()
            raise
        except BaseException:
            stop.set()
            raise

    threads = max(1, min(threads, len(copies)))
    if threads == 1:
        for args in copies:
            copy(*args)
    else:
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"dcp-atomic-drain{rank}") as pool:
            futures = [pool.submit(copy, *args) for args in copies]
            errors = [f.exception() for f in futures]
        first = next((e for e in errors if e is not None and not isinstance(e, CopyStopped)), None)
        if first is not None:
            raise first
    who = f"rank {rank} uploaded it from {local.storage.describe()}, every block checked"
    for source, shard_bytes in shards:
        storage.publish(durable.attempt_file(job.step, job.save_id, shard_name(source)), shard_bytes)
        uploaded.verified[shard_name(source)] = who
    uploaded.verified.update((entry.name, linked.get(entry.name, who)) for entry, _, _ in copies)
    uploaded.bytes, uploaded.files = sum(entry.size for entry, _, _ in copies), len(copies)
    uploaded.bytes_reused = sum(entry.size for entry, _, _ in copies if entry.name in linked)
    if control:
        uploaded.manifest = upload_control(local, durable, job)
    return uploaded


def _reusable(durable: RunLayout, job: DrainJob, sources: list[int], entries: list[FileEntry],
              stored: dict[str, str]) -> dict[str, tuple[int, str, str | None]]:
    """Reuse (P15) across the drain: for each stable file of this share, a file of the durable root's latest committed
    step below ``job.step`` that holds the bytes it references (:func:`~..protocol.links.holds_referenced`: under
    its name, or the plain file a local save linked under a stable name), as name -> (that step, its path, the
    store's checksum of it: recorded in its shard, else ``stored``'s, else None), so it is linked there
    (:func:`~..protocol.links.link_verified`) instead of uploaded again.  Nothing where the local
    step has no stable file or the durable store can neither hard-link nor copy in place."""
    stable = [entry for entry in entries if STABLE_FILE_PATTERN.fullmatch(entry.name)]
    if not stable or durable.storage.link_kind is None:
        return {}
    base = base_files(durable, job.step, sources)
    reusable = {}
    for entry in stable:
        held = [(step, path, other) for step, path, other in base if holds_referenced(other, entry)]
        if held:  # the same name first: the file the durable step already links on
            step, path, other = min(held, key=lambda found: found[2].name != entry.name)
            reusable[entry.name] = (step, path, other.checksum or stored.get(path))
    return reusable


def upload_control(local: RunLayout, durable: RunLayout, job: DrainJob) -> bytes:
    """The step's control files from this local root to the durable attempt (:func:`~.commit.copy_control`), the
    manifest checked first against the local marker's digest.  Returns the manifest's bytes (what the commit's
    marker names)."""
    manifest_bytes, manifest = _local_manifest_bytes(local, job)
    attempt = local.attempt_dir(job.step, job.save_id)
    copy_control(lambda name: local.storage.read_file(local.storage.join(attempt, name)), durable, manifest,
                 manifest_bytes, source=attempt)
    return manifest_bytes


def commit_durable(durable: RunLayout, job: DrainJob, manifest_bytes: bytes | None, resumed: ResumePoint | None,
                   timeout: float, evidence: Evidence, clock: StallClock | None = None) -> Marker:
    """Step 3 (global rank 0), once every share (and the control files, :func:`upload_control`) is up: the durable
    marker with the step's local sequence, then ``LATEST`` unless a newer commit holds it.  ``manifest_bytes``: the
    manifest rank 0 uploaded itself, or None when another rank's root held the control files (global rank 0's node
    was replaced): then it is read back from the durable attempt, checked against the local marker's digest.
    ``clock``: the drain's shared stall clock; the marker is written only if rank 0 claims it before any waiter
    declared the drain stalled (:mod:`~..exchange.stall`), so every rank's verdict holds."""
    storage = durable.storage
    attempt = durable.attempt_dir(job.step, job.save_id)
    path = storage.join(attempt, MANIFEST)
    if manifest_bytes is None:
        manifest_bytes = storage.read_file(path)
    if sha256_hex(manifest_bytes) != job.manifest_sha256:
        raise CorruptCheckpointError(f"{path}: does not match the local marker of step {job.step}", path=path,
                                     step=job.step)
    manifest = Manifest.from_json(manifest_bytes, where=path)
    if (manifest.step, manifest.save_id) != (job.step, job.save_id):  # the marker names the manifest's step
        raise CorruptCheckpointError(f"{path}: describes step {manifest.step} (save {manifest.save_id}), not the "
                                     f"drained step {job.step} (save {job.save_id})", path=path, step=job.step)
    storage.sync_dir(attempt)
    storage.sync_dir(durable.step_dir(job.step))
    failpoints.hit("commit.after_manifest", 0)  # the committer's phases, as a save's (commit.publish)
    failpoints.hit("drain.before_marker", 0, job.step)
    marker = Marker.for_manifest(durable.run_id, manifest, job.manifest_sha256, job.sequence)

    def conflict(existing: Marker) -> str:
        return (f"draining step {job.step} to {durable.run_dir}: the durable root already holds step {job.step} from "
                f"another save ({existing.save_id}, sequence {existing.sequence}); the local step (save "
                f"{job.save_id}) stays local only. Two jobs on one run? Use another run_id.")

    # An earlier attempt of this drain may have placed the marker and then failed on LATEST: then the marker it
    # placed is accepted, and LATEST is written now.
    policy = CommitPolicy(what=f"drain of step {job.step}", conflict_message=conflict, resumed=resumed,
                          latest_if_newest=True)
    if clock is not None and not clock.claim_commit():
        raise DrainStalledError(
            f"drain of step {job.step} (save {job.save_id}) to {durable.storage.describe()}: abandoned before its "
            "durable marker, because the drain made no progress for the stall deadline and the ranks' waiters "
            "declared it stalled; no durable marker of the step was written, the durable root's previous step is "
            "intact and the step stays on the local tier", step=job.step, rank=0, path=durable.marker(job.step),
            durable=False, abandoned=True)
    done = None
    try:
        placed = commit_step(durable, marker, manifest, evidence, policy, timeout=timeout)
        done = job.key
        return placed
    except (CommitConflictError, IncompleteStepError):
        raise
    except StorageError as e:
        if "committed" in e.details:  # the committer said which side of the marker it failed on
            raise
        raise _commit_failed(durable, job, e) from e
    except (OSError, CheckpointError) as e:
        raise _commit_failed(durable, job, e) from e
    finally:
        if clock is not None:
            clock.commit_done(done)


def _commit_failed(durable: RunLayout, job: DrainJob, e: Exception) -> StorageError:
    """Before or after the marker's create: say which, if we can tell."""
    reason = getattr(e, "message", None) or getattr(e, "strerror", None) or str(e)
    where = getattr(e, "filename", None) or durable.marker(job.step)
    return StorageError(reason, step=job.step, rank=0, path=str(where),
                        committed=None if _holds_marker_of(durable, job) else False)


def _local_manifest_bytes(local: RunLayout, job: DrainJob) -> tuple[bytes, Manifest]:
    path = local.attempt_file(job.step, job.save_id, MANIFEST)
    data = local.storage.read_file(path)
    if sha256_hex(data) != job.manifest_sha256:
        raise CorruptCheckpointError(f"{path}: does not match the local marker of step {job.step}", path=path)
    return data, Manifest.from_json(data, where=path)


def _local_manifest(local: RunLayout, job: DrainJob) -> Manifest:
    marker = Marker.from_json(local.storage.read_file(local.marker(job.step)), where=local.marker(job.step))
    if (marker.save_id, marker.manifest_sha256) != (job.save_id, job.manifest_sha256):
        raise CorruptCheckpointError(f"{local.marker(job.step)}: names save {marker.save_id}, the drain was asked for "
                                     f"{job.save_id}", path=local.marker(job.step))
    return read_manifest(local, marker)


def _holds_marker_of(durable: RunLayout, job: DrainJob) -> bool:
    """Whether the durable root now shows this drain's marker (a failure inside the marker step came after it)."""
    try:
        marker = Marker.from_json(durable.storage.read_file(durable.marker(job.step)), where=durable.marker(job.step))
    except (OSError, CheckpointError):
        return False
    return marker.save_id == job.save_id
