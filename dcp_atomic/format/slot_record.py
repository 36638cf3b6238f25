"""A memory slot's commit record (P16), as data: whose share of which step a slot holds, in which commit order, and
every item in it; sealed like the marker and the manifest, parsed by one strict parser.

The record is what makes a slot's bytes a checkpoint, and every judge of a slot reads it through
:meth:`SlotRecord.from_bytes`: a restore on every rank, a replica holder, ``dcp-atomic verify --memory``.  So a field
that does not fit every other (an item whose shape and dtype do not make its byte count, items that overlap or leave
a gap, a kind, dtype or key that is not one, a place outside its global tensor) is refused here, by name, as a
:class:`CorruptCheckpointError`: the restore serves around that copy (another holder's, or an older complete
snapshot) and ``verify`` calls it FAILED with the same reason, instead of both trusting it and a restore failing
untyped later.

Schema: ``schema_version`` 2 carries ``requires`` (the features a reader must know; none yet), as the manifest does
from its schema 5: a feature this dcp_atomic does not know is refused by name ("upgrade"), never misread.  Records
of schema 1 (before ``requires``) are read as they are.  No torch: the byte size of each dtype is a table.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ..errors import CorruptCheckpointError
from .integrity import BLOCK_SIZE
from .manifest import CONTROL_SCHEMA, ItemExtent, sealed_json, unseal

RECORD_KIND = "memory_slot"
SLOT_SCHEMA = 2  # with ``requires``; 1: written before it (read as is)
SLOT_FEATURES: tuple[str, ...] = ()  # what a record may require of its reader
ITEM_KINDS = ("tensor", "dtensor", "object")
# bytes per element of every dtype a slot can hold (torch's ``itemsize``; str(dtype) without "torch.")
DTYPE_BYTES = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "uint16": 2, "uint32": 4, "uint64": 8,
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "complex32": 4, "complex64": 8, "complex128": 16,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
    "float4_e2m1fn_x2": 1, "bits8": 1, "bits16": 2, "bits1x8": 1, "bits2x4": 1, "bits4x2": 1,
    "qint8": 1, "quint8": 1, "qint32": 4, "quint4x2": 1, "quint2x4": 1,
}


@dataclasses.dataclass(frozen=True)
class SlotItem:
    """One item of a rank's share: where its bytes lie in the slot, and what they must be."""

    key: str
    kind: str  # "tensor" | "dtensor" | "object" (a non-tensor value, torch.save-encoded, decoded by the allow-list)
    offset: int
    nbytes: int
    checksums: tuple[str, ...]
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    dtensor: dict | None = None  # {"placements": [...], "mesh_shape": [...]}: the local shard's place
    # Where the stored bytes lie in the global tensor, {"global_shape": [...], "global_offset": [...]} (a plain tensor
    # is all of it): what a restore at another world size reshards by (memory.reshard); None for an object, and in
    # records written before it existed (those snapshots restore at their own world size only).
    place: dict | None = None

    def extent(self) -> ItemExtent:
        """The item as the one block check knows items (:func:`~dcp_atomic.format.blocks.verify_item`)."""
        return ItemExtent(key=self.key, chunk_offset=None, kind="bytes" if self.kind == "object" else "tensor",
                          format="raw", pos=self.offset, length=self.nbytes, checksums=list(self.checksums),
                          block_size=BLOCK_SIZE)

    def to_json(self) -> dict:
        return {"key": self.key, "kind": self.kind, "offset": self.offset, "nbytes": self.nbytes,
                "checksums": list(self.checksums), "dtype": self.dtype,
                "shape": None if self.shape is None else list(self.shape), "dtensor": self.dtensor,
                "place": self.place}

    @classmethod
    def from_json(cls, raw: Any, offset: int) -> "SlotItem":
        """The item at ``offset`` (where the previous items end), every field checked against the others
        (``ValueError`` naming the first that does not fit)."""
        if not isinstance(raw, dict):
            raise ValueError(f"an item is {type(raw).__name__}, not an object")
        key = raw.get("key")
        if not isinstance(key, str) or not key:
            raise ValueError(f"item key {key!r} is not a non-empty string")
        kind, nbytes, dtype, shape = raw.get("kind"), _count(raw.get("nbytes"), key, "nbytes"), raw.get("dtype"), \
            raw.get("shape")
        if kind not in ITEM_KINDS:
            raise ValueError(f"item {key!r}: kind {kind!r} is not one of {', '.join(ITEM_KINDS)}")
        if _count(raw.get("offset"), key, "offset") != offset:
            raise ValueError(f"item {key!r}: offset {raw.get('offset')} is not {offset}, where the items before it end")
        checksums = raw.get("checksums")
        blocks = max(1, math.ceil(nbytes / BLOCK_SIZE))
        if not (isinstance(checksums, list) and len(checksums) == blocks
                and all(isinstance(c, str) and c for c in checksums)):
            raise ValueError(f"item {key!r}: {nbytes} bytes need {blocks} block digest(s), the record has "
                             f"{checksums!r:.80}")
        if kind == "object":
            if any(raw.get(field) is not None for field in ("dtype", "shape", "dtensor", "place")):
                raise ValueError(f"item {key!r}: an object with a dtype, shape, placement or place")
            return cls(key=key, kind=kind, offset=offset, nbytes=nbytes, checksums=tuple(checksums))
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"item {key!r}: dtype {dtype!r} is not a dtype this dcp_atomic knows")
        if not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)):
            raise ValueError(f"item {key!r}: shape {shape!r} is not a list of sizes >= 0")
        if math.prod(shape) * DTYPE_BYTES[dtype] != nbytes:
            raise ValueError(f"item {key!r}: {dtype} {shape} is {math.prod(shape) * DTYPE_BYTES[dtype]} bytes, the "
                             f"record says {nbytes}")
        dtensor = raw.get("dtensor")
        if (kind == "dtensor") != (dtensor is not None) or dtensor is not None and not (
                isinstance(dtensor, dict) and isinstance(dtensor.get("placements"), list)
                and isinstance(dtensor.get("mesh_shape"), list)):
            raise ValueError(f"item {key!r}: a {kind} with placement {dtensor!r:.80}")
        place = raw.get("place")
        if place is not None:
            _check_place(place, shape, key)
        return cls(key=key, kind=kind, offset=offset, nbytes=nbytes, checksums=tuple(checksums), dtype=dtype,
                   shape=tuple(shape), dtensor=dtensor, place=place)


@dataclasses.dataclass(frozen=True)
class SlotRecord:
    """A slot's commit record: whose share of which step it holds, in which commit order."""

    run_id: str
    lineage: str
    rank: int  # the rank whose share this is (a replica holder keeps the owner's number)
    world_size: int
    step: int
    sequence: int
    slot: int
    length: int
    items: tuple[SlotItem, ...]
    holder: int | None = None  # the rank keeping this copy for its owner on another failure domain; None: the owner's
    layout: dict | None = None  # the job's Parallelism (declared, else inferred from its meshes): a resized restore's check

    def to_bytes(self) -> bytes:
        return sealed_json({"kind": RECORD_KIND, "schema_version": SLOT_SCHEMA, "requires": [],
                            "run_id": self.run_id, "lineage": self.lineage, "rank": self.rank,
                            "world_size": self.world_size, "step": self.step, "sequence": self.sequence,
                            "slot": self.slot, "length": self.length, "items": [item.to_json() for item in self.items],
                            "holder": self.holder, "layout": self.layout})

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> "SlotRecord":
        """The record, once its seal holds and every field fits every other; else a
        :class:`CorruptCheckpointError` naming ``where`` and the first field that does not."""
        raw = unseal(data, where, RECORD_KIND, schemas=(CONTROL_SCHEMA, SLOT_SCHEMA))
        try:
            if raw["schema_version"] >= SLOT_SCHEMA:
                _check_requires(raw.get("requires"))
            world_size = _count(raw.get("world_size"), "record", "world_size", minimum=1)
            rank = _count(raw.get("rank"), "record", "rank")
            if rank >= world_size:
                raise ValueError(f"rank {rank} of a world of {world_size}")
            holder = raw.get("holder")
            if holder is not None and (_count(holder, "record", "holder") == rank):
                raise ValueError(f"holder {holder} is the owner itself (a replica is held by another rank)")
            for field in ("run_id", "lineage"):
                if not isinstance(raw.get(field), str) or not raw[field]:
                    raise ValueError(f"{field} {raw.get(field)!r} is not a non-empty string")
            layout = raw.get("layout")
            if layout is not None and not isinstance(layout, dict):
                raise ValueError(f"layout {layout!r:.80} is not an object")
            listed = raw.get("items")
            if not isinstance(listed, list):
                raise ValueError(f"items {listed!r:.80} is not a list")
            items, offset = [], 0
            for entry in listed:
                item = SlotItem.from_json(entry, offset)
                items.append(item)
                offset += item.nbytes
            keys = [item.key for item in items]
            if len(set(keys)) != len(keys):
                raise ValueError(f"item keys repeat: {sorted({k for k in keys if keys.count(k) > 1})[:4]}")
            length = _count(raw.get("length"), "record", "length")
            if length != offset:
                raise ValueError(f"length {length} is not the {offset} bytes its items take")
            return cls(run_id=raw["run_id"], lineage=raw["lineage"], rank=rank, world_size=world_size,
                       step=_count(raw.get("step"), "record", "step"),
                       sequence=_count(raw.get("sequence"), "record", "sequence"),
                       slot=_count(raw.get("slot"), "record", "slot"), length=length, items=tuple(items),
                       holder=holder, layout=layout)
        except (ValueError, TypeError) as e:
            raise CorruptCheckpointError(f"{where}: not a sound memory slot record ({e})", path=where) from None


def _count(value: Any, key: str, field: str, minimum: int = 0) -> int:
    if type(value) is not int or value < minimum:
        raise ValueError(f"{'' if key == 'record' else f'item {key!r}: '}{field} {value!r} is not an integer >= "
                         f"{minimum}")
    return value


def _check_place(place: Any, shape: list[int], key: str) -> None:
    """A tensor's place in its global tensor: as many dimensions as its shape, inside the global shape."""
    sizes, offsets = (place.get("global_shape"), place.get("global_offset")) if isinstance(place, dict) else (None,
                                                                                                               None)
    if not (isinstance(sizes, list) and isinstance(offsets, list) and len(sizes) == len(offsets) == len(shape)
            and all(type(n) is int and n >= 0 for n in sizes + offsets)
            and all(o + s <= g for o, s, g in zip(offsets, shape, sizes))):
        raise ValueError(f"item {key!r}: place {place!r:.120} does not hold its {shape} shard")


def _check_requires(names: Any) -> None:
    if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise ValueError(f"requires {names!r:.80} is not a list of feature names")
    unknown = [n for n in names if n not in SLOT_FEATURES]
    if unknown:
        raise ValueError(f"this snapshot needs {', '.join(unknown)}, which this dcp_atomic does not know; upgrade "
                         "dcp_atomic to restore it")
