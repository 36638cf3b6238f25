"""``dcp-atomic diff``: which keys two committed steps of a run add, remove, change or keep, and by how much.

Why digests first: a model's steps share most of their bytes (frozen layers, embeddings, counters that did not
move), and reading two multi-GB steps to learn that is what an operator cannot afford on an object store.  Each
manifest records every item's block digests (P5) beside its encoding, so a key whose items agree in both steps —
same chunks, same digests, same codec, same stored dtype and shape — is unchanged without a byte of it being read.
Only the keys whose records differ are read, once per step, through the reader (every block checked against its
digest, non-tensor items decoded through the allow-list, P11), and compared: tensors by their largest absolute
difference, everything else by equality.  Digests prove "unchanged" only for the bytes as recorded; ``verify``
first (``check_both``) re-reads every byte of both steps and refuses a damaged one by name, as ``dcp-atomic
verify`` does.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .._base.retry import Deadline
from ..errors import CorruptCheckpointError
from ..format.manifest import Manifest
from .export import StepTensors


@dataclass
class KeyChange:
    """One key whose stored records differ between the steps, as read and compared."""

    key: str
    kind: str  # "tensor" | "object"
    max_abs: float | None = None  # tensors of one shape: max |b - a|, in float64
    relative: float | None = None  # max_abs / max |a| (None when a is all zeros and so is the difference)
    dtype: list[str] | None = None  # [a, b] when the dtype changed
    shape: list[list[int]] | None = None  # [a, b] when the shape changed (then no difference is computed)
    equal: bool | None = None  # objects: whether the decoded values are equal


@dataclass
class StepDiff:
    run: str
    step_a: int
    save_a: str
    step_b: int
    save_b: str
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    changed: list[KeyChange] = field(default_factory=list)  # largest max-abs difference first, then the rest
    unchanged: list[str] = field(default_factory=list)
    unchanged_by_digest: int = 0  # of ``unchanged``: decided from the manifests, no byte read
    bytes_read: int = 0  # data bytes the comparison read from storage, both steps (not ``check_both``'s re-read)
    tolerance: float = 0.0
    verified: bool = False  # both steps re-read whole and every digest checked first

    def to_dict(self) -> dict[str, Any]:
        body = asdict(self)
        body["counts"] = {"added": len(self.added), "removed": len(self.removed), "changed": len(self.changed),
                          "unchanged": len(self.unchanged)}
        return body


def diff_steps(root: str, run_id: str, step_a: int, step_b: int, *, timeout: float = 10.0,
               storage_options: dict[str, Any] | None = None, tolerance: float = 0.0,
               check_both: bool = False) -> StepDiff:
    """Compare committed steps ``step_a`` and ``step_b`` of one run.  A tensor whose values differ by at most
    ``tolerance`` counts as unchanged; ``check_both``: verify both steps whole first (a damaged one is refused)."""
    a = StepTensors(root, run_id, step_a, timeout=timeout, storage_options=storage_options)
    b = StepTensors(root, run_id, step_b, timeout=timeout, storage_options=storage_options)
    if check_both:
        for side in (a, b):
            _refuse_damaged(side, timeout)
    keys_a, keys_b = a.metadata.state_dict_metadata, b.metadata.state_dict_metadata
    result = StepDiff(run_id, a.step, a.save_id, b.step, b.save_id, tolerance=tolerance, verified=check_both,
                      added=sorted(set(keys_b) - set(keys_a)), removed=sorted(set(keys_a) - set(keys_b)))
    records_a, records_b = _records(_manifest(a, timeout)), _records(_manifest(b, timeout))
    for key in sorted(set(keys_a) & set(keys_b)):
        if _encoding(keys_a[key]) == _encoding(keys_b[key]) and records_a.get(key) == records_b.get(key):
            result.unchanged.append(key)
            result.unchanged_by_digest += 1
            continue
        change = _compare(key, a, b)
        if _within(change, tolerance):
            result.unchanged.append(key)
        else:
            result.changed.append(change)
    result.changed.sort(key=lambda c: (c.max_abs is None, -(c.max_abs or 0.0), c.key))  # then dtype, shape, objects
    result.bytes_read = a.bytes_read + b.bytes_read
    return result


def _manifest(side: StepTensors, timeout: float) -> Manifest:
    """The step's manifest with every rank's items (each shard checked against the digest the manifest holds)."""
    committed = side.reader.committed
    committed.load_items(side.reader.layout, None, Deadline(timeout))
    return committed.manifest


def _records(manifest: Manifest) -> dict[str, list[tuple]]:
    """Per key, what its stored bytes are: each chunk's offset and encoding with its block digests, in order."""
    records: dict[str, list[tuple]] = {}
    for entry in manifest.files:
        for item in entry.items:
            records.setdefault(item.key, []).append(
                (item.chunk_offset or [], item.chunk_sizes, item.kind, item.format, item.codec, item.planes,
                 item.dtype, item.logical, tuple(item.checksums)))
    return {key: sorted(chunks, key=lambda c: c[0]) for key, chunks in records.items()}


def _encoding(md: Any) -> tuple:
    """A key's dtype and shape as ``.metadata`` plans it (a tensor), or its kind (anything else)."""
    if isinstance(md, TensorStorageMetadata):
        return "tensor", str(md.properties.dtype), tuple(md.size)
    return (type(md).__name__,)


def _compare(key: str, a: StepTensors, b: StepTensors) -> KeyChange:
    tensor_a = isinstance(a.metadata.state_dict_metadata[key], TensorStorageMetadata)
    tensor_b = isinstance(b.metadata.state_dict_metadata[key], TensorStorageMetadata)
    if not (tensor_a and tensor_b):  # an object on either side: equal or not, nothing to subtract
        value_a = a.load(key) if tensor_a else a.load_object(key)
        value_b = b.load(key) if tensor_b else b.load_object(key)
        return KeyChange(key, "object", equal=_same(value_a, value_b))
    x, y = a.load(key), b.load(key)
    change = KeyChange(key, "tensor")
    if x.dtype != y.dtype:
        change.dtype = [str(x.dtype).removeprefix("torch."), str(y.dtype).removeprefix("torch.")]
    if x.shape != y.shape:
        change.shape = [list(x.shape), list(y.shape)]
        return change
    change.max_abs, change.relative = _difference(x, y)
    return change


def _difference(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float | None]:
    """max |y - x| and that relative to max |x|, in float64 (complex128 for complex); NaN where only one is NaN."""
    wide = torch.complex128 if x.is_complex() or y.is_complex() else torch.float64
    x, y = x.to(wide), y.to(wide)
    if not x.numel():
        return 0.0, 0.0
    delta = (y - x).abs()
    delta[torch.isnan(x) & torch.isnan(y)] = 0.0
    delta[(x == y)] = 0.0  # equal infinities: inf - inf is NaN, not a difference
    max_abs = float(delta.max())
    scale = float(x.abs().nan_to_num(0.0, 0.0, 0.0).max())
    if scale == 0.0:
        return max_abs, 0.0 if max_abs == 0.0 else None
    return max_abs, max_abs / scale


def _within(change: KeyChange, tolerance: float) -> bool:
    if change.kind == "object":
        return bool(change.equal)
    return change.dtype is None and change.shape is None and change.max_abs is not None and change.max_abs <= tolerance


def _same(x: Any, y: Any) -> bool:
    """Equality of decoded values that may hold tensors (whose ``==`` is elementwise)."""
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == y.dtype
                and x.shape == y.shape and bool(torch.equal(x, y)))
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(_same(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(_same(p, q) for p, q in zip(x, y))
    try:
        return bool(x == y)
    except Exception:  # noqa: BLE001 - a type whose == raises or is ambiguous: not provably equal
        return False


def _refuse_damaged(side: StepTensors, timeout: float) -> None:
    """Re-read the whole step as ``dcp-atomic verify`` does; a damaged one is refused, naming what failed."""
    from .audit import audit_step

    report = audit_step(side.reader.layout, side.step, timeout=timeout)
    if not report.ok:
        shown = "; ".join(report.problems[:3]) + (f" (+{len(report.problems) - 3} more)" if len(report.problems) > 3
                                                  else "")
        raise CorruptCheckpointError(
            f"step {side.step} of run {side.reader.layout.run_id!r} fails verification, so it is not compared: "
            f"{shown}. `dcp-atomic verify ROOT {side.reader.layout.run_id} {side.step}` lists every problem; compare "
            "another step", step=side.step, path=side.reader.layout.step_dir(side.step))
