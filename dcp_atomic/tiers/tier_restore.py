"""Restore from the nearest complete, verified copy: own local files, a peer's replica, or the durable root (P13).

After a restart some nodes are new (their local root is empty), some disks hold damaged bytes, and the durable
root may lag the local tier by a few steps.  Loading "the latest local step" on each node independently would mix
versions or load garbage, so the choice is made once, by global rank 0, from what every root reports:

1. the lowest rank of each local root (its leader, :class:`~.local_tier.Topology`) lists the local markers there
   and reads back every data file of each marked step, verifying it against the digests recorded at write time;
   it reports which files it holds intact (a damaged, partial or absent file is not held);
2. rank 0 orders the local steps and the durable tier's newest commit by commit sequence (P10), and takes the
   first one that can be assembled completely: a local step whose every data file is intact in at least one
   root, whatever world size saved it (a resized job reshards from it as from a durable step: the load applies
   the one layout policy, :func:`~dcp_atomic.dcp.reshard.check_layout`, to either); a local step
   that cannot be assembled is logged with the ranks and files it lacks, and the next one is tried;
3. for a local step (:func:`assemble_step`): every root that lacks the step's control files gets them from one root
   that holds them; then each rank plans its own load (the load planner, on the step's ``.metadata`` and the
   rank's state dict) and names the stored items it will read.  What its root lacks of them, the rank receives
   *itself*, from a rank whose root holds the file intact (sources spread by bytes), so a replaced node's ranks
   receive in parallel; ranks of one root never receive the same file twice.  A rank always receives its own
   primary files whole (the drain and the next replicas read them); of another rank's file it needs only a
   few items of (replicated objects DCP saved once, on some rank), it receives just those items' bytes, kept
   as a partial copy (:func:`~.local_tier.keep_extents`); a root's leader also receives the manifest shards its
   root lacks (small: a later restore and ``dcp-atomic show`` read them).  The receiver checks every byte against
   the manifest and block digests before it keeps it (the sender does not: that second pass bought nothing);
   the marker comes last.  Every rank then loads from its own root with an ordinary verified
   :class:`~.reader.AtomicStorageReader`, which reads exactly the items planned here (read-once sharing too:
   it assigns an item to one of the ranks that read it, and each of them holds it).

A root assembled this way holds what its ranks read, not the whole step: the step's redundancy comes back with
the next local save.  Until then, losing the *other* root as well leaves some files of that step on no root: a
restore then takes the newest durable step, or raises :class:`~.errors.CheckpointNotFoundError` naming the ranks
and files no root holds.  Only one version is ever chosen: every byte is checked against the one manifest whose
digest the chosen marker names.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from ..protocol.commit import Evidence, record_local_marker
from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from ..exchange.file_transfer import Part, Received, discard, transfer
from ..exchange.collective import agreed_phase, gather
from .._base.gc_pause import gc_paused
from ..format.integrity import sha256_hex
from ..format.layout import DCP_METADATA, MANIFEST, MARKER, RunLayout
from ..format.blocks import verify_item
from .local_tier import (Held, Topology, check_received, check_shard, keep, keep_extents,
                         partial_note, spool_dir, write_control)
from ..format.manifest import Manifest, ManifestShard, Marker, shard_name

log = logging.getLogger("dcp_atomic.tier_restore")  # the name users filter on

#: a file another rank wrote is copied in part (only the items read) when those items are at most half of it and
#: at most this many bytes (they travel in memory); else whole
PARTIAL_LIMIT = 64 << 20


@dataclass
class DurableCandidate:
    """The durable tier's candidate for a restore (its newest commit, or the step asked for), as rank 0 read it."""

    step: int
    save_id: str
    sequence: int | None


@dataclass
class Choice:
    tier: str  # "local", "durable", or "none"
    step: int | None = None
    save_id: str | None = None
    manifest_sha256: str | None = None
    sequence: int | None = None
    holders: dict[str, list[int]] = field(default_factory=dict)  # data file -> leaders whose root holds it intact
    writers: dict[str, int] = field(default_factory=dict)  # data file -> the rank that wrote it
    sizes: dict[str, int] = field(default_factory=dict)  # data file -> stored bytes
    control_from: int | None = None  # a leader whose root holds the control files intact
    lacking: list[int] = field(default_factory=list)  # leaders whose root needs the control files
    unmarked: list[int] = field(default_factory=list)  # leaders whose root has no marker of the step
    partial: dict[int, dict[str, list[tuple[int, int]]]] = field(default_factory=dict)  # leader -> file -> items
    shards: dict[int, list[int]] = field(default_factory=dict)  # leader -> ranks whose shard its root holds
    skipped: list[str] = field(default_factory=list)  # why newer local steps could not serve


@dataclass(frozen=True)
class Fetch:
    """``target`` receives data file ``name`` (written by ``rank``) from ``source``, whose root holds it intact:
    whole, or only the stored items at ``extents`` ((offset, length), a partial copy).  ``shard``: the target
    also writes ``rank``'s manifest shard into its root (one rank per root does); ``name`` None: the shard alone
    (every root gets every shard: small, and what ``dcp-atomic show`` and a later restore read)."""

    name: str | None
    rank: int
    source: int
    target: int
    extents: tuple[tuple[int, int], ...] | None
    shard: bool


def choose_restore(topology: Topology, reports: dict[int, list[Held]], durable: DurableCandidate | None,
                   step: int | None, save_id: str | None = None) -> Choice:
    """Rank 0's decision (step 2 of the module doc) from each leader's report; ``save_id`` (with ``step``): that
    exact save or nothing, never another save of the step (a file that names one save, as Lightning's do)."""
    if save_id is not None and durable is not None and durable.save_id != save_id:
        durable = None
    candidates: dict[tuple[str, str], dict[str, Any]] = {}
    for leader, held in reports.items():
        for h in held:
            if (step is not None and h.step != step) or (save_id is not None and h.save_id != save_id):
                continue
            entry = candidates.setdefault((h.save_id, h.manifest_sha256), {"held": h, "stores": {}})
            entry["stores"][leader] = h
            for rank, why in h.damaged.items():
                entry.setdefault("damaged", []).append(f"rank {rank}'s files on {topology.describe(leader)}: {why}")
    skipped: list[str] = []
    ordered = sorted(candidates.values(), key=lambda c: c["held"].sequence or 0, reverse=True)
    for entry in ordered:
        held: Held = entry["held"]
        if durable is not None and (durable.sequence or 0) >= (held.sequence or 0) and durable.save_id != held.save_id:
            break  # the durable tier holds a newer commit, or one no older (another job's, sequence unknown to ours)
        where = f"local step {held.step} (save {held.save_id}, sequence {held.sequence})"
        stores: dict[int, Held] = entry["stores"]
        writers = {name: rank for rank, names in held.files.items() for name in names}
        holders = {name: sorted(leader for leader, h in stores.items() if name in h.intact) for name in writers}
        lost: dict[int, list[str]] = {}
        for name, leaders in sorted(holders.items()):
            if not leaders:
                lost.setdefault(writers[name], []).append(name)
        controls = sorted(leader for leader, h in stores.items() if h.control)
        if lost or not controls:
            what = (", ".join(f"rank {r} ({', '.join(names)})" for r, names in sorted(lost.items())[:8])
                    if lost else "the control files (.metadata, ranks.json)")
            skipped.append(f"{where} has no intact copy on any local root of {what}"
                           + (f" ({'; '.join(entry['damaged'][:3])})" if entry.get("damaged") else ""))
            continue
        return Choice(tier="local", step=held.step, save_id=held.save_id, manifest_sha256=held.manifest_sha256,
                      sequence=held.sequence, holders=holders, writers=writers, sizes=dict(held.sizes),
                      control_from=controls[0], lacking=[l for l in topology.leaders if l not in controls],
                      unmarked=[l for l in topology.leaders if l not in stores],
                      partial={leader: h.partial for leader, h in stores.items() if h.partial},
                      shards={leader: list(h.shards) for leader, h in stores.items()}, skipped=skipped)
    if durable is not None and (step is None or durable.step == step):
        return Choice(tier="durable", step=durable.step, save_id=durable.save_id, sequence=durable.sequence,
                      skipped=skipped)
    return Choice(tier="none", step=step, skipped=skipped)


def expand_stateful(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``Stateful`` values replaced by their ``state_dict()``, as ``dcp.load`` does first (on every rank alike:
    a framework's ``state_dict()`` may run collectives)."""
    from torch.distributed.checkpoint.stateful import Stateful

    return {key: value.state_dict() if isinstance(value, Stateful) else value for key, value in state_dict.items()}


def planned_reads(state_dict: dict[str, Any], metadata) -> dict[str, set[tuple[int, int]]]:
    """The stored items (file -> (offset, length)) this rank's load of ``state_dict`` (expanded:
    :func:`expand_stateful`) will read: DCP's default load planner, which :class:`~.planners.AtomicLoadPlanner`
    (the manager's) adds only checks to, on the step's ``.metadata``.  Keys the checkpoint lacks are left out
    here; the load itself then refuses them with its own error."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    with gc_paused():
        planner = DefaultLoadPlanner(allow_partial_load=True)
        planner.set_up_planner(state_dict, metadata, is_coordinator=False)
        plan = planner.create_local_plan()
    storage = metadata.storage_data or {}
    reads: dict[str, set[tuple[int, int]]] = {}
    for item in plan.items:
        info = storage[item.storage_index]
        reads.setdefault(info.relative_path, set()).add((int(info.offset), int(info.length)))
    return reads


def plan_fetches(topology: Topology, choice: Choice, needs: list[dict[str, list[tuple[int, int]] | None]],
                 ) -> list[Fetch]:
    """Who receives what from whom (the same on every rank): per root, each file its ranks read that it does not
    hold intact, received once, by the reading rank with the fewest bytes to receive so far, from the source
    rank (any rank of a holding root) with the fewest bytes to send; biggest files first."""
    world = len(topology.domains)
    wanted: dict[tuple[int, str], dict[str, Any]] = {}  # (leader, file) -> the readers and what they read
    for rank, need in enumerate(needs):
        leader = topology.leader(rank)
        for name, extents in need.items():
            if name not in choice.holders or leader in choice.holders[name]:
                continue  # an unknown name is the load's to refuse; a held one needs nothing
            want = wanted.setdefault((leader, name), {"ranks": [], "whole": False, "extents": set(), "owners": set()})
            want["ranks"].append(rank)
            if extents is None:
                want["whole"] = True
                want["owners"].add(rank)
            else:
                want["extents"].update(map(tuple, extents))
    sent, received = [0] * world, [0] * world
    shard_held = {(leader, rank) for leader, ranks in choice.shards.items() for rank in ranks}
    fetches = []
    for (leader, name), want in sorted(wanted.items(), key=lambda kv: (-choice.sizes.get(kv[0][1], 0), kv[0])):
        if not want["whole"] and want["extents"] <= set(map(tuple, choice.partial.get(leader, {}).get(name, ()))):
            continue  # the items read there are in the root's partial copy already
        size, extents = choice.sizes[name], tuple(sorted(want["extents"]))
        part = sum(length for _, length in extents)
        if want["whole"] or part * 2 > size or part > PARTIAL_LIMIT:
            extents, part = None, size
        target = min(want["ranks"], key=lambda r: (r not in want["owners"], received[r], r))  # its own first
        source = min((r for r in range(world) if topology.leader(r) in choice.holders[name]),
                     key=lambda r: (sent[r], r))
        received[target] += part
        sent[source] += part
        writer = choice.writers[name]
        fetches.append(Fetch(name, writer, source, target, extents, shard=(leader, writer) not in shard_held))
        shard_held.add((leader, writer))
    for leader in topology.leaders:
        for writer in sorted(set(choice.writers.values())):
            if (leader, writer) not in shard_held:
                source = min((r for r in range(world) if writer in choice.shards.get(topology.leader(r), ())),
                             key=lambda r: (sent[r], r))
                fetches.append(Fetch(None, writer, source, leader, (), shard=True))
    return fetches


def assemble_step(topology: Topology, layout: RunLayout, choice: Choice, group,
                  state_dict: dict[str, Any] | None, *, timeout: float) -> tuple[int, int]:
    """Step 3 on every rank; returns how many ranks' files (whole or in part) this rank received, and the stored
    bytes it received (control files included).  Raises the same typed error on every rank on failure; a peer
    lost while files move raises :class:`.transport.PeerLost` (naming it, within ``timeout``) on the ranks that
    exchanged with it, at once, without another collective on the broken group."""
    rank, here = topology.rank, topology.describe(topology.rank)
    where = f"restoring local step {choice.step} (save {choice.save_id})"
    moving = _Moving(where, timeout, f"restore/{choice.save_id}")
    then = ("Nothing was loaded; restart to retry (a copy found damaged is then passed over), or load from the durable "
            "tier.")

    control_bytes = 0
    with agreed_phase(group, where, f"{here} could not copy the step's control files", then=then, step=choice.step):
        control_bytes = _share_control(topology, layout, choice, group, moving)

    manifest: Manifest | None = None
    need: Any = None
    expanded, unplanned = None, None
    try:
        expanded = expand_stateful(state_dict) if state_dict is not None else None
    except Exception as e:  # the load itself raises this with its own error
        unplanned = e
    try:
        manifest, metadata = _open_step(layout, choice)
        # Its own primary files, whole (the drain and the next replicas read them): at the world size that wrote
        # them; a resized job's next save writes files of its own, so it receives only what its load reads.
        need = {f.name: None for f in manifest.files if f.rank == rank and manifest.world_size == len(topology.domains)}
        try:
            reads = planned_reads(expanded, metadata) if expanded is not None else None
        except Exception as e:  # the load itself raises this with its own error; fetch everything meanwhile
            unplanned, reads = e, None
        if unplanned is not None:
            log.warning("%s: rank %d could not plan its load (%s); it receives every file its root lacks", where,
                        rank, unplanned)
        if reads is None:
            need.update({f.name: None for f in manifest.files})
        else:
            for name, extents in reads.items():
                need.setdefault(name, sorted(extents))
    except (OSError, CheckpointError) as e:
        need = f"{here} could not open the step in its own root: {e}"
    needs = gather(group, need, where)
    if any(isinstance(n, str) for n in needs):
        with agreed_phase(group, where, here, then=then, step=choice.step) as failures:
            if isinstance(need, str):
                failures.append(need)

    fetches = plan_fetches(topology, choice, needs)
    received: dict[int, dict[str, Received]] = {}
    got_bytes = 0
    sending = [f for f in fetches if f.source == rank]
    with agreed_phase(group, where, f"{here} could not receive the files it reads", then=then,
                      step=choice.step) as failures:
        try:
            outgoing = _outgoing(layout, manifest, sending)
        except (OSError, CheckpointError) as e:  # the stream must still run: its targets wait for an index
            failures.append(f"{here} could not read what it was to send: {e}")
            outgoing = {f.target: [] for f in sending}  # an empty index: the target reports what is missing
        try:
            mine = [f for f in fetches if f.target == rank]
            received = moving.transfer(outgoing, {s: topology.describe(s) for s in sorted({f.source for f in mine})},
                                       group, spool_dir(layout))
            got_bytes = sum(len(p) if isinstance(p, bytes) else p.size for parts in received.values()
                            for p in parts.values())
            _keep(topology, layout, manifest, mine, received)
        finally:
            discard(received)

    with agreed_phase(group, where, f"{here} could not record the step's marker", then=then, step=choice.step):
        if rank in choice.unmarked:  # last: the marker says the root holds the step (file by file, as scanned)
            record_local_marker(layout, _marker_bytes(layout, choice), manifest, _evidence(topology, choice),
                                f"restore of local step {choice.step} on {here}", rank)
    return len({f.rank for f in fetches if f.target == rank and f.name is not None}), got_bytes + control_bytes


def _evidence(topology: Topology, choice: Choice) -> Evidence:
    """What the scan verified across the tier: each data file and manifest shard, and the roots holding it intact."""
    verified = {name: "intact on " + ", ".join(topology.describe(l) for l in leaders)
                for name, leaders in choice.holders.items() if leaders}
    verified.update((shard_name(r), f"intact on {topology.describe(leader)}")
                    for leader, ranks in choice.shards.items() for r in ranks)
    return Evidence.on_roots(verified, [topology.describe(leader) for leader in topology.leaders])


@dataclass(frozen=True)
class _Moving:
    """What a restore's transfers tell the transport: its name, timeout and blame keys (one per transfer)."""

    where: str
    timeout: float
    exchange_id: str

    def transfer(self, outgoing: dict[int, list[Part]], incoming: dict[int, str], group, spool: str):
        return transfer(outgoing, incoming, group, spool, what=self.where, timeout=self.timeout,
                        exchange_id=self.exchange_id,
                        consequence="nothing was loaded and no root got a marker of this step. Restart the job: "
                                    "the restore is retried, or the step is loaded from the durable tier.")


def _share_control(topology: Topology, layout: RunLayout, choice: Choice, group, moving: _Moving) -> int:
    """The marker, manifest, ``.metadata`` and ``ranks.json`` from one holding root's leader to each leader that
    lacks them, checked against the chosen marker's manifest digest; returns the bytes this rank received."""
    rank = topology.rank
    outgoing: dict[int, list[Part]] = {}
    unread: BaseException | None = None
    if rank == choice.control_from and choice.lacking:
        attempt = layout.attempt_dir(choice.step, choice.save_id)
        try:
            marker = layout.storage.read_file(layout.marker(choice.step))
            manifest = layout.storage.read_file(layout.storage.join(attempt, MANIFEST))
            control = Manifest.from_json(manifest, where=attempt).control_files()
            parts = [Part.inline(MARKER, marker), Part.inline(MANIFEST, manifest)] + [
                Part.inline(name, layout.storage.read_file(layout.storage.join(attempt, name)))
                for name, _, _ in control]
        except (OSError, CheckpointError) as e:  # the targets still get an (empty) index, then the error
            unread, parts = e, []
        outgoing = {target: parts for target in choice.lacking}
    incoming = {choice.control_from: topology.describe(choice.control_from)} if rank in choice.lacking else {}
    received = moving.transfer(outgoing, incoming, group, spool_dir(layout))
    if unread is not None:
        raise unread
    if not incoming:
        return 0
    parts = received[choice.control_from]
    sender = topology.describe(choice.control_from)
    data = parts.get(MANIFEST, b"")
    if sha256_hex(data) != choice.manifest_sha256:
        raise CorruptCheckpointError(f"the manifest from {sender} does not match the chosen marker of step "
                                     f"{choice.step}", sender=sender)
    marker = Marker.from_json(parts.get(MARKER, b""), where=f"the marker from {sender}")
    if (marker.save_id, marker.manifest_sha256) != (choice.save_id, choice.manifest_sha256):
        raise CorruptCheckpointError(f"{sender} sent the marker of another save ({marker.save_id})", sender=sender)
    write_control(layout, Manifest.from_json(data, where=f"the manifest from {sender}"), parts, sender)
    if rank in choice.unmarked:  # kept for the end, in the spool: the marker goes in once every file is there
        layout.storage.publish(_marker_spool(layout, choice), parts[MARKER])
    return sum(len(p) for p in parts.values())


def _marker_spool(layout: RunLayout, choice: Choice) -> str:
    return layout.storage.join(spool_dir(layout), f"marker-{choice.step}-{choice.save_id}")


def _marker_bytes(layout: RunLayout, choice: Choice) -> bytes:
    path = _marker_spool(layout, choice)
    data = layout.storage.read_file(path)
    layout.storage.remove(path)
    return data


def _open_step(layout: RunLayout, choice: Choice) -> tuple[Manifest, Any]:
    """The chosen step's manifest and DCP ``.metadata`` from this rank's own root, each against its digest."""
    from ..format.safe_pickle import load_dcp_metadata

    attempt = layout.attempt_dir(choice.step, choice.save_id)
    path = layout.storage.join(attempt, MANIFEST)
    data = layout.storage.read_file(path)
    if sha256_hex(data) != choice.manifest_sha256:
        raise CorruptCheckpointError(f"{path}: does not match the chosen marker", path=path)
    manifest = Manifest.from_json(data, where=path)
    path = layout.storage.join(attempt, DCP_METADATA)
    data = layout.storage.read_file(path)
    if len(data) != manifest.dcp_metadata["size"] or sha256_hex(data) != manifest.dcp_metadata["sha256"]:
        raise CorruptCheckpointError(f"{path}: does not match the manifest", path=path)
    return manifest, load_dcp_metadata(data, where=path, written_by=manifest.versions.get("torch"))


def _outgoing(layout: RunLayout, manifest: Manifest | None, fetches: list[Fetch]) -> dict[int, list[Part]]:
    """What this rank sends, per target: each writer's shard once, then whole files (streamed from this root,
    not verified here: the receiver checks every block) or the items of a partial copy."""
    outgoing: dict[int, list[Part]] = {}
    if not fetches:
        return outgoing
    shards: dict[int, bytes] = {}
    for f in fetches:
        parts = outgoing.setdefault(f.target, [])
        if not any(p.name == shard_name(f.rank) for p in parts):
            if f.rank not in shards:
                shards[f.rank] = layout.storage.read_file(
                    layout.attempt_file(manifest.step, manifest.save_id, shard_name(f.rank)))
            parts.append(Part.inline(shard_name(f.rank), shards[f.rank]))
        if f.name is None:
            continue
        path = layout.data_file(manifest.step, manifest.save_id, f.name, manifest.data_prefixes)
        if f.extents is None:
            parts.append(Part(f.name, manifest_size(manifest, f.name), path=path))
            continue
        with open(path, "rb", buffering=0) as source:
            for offset, length in f.extents:
                parts.append(Part.inline(f"{f.name}@{offset}", os.pread(source.fileno(), length, offset)))
    return outgoing


def manifest_size(manifest: Manifest, name: str) -> int:
    return next(f.size for f in manifest.files if f.name == name)


def _keep(topology: Topology, layout: RunLayout, manifest: Manifest, fetches: list[Fetch],
          received: dict[int, dict[str, Received]]) -> None:
    """Verify what arrived against the manifest's shards and block digests, then keep it: data first, the shards
    this rank writes last."""
    storage, step, save_id = layout.storage, manifest.step, manifest.save_id
    shards: dict[tuple[int, int], tuple[bytes, ManifestShard]] = {}
    for f in fetches:
        parts, sender = received[f.source], topology.describe(f.source)
        where = f"rank {f.rank}'s {f.name} from {sender}"
        if (f.source, f.rank) not in shards:
            data = parts.get(shard_name(f.rank), b"")
            shards[f.source, f.rank] = (data, check_shard(manifest, f.rank, data if isinstance(data, bytes) else b"",
                                                          f"rank {f.rank}'s shard from {sender}"))
        if f.name is None:
            continue
        entry = next(e for e in shards[f.source, f.rank][1].files if e.name == f.name)
        target = layout.data_file(step, save_id, f.name, manifest.data_prefixes)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if f.extents is None:
            part = parts.get(f.name)
            if part is None:
                raise CorruptCheckpointError(f"{where}: missing from the transfer", rank=f.rank)
            check_received(entry, part, where)
            keep(part, storage, target)
            storage.remove(partial_note(layout, manifest, f.name))  # a whole copy replaced a partial one
            continue
        items = {(item.pos, item.length): item for item in entry.items}
        pieces = {}
        for offset, length in f.extents:
            item = items.get((offset, length))
            data = parts.get(f"{f.name}@{offset}")
            if item is None or not isinstance(data, bytes):
                raise CorruptCheckpointError(f"{where}: no item at offset {offset} ({length} bytes) in the shard, "
                                             "or it did not arrive; the step's .metadata and shards disagree",
                                             rank=f.rank, path=target)
            verify_item(item, data, f"{where} item {item.key!r}", path=target)
            pieces[offset] = data
        keep_extents(layout, manifest, entry, pieces)
    for f in fetches:
        if f.shard:
            storage.publish(layout.attempt_file(step, save_id, shard_name(f.rank)), shards[f.source, f.rank][0])


def restore_not_found(run_id: str, choice: Choice, where: str) -> CheckpointNotFoundError:
    detail = (" Local steps that could not be assembled: " + "; ".join(choice.skipped[:4]) + ".") if choice.skipped else ""
    return CheckpointNotFoundError(
        f"no step of run {run_id!r} can be restored: nothing complete on the local tier and no durable commit under "
        f"{where}.{detail} Restore the named files or start training from scratch.",
        run_id=run_id, skipped=choice.skipped)
