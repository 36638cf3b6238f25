"""What a load checks before it trusts a byte: DCP's ``.metadata`` against the manifest, and each rank's plan.

``.metadata`` is DCP's, pickled by the saving coordinator; the manifest is ours, sealed by the commit marker.
Before any data is read, every chunk ``.metadata`` describes must be an item the manifest records (same key,
offset, dtype and size, in the data file the manifest says), the chunks of each tensor must tile it exactly
(no hole, no overlap: a hole would load uninitialised memory), and a ``torch.save`` container must hold its
payload where the manifest says.  A mismatch is corruption or tampering and is refused by name (P4, P9).
"""

from __future__ import annotations

import io
import math
import struct
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from ..format.codec import plane_width
from ..format.container import find_payload
from ..errors import CorruptCheckpointError
from ..format.integrity import sha256_hex
from ..format.manifest import ItemExtent, Manifest
from ..format.safe_pickle import load_dcp_metadata
from ..stores.storage import Storage

_DATA_DESCRIPTOR = b"PK\x07\x08"


@dataclass(frozen=True)
class Chunk:
    """One stored tensor chunk as .metadata and the manifest together describe it."""

    sizes: tuple[int, ...]
    dtype: torch.dtype  # as stored: the manifest's ItemExtent.dtype where a planner cast, else .metadata's


def item_id(index: MetadataIndex) -> tuple[str, tuple[int, ...] | None]:
    """An item's identity, as ``Manifest.extent_index`` keys it: (key, chunk offset)."""
    return index.fqn, None if index.offset is None else tuple(index.offset)


def stored_dtype(name: str | None, planned: torch.dtype) -> torch.dtype | None:
    if name is None:
        return planned
    dtype = getattr(torch, name.removeprefix("torch."), None)
    return dtype if isinstance(dtype, torch.dtype) else None


def described(metadata: Metadata, index: MetadataIndex) -> tuple[Any, tuple[int, ...] | None]:
    """(.metadata's record of the key, the chunk's sizes or None for bytes) for one stored item, or (None, None).

    By DCP's chunk-position hint where it holds (O(1)), else by a scan of that one key's chunks."""
    md = metadata.state_dict_metadata.get(index.fqn)
    if not isinstance(md, TensorStorageMetadata):
        return (md, None) if md is not None and index.offset is None else (None, None)
    if index.offset is None:
        return None, None
    offsets = tuple(index.offset)
    hint = index.index
    if hint is not None and 0 <= hint < len(md.chunks) and tuple(md.chunks[hint].offsets) == offsets:
        return md, tuple(md.chunks[hint].sizes)
    return next(((md, tuple(c.sizes)) for c in md.chunks if tuple(c.offsets) == offsets), (None, None))


def check_items(metadata: Metadata, extents: dict, infos: dict,
                stored_dtypes: dict[str, list[str]] | None) -> tuple[dict[tuple, Chunk], list[tuple[str, str]]]:
    """The stored items ``infos`` (index -> .metadata's storage entry) against the manifest's ``extents`` of
    their files; returns the tensor chunks and every (key, problem).  Every extent of those files must also be
    named by .metadata, and every item's stored dtype be one the manifest recorded for its key (``stored_dtypes``,
    Manifest.stored_dtypes; None: a manifest that predates the record)."""
    chunks: dict[tuple, Chunk] = {}
    problems: list[tuple[str, str]] = []
    storage = metadata.storage_data or {}
    for index, info in infos.items():
        ident, fqn = item_id(index), index.fqn
        name, extent = extents.get(ident, (None, None))
        where = f"{fqn!r}" + ("" if index.offset is None else f" chunk {list(index.offset)}")
        if extent is None or (name, extent.pos, extent.length) != (info.relative_path, info.offset, info.length):
            problems.append((fqn, f"{where}: .metadata names {info.relative_path!r} at offset {info.offset} "
                                 f"({info.length} bytes), which the manifest does not record"))
            continue
        md, sizes = described(metadata, index)
        if md is None:
            problems.append((fqn, f"{where}: stored in {name} but not described by .metadata"))
            continue
        kind = "tensor" if sizes is not None else "bytes"
        if extent.kind != kind:
            problems.append((fqn, f"{where}: the manifest records {extent.kind}, .metadata {kind}"))
            continue
        if sizes is None:
            continue
        dtype = stored_dtype(extent.dtype, md.properties.dtype)
        if dtype is None:
            problems.append((fqn, f"{where}: unknown stored dtype {extent.dtype!r}"))
            continue
        allowed = None if stored_dtypes is None else stored_dtypes.get(fqn, [str(md.properties.dtype)])
        if allowed is not None and str(dtype) not in allowed:
            problems.append((fqn, f"{where}: its shard says it is stored as {dtype}, the manifest records "
                                 f"{' / '.join(allowed)} for this key"))
            continue
        nbytes = math.prod(sizes) * dtype.itemsize
        if extent.format == "raw" and extent.logical != nbytes:
            problems.append((fqn, f"{where}: holds {extent.logical} bytes; its chunk {list(sizes)} of {dtype} "
                                 f"is {nbytes}"))
        elif extent.format == "raw" and extent.codec == "zstd" and extent.planes != plane_width(dtype):
            problems.append((fqn, f"{where}: {extent.planes} byte planes recorded for {dtype}"))
        elif extent.format == "torch_save" and extent.payload is not None and extent.payload + nbytes > extent.length:
            problems.append((fqn, f"{where}: payload of {nbytes} bytes at {extent.payload} overruns the "
                                 f"{extent.length}-byte item"))
        else:
            chunks[ident] = Chunk(sizes, dtype)
    unnamed = sorted((ident for ident, (name, extent) in extents.items() if not names_item(storage, ident, name, extent)),
                     key=str)
    if unnamed:
        problems.append((unnamed[0][0], f"the manifest records {len(unnamed)} item(s) that .metadata does not name, "
                                  f"e.g. {unnamed[0][0]!r}"))
    return chunks, problems


def names_item(storage: dict, ident: tuple, name: str, extent: ItemExtent) -> bool:
    """Whether .metadata's storage entries name this extent of the manifest exactly."""
    fqn, offset = ident
    info = storage.get(MetadataIndex(fqn, None if offset is None else torch.Size(offset)))
    return info is not None and (info.relative_path, info.offset, info.length) == (name, extent.pos, extent.length)


def dtype_mismatches(metadata: Metadata, keys: dict[str, dict]) -> list[tuple[str, str, str]]:
    """(key, .metadata's dtype, the manifest's) for every tensor whose two records of its planned dtype differ.

    The manifest's per-key records come from the ranks' plans, before .metadata is written, so the two agree
    on every intact checkpoint; a ``.metadata`` relabelled to a dtype of the same element size (fp32 / int32,
    bf16 / fp16) passes every size check and would load its bytes reinterpreted.  Keys the manifest does not
    type (bytes, older manifests) have nothing to compare."""
    found = []
    for fqn, md in metadata.state_dict_metadata.items():
        recorded = (keys.get(fqn) or {}).get("dtype")
        if isinstance(md, TensorStorageMetadata) and recorded is not None and str(md.properties.dtype) != recorded:
            found.append((fqn, str(md.properties.dtype), recorded))
    return sorted(found)


def check_coverage(metadata: Metadata) -> dict[str, str]:
    """Keys whose stored chunks do not tile the global shape exactly: key -> what is wrong."""
    stored = {item_id(i) for i in (metadata.storage_data or {})}
    holes: dict[str, str] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            if (fqn, None) not in stored:
                holes[fqn] = "not stored"
            continue
        missing = [list(c.offsets) for c in md.chunks if (fqn, tuple(c.offsets)) not in stored]
        why = (f"{len(missing)} chunk(s) described but not stored, at {missing[:3]}" if missing
               else tiling_problem(tuple(md.size), md.chunks))
        if why:
            holes[fqn] = why
    return holes


def tiling_problem(shape: tuple[int, ...], chunks) -> str | None:
    """Why ``chunks`` do not tile ``shape`` exactly (all in bounds, volumes add up, no overlap), or None."""
    total, covered, boxes = math.prod(shape), 0, []
    for c in chunks:
        offsets, sizes = tuple(c.offsets), tuple(c.sizes)
        if (len(offsets), len(sizes)) != (len(shape), len(shape)) or any(
                o < 0 or n < 0 or o + n > d for o, n, d in zip(offsets, sizes, shape)):
            return f"chunk at {list(offsets)} of size {list(sizes)} lies outside the shape {list(shape)}"
        volume = math.prod(sizes)
        if volume:
            covered += volume
            boxes.append((offsets, sizes))
    if covered != total:
        return f"stored chunks hold {covered} of its {total} elements"
    if boxes_overlap(boxes):
        return "stored chunks overlap, so other elements are missing"
    return None


def boxes_overlap(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> bool:
    """Whether any two non-empty boxes intersect.

    A sweep along the dimension with the most distinct offsets: row shards,
    column shards and dp x tp grids cost O(n log n) plus, per box, the few
    boxes that share its slab, so 1,000+ chunks per key stay cheap.
    """
    if len(boxes) < 2:
        return False
    ndim = len(boxes[0][0])
    axis = max(range(ndim), key=lambda d: len({offsets[d] for offsets, _ in boxes}))
    active: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for offsets, sizes in sorted(boxes, key=lambda b: b[0][axis]):
        active = [(o, s) for o, s in active if o[axis] + s[axis] > offsets[axis]]
        for o, s in active:
            if all(o[d] < offsets[d] + sizes[d] and offsets[d] < o[d] + s[d] for d in range(ndim)):
                return True
        active.append((offsets, sizes))
    return False


def payload_proven(head: bytes, tail: bytes, payload: int, nbytes: int) -> bool:
    """Whether the zip entry ``data/0`` of a torch.save item spans exactly ``[payload, payload + nbytes)``.

    The local header must end exactly at ``payload`` (the writer's own proof,
    :func:`.container.find_payload`), and the data descriptor torch writes
    right after the entry must record ``nbytes`` (32- or 64-bit sizes).
    """
    if find_payload(head, [(payload, nbytes)], nbytes) != payload or not tail.startswith(_DATA_DESCRIPTOR):
        return False
    small = len(tail) >= 16 and struct.unpack_from("<II", tail, 8) == (nbytes, nbytes)
    large = len(tail) >= 24 and struct.unpack_from("<QQ", tail, 8) == (nbytes, nbytes)
    return small or large


# -- the checks as a load (and ``verify``, :mod:`~dcp_atomic.tools.audit`) applies them: one place, so the two cannot disagree -----


def _malformed(path: str, e: Exception) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{path}: malformed DCP metadata ({type(e).__name__}: {e})", path=path)


def read_dcp_metadata(storage: Storage, path: str, manifest: Manifest) -> Metadata:
    """``.metadata`` at ``path``, unpickled (allow-list) only if its size and sha256 are the manifest's record of it,
    then checked as a whole (:func:`check_metadata`).  Raises :class:`CorruptCheckpointError` (or
    :class:`~dcp_atomic.errors.TorchVersionError`)."""
    expected = manifest.dcp_metadata
    try:
        data = storage.read_file(path)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path}: committed checkpoint lacks DCP metadata", path=path) from None
    if len(data) != expected["size"] or sha256_hex(data) != expected["sha256"]:
        raise CorruptCheckpointError(
            f"{path}: DCP metadata does not match the manifest (size {len(data)} vs {expected['size']} or "
            "sha256 differs); refusing to unpickle it",
            path=path,
        )
    metadata = load_dcp_metadata(data, where=path, written_by=manifest.versions.get("torch"))
    check_metadata(metadata, manifest.keys, path)
    return metadata


def read_by_a_load(metadata: Metadata) -> dict:
    """The storage entries (index -> entry) a load of every key reads: all but the chunks without elements, for
    which DCP plans no read.  What a load never reads cannot make it refuse a step or load a wrong value, so
    ``verify`` (:mod:`..tools.audit`) judges exactly these, as the reader judges those of its plan."""
    entries = {}
    for index, info in (metadata.storage_data or {}).items():
        _, sizes = described(metadata, index)
        if sizes is None or math.prod(sizes):
            entries[index] = info
    return entries


def check_metadata(metadata: Metadata, keys: dict, path: str) -> None:
    """``.metadata`` (at ``path``) as a whole, once it is unpickled: every tensor's chunks tile it, and each key's
    element type is the one the manifest recorded (``keys``).  Raises :class:`CorruptCheckpointError`."""
    try:
        holes = check_coverage(metadata)
        relabelled = dtype_mismatches(metadata, keys)
    except (AttributeError, TypeError, ValueError) as e:  # a .metadata of the right classes, wrongly built
        raise _malformed(path, e) from None
    if holes:
        raise CorruptCheckpointError(
            f"{path}: the stored chunks of {len(holes)} key(s) do not cover their tensors exactly (a partial "
            "checkpoint, e.g. saved without collectives); loading would leave parts of them unset:\n  - "
            + "\n  - ".join(f"{key!r}: {why}" for key, why in sorted(holes.items()))
            + "\nLoad another step, or save again with every rank taking part.",
            path=path,
            keys=sorted(holes),
        )
    if relabelled:
        raise CorruptCheckpointError(
            f"{path}: the element type .metadata gives {len(relabelled)} key(s) is not the one the manifest "
            "recorded at save; their bytes would load reinterpreted as another type:\n  - "
            + "\n  - ".join(f"{key!r}: .metadata says {found}, the manifest {recorded}"
                             for key, found, recorded in relabelled[:20])
            + ("\n  - ..." if len(relabelled) > 20 else "")
            + "\nThe step's control files were altered after the commit: restore them or load another step.",
            path=path,
            keys=[key for key, _, _ in relabelled],
        )


def check_stored_items(metadata: Metadata, manifest: Manifest, names: set[str], infos: dict,
                       path: str) -> tuple[dict, dict[tuple, Chunk]]:
    """The stored items ``infos`` (index -> .metadata's storage entry, in the data files ``names``) against the
    manifest's items of those files (their shards loaded): returns (extents, chunks) or raises
    :class:`CorruptCheckpointError` naming every item that disagrees."""
    unknown = sorted(names - {f.name for f in manifest.files})
    if unknown:
        raise CorruptCheckpointError(f"{path}: names data file(s) {unknown[:5]} that the manifest does not record",
                                     path=path)
    try:
        extents = manifest.extent_index(names)
    except ValueError as e:
        raise CorruptCheckpointError(f"{path}: the manifest shards record {e}", path=path) from None
    try:
        chunks, problems = check_items(metadata, extents, infos, manifest.stored_dtypes)
    except (AttributeError, TypeError, ValueError) as e:
        raise _malformed(path, e) from None
    if problems:
        raise CorruptCheckpointError(
            f"{path}: {len(problems)} stored item(s) do not match the manifest; refusing to read them:\n  - "
            + "\n  - ".join(text for _, text in problems[:20]) + ("\n  - ..." if len(problems) > 20 else ""),
            path=path,
            keys=sorted({key for key, _ in problems}),
        )
    return extents, chunks


def decode_chunk(data: bytes, chunk: Chunk, what: str, key: str) -> torch.Tensor:
    """A ``torch.save`` item read whole (no proven payload offset): decoded with ``weights_only`` and held to the
    chunk's stored dtype and shape."""
    try:
        tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:
        raise CorruptCheckpointError(f"{what}: cannot decode tensor ({e})", key=key) from None
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != chunk.dtype or tuple(tensor.shape) != chunk.sizes:
        found = f"{tensor.dtype} {tuple(tensor.shape)}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise CorruptCheckpointError(
            f"{what}: stored chunk is {found}, the checkpoint records {chunk.dtype} {chunk.sizes}", key=key
        )
    return tensor
