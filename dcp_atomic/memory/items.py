"""A rank's state dict as the items of a memory slot, and back.

The state dict is flattened the way DCP flattens it (``Stateful`` values replaced by their ``state_dict()``, nested
dicts and lists walked, leaves named by dotted paths): tensors are stored as their raw bytes, a DTensor as its local
shard (its placements and mesh shape recorded, so a restore at the same world size puts the bytes back into the same
local shard), and any other value ``torch.save``-encoded, decoded on restore by the allow-list
(:func:`~dcp_atomic.format.safe_pickle.decode_item`), never ``pickle.loads``.

Writing goes through a sink (:class:`~.slots.SlotSink`: ``write(index, offset, data)``, ``finish(index)``), a window
at a time: a CPU tensor's bytes go from its own memory into the slot (no second host copy); a device tensor is copied
to the host one window at a time.  Restoring copies the verified bytes straight into the state dict's tensors.  A
durable copy of a slot gets the state back as the snapshot took it (its containers, read-only tensors over the slot's
bytes: :func:`durable_state`).
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from .._base import internals
from ..errors import ConfigurationError, RankConsistencyError
from ..format.blocks import verify_item
from ..format.codec import tensor_bytes
from ..format.safe_pickle import decode_item
from ..staging import StagedCopy, Stager
from ..tiers import expand_stateful
from ..format.slot_record import DTYPE_BYTES, SlotItem

WINDOW_BYTES = 16 << 20  # a device tensor crosses to the host this much at a time


@dataclass
class Leaf:
    """One flattened value at ``path`` (its keys and list indexes from the state dict's top): a tensor's bytes
    (``tensor``: what is stored, the local shard of a DTensor), or an encoded object."""

    path: tuple
    value: Any
    tensor: torch.Tensor | None
    encoded: bytes | None = None

    @property
    def key(self) -> str:
        return ".".join(map(str, self.path))

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size() if self.tensor is not None else len(self.encoded)


@dataclass(frozen=True)
class Hole:
    """Where leaf ``index`` sat in the state dict's containers (:func:`flatten`'s shape); a DTensor's mesh,
    placements, global size and stride kept beside it, so that its local shard can be put back into one
    (:func:`durable_state`)."""

    index: int
    dtensor: tuple | None = None


def shaped_leaves(expanded: dict[str, Any]) -> tuple[list[Leaf], dict[str, Any]]:
    """Every leaf of an expanded state dict (dicts and lists walked), in a stable order, nothing encoded yet; and
    the state's shape: its containers as they are, each leaf replaced by its :class:`Hole`."""
    leaves: list[Leaf] = []

    def walk(path: tuple, value: Any) -> Any:
        if isinstance(value, dict):
            return {key: walk((*path, key), value[key]) for key in value}
        if isinstance(value, list):
            return [walk((*path, index), element) for index, element in enumerate(value)]
        stored = value.to_local() if isinstance(value, DTensor) else value
        leaves.append(Leaf(path, value, stored if isinstance(stored, torch.Tensor) else None))
        layout = ((value.device_mesh, tuple(value.placements), value.size(), value.stride())
                  if isinstance(value, DTensor) else None)
        return Hole(len(leaves) - 1, layout)

    return leaves, walk((), expanded)


def leaves_of(expanded: dict[str, Any]) -> list[Leaf]:
    """Every leaf of an expanded state dict (dicts and lists walked), in a stable order; nothing encoded yet."""
    return shaped_leaves(expanded)[0]


def flatten(state_dict: dict[str, Any]) -> tuple[list[Leaf], dict[str, Any]]:
    """The leaves of a state dict (expanded here), each non-tensor value ``torch.save``-encoded, and its shape
    (:func:`shaped_leaves`)."""
    leaves, shape = shaped_leaves(expand_stateful(state_dict))
    for leaf in leaves:
        if leaf.tensor is not None and str(leaf.tensor.dtype).removeprefix("torch.") not in DTYPE_BYTES:
            raise ConfigurationError(f"the memory tier cannot snapshot {leaf.key!r}: its dtype {leaf.tensor.dtype} is "
                                     "not one a slot record knows; nothing was snapshotted", key=leaf.key)
        if leaf.tensor is None:
            stream = io.BytesIO()
            torch.save(leaf.value, stream)
            leaf.encoded = stream.getvalue()
    return leaves, shape


def write_leaves(leaves: list[Leaf], sink) -> list[SlotItem]:
    """Every leaf's bytes into ``sink`` (a window at a time), now; the items of the slot's record."""
    checksums = {}
    for index, leaf in enumerate(leaves):
        if leaf.tensor is None:
            sink.write(index, 0, memoryview(leaf.encoded))
        else:
            _write_tensor(index, leaf.tensor, sink)
        checksums[index] = sink.finish(index)
    return slot_items(leaves, checksums)


def stage_leaves(leaves: list[Leaf], sink, stager: Stager, *, step: int, rank: int) -> tuple[StagedCopy, dict]:
    """The objects (encoded at the call) into ``sink`` now, the tensors through ``stager`` after the call returns
    (bounded staging: the pool, a version check per tensor); returns the copy in flight and the digests per item,
    which fill in as items finish (:func:`slot_items` once the copy's ``result()`` returned)."""
    checksums: dict[int, tuple[str, ...]] = {}
    tensors = []
    for index, leaf in enumerate(leaves):
        if leaf.tensor is None:
            sink.write(index, 0, memoryview(leaf.encoded))
            checksums[index] = sink.finish(index)
        else:
            tensors.append(index)
    copy = stager.stage([(leaves[i].key, leaves[i].value) for i in tensors], _Renumbered(sink, tensors, checksums),
                        step=step, rank=rank)
    return copy, checksums


class _Renumbered:
    """The stager's item ``i`` is the slot's item ``slot_index[i]``; each finished item's digests kept."""

    def __init__(self, sink, slot_index: list[int], checksums: dict[int, tuple[str, ...]]) -> None:
        self.sink, self.slot_index, self.checksums = sink, slot_index, checksums

    def write(self, index: int, offset: int, data: memoryview) -> None:
        self.sink.write(self.slot_index[index], offset, data)

    def finish(self, index: int) -> None:
        self.checksums[self.slot_index[index]] = self.sink.finish(self.slot_index[index])


def slot_items(leaves: list[Leaf], checksums: dict[int, tuple[str, ...]]) -> list[SlotItem]:
    """The items of the slot's record: each leaf at its offset, with the digests its bytes had in the slot."""
    items, offset = [], 0
    for index, leaf in enumerate(leaves):
        value = leaf.value
        items.append(SlotItem(
            key=leaf.key, kind="object" if leaf.tensor is None else "dtensor" if isinstance(value, DTensor) else "tensor",
            offset=offset, nbytes=leaf.nbytes, checksums=checksums[index],
            dtype=None if leaf.tensor is None else str(leaf.tensor.dtype).removeprefix("torch."),
            shape=None if leaf.tensor is None else tuple(leaf.tensor.shape),
            dtensor=_placement(value) if isinstance(value, DTensor) else None,
            place=None if leaf.tensor is None else global_place(value)))
        offset += leaf.nbytes
    return items


def _write_tensor(index: int, tensor: torch.Tensor, sink) -> None:
    tensor = tensor.detach()
    if tensor.device.type == "cpu":  # its own memory is the source: no host copy (one if it is not contiguous)
        sink.write(index, 0, tensor_bytes(tensor.contiguous()))
        return
    flat = tensor.contiguous().reshape(-1).view(torch.uint8)
    for start in range(0, flat.numel(), WINDOW_BYTES):
        window = flat[start:start + WINDOW_BYTES].cpu()
        sink.write(index, start, tensor_bytes(window))


def durable_state(shape: dict[str, Any], items: tuple[SlotItem, ...], data: memoryview, where: str) -> dict[str, Any]:
    """The state a durable copy of a slot saves: ``shape`` (:func:`flatten`'s, the same containers as the state the
    snapshot took) with every leaf read from the slot's bytes ``data``: tensors as read-only views of them (no
    copy: the slot is pinned until the save is done), a DTensor's local shard put back into its mesh and placements,
    objects decoded by the allow-list.  So the copy holds the snapshot's bytes, whatever training did since.  Each
    item is verified against the record's block digests first (``CorruptCheckpointError`` naming it): the save
    seals what it writes with digests of its own, so a byte that changed in the slot would otherwise become a
    durable step that verifies."""
    def fill(node: Any) -> Any:
        if isinstance(node, dict):
            return {key: fill(value) for key, value in node.items()}
        if isinstance(node, list):
            return [fill(value) for value in node]
        item = items[node.index]
        stored = data[item.offset:item.offset + item.nbytes]
        try:
            verify_item(item.extent(), stored, f"{where} item {item.key!r}", path=where)
        finally:
            stored.release()
        if item.kind == "object":
            return decode_item(bytes(data[item.offset:item.offset + item.nbytes]), key=item.key, where=where)
        local = tensor_over(item, data)
        if node.dtensor is None:
            return local
        mesh, placements, size, stride = node.dtensor
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=size, stride=stride)

    return fill(shape)


def tensor_over(item: SlotItem, data: memoryview) -> torch.Tensor:
    """The item's bytes in ``data`` as a tensor of its dtype and shape, sharing the memory (read-only)."""
    dtype = getattr(torch, item.dtype)
    if not item.nbytes:
        return torch.empty(item.shape, dtype=dtype)
    with warnings.catch_warnings():  # the slot is mapped read-only: nothing writes these tensors
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        flat = torch.frombuffer(data, dtype=dtype, count=item.nbytes // dtype.itemsize, offset=item.offset)
    return flat.view(item.shape)


def _placement(value: DTensor) -> dict:
    return {"placements": [repr(p) for p in value.placements], "mesh_shape": list(value.device_mesh.shape)}


def global_place(value: torch.Tensor) -> dict:
    """Where a tensor's stored bytes lie in its global tensor (a plain tensor is all of it): a DTensor's local shard
    at the chunk offset DCP itself records for it.  The one rule of :attr:`.slots.SlotItem.place`, for the shares
    a snapshot writes and for the shards a resized restore fills (:mod:`.reshard`)."""
    if isinstance(value, DTensor):
        return {"global_shape": list(value.shape), "global_offset": list(internals.dtensor_global_offset(value))}
    return {"global_shape": list(value.shape), "global_offset": [0] * value.dim()}


def install(state_dict: dict[str, Any], items: tuple[SlotItem, ...], data: memoryview, where: str) -> None:
    """Copy the bytes of ``items`` (``data``: the slot) into ``state_dict``, each item verified as it is read:
    tensors in place, other values decoded by the allow-list; ``Stateful`` values then get their
    ``load_state_dict``, as ``dcp.load`` does.  A key of the state dict the slot lacks, or a tensor of another dtype,
    shape or placement, is refused by name before a byte is copied."""
    expanded = expand_stateful(state_dict)
    by_key = {item.key: item for item in items}
    leaves = leaves_of(expanded)
    missing = [leaf.key for leaf in leaves if leaf.key not in by_key]
    wrong = [why for leaf in leaves if leaf.key in by_key for why in [_mismatch(by_key[leaf.key], leaf)] if why]
    if missing or wrong:
        raise RankConsistencyError(
            f"{where} does not fit this state dict: "
            + "; ".join([f"missing key(s) {missing[:6]}"] * bool(missing) + wrong[:6])
            + ". Nothing was loaded from it.", path=where)
    for leaf in leaves:
        item = by_key[leaf.key]
        stored = data[item.offset:item.offset + item.nbytes]
        try:
            verify_item(item.extent(), stored, f"{where} item {leaf.key!r}", path=where)
            if item.kind == "object":
                put_object(expanded, leaf.path, decode_item(bytes(stored), key=leaf.key, where=where))
            else:
                _copy_into(leaf.tensor, stored)
        finally:
            stored.release()
    hand_back(state_dict, expanded)


def hand_back(state_dict: dict[str, Any], expanded: dict[str, Any]) -> None:
    """After the leaves of ``expanded`` were filled: ``Stateful`` values get their ``load_state_dict``, as
    ``dcp.load`` does, and a top-level object decoded into the expanded copy goes back into ``state_dict``."""
    for key, value in state_dict.items():
        if isinstance(value, Stateful):
            value.load_state_dict(expanded[key])
        else:
            state_dict[key] = expanded[key]


def _copy_into(tensor: torch.Tensor, stored: memoryview) -> None:
    """The stored bytes into ``tensor``'s memory: one memcpy for a contiguous CPU tensor."""
    if tensor.device.type == "cpu" and tensor.is_contiguous():
        tensor_bytes(tensor)[:] = stored
        return
    source = torch.frombuffer(bytearray(stored), dtype=torch.uint8) if len(stored) else torch.empty(0, dtype=torch.uint8)
    with torch.no_grad():
        tensor.copy_(source.view(tensor.dtype).view(tensor.shape))


def _mismatch(item: SlotItem, leaf: Leaf) -> str | None:
    """Why the stored ``item`` cannot go into ``leaf`` (None: it fits)."""
    target, local = leaf.value, leaf.tensor
    if item.kind == "object":
        return None if local is None else f"{item.key!r} is a tensor, the slot holds an object"
    if local is None:
        return f"{item.key!r} is not a tensor, the slot holds one"
    if (item.kind == "dtensor") != isinstance(target, DTensor):
        return f"{item.key!r}: a DTensor on one side only"
    dtype = str(local.dtype).removeprefix("torch.")
    if dtype != item.dtype or tuple(local.shape) != item.shape:
        return f"{item.key!r} is {dtype} {list(local.shape)}, the slot holds {item.dtype} {list(item.shape or ())}"
    if isinstance(target, DTensor) and _placement(target) != item.dtensor:
        return f"{item.key!r} is placed {_placement(target)}, the slot's shard was {item.dtensor}"
    return None


def put_object(expanded: dict[str, Any], path: tuple, value: Any) -> None:
    """Put a decoded object at ``path`` (its container is a dict or a list)."""
    node = expanded
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
