"""Export a committed step for tools outside DCP: one ``torch.save`` file, or Hugging Face safetensors shards.

The safetensors export streams: the layout of every shard (names, shapes, dtypes,
byte offsets) follows from DCP's ``.metadata`` alone, so each shard's header is
written first and each tensor is then loaded (through :class:`AtomicStorageReader`,
every block verified), cast, appended and freed.  Peak memory is one tensor, not
one shard and not the model (measured: see the README).  ``safetensors.torch.save_file``
would need a whole shard in memory, so the format (an 8-byte header length, a JSON
header, raw little-endian bytes) is written here directly and needs no dependency;
the tests load every shard with the ``safetensors`` package itself.

Names are what decide whether ``transformers`` loads the export: a model saved as
``{"model": model.state_dict()}`` is stored under ``model.<name>``, which no Hugging Face
class expects.  ``renames`` (``--strip-prefix``, ``--rename``) map stored names to exported
ones, and ``ties`` write tied weights once, under the name the model owns them by, as
``save_pretrained`` does.  Every request that cannot be met as asked (a rule that matches no
key, two keys becoming one name, a tie between tensors that differ) is refused by name
before a byte is written: a quietly wrong name surfaces only later, as a freshly initialised
layer.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import math
import os
import re
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .._base import internals
from .._base.gc_pause import STORAGE, leave
from ..format.codec import tensor_bytes
from ..errors import CheckpointError, ConfigurationError
from ..stores.storage import publish_stream

INDEX_NAME = "model.safetensors.index.json"
DEFAULT_SHARD_SIZE = "5GB"  # transformers' default max_shard_size

#: torch dtype -> safetensors dtype name (the safetensors specification's names)
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
}

#: names accepted by ``--dtype``
CAST_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
               "fp32": torch.float32, "float32": torch.float32}

_SIZE = re.compile(r"(\d+)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)?", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5 * 10**9, ``"500MiB"`` -> 500 * 2**20, as transformers reads ``max_shard_size``."""
    match = _SIZE.fullmatch(text.strip())
    if not match or int(match.group(1)) < 1:
        raise ValueError(f"invalid size {text!r}: expected a positive number with an optional unit (5GB, 500MiB, 4096)")
    return int(match.group(1)) * _UNITS[(match.group(2) or "").lower()]


# -- reading one tensor at a time -------------------------------------------------------------------------------


class StepTensors:
    """One committed step opened once, its tensors loaded one at a time at full (unsharded) size.

    Drives the reader through DCP's storage-reader protocol in this process
    (read_metadata once, then one plan per key), so the marker, manifest and
    ``.metadata`` are resolved and checked once, not once per key.
    """

    def __init__(self, root: str, run_id: str, step: int, *, timeout: float,
                 storage_options: dict[str, Any] | None = None) -> None:
        from ..dcp.reader import AtomicStorageReader

        self.reader = AtomicStorageReader(root, run_id, step, timeout=timeout, storage_options=storage_options)
        self.metadata = self.reader.read_metadata()
        self.reader.set_up_storage_reader(self.metadata, True)
        leave(STORAGE)  # set_up begins a load's GC lease (gc_pause); reads here come one key at a time, or never
        self.bytes_read = 0  # data bytes read from storage by load() and load_object(), all keys

    @property
    def step(self) -> int:
        return self.reader.step

    @property
    def save_id(self) -> str:
        return self.reader.save_id

    def tensor_keys(self) -> dict[str, TensorStorageMetadata]:
        return {k: md for k, md in self.metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)}

    def other_keys(self) -> list[str]:
        return [k for k, md in self.metadata.state_dict_metadata.items() if not isinstance(md, TensorStorageMetadata)]

    def load(self, key: str) -> torch.Tensor:
        md = self.metadata.state_dict_metadata[key]
        return self._read(key, torch.empty(tuple(md.size), dtype=md.properties.dtype))

    def load_object(self, key: str) -> Any:
        """A non-tensor item, decoded through the reader's allow-list (P11), never ``pickle.loads``."""
        return self._read(key, None)

    def _read(self, key: str, target: Any) -> Any:
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        planner = DefaultLoadPlanner(flatten_state_dict=False)
        planner.set_up_planner({key: target}, self.metadata, True)
        plan = self.reader.prepare_local_plan(planner.create_local_plan())
        plan = self.reader.prepare_global_plan(planner.create_global_plan([plan]))[0]
        self.reader.read_data(planner.finish_plan(plan), planner).wait()
        self.bytes_read += self.reader.read_stats.storage_bytes  # read_data starts its count afresh
        return planner.state_dict[key] if target is None else target  # a tensor is filled in place


# -- safetensors -------------------------------------------------------------------------------------------------


@dataclass
class _Entry:
    key: str  # as stored in the checkpoint
    shape: list[int]
    dtype: torch.dtype  # as exported (after --dtype)
    name: str = ""  # as exported (after renames); the stored key when empty

    def __post_init__(self) -> None:
        self.name = self.name or self.key

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * math.prod(self.shape)


@dataclass
class ExportReport:
    out_dir: str
    step: int
    save_id: str
    files: list[str]
    total_size: int
    skipped: list[str] = field(default_factory=list)  # non-tensor keys
    renamed: dict[str, str] = field(default_factory=dict)  # stored key -> exported name, where they differ
    tied: list[tuple[str, str]] = field(default_factory=list)  # (alias left out, name it was written under)


def export_safetensors(root: str, run_id: str, step: int, out_dir: str, *, shard_size: int | str = DEFAULT_SHARD_SIZE,
                       dtype: str | torch.dtype | None = None, keys: Iterable[str] = (),
                       renames: Iterable[tuple[str, str]] = (), ties: Iterable[tuple[str, str]] = (),
                       force: bool = False, timeout: float = 10.0, storage_options: dict[str, Any] | None = None,
                       note: Callable[[str], None] | None = None, progress: Progress | None = None) -> ExportReport:
    """Write ``model-0000k-of-0000n.safetensors`` shards and ``model.safetensors.index.json`` into ``out_dir``.

    ``keys``: globs of the stored keys to export (default: every tensor); ``dtype``: cast floating tensors to it;
    ``shard_size``: bytes per shard (a tensor larger than that gets a shard of its own, as in transformers).
    ``renames``: ``(old, new)`` rules applied in order to every exported name that starts with ``old`` (``new=""``
    strips a prefix); ``ties``: ``(alias, target)`` exported names holding one tied weight, written once under
    ``target`` after checking the two are bit-identical.  ``force`` replaces an export already in ``out_dir``
    (otherwise refused).  Non-tensor keys are skipped and named through ``note`` (default: stderr).  Shards are
    written atomically (temp + fsync + rename), the index last: a directory with an index holds a complete export.
    ``progress``: given the bytes to export, the callable that hears of each tensor's bytes as they are written.
    """
    limit = parse_size(shard_size) if isinstance(shard_size, str) else shard_size
    if isinstance(dtype, str) and dtype not in CAST_DTYPES:
        raise ConfigurationError(f"unknown dtype {dtype!r}: use one of {sorted(CAST_DTYPES)}")
    target = CAST_DTYPES[dtype] if isinstance(dtype, str) else dtype
    note = note or (lambda text: print(text, file=sys.stderr))
    existing = existing_export(out_dir)
    if existing and not force:
        raise ConfigurationError(
            f"{out_dir} already holds an export ({_describe(existing)}); nothing was written: choose another "
            "directory, or pass --force (force=True) to replace it",
            path=out_dir)
    source = StepTensors(root, run_id, step, timeout=timeout, storage_options=storage_options)
    where = f"run {run_id!r} step {source.step}"
    globs = list(keys)

    def wanted(key: str) -> bool:
        return not globs or any(fnmatch.fnmatchcase(key, g) for g in globs)

    entries = []
    for key, md in source.tensor_keys().items():
        if wanted(key):
            cast = target if target is not None and md.properties.dtype.is_floating_point else md.properties.dtype
            if cast not in SAFETENSORS_DTYPES:
                raise ConfigurationError(f"{where}: key {key!r} is {cast}, which safetensors cannot hold; "
                                         "leave it out with --keys", key=key)
            entries.append(_Entry(key, list(md.size), cast))
    skipped = [k for k in source.other_keys() if wanted(k)]
    if not entries:
        available = sorted(source.tensor_keys())
        raise ConfigurationError(
            f"{where}: no tensor key matches {globs}; it has {len(available)} tensor key(s), e.g. "
            + ", ".join(repr(k) for k in available[:8]), keys=globs)
    _rename(entries, list(renames), where)
    tied = _tie(entries, list(ties), source, where)
    if skipped:
        note(f"skipping {len(skipped)} non-tensor key(s) (safetensors holds tensors only): "
             + ", ".join(repr(k) for k in skipped[:10]) + (", ..." if len(skipped) > 10 else ""))
    shards = _plan_shards(entries, limit)
    os.makedirs(out_dir, exist_ok=True)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for stale in (INDEX_NAME, SINGLE_FILE_NAME):  # first, so the directory never claims an export that mixes two
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(out_dir, stale))
    tick = progress(sum(e.nbytes for e in entries)) if progress is not None else _no_progress
    for name, shard in zip(names, shards):
        _write_shard(os.path.join(out_dir, name), shard, source, tick)
    index = {"metadata": {"total_size": sum(e.nbytes for e in entries)},
             "weight_map": {e.name: name for name, shard in zip(names, shards) for e in shard}}
    _publish_bytes(os.path.join(out_dir, INDEX_NAME), json.dumps(index, indent=2).encode() + b"\n")
    for stale in set(existing) - set(names) - {INDEX_NAME}:  # a replaced export's other shards
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(out_dir, stale))
    renamed = {e.key: e.name for e in entries if e.name != e.key}
    return ExportReport(out_dir, source.step, source.save_id, names, index["metadata"]["total_size"], skipped,
                        renamed, tied)


SINGLE_FILE_NAME = "model.safetensors"  # what save_pretrained writes for one shard; from_pretrained prefers it
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def existing_export(out_dir: str) -> list[str]:
    """The files of a Hugging Face weights export in ``out_dir`` (index, shards, single file), sorted."""
    try:
        found = os.listdir(out_dir)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(f for f in found if f in (INDEX_NAME, SINGLE_FILE_NAME) or _SHARD_NAME.fullmatch(f))


def _describe(files: list[str]) -> str:
    shards = [f for f in files if _SHARD_NAME.fullmatch(f)]
    return ", ".join([f for f in files if f not in shards] + ([f"{len(shards)} shard file(s)"] if shards else []))


def _rename(entries: list[_Entry], rules: list[tuple[str, str]], where: str) -> None:
    """Apply ``(old, new)`` prefix rules in order; refuse a rule that matches nothing, an empty name, a collision."""
    for old, new in rules:
        if not old:
            raise ConfigurationError("a rename needs a non-empty prefix to replace (--strip-prefix '' / --rename =NEW)")
        hits = [e for e in entries if e.name.startswith(old)]
        if not hits:
            shown = ", ".join(repr(e.name) for e in entries[:8])
            raise ConfigurationError(
                f"{where}: {_rule(old, new)} matches no exported key (names at that point: {shown}"
                f"{', ...' if len(entries) > 8 else ''}); nothing was written", prefix=old)
        for e in hits:
            e.name = new + e.name[len(old):]
    empty = [e.key for e in entries if not e.name]
    if empty:
        raise ConfigurationError(f"{where}: renaming leaves key(s) {empty} with an empty name; nothing was written",
                                 keys=empty)
    by_name: dict[str, list[str]] = {}
    for e in entries:
        by_name.setdefault(e.name, []).append(e.key)
    clashes = {name: found for name, found in by_name.items() if len(found) > 1}
    if clashes:
        shown = "; ".join(f"{' and '.join(map(repr, found))} -> {name!r}" for name, found in list(clashes.items())[:5])
        raise ConfigurationError(
            f"{where}: after renaming, {len(clashes)} exported name(s) would hold more than one key ({shown}"
            f"{'; ...' if len(clashes) > 5 else ''}); "
            "narrow --keys or the rename rules; nothing was written", keys=sorted(clashes))


def _rule(old: str, new: str) -> str:
    return f"--strip-prefix {old!r}" if not new else f"--rename {old!r}={new!r}"


def _tie(entries: list[_Entry], ties: list[tuple[str, str]], source: StepTensors,
         where: str) -> list[tuple[str, str]]:
    """Leave each ``alias`` out after checking it is bit-identical to ``target`` (both exported names)."""
    by_name = {e.name: e for e in entries}
    done = []
    for alias, target in ties:
        missing = [n for n in (alias, target) if n not in by_name]
        if missing or alias == target:
            raise ConfigurationError(
                f"{where}: --tie {alias}={target}: " + (f"no exported key named {missing} (exported names, e.g. "
                + ", ".join(repr(n) for n in list(by_name)[:8]) + ")" if missing else "a key cannot be tied to itself")
                + "; nothing was written", keys=missing or [alias])
        a, t = by_name[alias], by_name[target]
        if (a.shape, a.dtype) != (t.shape, t.dtype) or not _same_bits(source.load(a.key), source.load(t.key)):
            raise ConfigurationError(
                f"{where}: --tie {alias}={target}: the two are not the same tensor (stored keys {a.key!r} "
                f"{a.shape} {a.dtype} and {t.key!r} {t.shape} {t.dtype} differ); an untied model needs both, so "
                "drop --tie; nothing was written", keys=[a.key, t.key])
        entries.remove(by_name.pop(alias))
        done.append((alias, target))
    return done


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same bytes (NaN payloads and -0.0 included), which ``torch.equal`` alone does not check."""
    flat = lambda t: t.contiguous().reshape(-1).view(torch.uint8) if t.dtype != torch.bool else t.reshape(-1)  # noqa: E731
    return torch.equal(flat(a), flat(b))


def _plan_shards(entries: list[_Entry], limit: int) -> list[list[_Entry]]:
    """Greedy in key order, as transformers shards: a new shard when the next tensor would overflow this one."""
    shards: list[list[_Entry]] = [[]]
    size = 0
    for entry in entries:
        if shards[-1] and size + entry.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.nbytes
    return shards


def _header(shard: list[_Entry]) -> bytes:
    """The safetensors header: JSON padded with spaces to 8 bytes, after its little-endian u64 length."""
    offset, described = 0, {"__metadata__": {"format": "pt"}}
    for e in shard:
        described[e.name] = {"dtype": SAFETENSORS_DTYPES[e.dtype], "shape": e.shape,
                            "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    text = json.dumps(described, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def _write_shard(path: str, shard: list[_Entry], source: StepTensors, tick: Callable[[int], Any]) -> None:
    def write(f) -> None:
        f.write(_header(shard))
        for entry in shard:
            tensor = source.load(entry.key).to(entry.dtype).resolve_conj().resolve_neg().contiguous()
            if tensor.nbytes != entry.nbytes:  # .metadata and the loaded tensor disagree: never a short shard
                raise CheckpointError(f"{entry.key!r} loaded as {tensor.nbytes} bytes, planned {entry.nbytes}",
                                      key=entry.key)
            f.write(tensor_bytes(tensor))
            tick(entry.nbytes)
            del tensor

    publish_stream(path, write)


def _publish_bytes(path: str, data: bytes) -> None:
    publish_stream(path, lambda f: f.write(data))


# -- one torch.save file -----------------------------------------------------------------------------------------


def export_torch(root: str, run_id: str, step: int, out: str, *, timeout: float = 10.0,
                 storage_options: dict[str, Any] | None = None, force: bool = False,
                 progress: Progress | None = None) -> tuple[int, str]:
    """The whole (unsharded) state dict of a step in one ``torch.save`` file; returns (step, save_id).

    An existing ``out`` is refused unless ``force`` (then replaced atomically).  ``progress``: given twice the bytes
    of the step's tensors, the callable that hears of each tensor as it is read, then of the bytes written."""
    if os.path.exists(out) and not force:
        raise ConfigurationError(f"{out} already exists; nothing was written: choose another path, or pass --force "
                                 "(force=True) to replace it", path=out)
    from torch.distributed.checkpoint.api import CheckpointException

    from ..dcp.reader import AtomicStorageReader

    warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
    reader = AtomicStorageReader(root, run_id, step, timeout=timeout, storage_options=storage_options)
    reader.resolve()
    tick = _no_progress
    if progress is not None:
        sizes = [md.size.numel() * md.properties.dtype.itemsize for md in reader.read_metadata().state_dict_metadata
                 .values() if isinstance(md, TensorStorageMetadata)]
        tick = progress(2 * sum(sizes))
        _count_reads(reader, tick)
    try:
        state = internals.load_state_dict_from_keys(storage_reader=reader)
    except CheckpointException as e:  # DCP wraps each rank's failure as (exception, traceback)
        raise _first_cause(e) from None
    publish_stream(out, lambda f: torch.save(state, _Counting(f, tick)))
    return reader.step, reader.save_id


Progress = Callable[[int], Callable[[int], Any]]  # given the total bytes, what hears of each part done


def _no_progress(n: int) -> None:
    """No progress to tell."""


def _count_reads(reader: Any, tick: Callable[[int], Any]) -> None:
    """Each tensor ``reader`` hands DCP's planner counts as read (this reader instance only)."""
    read_data = reader.read_data

    def counted(plan: Any, planner: Any) -> Any:
        commit = planner.commit_tensor

        def commit_tensor(read_item: Any, tensor: torch.Tensor) -> None:
            commit(read_item, tensor)
            tick(tensor.numel() * tensor.element_size())

        planner.commit_tensor = commit_tensor
        return read_data(plan, planner)

    reader.read_data = counted


class _Counting:
    """A file ``torch.save`` writes to, each write counted."""

    def __init__(self, f: Any, tick: Callable[[int], Any]) -> None:
        self._f, self._tick = f, tick

    def write(self, data: Any) -> int:
        written = self._f.write(data)
        self._tick(len(memoryview(data).cast("B")))
        return written

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


def _first_cause(e) -> Exception:
    causes = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
    cause = causes[0] if causes else e
    if isinstance(cause, (CheckpointError, OSError, ValueError)):
        return cause
    return CheckpointError("; ".join(f"{type(c).__name__}: {c}" for c in causes) or str(e))
