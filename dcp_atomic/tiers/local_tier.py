"""The local tier: a step saved on every node's own storage, with copies on other failure domains (P13).

Saving to shared storage stalls training for as long as the slowest node takes to upload; a node's own NVMe
takes seconds.  But a node's disk dies with the node, so a local save counts only once every rank's files also
lie on ``replicas`` other failure domains (:mod:`.placement`).  The protocol, run by every rank after DCP's
``save`` returned (no collective inside DCP's hooks):

1. every rank has written its data files and its manifest shard into its own node's ``local_root``, in the
   durable format and layout (``<local_root>/<run_id>/step_N/<save_id>/``), and global rank 0 has published
   ``.metadata``, ``manifest.json`` and ``ranks.json`` there *without a marker* (:class:`LocalWriter`);
2. rank 0 sends those control files to every rank; each rank sends its shard and data files, as stored bytes, to
   its replica holders over the process group; a holder checks the shard against the manifest's digest and every
   item against the shard's block digests before it writes them into its own ``local_root``;
3. every rank reports; rank 0 decides and hands out the marker, with the next commit sequence number (P10);
4. one process per local root (its lowest rank) writes the control files it lacks and the marker.

Nothing here touches shared storage.  A crash before step 4 leaves no marker of the new step anywhere and the
previous local step intact; a crash inside step 4 leaves the marker on some roots, which is enough: rank 0
decided, and a restore (:mod:`.tier_restore`) takes the files of a marked step from any root that holds them.
Local markers are rank 0's records, so a root's marker is replaced, not created exclusively.

Stored bytes travel, never tensors: what a holder keeps is what the primary's disk keeps, so the drain and a
restore copy files without re-serialising, and each side verifies the same digests.  They travel in chunks
(:mod:`..exchange.file_transfer`): memory per peer is one chunk, whatever a rank's share of the step.

Why one module of about 650 lines: the local commit end to end (the steps above) with the checks each step makes;
the drain, the restore and the placement are modules of their own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import json
import os
import time
from dataclasses import dataclass

from .._base import failpoints
from ..protocol.commit import (Evidence, commit_order, copy_control, listed_steps, publish_control,
                               record_local_marker, require_complete)
from ..protocol.retention_policy import retained
from ..errors import CheckpointError, ConfigurationError, CorruptCheckpointError, StorageError
from ..exchange.file_transfer import Part, Received, Spooled, discard, transfer
from ..exchange.collective import agreed_phase, from_rank0, gather
from ..exchange.transport import PeerLost
from ..format.blocks import verify_item, verify_stored_file
from ..format.integrity import sha256_hex
from ..format.layout import DCP_METADATA, MANIFEST, PARTIAL_SUFFIX, SPOOL_DIR, RunLayout
from ..format.manifest import RANKS_FILE, FileEntry, Manifest, ManifestShard, Marker, shard_name
from .placement import Placement, place_replicas
from ..stores.storage import LocalRangeReader, LocalStorage, publish_stream
from ..dcp.watched import WatchedWriter

log = logging.getLogger("dcp_atomic.local_tier")  # the name users filter on


# -- who is where ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Topology:
    """Every rank's failure domain and local root, learned once; a *store* is one (domain, host, local root): ranks
    that share it (the ranks of one node) share its files, and its lowest rank, the leader, writes them."""

    rank: int
    domains: tuple[str, ...]
    roots: tuple[str, ...]
    hosts: tuple[str, ...]
    placement: Placement

    @classmethod
    def learn(cls, rank: int, domain: str, root: str, replicas: int, group) -> "Topology":
        import socket

        mine = (domain, os.path.realpath(root), socket.gethostname())
        everyone = gather(group, mine, "learning the local tier's topology")
        roots, hosts = tuple(r for _, r, _ in everyone), tuple(h for _, _, h in everyone)
        domains, merged = one_domain_per_disk([d for d, _, _ in everyone], hosts, roots)
        if merged and rank == 0:
            log.warning("local tier: %s", merged)
        try:
            placement = place_replicas(domains, replicas)
        except ConfigurationError as e:
            raise ConfigurationError(f"{e.message}" + (f" ({merged})" if merged else ""), **e.details) from None
        return cls(rank=rank, domains=tuple(domains), roots=roots, hosts=hosts, placement=placement)

    def store(self, rank: int) -> tuple[str, str, str]:
        """(domain, host, root): a domain may span hosts (a rack), each with its own disk at the same path."""
        return self.domains[rank], self.hosts[rank], self.roots[rank]

    def leader(self, rank: int) -> int:
        return min(r for r in range(len(self.domains)) if self.store(r) == self.store(rank))

    @property
    def leaders(self) -> list[int]:
        return sorted({self.leader(r) for r in range(len(self.domains))})

    @property
    def is_leader(self) -> bool:
        return self.leader(self.rank) == self.rank

    def describe(self, rank: int) -> str:
        return f"rank {rank} ({self.domains[rank]}, {self.hosts[rank]}:{self.roots[rank]})"


def one_domain_per_disk(domains: list[str], hosts: tuple[str, ...], roots: tuple[str, ...]) -> tuple[list[str], str]:
    """Each rank's effective failure domain: ranks whose local roots are one disk (the same host and path) share
    its fate, whatever they declared, so their domains merge (transitively; a merged domain keeps the name its
    lowest rank declared).  A replica on the primary's own disk is no replica.  Returns the domains and, when any
    merged, a sentence naming the ranks and the path (for the warning, or the refusal of too few domains)."""
    parent = {d: d for d in domains}

    def find(d: str) -> str:
        while parent[d] != d:
            parent[d] = parent[parent[d]]
            d = parent[d]
        return d

    first: dict[tuple[str, str], int] = {}
    shared: dict[tuple[str, str], list[int]] = {}
    for rank, disk in enumerate(zip(hosts, roots)):
        shared.setdefault(disk, []).append(rank)
        if disk in first:
            a, b = find(domains[first[disk]]), find(domains[rank])
            if a != b:  # keep the name of the lower rank's domain
                keep, drop = (a, b) if domains.index(a) <= domains.index(b) else (b, a)
                parent[drop] = keep
        else:
            first[disk] = rank
    effective = [find(d) for d in domains]
    notes = [f"ranks {', '.join(map(str, ranks))} declare domains {sorted({domains[r] for r in ranks})} but share "
             f"one local root ({host}:{root}): one failure domain, {effective[ranks[0]]!r}"
             for (host, root), ranks in shared.items() if len({domains[r] for r in ranks}) > 1]
    return effective, "; ".join(notes[:4]) + (f"; and {len(notes) - 4} more disks" if len(notes) > 4 else "")


# -- step 1: the writer's half ------------------------------------------------------------------------------


@dataclass
class Staged:
    """The control files rank 0 published in its local root without a marker (step 1)."""

    manifest: bytes
    metadata: bytes
    ranks: bytes | None


class LocalWriter(WatchedWriter):
    """Writes a step into the local root exactly as the durable tier would, stopping short of the marker.

    ``topology`` (set by the manager) goes into ``ranks.json``: each rank's failure domain and the domains holding
    its replicas, so ``dcp-atomic show`` can say where a step's copies were, in either tier.  ``provisional_for``
    (set by the manager; global rank 0's counts) goes into the step's local marker (:attr:`Marker.provisional_for`).
    ``decided``: this rank holds rank 0's marker of the step (:func:`commit_local`); from then on its files are a
    commit's, never a failed attempt's, even if recording the marker fails on some root."""

    staged: Staged | None = None
    topology: "Topology | None" = None
    provisional_for: str | None = None
    decided: bool = False

    def _publish(self, manifest: Manifest, metadata_bytes: bytes) -> None:
        storage, layout = self.storage, self.layout
        attempt = layout.attempt_dir(self.step, manifest.save_id)
        if self.topology is not None:
            for record in manifest.ranks:
                rank = record["rank"]
                record["failure_domain"] = self.topology.domains[rank]
                record["replicas_on"] = [self.topology.domains[h] for h in self.topology.placement.holders[rank]]
        data = publish_control(layout, manifest, metadata_bytes, rank=self.rank)  # the durable commit's step 2
        ranks = storage.read_file(storage.join(attempt, RANKS_FILE)) if manifest.ranks_file else None
        self.staged = Staged(manifest=data, metadata=metadata_bytes, ranks=ranks)
        return None


# -- moving stored bytes between ranks (:mod:`~dcp_atomic.exchange.file_transfer`) -----------------------------------------------


def spool_dir(layout: RunLayout) -> str:
    """Where a root's incoming files wait for verification: inside the run, so the rename into place stays on one
    filesystem; step listings skip it (not a ``step_`` name)."""
    return layout.storage.join(layout.run_dir, SPOOL_DIR)


def sweep_spool(layout: RunLayout) -> list[str]:
    """Remove what a restore killed midway left in this root's spool: a marker held back for the end
    (``marker-*``), a partial copy being assembled by a process that is gone (``partial-<pid>-*``: versions
    before :func:`keep_extents` assembled it beside its data file).  Run by the
    root's leader before a restore scans (no transfer into this root runs then); returns the names removed.
    A transfer's own leftovers (``r<rank>-*``) are swept by :func:`~.file_transfer.transfer`."""
    spool = spool_dir(layout)
    try:
        names = os.listdir(spool)
    except FileNotFoundError:
        return []
    removed = []
    for name in names:
        owner = name.split("-")[1] if name.startswith("partial-") else None
        if name.startswith("marker-") or (owner is not None and owner.isdigit() and not _alive(int(owner))):
            try:
                os.unlink(os.path.join(spool, name))
                removed.append(name)
            except FileNotFoundError:
                pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -- verification ------------------------------------------------------------------------------------------


def check_shard(manifest: Manifest, rank: int, data: bytes, where: str) -> ManifestShard:
    """Rank ``rank``'s shard bytes, against the manifest's digest and file list."""
    ref = manifest.shard_of(rank)
    if ref is None or len(data) != ref.size or sha256_hex(data) != ref.sha256:
        raise CorruptCheckpointError(f"{where}: manifest shard of rank {rank} does not match the manifest of step "
                                     f"{manifest.step} (save {manifest.save_id})", path=where, rank=rank)
    shard = ManifestShard.from_json(data, where=where)
    recorded = sorted((f.name, f.size) for f in manifest.files if f.rank == rank)
    if shard.rank != rank or sorted((f.name, f.size) for f in shard.files) != recorded:
        raise CorruptCheckpointError(f"{where}: shard names other files than the manifest records for rank {rank}",
                                     path=where, rank=rank)
    return shard


def check_file(entry: FileEntry, data: bytes, where: str) -> None:
    """Every item of a data file held in memory against the digests its shard recorded at write time."""
    if len(data) != entry.size:
        raise CorruptCheckpointError(f"{where}: {len(data)} bytes, the shard records {entry.size}", path=where)
    view = memoryview(data)
    for item in entry.items:
        verify_item(item, view[item.pos:item.pos + item.length], f"{where} item {item.key!r}", path=where)


def check_stored_file(entry: FileEntry, path: str, where: str) -> None:
    """:func:`check_file` for a file on disk, read one block (or frame) at a time: memory stays one block whatever
    the file's size, and a failing disk is an ``OSError`` naming the file (a memory map would crash on it)."""
    with LocalRangeReader(path) as reader:
        verify_stored_file(entry, reader, where)


def read_rank_files(layout: RunLayout, manifest: Manifest, rank: int, verify: bool = True) -> list[Part]:
    """Rank ``rank``'s shard and data files as this root stores them: the parts to send.  ``verify=False`` when
    the receiver verifies every block anyway (a replica holder, a restore's receiver): a second pass on the
    sender would only read the bytes once more."""
    storage, step, save_id = layout.storage, manifest.step, manifest.save_id
    path = layout.attempt_file(step, save_id, shard_name(rank))
    shard_bytes = storage.read_file(path)
    shard = check_shard(manifest, rank, shard_bytes, path)
    parts = [Part.inline(shard_name(rank), shard_bytes)]
    for entry in shard.files:
        file_path = layout.data_file(step, save_id, entry.name, manifest.data_prefixes)
        if verify:
            check_stored_file(entry, file_path, file_path)
        parts.append(Part(entry.name, entry.size, path=file_path))
    return parts


def check_received(entry: FileEntry, part: Received, where: str) -> None:
    """A file as it arrived from a peer, against its block digests: spooled on disk, or in memory."""
    if isinstance(part, Spooled):
        check_stored_file(entry, part.path, where)
    else:
        check_file(entry, part, where)


def keep(part: Received, storage: LocalStorage, path: str) -> None:
    """Put a verified part at ``path`` in ``storage`` (the receiving root): publish bytes, rename a spool file."""
    if isinstance(part, bytes):
        storage.publish(path, part)
        return
    storage.adopt(part.path, path)


def write_rank_files(layout: RunLayout, manifest: Manifest, rank: int, parts: dict[str, Received], sender: str) -> None:
    """Verify another rank's shard and files as received, then keep them (a damaged copy here is replaced)."""
    storage, step, save_id = layout.storage, manifest.step, manifest.save_id
    where = f"rank {rank}'s files from {sender}"
    shard_bytes = parts.get(shard_name(rank), b"")
    shard = check_shard(manifest, rank, shard_bytes if isinstance(shard_bytes, bytes) else b"", where)
    for entry in shard.files:
        if entry.name not in parts:
            raise CorruptCheckpointError(f"{where}: {entry.name} is missing from the transfer", rank=rank)
        check_received(entry, parts[entry.name], f"{where}: {entry.name}")
    storage.makedirs(layout.attempt_dir(step, save_id))
    for entry in shard.files:
        keep(parts[entry.name], storage, layout.data_file(step, save_id, entry.name, manifest.data_prefixes))
    storage.publish(layout.attempt_file(step, save_id, shard_name(rank)), shard_bytes)


def write_control(layout: RunLayout, manifest: Manifest, control: dict[str, bytes], sender: str) -> None:
    """The attempt's control files as received from ``sender`` (``.metadata``, ``ranks.json``, ``manifest.json``),
    each checked first (:func:`~.commit.copy_control`)."""
    copy_control(lambda name: control.get(name, b""), layout, manifest, control[MANIFEST],
                 source=f"the control files from {sender}")


# -- what a root holds --------------------------------------------------------------------------------------


@dataclass
class Held:
    """One local-committed step as one root holds it, file by file: a root that a restore assembled holds only
    what its own ranks read (:mod:`.tier_restore`), so "this root holds rank r" is not all-or-nothing."""

    step: int
    save_id: str
    manifest_sha256: str
    sequence: int | None
    ranks: list[int]  # ranks whose shard and every data file verified here
    intact: dict[str, int]  # data file -> its rank, for each file that verified here (its rank's shard too)
    control: bool  # .metadata and ranks.json here match the manifest (a reader can open the step here)
    damaged: dict[int, str]  # rank -> why a file of it here does not verify (absent or partial files are no damage)
    files: dict[int, list[str]]  # rank -> its data files, as the manifest names them (to name what is lost)
    sizes: dict[str, int]  # data file -> its stored size
    partial: dict[str, list[tuple[int, int]]]  # data file -> (offset, length) of the items a partial copy holds
    shards: list[int]  # ranks whose manifest shard verified here (a reader of any of their files needs it)


def local_markers(layout: RunLayout) -> list[Marker]:
    """Every readable local marker of the run in this root (a node's own disk: listing it is cheap and exact)."""
    markers = []
    for step in listed_steps(layout):
        try:
            markers.append(Marker.from_json(layout.storage.read_file(layout.marker(step)), where=layout.marker(step)))
        except FileNotFoundError:
            continue
        except CheckpointError as e:
            log.warning("local tier: ignoring step %d in %s: %s", step, layout.run_dir, e)
    return sorted(markers, key=commit_order)


ANY_LINEAGE = "*"  # of_lineage: every marker (tools that look at a whole root); never a lineage id (lineage.py)


def of_lineage(markers: list[Marker], lineage: str | None, *, foreign: bool = False) -> list[Marker]:
    """The markers of ``lineage`` (``foreign``: of any other).  Equal ids only: a marker that records no lineage
    (written by a version before lineages existed, or by one that recorded none while its durable root's ``LINEAGE``
    could not be created) is no lineage's; nothing proves it is this experiment's (:mod:`~dcp_atomic.protocol.lineage`)."""
    if lineage == ANY_LINEAGE:
        return [] if foreign else markers
    return [m for m in markers if (m.lineage != lineage) == foreign]


def read_manifest(layout: RunLayout, marker: Marker) -> Manifest:
    path = layout.attempt_file(marker.step, marker.save_id, MANIFEST)
    data = layout.storage.read_file(path)
    if sha256_hex(data) != marker.manifest_sha256:
        raise CorruptCheckpointError(f"{path}: does not match its local marker", path=path)
    return Manifest.from_json(data, where=path)


def scan_root(layout: RunLayout, *, lineage: str | None, verify_data: bool = True,
              share: tuple[int, int] = (0, 1)) -> list[Held]:
    """What this root holds of each local-committed step, every file verified (the restore's input).  ``share``
    (i, n): verify only every n-th data file from the i-th, so the n ranks of a root verify it in parallel; the
    shares' reports are joined by :func:`merge_held`."""
    held = []
    for marker in of_lineage(local_markers(layout), lineage):  # another lineage's steps are never candidates
        try:
            manifest = read_manifest(layout, marker)
        except (OSError, CheckpointError) as e:
            log.warning("local tier: step %d in %s is unusable: %s", marker.step, layout.run_dir, e)
            continue
        ranks, intact, damaged, partial, shards = [], {}, {}, {}, []
        names = sorted(f.name for f in manifest.files)
        mine = set(names[share[0]::share[1]])
        for rank in range(manifest.world_size):
            found, why = _held_files(layout, manifest, rank, verify_data, partial, shards, mine)
            intact.update((name, rank) for name in found)
            if why is not None:
                damaged[rank] = why
            if len(found) == sum(1 for f in manifest.files if f.rank == rank) and why is None:
                ranks.append(rank)
        held.append(Held(step=marker.step, save_id=marker.save_id, manifest_sha256=marker.manifest_sha256,
                         sequence=marker.sequence, ranks=ranks, intact=intact, control=_control_intact(layout, manifest), damaged=damaged,
                         files={r: sorted(f.name for f in manifest.files if f.rank == r)
                                for r in range(manifest.world_size)},
                         sizes={f.name: f.size for f in manifest.files}, partial=partial, shards=shards))
    return held


def _held_files(layout: RunLayout, manifest: Manifest, rank: int, verify: bool,
                partial: dict[str, list[tuple[int, int]]], shards: list[int],
                mine: set[str]) -> tuple[list[str], str | None]:
    """The data files of ``rank`` that verify in this root, and why one that is here does not (None: no damage).
    A file that is absent, or a partial copy a restore left (:func:`keep_extents`), is not held; of a partial
    copy, the items that verify go into ``partial``."""
    storage, step, save_id = layout.storage, manifest.step, manifest.save_id
    path = layout.attempt_file(step, save_id, shard_name(rank))
    try:
        shard = check_shard(manifest, rank, storage.read_file(path), path)
    except FileNotFoundError:
        return [], None
    except (OSError, CheckpointError) as e:
        return [], str(e)
    shards.append(rank)
    found, why = [], None
    for entry in shard.files:
        if entry.name not in mine:
            continue  # another rank of this root verifies it
        file_path = layout.data_file(step, save_id, entry.name, manifest.data_prefixes)
        try:
            if verify:
                check_stored_file(entry, file_path, file_path)
            elif not os.path.exists(file_path):
                raise FileNotFoundError(file_path)
            found.append(entry.name)
        except FileNotFoundError:
            continue
        except (OSError, CheckpointError) as e:
            if not os.path.exists(partial_note(layout, manifest, entry.name)):
                why = why or str(e)
            elif verify:
                partial[entry.name] = _intact_items(entry, file_path)
    return found, why


def merge_held(shares: list[list[Held]]) -> list[Held]:
    """One root's report from its ranks' shares of the scan (:func:`scan_root` ``share``): a file is held when the
    share that verified it says so; a rank is whole when every file of it is."""
    merged: dict[tuple[str, str], Held] = {}
    for held in shares:
        for h in held:
            key = (h.save_id, h.manifest_sha256)
            if key not in merged:
                merged[key] = dataclasses.replace(h, intact=dict(h.intact), damaged=dict(h.damaged),
                                                  partial=dict(h.partial), shards=list(h.shards))
                continue
            m = merged[key]
            m.intact.update(h.intact)
            m.partial.update(h.partial)
            for rank, why in h.damaged.items():
                m.damaged.setdefault(rank, why)
            m.shards = sorted(set(m.shards) & set(h.shards))
            m.control = m.control and h.control
    for m in merged.values():
        m.ranks = [r for r, names in sorted(m.files.items())
                   if r not in m.damaged and r in m.shards and all(n in m.intact for n in names)]
    return sorted(merged.values(), key=lambda h: (h.sequence or 0, h.step))


def _intact_items(entry: FileEntry, path: str) -> list[tuple[int, int]]:
    """(offset, length) of each item of a partial copy that matches its digests (the rest are holes)."""
    intact = []
    with contextlib.suppress(OSError), open(path, "rb", buffering=0) as f:
        for item in entry.items:
            with contextlib.suppress(CheckpointError):
                verify_item(item, os.pread(f.fileno(), item.length, item.pos), f"{path} item {item.key!r}", path=path)
                intact.append((item.pos, item.length))
    return intact


def _control_intact(layout: RunLayout, manifest: Manifest) -> bool:
    attempt = layout.attempt_dir(manifest.step, manifest.save_id)
    try:
        for name, size, sha256 in manifest.control_files():
            data = layout.storage.read_file(layout.storage.join(attempt, name))
            if len(data) != size or sha256_hex(data) != sha256:
                return False
    except OSError:
        return False
    return True


def partial_note(layout: RunLayout, manifest: Manifest, name: str) -> str:
    """Beside a data file that a restore copied only in part: says the holes in it are intended, not damage."""
    return layout.storage.join(layout.attempt_dir(manifest.step, manifest.save_id), name + PARTIAL_SUFFIX)


def keep_extents(layout: RunLayout, manifest: Manifest, entry: FileEntry, pieces: dict[int, bytes]) -> None:
    """A partial copy of a data file: ``pieces`` (offset -> stored bytes, each a verified item) at their offsets in
    a file of the recorded size, holes elsewhere.  The reader reads only the items its plan names, each checked
    against its digests, so a hole can never load as values; the note beside it tells a later scan the holes are
    intended (the file is not held, and not damaged)."""
    storage = layout.storage
    target = layout.data_file(manifest.step, manifest.save_id, entry.name, manifest.data_prefixes)

    def write(file) -> None:
        file.truncate(entry.size)
        for offset, data in pieces.items():
            os.pwrite(file.fileno(), data, offset)
        claims = json.dumps({"items": sorted([offset, len(data)] for offset, data in pieces.items())}).encode()
        storage.publish(partial_note(layout, manifest, entry.name), claims)  # first: a crash leaves no unexplained hole

    publish_stream(target, write, read_only=True)


def open_local(local_root: str, run_id: str) -> RunLayout:
    return RunLayout(LocalStorage(local_root), run_id)


# -- steps 2-4: replicate, decide, record ------------------------------------------------------------------


@dataclass
class LocalCommit:
    """What :func:`commit_local` recorded: the marker, the steps every root's retention keeps, and the cost."""

    marker: Marker
    kept: set[int]
    replica_bytes: int  # stored bytes all ranks sent to their replica holders
    seconds: float  # this rank's steps 2-4: replication, decision, markers


def commit_local(topology: Topology, layout: RunLayout, writer: LocalWriter, step: int, group,
                 sequence_floor: int, protected: set[int] | None = None, drain: bool = False,
                 *, lineage: str | None, timeout: float) -> LocalCommit:
    """Run steps 2-4 (module doc) on every rank after ``dcp.save`` returned.

    ``sequence_floor``: the newest commit sequence rank 0 knows of (both tiers); the marker gets the next one
    above it and above every root's newest local marker.  ``protected`` (rank 0's): the steps its drain still
    needs; handed out with the marker, so every root keeps the same ones (only rank 0 knows which step the drain
    takes next).  ``drain``: the marker records that the step is to be drained (:attr:`Marker.drain`); ``lineage``
    and rank 0's ``writer.provisional_for``: whose step it is (:mod:`~dcp_atomic.protocol.lineage`).  Raises the
    same typed error on every rank when any rank's replicas could not be written or
    verified: then no root has a marker of this step.  A peer lost while replicas move raises
    :class:`.transport.PeerLost` (naming it, within ``timeout``) on the ranks that exchanged with it, at once.
    """
    started = time.perf_counter()
    rank = topology.rank
    staged = from_rank0(group, writer.staged if rank == 0 else None, f"sharing step {step}'s control files")
    if staged is None:
        raise CheckpointError(f"step {step}: global rank 0 staged no control files for the local commit", step=step)
    control = {MANIFEST: staged.manifest, DCP_METADATA: staged.metadata}
    if staged.ranks is not None:
        control[RANKS_FILE] = staged.ranks
    manifest = Manifest.from_json(staged.manifest, where=f"step {step} manifest from rank 0")
    placement = topology.placement

    failure: str | None = None
    own: list[Part] = []
    try:
        own = read_rank_files(layout, manifest, rank, verify=False)  # each holder verifies what it receives
    except (OSError, CheckpointError) as e:
        failure = f"{topology.describe(rank)} could not read back its own files: {e}"  # holders get an empty index
    failpoints.hit("replicate.send", rank)
    received: dict[int, dict[str, Received]] = {}
    try:
        received = transfer({holder: own for holder in placement.holders[rank]},
                            {source: topology.describe(source) for source in placement.held_by(rank)}, group,
                            spool_dir(layout), what=f"replicating step {step}", timeout=timeout,
                            exchange_id=f"replicate/{manifest.save_id}",
                            consequence=f"step {step} is not committed to the local tier, and the previous local "
                                        "step is intact. Restart the job: it resumes from the latest committed step.")
    except PeerLost:
        raise  # the group is broken: the reports' gather below would only wait out its timeout, untyped
    except (OSError, CheckpointError) as e:
        failure = failure or f"{topology.describe(rank)} could not exchange replicas: {e}"
    here = topology.describe(rank)
    verified = {part.name: f"{here} wrote it" for part in own}  # written and fsynced by this rank in this attempt
    try:
        if failure is None:
            for source, parts in received.items():
                write_rank_files(layout, manifest, source, parts, topology.describe(source))
                verified.update((name, f"{here} verified its copy") for name in parts)
                failpoints.hit("replicate.receive", rank)
    except (OSError, CheckpointError) as e:
        failure = f"{topology.describe(rank)} could not keep a replica: {e}"
    finally:
        discard(received)  # what was kept was renamed into place; the rest goes
    newest = (max((m.sequence or 0 for m in of_lineage(local_markers(layout), lineage)), default=0)
              if topology.is_leader else 0)
    sent = sum(part.size for part in own) * len(placement.holders[rank])
    reports = gather(group, (failure, newest, sent, verified), f"reporting step {step}'s replicas")
    failures = [why for why, _, _, _ in reports if why]
    evidence = Evidence.on_roots({name: who for *_, held in reversed(reports) for name, who in held.items()},
                                 [topology.describe(r) for r in topology.leaders])
    if not failures:  # every rank holds the same reports: each refuses alike, before rank 0 decides
        try:
            require_complete(manifest, evidence, f"local commit of step {step}")
        except CheckpointError as e:
            failures = [e.message]
    decision = None
    if rank == 0 and not failures:
        marker = Marker.for_manifest(layout.run_id, manifest, sha256_hex(staged.manifest),
                                     max([sequence_floor] + [n for _, n, _, _ in reports]) + 1, drain=drain or None,
                                     lineage=lineage, provisional_for=writer.provisional_for)
        decision = (marker.to_json(), sorted(protected or ()))
    if failures:
        raise StorageError(
            f"step {step} was not committed to the local tier: {len(failures)} rank(s) failed to replicate: "
            + "; ".join(failures[:4]) + ". The previous local step is intact; check the named nodes' local_root "
            "(space, permissions) or lower replicas.", step=step)
    marker_bytes, kept = from_rank0(group, decision, f"sharing step {step}'s local marker")
    marker = Marker.from_json(marker_bytes, where=f"step {step} local marker from rank 0")
    writer.decided = True  # another rank of this root may be slower to record the marker: keep the files for it
    with agreed_phase(group, f"step {step} is local-committed (sequence {marker.sequence}) but recording its "
                      "marker on every local root", topology.describe(rank),
                      then="The step stays restorable from the other roots; check the named local_root.", step=step):
        if topology.is_leader:
            if topology.store(rank) != topology.store(0):
                write_control(layout, manifest, control, topology.describe(0))
            record_local_marker(layout, marker_bytes, manifest, evidence, f"local commit on {topology.describe(rank)}",
                                rank)
    return LocalCommit(marker=marker, kept={step, *kept}, replica_bytes=sum(n for _, _, n, _ in reports),
                       seconds=time.perf_counter() - started)


def retain_local(layout: RunLayout, keep_local: int, protected: set[int], lineage: str | None,
                 pinned: set[int] = frozenset()) -> list[int]:
    """Keep this root's ``keep_local`` most recent local steps of ``lineage`` (the durable root's rule,
    :func:`~dcp_atomic.protocol.retention_policy.retained`, with ``keep_last=keep_local``) and every ``protected``
    one (a drain in flight or queued); remove the others, marker first.  A ``pinned`` step (kept until it is durable:
    its drain failed) counts inside ``keep_local``, the newest step always kept: a disk sized for ``keep_local + 1``
    steps then holds the pin, the newest steps and the save in progress, however long the durable store refuses.
    Another lineage's steps are not this job's to delete (the restore names them)."""
    markers = of_lineage(local_markers(layout), lineage)
    older_pins = {m.step for m in markers[:-1]} & set(pinned)
    kept = {m.step for m in retained(markers, max(1, keep_local - len(older_pins)))} | older_pins | protected
    doomed = [m.step for m in markers if m.step not in kept]
    for step in doomed:
        remove_local_step(layout, step)
    return doomed


def remove_failed_attempt(layout: RunLayout, step: int, save_id: str, where: str) -> None:
    """Remove this root's files of the failed save ``save_id`` of ``step`` (the attempt directory, then the step's
    directory if nothing else is in it), unless the root holds a marker of it; logged, never raised (the save's own
    error is the one to report; what is left here is ``dcp-atomic gc``'s)."""
    storage = layout.storage
    try:
        try:
            marker = Marker.from_json(storage.read_file(layout.marker(step)), where=layout.marker(step))
            if marker.save_id == save_id:
                return  # committed here after all: not a failed attempt
        except FileNotFoundError:
            pass
        for _ in range(3):  # another rank of this root may be removing the same tree: files vanish under us
            try:
                storage.remove(layout.attempt_dir(step, save_id))
                break
            except FileNotFoundError:
                continue
        if not storage.list_dir(layout.step_dir(step)):
            storage.remove(layout.step_dir(step))
        log.info("local tier %s: removed the failed attempt %s of step %d", where, save_id, step)
    except FileNotFoundError:
        pass  # another rank of this root was first
    except (OSError, CheckpointError) as e:
        log.warning("local tier %s: could not remove the failed attempt %s of step %d (%s); `dcp-atomic gc` on this "
                    "local root collects it", where, save_id, step, e)


def remove_local_step(layout: RunLayout, step: int) -> None:
    """Drop one step from this root, marker first: a crash midway leaves files no restore trusts (gc's to collect),
    never a marker whose files are gone."""
    layout.storage.remove(layout.marker(step))
    layout.storage.remove(layout.step_dir(step))
