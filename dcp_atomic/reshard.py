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
"""

from __future__ import annotations

import fnmatch
import logging
import math
import pickle
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from .errors import ConfigurationError, ReshardError
from .parallelism import Parallelism

log = logging.getLogger(__name__)
_warned: set[str] = set()

SAMPLE_ELEMENTS = 1 << 16  # elements hashed per tensor: exact below this, strided sample above
SAMPLE_VALUES = 32  # values shipped to the coordinator to say how far diverged copies differ


def _warn_once(key: str, message: str, *args) -> None:
    if key not in _warned:  # a warning on every save/load would be noise
        _warned.add(key)
        log.warning(message, *args)


# -- per-rank summaries (computed where the data is) -----------------------------------------


def summarize_items(items) -> dict[str, dict[str, Any]]:
    """What the storage layer sees of a rank's plan: kind, global shape, dtype, chunk offsets."""
    from torch.distributed.checkpoint.planner import WriteItemType

    summary: dict[str, dict[str, Any]] = {}
    for item in items:
        fqn = item.index.fqn
        if item.type == WriteItemType.BYTE_IO:
            summary[fqn] = {"kind": "object"}
            continue
        data = item.tensor_data
        record = summary.setdefault(fqn, {
            "kind": "plain" if item.type == WriteItemType.TENSOR else "sharded",
            "shape": list(data.size),
            "dtype": str(data.properties.dtype),
            "chunks": [],
        })
        record["chunks"].append([list(data.chunk.offsets), list(data.chunk.sizes)])
    return summary


def _tensor_fingerprint(tensor: torch.Tensor) -> dict[str, Any]:
    flat = tensor.detach().reshape(-1)
    stride = max(1, math.ceil(flat.numel() / SAMPLE_ELEMENTS))
    sample = flat[::stride].to("cpu").contiguous()
    digest = xxhash.xxh3_64(f"{tuple(tensor.shape)}|{tensor.dtype}".encode())
    if sample.numel():
        digest.update(sample.view(torch.uint8).numpy() if sample.dtype != torch.bool else sample.numpy())
    values = sample[:: max(1, sample.numel() // SAMPLE_VALUES)][:SAMPLE_VALUES]
    if values.is_complex():
        values = values.abs()
    return {"fingerprint": digest.hexdigest(), "sample": values.to(torch.float64).tolist() if values.numel() else []}


def summarize_state_dict(state_dict: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Content-level summary of a flattened state dict (needs the data: runs in the planner)."""
    from torch.distributed.tensor import DTensor, Replicate

    summary: dict[str, dict[str, Any]] = {}
    for fqn, value in state_dict.items():
        if isinstance(value, DTensor):
            mesh = value.device_mesh
            record: dict[str, Any] = {
                "kind": "dtensor",
                "placements": [repr(p) for p in value.placements],
                "mesh_shape": list(mesh.mesh.shape),
                "mesh_dim_names": list(mesh.mesh_dim_names or ()),
            }
            if any(isinstance(p, Replicate) for p in value.placements):  # replicas exist: compare them
                record.update(_tensor_fingerprint(value.to_local()))
            summary[fqn] = record
        elif isinstance(value, torch.Tensor):
            summary[fqn] = {"kind": "plain", **_tensor_fingerprint(value)}
        else:
            try:
                blob = canonical_bytes(value)
            except Exception:  # unpicklable objects are DCP's problem, not a content check's
                continue
            summary[fqn] = {"kind": "object", "fingerprint": xxhash.xxh3_64_hexdigest(blob)}
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
    return part(b"pickle", pickle.dumps(value, protocol=4))


_SCALARS = (type(None), bool, int, float, complex, str, bytes)


def infer_parallelism(state_dict: dict[str, Any]) -> Parallelism | None:
    """The layout implied by the named device meshes of the state dict's DTensors.

    None (with a warning naming them) where a mesh dim name is not one :data:`.parallelism.MESH_DIM_ROLES`
    knows, or the meshes contradict each other: the checks that need the layout are then skipped, never run
    against a guess.  A mesh without names says nothing and is skipped silently, as before."""
    from torch.distributed.tensor import DTensor

    meshes: dict[tuple, tuple] = {}
    for value in state_dict.values():
        if isinstance(value, DTensor):
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

    keys: dict[str, dict[str, Any]]
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


def _max_sample_diff(records: list[dict]) -> str:
    samples = [r.get("sample") or [] for r in records]
    n = min(len(s) for s in samples) if samples else 0
    if n == 0:
        return ""
    worst = max(abs(a - b) for i in range(n) for a in (samples[0][i],) for b in (s[i] for s in samples[1:]))
    return f"; max |difference| over {n} sampled elements: {worst:.6g}"


def check_save(item_summaries: list[dict], reports: list[SaveReport | None]) -> dict[str, dict[str, Any]]:
    """Refuse keys whose copies differ across ranks; return the manifest's per-key records."""
    records: dict[str, dict[str, Any]] = {}
    holders: dict[str, dict[int, dict]] = defaultdict(dict)
    for rank, summary in enumerate(item_summaries):
        for fqn, record in summary.items():
            holders[fqn][rank] = record
    have_content = all(r is not None for r in reports)
    if not have_content and len(reports) > 1:
        _warn_once("planner", "dcp_atomic: content checks (plain tensors, per-rank objects, diverged replicas) "
                   "need dcp.save(..., planner=AtomicSavePlanner()); only shapes and dtypes were compared")
    divergence = reports[0].divergence if have_content else "raise"
    globs = reports[0].layout_dependent if have_content else ()
    problems: list[str] = []
    per_rank: set[str] = set()
    for fqn, by_rank in sorted(holders.items()):
        first = next(iter(by_rank.values()))
        content = {rank: reports[rank].keys.get(fqn, {}) for rank in by_rank} if have_content else {}
        record = {k: first[k] for k in ("kind", "shape", "dtype") if k in first}
        if content:
            sample = next(iter(content.values()))
            if sample.get("kind") == "dtensor":
                record.update(kind="dtensor", placements=sample["placements"], mesh_dim_names=sample["mesh_dim_names"],
                              mesh_shape=sample["mesh_shape"])
        record["layout_dependent"] = any(fnmatch.fnmatchcase(fqn, g) for g in globs)
        records[fqn] = record
        if len(by_rank) < 2:
            continue
        kind = first["kind"]
        if kind == "plain":
            shapes = {rank: (tuple(r["shape"]), r["dtype"]) for rank, r in by_rank.items()}
            if len(set(shapes.values())) > 1:
                detail = ", ".join(f"rank {rank} {list(s)} {d}" for rank, (s, d) in sorted(shapes.items()))
                problems.append(f"{fqn!r}: plain tensor with different shapes/dtypes across ranks ({detail})")
                per_rank.add(fqn)
                continue
        if kind in ("plain", "object") and content:
            prints = {rank: c.get("fingerprint") for rank, c in content.items()}
            if len(set(prints.values())) > 1:
                what = "plain tensor" if kind == "plain" else "object"
                problems.append(f"{fqn!r}: {what} differs across ranks ({_group_ranks(prints)})"
                                + (_max_sample_diff(list(content.values())) if kind == "plain" else ""))
                per_rank.add(fqn)
        elif kind == "sharded" and content:
            by_chunk: dict[tuple, dict[int, str]] = defaultdict(dict)
            for rank, r in by_rank.items():
                if content[rank].get("fingerprint"):
                    by_chunk[tuple(r["chunks"][0][0])][rank] = content[rank]["fingerprint"]
            for offset, prints in sorted(by_chunk.items()):
                if len(set(prints.values())) > 1:
                    diverged = [content[rank] for rank in prints]
                    problems.append(f"{fqn!r}: replicas of chunk at offset {list(offset)} diverged "
                                    f"({_group_ranks(prints)}){_max_sample_diff(diverged)}")
                    per_rank.add(fqn)
    for fqn in per_rank:
        records[fqn]["per_rank"] = True
    if problems:
        message = (
            f"{len(problems)} key(s) hold different data on different ranks; DCP would keep one rank's copy and "
            "silently drop the others:\n  - " + "\n  - ".join(problems) +
            "\nFix: make sharded state a DTensor, or give each rank its own key (e.g. f'rng_state.rank{rank}'); "
            "for diverged replicas, find why data-parallel ranks drifted apart. To save rank-local state "
            "knowingly, use AtomicSavePlanner(divergence='warn')."
        )
        if divergence == "raise":
            raise ReshardError(message, keys=sorted(per_rank))
        log.warning("%s", message)
    return records


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
                "\nConvert them offline for the new layout, or drop them from the state dict you load.",
                keys=[r.split("'")[1] for r in refused],
            )


def check_layout(*, saved: dict[str, Any] | None, current: Parallelism | None, allow_reshard: bool,
                 where: str) -> bool:
    """Apply the layout policy; returns True when tp, pp or ep changed (with consent).  A cp change is a
    data-parallel one: weights are replicated or FSDP-sharded across cp (see :mod:`.parallelism`)."""
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
