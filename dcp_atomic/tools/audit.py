"""Re-read a committed checkpoint end to end and check every recorded digest.

Used by ``dcp-atomic verify``: an operator's answer to "is this checkpoint
still good?" after a disk incident or before promoting it.  Every data file is
read once, block by block, in parallel; each problem names the file.
"""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from ..format.codec import Decoder
from ..protocol.commit import Committed, read_committed, scan_markers
from ..errors import CheckpointError
from ..format.blocks import check_block
from ..format.layout import DCP_METADATA, PARTIAL_SUFFIX, RunLayout
from ..format.manifest import FileEntry, ItemExtent
from ..dcp.read_checks import (check_stored_items, decode_chunk, item_id, payload_proven, read_by_a_load,
                                read_dcp_metadata)
from .._base.retry import Deadline
from ..format.safe_pickle import safe_byte_item
from ..stores.storage import Storage

READ_CHUNK_BLOCKS = 16  # read up to 16 frames (64 MiB with 4 MiB blocks) per request


@dataclass
class AuditReport:
    step: int
    save_id: str | None
    files: int
    bytes: int
    problems: list[str]
    notes: list[str] = field(default_factory=list)  # not damage: e.g. a partial copy a tier restore kept
    warnings: list[str] = field(default_factory=list)  # damage no load reads (ranks.json): the step still loads

    @property
    def ok(self) -> bool:
        return not self.problems


def audit_step(layout: RunLayout, step: int, *, threads: int = 4, timeout: float = 10.0,
               progress: Callable[[int], None] | None = None, local: bool = False) -> AuditReport:
    """Check every byte of ``step`` a load reads, as the load does and through the same checks
    (:mod:`..dcp.read_checks`): ``.metadata`` (size, digest, allow-list), every item's record against it, digests,
    frames, and the P11 decoders, so ``verify`` passes exactly the steps a load takes.  What no load reads
    (``ranks.json``, the records of chunks without elements) cannot fail the step; damage to ``ranks.json`` is a
    warning.  ``local``: the root is a node's local root, where a tier restore may have kept a partial copy of a data
    file (:func:`partial_claims`); anywhere else a partial note is itself a problem."""
    try:
        committed = read_committed(layout, step, Deadline(timeout))
        committed.load_items(layout, None, Deadline(timeout))  # every rank's shard, each against its digest
    except CheckpointError as e:
        return AuditReport(step, None, 0, 0, [str(e)])
    manifest = committed.manifest
    problems: list[str] = []
    warnings = _unread_damage(layout, committed, timeout)
    meta_path = layout.attempt_file(step, committed.save_id, DCP_METADATA)
    chunks: dict = {}  # (key, chunk offset) -> the stored chunk, once .metadata and the manifest agree
    read: set | None = None  # (key, chunk offset) of every item a load reads; None: .metadata cannot say
    try:
        metadata = read_dcp_metadata(layout.storage, meta_path, manifest)  # the load's own check, size included
        infos = read_by_a_load(metadata)
        _, chunks = check_stored_items(metadata, manifest, {i.relative_path for i in infos.values()}, infos,
                                       meta_path)
        read = {item_id(index) for index in infos}
    except CheckpointError as e:  # the allow-list refuses it, or this torch cannot read it: a load would fail
        problems.append(f"{type(e).__name__}: {e.message}")
    except (AttributeError, TypeError) as e:  # storage entries of the wrong shape: a load refuses them too
        problems.append(f"{meta_path}: malformed DCP metadata ({type(e).__name__}: {e})")

    def check(entry: FileEntry) -> list[str]:
        path = layout.data_file(step, committed.save_id, entry.name, manifest.data_prefixes)
        try:
            actual = layout.storage.size(path)
        except FileNotFoundError:
            return [f"{path}: missing"]
        found = [f"{path}: size {actual}, manifest says {entry.size}"] if actual != entry.size else []
        decoder = Decoder()
        items = [item for item in entry.items if read is None or item.ident in read]
        checked = [(item, _check_item(layout.storage, path, item, decoder, progress)) for item in items]
        checked = [(item, problem or _decodable(layout.storage, path, item, chunks)) for item, problem in checked]
        note = layout.attempt_file(step, committed.save_id, entry.name + PARTIAL_SUFFIX)
        claims = partial_claims(layout.storage, note)
        if claims is not None and not local:
            return found + [f"{note}: a partial-copy note in a root that is not a node's local root (a restore "
                            "writes them only there): a load reads this file whole here"] + [
                problem for _, problem in checked if problem]
        if claims is not None and claims != "stray":
            unknown = sorted(claims - {(item.pos, item.length) for item in entry.items})
            damaged = [problem for item, problem in checked if problem and (item.pos, item.length) in claims]
            if unknown or damaged:
                return found + damaged + [f"{note}: claims {length} bytes at offset {offset}, which are no item of "
                                          f"{entry.name}" for offset, length in unknown[:5]]
            notes.append(f"{path}: a partial copy a tier restore kept for this node's ranks ({len(claims)} of "
                         f"{len(entry.items)} items here, each verified); the whole file is on another node's "
                         "local root or in the durable root")
            return found
        stray = [f"{note}: a partial-copy note no tier restore wrote (it names no items as a restore does); the file "
                 "is checked whole"]
        return found + (stray if claims == "stray" else []) + [problem for _, problem in checked if problem]

    notes: list[str] = []
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for entry, found in zip(manifest.files, pool.map(check, manifest.files)):
            problems.extend(found)
            if found:
                problems.extend(_shared_damage(layout, step, entry.name,
                                               layout.data_file(step, committed.save_id, entry.name,
                                                                manifest.data_prefixes), timeout))
    return AuditReport(step, committed.save_id, len(manifest.files), manifest.total_bytes, problems, sorted(notes),
                       warnings)


def _unread_damage(layout: RunLayout, committed: Committed, timeout: float) -> list[str]:
    """Damage to ``ranks.json``, which no load reads (it holds who saved and how fast: ``show``'s records), so it
    warns and does not fail the step: ``verify`` passes exactly the steps a load takes, and refusing a load
    over these records instead would cost a user an intact state for nothing.  A copy of the step between tiers
    (drain, restore) does check it, so the warning says so."""
    try:
        committed.load_rank_records(layout, Deadline(timeout))
    except CheckpointError as e:
        return [f"{e.message} (no load reads this file: the step loads; `show` cannot print its rank records, and "
                "a drain or tier restore that copies the step refuses it: restore the file from another copy of the "
                "step)"]
    return []


def _shared_damage(layout: RunLayout, step: int, name: str, path: str, timeout: float) -> list[str]:
    """The other committed steps that hold this very file and whose own records find it damaged too: reuse (P15)
    hard-links a base file into the next steps (a stable file under its name, a plain one under a stable name), one
    inode for all, so damaged bytes here are damaged there wherever a step references them.  A file that fails only
    this step's records (its manifest or ``.metadata`` altered, not its bytes), or whose damage lies in bytes another
    step does not reference, is named in no other step."""
    storage = layout.storage
    if not storage.hard_links:
        return []
    try:
        mine = storage.file_version(path)
    except OSError:
        return []
    sharing = []
    for marker in scan_markers(layout):
        if marker.step == step:
            continue
        try:
            committed = read_committed(layout, marker.step, Deadline(timeout))
            prefixes = committed.manifest.data_prefixes
            names = {f.name for f in committed.manifest.files
                     if _version(storage, layout.data_file(marker.step, marker.save_id, f.name, prefixes)) == mine}
            if not names:
                continue
            committed.load_items(layout, names, Deadline(timeout))
        except (OSError, CheckpointError):
            continue
        if any(_bytes_damaged(storage, layout.data_file(marker.step, marker.save_id, f.name, prefixes), f)
               for f in committed.manifest.files if f.name in names):
            sharing.append(marker.step)
    if not sharing:
        return []
    return [f"{path}: the same file (hard-linked by reuse) is in step(s) {', '.join(map(str, sharing))}, which hold "
            "the same damaged bytes; an earlier step or another tier that holds its own copy may still serve"]


def _version(storage: Storage, path: str) -> tuple | None:
    try:
        return storage.file_version(path)
    except OSError:
        return None


def _bytes_damaged(storage: Storage, path: str, entry: FileEntry) -> bool:
    """Whether the data file at ``path`` fails ``entry``'s records of it: its size, every item's frame digests."""
    try:
        if storage.size(path) != entry.size:
            return True
    except FileNotFoundError:
        return True
    decoder = Decoder()
    return any(_check_item(storage, path, item, decoder, None) for item in entry.items)


def partial_claims(storage: Storage, note: str) -> set[tuple[int, int]] | str | None:
    """What a partial-copy note beside a data file claims: the (offset, length) of each item a tier restore kept
    (:func:`~.local_tier.keep_extents` writes ``{"items": [[offset, length], ...]}``), ``"stray"`` for a note
    that is not such a list naming at least one extent, None without a note."""
    try:
        data = storage.read_file(note)
    except FileNotFoundError:
        return None
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, nested too deep, a number too long
        return "stray"
    claimed = raw.get("items") if isinstance(raw, dict) and set(raw) == {"items"} else None
    if not isinstance(claimed, list) or not claimed or not all(
            isinstance(c, list) and len(c) == 2 and all(type(v) is int and v >= 0 for v in c) for c in claimed):
        return "stray"
    return {(offset, length) for offset, length in claimed}


def _decodable(storage: Storage, path: str, item: ItemExtent, chunks: dict) -> str | None:
    """A non-tensor item through the same allow-list a load uses (P11), a ``torch.save`` tensor item through the
    same decoder and dtype/shape check (:func:`~.read_checks.decode_chunk`): refused here means refused there."""
    chunk = chunks.get(item.ident)
    if item.codec != "none" or (item.kind == "tensor" and (item.format != "torch_save" or chunk is None)):
        return None
    try:
        if item.kind == "bytes":
            safe_byte_item(storage.read_range(path, item.pos, item.length), key=item.key, where=path)
        elif not _payload_proven(storage, path, item, chunk):  # the load decodes it whole, so does this
            decode_chunk(storage.read_range(path, item.pos, item.length), chunk, f"{path} item {item.key!r}",
                         item.key)
    except CheckpointError as e:
        return f"{type(e).__name__}: {e.message}"
    return None


def _payload_proven(storage: Storage, path: str, item: ItemExtent, chunk) -> bool:
    """Whether a load reads this ``torch.save`` item's payload in place (the reader's fast path, which decodes
    nothing): a recorded payload offset the container's own zip records prove.  Reads its header and trailer."""
    if item.payload is None:
        return False
    tail_start = item.payload + math.prod(chunk.sizes) * chunk.dtype.itemsize
    if tail_start > item.length:
        return False
    head = storage.read_range(path, item.pos, item.payload)
    tail = storage.read_range(path, item.pos + tail_start, item.length - tail_start)
    return payload_proven(head, tail, item.payload, tail_start - item.payload)


def _check_item(storage: Storage, path: str, item: ItemExtent, decoder: Decoder,
                progress: Callable[[int], None] | None) -> str | None:
    """Walk the item's frames as the reader does: each frame's digest, then its decoded length.

    Blocks are located and checked by :mod:`~dcp_atomic.format.blocks`, as every reader
    does, and compressed frames are decoded, so ``verify`` cannot pass an
    item the reader would refuse (or refuse one it reads).
    """
    what = f"{path} item {item.key!r}"
    try:
        blocks = item.blocks()
    except CheckpointError as e:
        return f"{path} {e.message}"
    scratch = memoryview(bytearray(item.block_size if item.codec != "none" else 0))
    for first in range(0, len(blocks), READ_CHUNK_BLOCKS):
        last = min(first + READ_CHUNK_BLOCKS, len(blocks))
        start, end = blocks[first][0], blocks[last - 1][1]
        data = storage.read_range(path, item.pos + start, end - start)
        if len(data) != end - start:
            return f"{what}: truncated at byte {item.pos + start + len(data)}"
        view = memoryview(data)
        for i in range(first, last):
            frame = view[blocks[i][0] - start : blocks[i][1] - start]
            try:
                check_block(item, i, frame, what, path=path)
            except CheckpointError as e:
                return e.message
            if item.codec != "none":
                logical = min(item.block_size, item.logical - i * item.block_size)
                try:
                    decoder.decode_into(frame, item.planes, scratch[:logical])
                except ValueError as e:
                    return f"{what}: frame {i} cannot be decoded to its {logical} logical bytes ({e})"
        if progress:
            progress(len(data))
    return None
