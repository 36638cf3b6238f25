"""Restore from the nearest complete, verified copy: own local files, a peer's replica, or the durable root (P13).

After a restart some nodes are new (their local root is empty), some disks hold damaged bytes, and the durable
root may lag the local tier by a few steps.  Loading "the latest local step" on each node independently would mix
versions or load garbage, so the choice is made once, by global rank 0, from what every root reports:

1. the lowest rank of each local root (its leader, :class:`~.local_tier.Topology`) lists the local markers there
   and reads back every rank's shard and data files of each marked step, verifying them against the digests
   recorded at write time; it reports which ranks' files it holds intact (a damaged file counts as absent);
2. rank 0 orders the local steps and the durable tier's newest commit by commit sequence (P10), and takes the
   first one that can be assembled completely: a local step whose every rank's files are intact in at least one
   root, for this world size (a changed world or declared layout restores from the durable tier); a local step
   that cannot be assembled is logged with the ranks and files it lacks, and the next one is tried;
3. for a local step, every root that lacks (or holds damaged) files of it receives them, as stored bytes, from a
   root that holds them intact; the receiver checks them against the manifest and block digests before it writes
   them, then the control files and the marker.  Every rank then loads the step from its own root with an
   ordinary verified :class:`~.reader.AtomicStorageReader`.

Each root assembles the whole step (the first slice: with two domains and one replica each root already holds
every rank's files, so nothing moves unless a node was replaced).  Only one version is ever chosen: every byte
is checked against the one manifest whose digest the chosen marker names.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from .errors import CheckpointError, CheckpointNotFoundError, StorageError
from .layout import DCP_METADATA, MANIFEST, MARKER, RunLayout
from .file_transfer import Part, Received, discard, transfer
from .local_tier import (Held, Topology, gather_failures, read_manifest, read_rank_files, spool_dir, write_control,
                         write_rank_files)
from .manifest import RANKS_FILE, Manifest, Marker

log = logging.getLogger(__name__)


@dataclass
class Durable:
    """The durable tier's candidate, as rank 0 read it."""

    step: int
    save_id: str
    sequence: int | None


@dataclass
class Transfer:
    """``source`` (a root's leader) sends ``ranks``' files of the chosen step to ``target`` (another leader), and
    the control files and marker when the target root holds nothing of the step."""

    source: int
    target: int
    ranks: list[int]
    control: bool


@dataclass
class Choice:
    tier: str  # "local", "durable", or "none"
    step: int | None = None
    save_id: str | None = None
    manifest_sha256: str | None = None
    sequence: int | None = None
    transfers: list[Transfer] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # why newer local steps could not serve


def choose(topology: Topology, reports: dict[int, list[Held]], durable: Durable | None, world: int,
           parallelism: dict | None, step: int | None) -> Choice:
    """Rank 0's decision (step 2 of the module doc) from each leader's report."""
    candidates: dict[tuple[str, str], dict[str, Any]] = {}
    for leader, held in reports.items():
        for h in held:
            if step is not None and h.step != step:
                continue
            entry = candidates.setdefault((h.save_id, h.manifest_sha256), {"held": h, "stores": {}})
            entry["stores"][leader] = set(h.ranks)
            for rank, why in h.damaged.items():
                entry.setdefault("damaged", []).append(f"rank {rank}'s files on {topology.describe(leader)}: {why}")
    skipped: list[str] = []
    ordered = sorted(candidates.values(), key=lambda c: c["held"].sequence or 0, reverse=True)
    for entry in ordered:
        held: Held = entry["held"]
        if durable is not None and (durable.sequence or 0) > (held.sequence or 0) and durable.save_id != held.save_id:
            break  # the durable tier holds a newer commit
        where = f"local step {held.step} (save {held.save_id}, sequence {held.sequence})"
        if held.world_size != world:
            skipped.append(f"{where} was saved by {held.world_size} ranks, this job has {world}")
            continue
        if parallelism is not None and held.parallelism is not None and held.parallelism != parallelism:
            skipped.append(f"{where} was saved with layout {held.parallelism}, this job declares {parallelism}")
            continue
        stores: dict[int, set[int]] = entry["stores"]
        missing = sorted(set(range(world)) - set().union(*stores.values()))
        if missing:
            lost = ", ".join(f"rank {r} ({', '.join(_files_of(entry, r)) or 'its files'})" for r in missing[:8])
            skipped.append(f"{where} has no intact copy on any local root of {lost}"
                           + (f" ({'; '.join(entry['damaged'][:3])})" if entry.get("damaged") else ""))
            continue
        return Choice(tier="local", step=held.step, save_id=held.save_id, manifest_sha256=held.manifest_sha256,
                      sequence=held.sequence, transfers=_transfers(topology, stores, world), skipped=skipped)
    if durable is not None and (step is None or durable.step == step):
        return Choice(tier="durable", step=durable.step, save_id=durable.save_id, sequence=durable.sequence,
                      skipped=skipped)
    return Choice(tier="none", step=step, skipped=skipped)


def _files_of(entry: dict[str, Any], rank: int) -> list[str]:
    return entry["held"].files.get(rank, [])


def _transfers(topology: Topology, stores: dict[int, set[int]], world: int) -> list[Transfer]:
    """For each root, the ranks whose files it lacks, each from a root that holds them intact (spread by count)."""
    sent = {leader: 0 for leader in stores}
    plan: dict[tuple[int, int], list[int]] = {}
    for target in topology.leaders:
        for rank in sorted(set(range(world)) - stores.get(target, set())):
            source = min((leader for leader, ranks in stores.items() if rank in ranks), key=lambda l: (sent[l], l))
            sent[source] += 1
            plan.setdefault((source, target), []).append(rank)
    return [Transfer(source, target, ranks, control=target not in stores) for (source, target), ranks in plan.items()]


def assemble(topology: Topology, layout: RunLayout, choice: Choice, group) -> tuple[int, int]:
    """Step 3 on every rank: leaders send and receive what the choice says, verified by the receiver; returns how
    many ranks' files this rank's root received, and their stored bytes (control files included).  Raises the
    same typed error on every rank on failure."""
    rank, world = topology.rank, len(topology.domains)
    outgoing: dict[int, list[Part]] = {}
    failure: str | None = None
    mine = [t for t in choice.transfers if t.source == rank]
    if mine:
        try:
            marker_bytes = layout.storage.read_file(layout.marker(choice.step))
            marker = Marker.from_json(marker_bytes, where=layout.marker(choice.step))
            manifest = read_manifest(layout, marker)
            attempt = layout.attempt_dir(choice.step, choice.save_id)
            names = [MANIFEST, DCP_METADATA] + ([RANKS_FILE] if manifest.ranks_file is not None else [])
            control = [Part.inline(MARKER, marker_bytes)] + [
                Part.inline(name, layout.storage.read_file(layout.storage.join(attempt, name))) for name in names]
            for t in mine:
                parts = list(control) if t.control else []
                for source_rank in t.ranks:
                    parts += read_rank_files(layout, manifest, source_rank)
                outgoing[t.target] = parts
        except (OSError, CheckpointError) as e:
            failure = f"{topology.describe(rank)} could not read what it was to send: {e}"
            outgoing = {t.target: [] for t in mine}  # the targets get an empty index
    incoming = [t for t in choice.transfers if t.target == rank]
    got, received = 0, {}
    try:
        received = transfer(outgoing, {t.source: topology.describe(t.source) for t in incoming}, group,
                            spool_dir(layout))
        if failure is None and incoming:
            got = _keep(topology, layout, choice, incoming, received)
    except (OSError, CheckpointError) as e:
        failure = failure or f"{topology.describe(rank)} could not keep what it received: {e}"
    finally:
        discard(received)
    failed = gather_failures(failure, world, group)
    if failed:
        raise StorageError(f"restoring local step {choice.step} (save {choice.save_id}) failed: " + "; ".join(failed[:4])
                           + ". Nothing was loaded; restart to retry, or load from the durable tier.",
                           step=choice.step)
    return got, sum(part.size if not isinstance(part, bytes) else len(part)
                    for parts in received.values() for part in parts.values())


def _keep(topology: Topology, layout: RunLayout, choice: Choice, incoming: list[Transfer],
          received: dict[int, dict[str, Received]]) -> int:
    manifest: Manifest | None = None
    marker_bytes: bytes | None = None
    messages = received
    for t in incoming:
        parts = messages[t.source]
        if t.control:
            marker = Marker.from_json(parts.get(MARKER, b""), where=f"the marker from {topology.describe(t.source)}")
            if (marker.save_id, marker.manifest_sha256) != (choice.save_id, choice.manifest_sha256):
                raise CheckpointError(f"{topology.describe(t.source)} sent the marker of another save ({marker.save_id})")
            manifest = Manifest.from_json(parts.get(MANIFEST, b""), where=f"the manifest from {topology.describe(t.source)}")
            from .integrity import sha256_hex

            if sha256_hex(parts[MANIFEST]) != choice.manifest_sha256:
                raise CheckpointError(f"the manifest from {topology.describe(t.source)} does not match the marker")
            write_control(layout, manifest, parts)
            marker_bytes = parts[MARKER]
    if manifest is None:
        marker = Marker.from_json(layout.storage.read_file(layout.marker(choice.step)), where=layout.marker(choice.step))
        manifest = read_manifest(layout, marker)
    got = 0
    for t in incoming:
        for source_rank in t.ranks:
            write_rank_files(layout, manifest, source_rank, messages[t.source], topology.describe(t.source))
            got += 1
    if marker_bytes is not None:  # last: the root holds a complete step only once every file is in place
        layout.storage.replace(layout.marker(choice.step), marker_bytes)
    return got


def not_found(run_id: str, choice: Choice, where: str) -> CheckpointNotFoundError:
    detail = (" Local steps that could not be assembled: " + "; ".join(choice.skipped[:4]) + ".") if choice.skipped else ""
    return CheckpointNotFoundError(
        f"no step of run {run_id!r} can be restored: nothing complete on the local tier and no durable commit under "
        f"{where}.{detail} Restore the named files or start training from scratch.",
        run_id=run_id, skipped=choice.skipped)
