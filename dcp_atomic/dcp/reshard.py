"""No silent resharding mistakes (P6): checks at save and at load.

At save, on the coordinator and before a byte is written: DCP deduplicates
items that several ranks hold under one key and keeps *one rank's copy*.  That
is right for true replicas and silently wrong otherwise — manual Megatron-style
shards in plain tensors, per-rank RNG or dataloader state, replicas that
diverged.  Every rank therefore summarises its keys (shape, dtype and, with
:class:`~dcp_atomic.AtomicSavePlanner`, a sampled content fingerprint), and the
coordinator refuses keys whose copies differ, all of them in one error.

At load: same layout loads; a dp / world-size change is logged (FSDP and
DTensor reshard natively); a tp, pp or ep change raises :class:`ReshardError`
naming both layouts unless ``allow_reshard=True``; and even with consent, keys
that cannot be resharded soundly — saved as per-rank plain tensors, declared
layout-dependent (a fused QKV with per-rank interleaving), or whose global
shape or dtype changed — are refused, every one of them in one error.

Why one module of about 590 lines: the save-side and load-side halves of P6 share their summaries and their one all-
keys error; apart, one rule's two checks would drift.
"""

from __future__ import annotations

import fnmatch
import itertools
import logging
import math
import pickle
from array import array
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash

from ..errors import ConfigurationError, ReshardError
from ..format.parallelism import Parallelism

log = logging.getLogger("dcp_atomic.reshard")  # the name users filter on
_warned: set[str] = set()

SAMPLE_ELEMENTS = 1 << 16  # elements hashed per tensor: exact below this, strided sample above
SAMPLE_VALUES = 32  # values shipped to the coordinator to say how far diverged copies differ


def _warn_once(key: str, message: str, *args) -> None:
    if key not in _warned:  # a warning on every save/load would be noise
        _warned.add(key)
        log.warning(message, *args)


# -- per-rank summaries (computed where the data is) -----------------------------------------
#
# Both summaries travel to the coordinator inside DCP's gather of local plans, which pickles them with
# Python's cyclic GC running.  As a dict per key (shape lists, a fingerprint string, 32 sampled floats)
# they were ~40 objects per key, four times DCP's own plan, and the collections their (un)pickling set
# off cost more than the checks: at world 2 with 10k keys per rank they took the whole gain of our
# single-rank path.  So they are columns: a list of key names and a few flat arrays, which pickle as
# a handful of bytes objects and are read on the coordinator without building a record per key.

_ITEM_KINDS = {"plain": b"p"[0], "sharded": b"s"[0], "object": b"o"[0]}
_ITEM_KIND_NAMES = {code: name for name, code in _ITEM_KINDS.items()}


class ItemSummary:
    """What the storage layer sees of one rank's plan, one row per key: kind, global shape and dtype, and the
    offset of the key's first chunk (the replicas of a chunk are compared by it)."""

    __slots__ = ("fqns", "kinds", "signature_of", "signatures", "offset_of", "offsets", "_index")

    def __init__(self) -> None:
        self.fqns: list[str] = []
        self.kinds = bytearray()
        self.signature_of = array("I")  # -> signatures: (shape, dtype) of the key
        self.signatures: list[tuple[tuple[int, ...], str]] = []
        self.offset_of = array("I")  # -> offsets: the first chunk's offset
        self.offsets: list[tuple[int, ...]] = []
        self._index: dict[str, int] | None = None

    def __getstate__(self):
        return (self.fqns, bytes(self.kinds), self.signature_of.tobytes(), self.signatures,
                self.offset_of.tobytes(), self.offsets)

    def __setstate__(self, state) -> None:
        self.fqns, kinds, signature_of, self.signatures, offset_of, self.offsets = state
        self.kinds = bytearray(kinds)
        self.signature_of, self.offset_of = array("I"), array("I")
        self.signature_of.frombytes(signature_of)
        self.offset_of.frombytes(offset_of)
        self._index = None

    def __len__(self) -> int:
        return len(self.fqns)

    def row(self, fqn: str) -> int:
        if self._index is None:
            self._index = {name: i for i, name in enumerate(self.fqns)}
        return self._index[fqn]

    def kind(self, i: int) -> str:
        return _ITEM_KIND_NAMES[self.kinds[i]]

    def signature(self, i: int) -> tuple[tuple[int, ...], str]:
        return self.signatures[self.signature_of[i]]

    def first_offset(self, i: int) -> tuple[int, ...]:
        return self.offsets[self.offset_of[i]]


def summarize_items(items) -> ItemSummary:
    """Kind, global shape, dtype and first chunk offset of every key of a rank's plan."""
    from torch.distributed.checkpoint.planner import WriteItemType

    summary = ItemSummary()
    seen: set[str] = set()
    signatures: dict[tuple, int] = {}
    offsets: dict[tuple, int] = {}
    for item in items:
        fqn = item.index.fqn
        if fqn in seen:
            continue
        seen.add(fqn)
        summary.fqns.append(fqn)
        if item.type == WriteItemType.BYTE_IO:
            summary.kinds.append(_ITEM_KINDS["object"])
            summary.signature_of.append(0)
            summary.offset_of.append(0)
            continue
        data = item.tensor_data
        summary.kinds.append(_ITEM_KINDS["plain" if item.type == WriteItemType.TENSOR else "sharded"])
        signature = (tuple(data.size), str(data.properties.dtype))
        summary.signature_of.append(signatures.setdefault(signature, len(signatures)))
        offset = tuple(data.chunk.offsets)
        summary.offset_of.append(offsets.setdefault(offset, len(offsets)))
    summary.signatures = list(signatures)
    summary.offsets = list(offsets)
    return summary


_PLAIN, _DTENSOR, _DTENSOR_SHARDED, _OBJECT = b"pdso"  # content kinds; _DTENSOR_SHARDED has no fingerprint
_NO_PRINT = 0  # where a key has no fingerprint (a sharded-only DTensor)

# numpy views for the sampled values; bfloat16 is widened by hand (numpy has no such type)
_NUMPY_DTYPES = {getattr(torch, name): np.dtype(name) for name in (
    "float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint8", "bool", "complex64", "complex128")}


class ContentSummary:
    """AtomicSavePlanner's content report of one rank, one row per key: kind, a content fingerprint (xxh3-64 of
    shape, dtype and the elements, sampled above :data:`SAMPLE_ELEMENTS`) and up to :data:`SAMPLE_VALUES`
    values, which only an error message reads (how far diverged copies differ).  ``summary[fqn]`` gives one key
    as a record (``kind``, ``fingerprint``, ``sample``, a DTensor's ``placements`` and mesh)."""

    __slots__ = ("fqns", "kinds", "prints", "counts", "samples", "layouts", "_index", "_starts")

    def __init__(self) -> None:
        self.fqns: list[str] = []
        self.kinds = bytearray()
        self.prints = array("Q")
        self.counts = bytearray()  # sampled values per key
        self.samples = array("d")
        self.layouts: dict[str, tuple[tuple[str, ...], tuple[int, ...], tuple[str, ...]]] = {}  # DTensors
        self._index: dict[str, int] | None = None
        self._starts: list[int] | None = None

    def __getstate__(self):
        return (self.fqns, bytes(self.kinds), self.prints.tobytes(), bytes(self.counts), self.samples.tobytes(),
                self.layouts)

    def __setstate__(self, state) -> None:
        self.fqns, kinds, prints, counts, samples, self.layouts = state
        self.kinds, self.counts = bytearray(kinds), bytearray(counts)
        self.prints, self.samples = array("Q"), array("d")
        self.prints.frombytes(prints)
        self.samples.frombytes(samples)
        self._index = self._starts = None

    def _add(self, fqn: str, kind: int, fingerprint: int = _NO_PRINT, sample=None) -> None:
        self.fqns.append(fqn)
        self.kinds.append(kind)
        self.prints.append(fingerprint)
        if sample is None or not len(sample):
            self.counts.append(0)
        else:
            self.counts.append(len(sample))
            self.samples.frombytes(sample.tobytes())

    def index(self, fqn: str) -> int | None:
        if self._index is None:
            self._index = {name: i for i, name in enumerate(self.fqns)}
        return self._index.get(fqn)

    def fingerprint(self, i: int | None) -> int | None:
        """The key's fingerprint; None where it has none (not reported, or a DTensor without replicas)."""
        if i is None or self.kinds[i] == _DTENSOR_SHARDED:
            return None
        return self.prints[i]

    def sample(self, i: int) -> list[float]:
        if self._starts is None:
            self._starts = [0, *itertools.accumulate(self.counts)]
        return self.samples[self._starts[i]:self._starts[i + 1]].tolist()

    def record(self, i: int) -> dict[str, Any]:
        kind = self.kinds[i]
        record: dict[str, Any] = {"kind": {_PLAIN: "plain", _OBJECT: "object"}.get(kind, "dtensor")}
        if kind in (_DTENSOR, _DTENSOR_SHARDED):
            placements, mesh_shape, names = self.layouts[self.fqns[i]]
            record.update(placements=list(placements), mesh_shape=list(mesh_shape), mesh_dim_names=list(names))
        if kind != _DTENSOR_SHARDED:
            record["fingerprint"] = f"{self.prints[i]:016x}"
        if kind != _OBJECT and kind != _DTENSOR_SHARDED:
            record["sample"] = self.sample(i)
        return record

    def get(self, fqn: str, default: Any = None) -> dict[str, Any] | Any:
        i = self.index(fqn)
        return default if i is None else self.record(i)

    def __getitem__(self, fqn: str) -> dict[str, Any]:
        i = self.index(fqn)
        if i is None:
            raise KeyError(fqn)
        return self.record(i)

    def __contains__(self, fqn: object) -> bool:
        return isinstance(fqn, str) and self.index(fqn) is not None

    def __len__(self) -> int:
        return len(self.fqns)


def _tensor_fingerprint(tensor: torch.Tensor):
    """(xxh3-64 of shape, dtype and the elements, float64 sample values): exact up to SAMPLE_ELEMENTS elements,
    a strided sample above.  Contiguous CPU tensors hash their own memory and sample through numpy, without a
    torch op per key (the per-op overhead was most of this pass at 10^4 small keys)."""
    digest = xxhash.xxh3_64(f"{tuple(tensor.shape)}|{tensor.dtype}".encode())
    flat = tensor.detach().reshape(-1)
    numel = flat.numel()
    if numel == 0:
        return digest.intdigest(), None
    stride = max(1, math.ceil(numel / SAMPLE_ELEMENTS))
    dtype = flat.dtype
    if stride == 1 and flat.device.type == "cpu" and (dtype in _NUMPY_DTYPES or dtype == torch.bfloat16):
        if dtype == torch.bfloat16:
            raw = flat.view(torch.int16).numpy()
            digest.update(raw)
            picked = raw[:: max(1, numel // SAMPLE_VALUES)][:SAMPLE_VALUES]
            values = (picked.view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        else:
            raw = flat.numpy()
            digest.update(raw.view(np.uint8))
            values = raw[:: max(1, numel // SAMPLE_VALUES)][:SAMPLE_VALUES]
            values = (np.abs(values) if values.dtype.kind == "c" else values).astype(np.float64)
        return digest.intdigest(), values
    sample = flat[::stride].to("cpu").contiguous()
    digest.update(sample.view(torch.uint8).numpy() if sample.dtype != torch.bool else sample.numpy())
    values = sample[:: max(1, sample.numel() // SAMPLE_VALUES)][:SAMPLE_VALUES]
    if values.is_complex():
        values = values.abs()
    return digest.intdigest(), values.to(torch.float64).numpy()


def summarize_state_dict(state_dict: dict[str, Any]) -> ContentSummary:
    """Content-level summary of a flattened state dict (needs the data: runs in the planner)."""
    from torch.distributed.tensor import DTensor, Replicate

    summary = ContentSummary()
    for fqn, value in state_dict.items():
        if isinstance(value, DTensor):
            mesh = value.device_mesh
            summary.layouts[fqn] = (tuple(repr(p) for p in value.placements), tuple(mesh.mesh.shape),
                                    tuple(mesh.mesh_dim_names or ()))
            if any(isinstance(p, Replicate) for p in value.placements):  # replicas exist: compare them
                summary._add(fqn, _DTENSOR, *_tensor_fingerprint(value.to_local()))
            else:
                summary._add(fqn, _DTENSOR_SHARDED)
        elif isinstance(value, torch.Tensor):
            summary._add(fqn, _PLAIN, *_tensor_fingerprint(value))
        else:
            try:
                blob = canonical_bytes(value)
            except Exception:  # unpicklable objects are DCP's problem, not a content check's
                continue
            summary._add(fqn, _OBJECT, xxhash.xxh3_64_intdigest(blob))
    return summary


def canonical_bytes(value: Any) -> bytes:
    """An encoding equal for equal values on every rank, whatever each rank's hash seed or insertion order.

    A pickle of a set (or of a dict built by iterating one) lists elements in hash
    order, which depends on ``PYTHONHASHSEED``: equal objects would look diverged.
    Sets and dict items are therefore sorted by their own encodings; types are
    tagged (``1``, ``1.0`` and ``True`` stay distinct, as their pickles are); any
    other type falls back to its pickle.
    """
    def part(tag: bytes, body: bytes) -> bytes:
        return tag + len(body).to_bytes(8, "little") + body

    kind = type(value)
    if kind in _SCALARS:
        return part(kind.__name__.encode(), repr(value).encode())
    if kind in (set, frozenset):
        return part(kind.__name__.encode(), b"".join(sorted(canonical_bytes(v) for v in value)))
    if kind in (dict, OrderedDict):  # a dict's order is not part of its value; an OrderedDict's is
        items = [canonical_bytes(k) + canonical_bytes(v) for k, v in value.items()]
        return part(kind.__name__.encode(), b"".join(sorted(items) if kind is dict else items))
    if kind in (list, tuple):
        return part(kind.__name__.encode(), b"".join(canonical_bytes(v) for v in value))
    if kind is torch.Tensor and value.layout == torch.strided and value.device.type != "meta":
        # its pickle names the storage's address: equal tensors inside an object (a gathered RNG state, a
        # scheduler's) would look diverged
        flat = value.detach().reshape(-1).contiguous()
        header = f"{flat.dtype} {tuple(value.shape)} {value.requires_grad}".encode()
        return part(b"tensor", header + flat.view(torch.uint8).cpu().numpy().tobytes())
    return part(b"pickle", pickle.dumps(value, protocol=4))


_SCALARS = (type(None), bool, int, float, complex, str, bytes)


def infer_parallelism(state_dict: dict[str, Any]) -> Parallelism | None:
    """The layout implied by the named device meshes of the state dict's DTensors.

    None (with a warning naming them) where a mesh dim name is not one :data:`.parallelism.MESH_DIM_ROLES`
    knows, or the meshes contradict each other: the checks that need the layout are then skipped, never run
    against a guess.  A mesh without names says nothing and is skipped silently, as before."""
    from torch.distributed.tensor import DTensor

    meshes: dict[tuple, tuple] = {}
    seen: set[int] = set()  # the leaves share a few meshes: each is read once (a snapshot asks every step)
    for value in state_dict.values():
        if isinstance(value, DTensor) and id(value.device_mesh) not in seen:
            seen.add(id(value.device_mesh))
            names = value.device_mesh.mesh_dim_names
            if not names:
                return None
            shape = tuple(int(s) for s in value.device_mesh.mesh.shape)
            meshes.setdefault((tuple(names), shape), tuple(zip(names, shape)))
    if not meshes:
        return None
    try:
        return Parallelism.from_mesh_dims(meshes.values())
    except ConfigurationError as e:
        _warn_once(f"dims {sorted(meshes)}", "cannot infer Parallelism from the state dict's DTensor meshes (%s); "
                   "layout checks are skipped: pass parallelism= explicitly", e.message)
        return None


@dataclass
class SaveReport:
    """What AtomicSavePlanner tells the writer about one rank (travels in SavePlan.storage_data)."""

    keys: ContentSummary
    parallelism: Parallelism | None
    divergence: str  # "raise" | "warn"
    layout_dependent: tuple[str, ...] = ()
    plan_cache: str | None = None  # with DCP's plan caching, the planner's cache key: which series a replay continues


# -- save-time check (coordinator) -------------------------------------------------------------


def _group_ranks(values: dict[int, Any]) -> str:
    groups: dict[Any, list[int]] = defaultdict(list)
    for rank, value in sorted(values.items()):
        groups[value].append(rank)
    return " vs ".join(f"ranks {','.join(map(str, ranks))}" for ranks in groups.values())


def _max_sample_diff(samples: list[list[float]]) -> str:
    n = min(len(s) for s in samples) if samples else 0
    if n == 0:
        return ""
    worst = max(abs(a - b) for i in range(n) for a in (samples[0][i],) for b in (s[i] for s in samples[1:]))
    return f"; max |difference| over {n} sampled elements: {worst:.6g}"


def check_save(item_summaries: list[ItemSummary], reports: list[SaveReport | None]) -> dict[str, dict[str, Any]]:
    """Refuse keys whose copies differ across ranks; return the manifest's per-key records.

    A key held by one rank only (most keys of a sharded job) gets its record and nothing else: only keys
    that several ranks hold are compared."""
    holder: dict[str, tuple[int, int]] = {}  # key -> (rank, row) of its first holder
    others: dict[str, list[int]] = {}  # key -> the ranks holding it, for keys held by several ranks
    for rank, summary in enumerate(item_summaries):
        for row, fqn in enumerate(summary.fqns):
            if fqn not in holder:
                holder[fqn] = (rank, row)
            else:  # a key is listed once per rank: a second holder is another rank
                more = others.get(fqn)
                if more is None:
                    others[fqn] = [holder[fqn][0], rank]
                else:
                    more.append(rank)
    have_content = all(r is not None for r in reports)
    if not have_content and len(reports) > 1:
        _warn_once("planner", "dcp_atomic: content checks (plain tensors, per-rank objects, diverged replicas) "
                   "need dcp.save(..., planner=AtomicSavePlanner()); only shapes and dtypes were compared")
    divergence = reports[0].divergence if have_content else "raise"
    globs = reports[0].layout_dependent if have_content else ()
    records: dict[str, dict[str, Any]] = {}
    for fqn in sorted(holder):
        rank, row = holder[fqn]
        summary = item_summaries[rank]
        kind = summary.kind(row)
        if kind == "object":
            record: dict[str, Any] = {"kind": "object"}
        else:
            shape, dtype = summary.signature(row)
            record = {"kind": kind, "shape": shape, "dtype": dtype}  # a tuple: see below
        if have_content:
            layout = reports[rank].keys.layouts.get(fqn)  # the lowest holder's report, as before
            if layout is not None:
                record.update(kind="dtensor", placements=layout[0], mesh_dim_names=layout[2], mesh_shape=layout[1])
        record["layout_dependent"] = bool(globs) and any(fnmatch.fnmatchcase(fqn, g) for g in globs)
        records[fqn] = record
    # The records outlive the save (the writer keeps them for a plan-caching series).  Made of str, int, bool
    # and tuples only, the collector untracks them at its first pass; with a list inside, every record stays
    # tracked, is promoted to the oldest generation and sets off a full collection inside DCP's next pickled
    # collective (the metadata broadcast: 0.4-2 s at 20k keys, measured).
    problems: list[str] = []
    per_rank: set[str] = set()
    for fqn in sorted(others):
        found = _compare_copies(fqn, others[fqn], item_summaries, reports if have_content else None)
        if found:
            problems.extend(found)
            per_rank.add(fqn)
    for fqn in per_rank:
        records[fqn]["per_rank"] = True
    if problems:
        message = (
            f"{len(problems)} key(s) hold different data on different ranks; DCP would keep one rank's copy and "
            "silently drop the others:\n  - " + "\n  - ".join(problems) +
            "\nFix: make sharded state a DTensor, or give each rank its own key (e.g. f'rng_state.rank{rank}'); "
            "for diverged replicas, find why data-parallel ranks drifted apart. To save rank-local state "
            "knowingly, use AtomicSavePlanner(divergence='warn') (CheckpointManager(allow_divergence=True))."
        )
        if divergence == "raise":
            raise ReshardError(message, keys=sorted(per_rank))
        log.warning("%s", message)
    return records


def _compare_copies(fqn: str, ranks: list[int], items: list[ItemSummary],
                    reports: list[SaveReport] | None) -> list[str]:
    """What is wrong with the copies of one key that several ranks hold (empty: nothing)."""
    kind = items[ranks[0]].kind(items[ranks[0]].row(fqn))
    if kind == "sharded" and reports is None:  # chunks of one key: nothing to compare without content
        return []
    holders = [(rank, items[rank].row(fqn)) for rank in ranks]
    if kind == "plain":
        shapes = {rank: items[rank].signature(row) for rank, row in holders}
        if len(set(shapes.values())) > 1:
            detail = ", ".join(f"rank {rank} {list(s)} {d}" for rank, (s, d) in sorted(shapes.items()))
            return [f"{fqn!r}: plain tensor with different shapes/dtypes across ranks ({detail})"]
    if reports is None:
        return []
    rows = {rank: reports[rank].keys.index(fqn) for rank, _ in holders}
    if kind in ("plain", "object"):
        prints = {rank: reports[rank].keys.fingerprint(i) for rank, i in rows.items()}
        if len(set(prints.values())) > 1:
            what = "plain tensor" if kind == "plain" else "object"
            return [f"{fqn!r}: {what} differs across ranks ({_group_ranks(prints)})"
                    + (_max_sample_diff(_samples(reports, rows)) if kind == "plain" else "")]
    if kind != "sharded":
        return []
    problems = []
    by_chunk: dict[tuple, dict[int, int]] = defaultdict(dict)
    for rank, row in holders:
        fingerprint = reports[rank].keys.fingerprint(rows[rank])
        if fingerprint is not None:
            by_chunk[items[rank].first_offset(row)][rank] = fingerprint
    for offset, prints in sorted(by_chunk.items()):
        if len(set(prints.values())) > 1:
            diverged = _samples(reports, {rank: rows[rank] for rank in prints})
            problems.append(f"{fqn!r}: replicas of chunk at offset {list(offset)} diverged "
                            f"({_group_ranks(prints)}){_max_sample_diff(diverged)}")
    return problems


def _samples(reports: list[SaveReport], rows: dict[int, int | None]) -> list[list[float]]:
    return [[] if i is None else reports[rank].keys.sample(i) for rank, i in rows.items()]


# -- load-time checks --------------------------------------------------------------------------


@dataclass
class LoadContext:
    """What the reader resolved, shared with AtomicLoadPlanner through the DCP Metadata object."""

    where: str
    saved: dict[str, Any] | None
    current: Parallelism | None
    allow_reshard: bool
    keys: dict[str, dict[str, Any]]
    layout_dependent: tuple[str, ...] = ()
    layout_checked: bool = False
    keys_checked: bool = False
    _changed: bool = field(default=False, repr=False)

    def check_layout(self) -> None:
        if not self.layout_checked:
            self._changed = check_layout(saved=self.saved, current=self.current, allow_reshard=self.allow_reshard,
                                         where=self.where)
            self.layout_checked = True

    @property
    def layout_changed(self) -> bool:
        return self._changed

    def check_keys(self, requested: dict[str, tuple[tuple[int, ...], torch.dtype] | None]) -> None:
        """Refuse every unsound key at once. ``requested`` maps fqn -> (global shape, dtype) or None if unknown."""
        self.check_layout()
        refused: list[str] = []
        for fqn, want in sorted(requested.items()):
            record = self.keys.get(fqn)
            if record is None:
                continue
            if want is not None and record.get("shape") is not None:
                shape, dtype = want
                if list(shape) != list(record["shape"]):
                    refused.append(f"{fqn!r}: global shape changed {record['shape']} -> {list(shape)}")
                    continue
                if self.layout_changed and str(dtype) != record.get("dtype"):
                    refused.append(f"{fqn!r}: dtype changed {record.get('dtype')} -> {dtype}")
                    continue
                lost = _lossy_cast(record.get("dtype"), dtype)
                if lost:
                    refused.append(f"{fqn!r}: saved as {record['dtype']}, the tensor it loads into is {dtype} ({lost})")
                    continue
            if not self.layout_changed:
                continue
            if record.get("per_rank"):
                refused.append(f"{fqn!r}: saved as per-rank plain data; it has no meaning under another layout")
            elif record.get("layout_dependent") or any(fnmatch.fnmatchcase(fqn, g) for g in self.layout_dependent):
                refused.append(f"{fqn!r}: declared layout-dependent (its layout depends on tensor_parallel_size)")
        self.keys_checked = True
        if refused:
            raise ReshardError(
                f"{self.where}: {len(refused)} key(s) cannot be loaded soundly:\n  - " + "\n  - ".join(refused) +
                "\nConvert them offline (for the new layout, or to the dtype you want: load into a tensor of the "
                "saved dtype and cast it yourself), or drop them from the state dict you load.",
                keys=[r.split("'")[1] for r in refused],
            )


def _lossy_cast(saved: str | None, target: torch.dtype) -> str | None:
    """Why loading a ``saved`` (its ``str(dtype)``) tensor into a ``target`` one loses what it holds, or None:
    DCP copies into the target tensor, casting silently.  Float to float (a precision change the user chose) is
    allowed; float or complex into integer or bool truncates, complex into real drops the imaginary part."""
    stored = getattr(torch, saved.removeprefix("torch."), None) if isinstance(saved, str) else None
    if not isinstance(stored, torch.dtype):
        return None
    if (stored.is_floating_point or stored.is_complex) and not (target.is_floating_point or target.is_complex):
        return ("every value would become True or False" if target == torch.bool
                else "every value would be truncated to an integer")
    if stored.is_complex and not target.is_complex:
        return "the imaginary parts would be dropped"
    return None


def check_layout(*, saved: dict[str, Any] | None, current: Parallelism | None, allow_reshard: bool,
                 where: str) -> bool:
    """Apply the layout policy; returns True when tp, pp or ep changed (with consent).  A cp change is a
    data-parallel one: weights are replicated or FSDP-sharded across cp (see :mod:`~dcp_atomic.format.parallelism`)."""
    if saved is None and current is None:  # nothing declared on either side: nothing asked for, nothing to check
        log.info("%s: no parallel layout declared at save or load; layout check not applicable", where)
        return False
    if saved is None or current is None:
        missing = "the checkpoint" if saved is None else "this job"
        _warn_once(missing, "%s: parallel layout check skipped (%s has no declared or inferable Parallelism)",
                   where, missing)
        return False
    before = Parallelism.from_dict(saved)
    if (before.tp, before.pp, before.ep) == (current.tp, current.pp, current.ep):
        if (before.world_size, before.dp, before.cp) != (current.world_size, current.dp, current.cp):
            log.info("%s: data-parallel reshard %s -> %s", where, before.describe(), current.describe())
        return False
    if not allow_reshard:
        raise ReshardError(
            f"{where} was saved with {before.describe()}; this job has {current.describe()}; "
            "pass allow_reshard=True if intended (loading across a tensor/pipeline/expert-parallel size change "
            "without checking can produce silently wrong weights)",
            saved=before.to_dict(),
            current=current.to_dict(),
        )
    log.warning("%s: resharding with consent: %s -> %s", where, before.describe(), current.describe())
    return True
