"""A memory snapshot restored by a job of another world size (P16: a resized job reshards from the memory tier's
complete copy instead of rolling back to the newest durable step).

Every tensor item of a slot records where its bytes lie in the global tensor (:attr:`~.slots.SlotItem.place`: a
DTensor's local shard at the chunk offset DCP records, a plain tensor as all of it).  A rank of the resized job
plans its own state dict against the records of every old share (:func:`plan`):

- a tensor (the local shard of a DTensor, or a whole plain tensor) is filled from the stored regions that overlap
  its region of the global tensor, one copy of each region; the pieces must cover it exactly;
- a region stored by several old ranks (a ``Replicate`` mesh dim, a plain tensor every rank kept) and an object
  must hold the same digests on every rank that stored it: a per-rank value has no place in another world size, so
  its key is refused by name (DESIGN "Reshard policy"), never one rank's copy taken silently;
- a key the snapshot lacks, or whose global shape or dtype changed, is refused by name; all of them at once.

The layout policy is the one of every load (:func:`~dcp_atomic.dcp.reshard.check_layout`: a data-parallel change is
logged, a tensor/pipeline/expert-parallel one needs ``allow_reshard=True``).  The bytes a rank reads are verified
against the old share's record as they are read (:func:`fill`), wherever the share came from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..errors import ReshardError
from ..format.blocks import verify_item
from ..format.safe_pickle import decode_item
from .items import Leaf, global_place, put_object, tensor_over
from ..format.slot_record import SlotItem, SlotRecord


@dataclass(frozen=True)
class Piece:
    """Part of stored item ``item`` of old rank ``share``'s slot going into part of a target tensor."""

    share: int
    item: SlotItem
    source: tuple[slice, ...]  # within the stored tensor (its own shape)
    target: tuple[slice, ...]  # within the target's local tensor


@dataclass
class Plan:
    """What one rank reads: per leaf index, the pieces of its tensor or the (share, item) of its object."""

    pieces: dict[int, list[Piece]] = field(default_factory=dict)
    objects: dict[int, tuple[int, SlotItem]] = field(default_factory=dict)

    @property
    def shares(self) -> set[int]:
        """The old ranks whose slots this rank reads."""
        return ({p.share for pieces in self.pieces.values() for p in pieces}
                | {share for share, _ in self.objects.values()})


def reshardable(records: dict[int, SlotRecord]) -> bool:
    """Whether every tensor item of the snapshot says where it lies in its global tensor (records written before
    places were recorded do not: such a snapshot restores at its own world size only)."""
    return all(item.kind == "object" or item.place is not None for r in records.values() for item in r.items)


def plan(leaves: list[Leaf], records: dict[int, SlotRecord], near: set[int], where: str) -> Plan:
    """This rank's reads of the old shares ``records`` (old rank -> its record) for ``leaves`` (its expanded state
    dict's); among identical copies, a share in ``near`` (on this node) first, then the lowest rank.  Raises one
    :class:`ReshardError` naming every key that cannot be filled soundly."""
    stored: dict[str, list[tuple[int, SlotItem]]] = {}
    for share in sorted(records):
        for item in records[share].items:
            stored.setdefault(item.key, []).append((share, item))
    result, problems, missing = Plan(), {}, []
    for index, leaf in enumerate(leaves):
        copies = stored.get(leaf.key)
        if not copies:
            missing.append(leaf.key)
        elif any(item.kind == "object" for _, item in copies) or leaf.tensor is None:
            found = _object_source(leaf, copies, near)
            if isinstance(found, str):
                problems[leaf.key] = found
            else:
                result.objects[index] = found
        else:
            found = _tensor_pieces(leaf, copies, near)
            if isinstance(found, str):
                problems[leaf.key] = found
            else:
                result.pieces[index] = found
    if missing or problems:
        said = list(problems.values())
        raise ReshardError(
            f"{where} cannot fill this job's state dict: "
            + "; ".join([f"key(s) the snapshot lacks: {missing[:6]}"] * bool(missing) + said[:6])
            + (f" (and {len(said) - 6} more)" if len(said) > 6 else "") + ". Nothing was loaded from it.",
            keys=missing + list(problems))
    return result


def _prefer(candidates: list[tuple[int, SlotItem]], near: set[int]) -> tuple[int, SlotItem]:
    return min(candidates, key=lambda c: (c[0] not in near, c[0]))


def _per_rank(key: str, copies: list[tuple[int, SlotItem]], at: str = "") -> str | None:
    """Why copies of one value stored by several old ranks cannot be taken as one (None: the same bytes on each)."""
    first = copies[0][1].checksums, copies[0][1].nbytes
    odd = [share for share, item in copies if (item.checksums, item.nbytes) != first]
    if not odd:
        return None
    return (f"{key!r} was a per-rank value (ranks {odd} held other bytes{at} than rank {copies[0][0]}): it has no "
            "place in another world size")


def _object_source(leaf: Leaf, copies: list[tuple[int, SlotItem]], near: set[int]) -> tuple[int, SlotItem] | str:
    if leaf.tensor is not None or any(item.kind != "object" for _, item in copies):
        return f"{leaf.key!r} is {'a tensor' if leaf.tensor is not None else 'not a tensor'} here, not in the snapshot"
    return _per_rank(leaf.key, copies) or _prefer(copies, near)


def _tensor_pieces(leaf: Leaf, copies: list[tuple[int, SlotItem]], near: set[int]) -> list[Piece] | str:
    local = leaf.tensor
    dtype = str(local.dtype).removeprefix("torch.")
    place = global_place(leaf.value)
    shape, offset = tuple(place["global_shape"]), tuple(place["global_offset"])
    saved = copies[0][1]
    if saved.dtype != dtype or tuple(saved.place["global_shape"]) != shape:
        return (f"{leaf.key!r} is {dtype} {list(shape)} here, the snapshot holds {saved.dtype} "
                f"{saved.place['global_shape']}")
    regions: dict[tuple, list[tuple[int, SlotItem]]] = {}
    for share, item in copies:
        if item.dtype != saved.dtype or item.place["global_shape"] != saved.place["global_shape"]:
            return f"{leaf.key!r}: the old ranks' shards disagree on its dtype or global shape"
        regions.setdefault((tuple(item.place["global_offset"]), tuple(item.shape)), []).append((share, item))
    pieces, covered = [], 0
    for (start, extent), holders in sorted(regions.items()):
        why = _per_rank(leaf.key, holders, f" for its region at {list(start)}")
        if why:
            return why
        low = [max(a, b) for a, b in zip(start, offset)]
        high = [min(a + n, b + m) for a, n, b, m in zip(start, extent, offset, local.shape)]
        if any(h <= l for l, h in zip(low, high)):
            continue
        share, item = _prefer(holders, near)
        pieces.append(Piece(share, item, tuple(slice(l - a, h - a) for l, h, a in zip(low, high, start)),
                            tuple(slice(l - b, h - b) for l, h, b in zip(low, high, offset))))
        covered += math.prod(h - l for l, h in zip(low, high))
    if covered != local.numel():
        return (f"{leaf.key!r}: the snapshot's shards cover {covered} of the {local.numel()} elements this rank's "
                f"shard at {list(offset)} needs")
    return pieces


def fill(expanded: dict[str, Any], leaves: list[Leaf], chosen: Plan, data: dict[int, memoryview],
         where: dict[int, str]) -> None:
    """Copy ``chosen``'s pieces and objects from the old shares' bytes ``data`` (old rank -> its slot) into the
    leaves; each stored item verified against its record before a byte of it is used (once per item)."""
    checked: set[tuple[int, str]] = set()

    def stored(share: int, item: SlotItem) -> memoryview:
        view = data[share][item.offset:item.offset + item.nbytes]
        if (share, item.key) not in checked:
            verify_item(item.extent(), view, f"{where[share]} item {item.key!r}", path=where[share])
            checked.add((share, item.key))
        return view

    for index, (share, item) in chosen.objects.items():
        leaf = leaves[index]
        with stored(share, item) as view:
            put_object(expanded, leaf.path, decode_item(bytes(view), key=leaf.key, where=where[share]))
    with torch.no_grad():
        for index, pieces in chosen.pieces.items():
            local = leaves[index].tensor
            for piece in pieces:
                stored(piece.share, piece.item).release()
                source = tensor_over(piece.item, data[piece.share])
                local[piece.target].copy_(source[piece.source])


def layout_of(leaves: list[Leaf]) -> dict[str, Any]:
    """The DTensors among ``leaves`` by key: what :func:`~dcp_atomic.dcp.reshard.infer_parallelism` reads a job's
    layout from (their named meshes)."""
    return {leaf.key: leaf.value for leaf in leaves if isinstance(leaf.value, DTensor)}
