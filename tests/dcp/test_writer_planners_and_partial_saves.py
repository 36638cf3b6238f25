"""The writer: what a planner resolves, partial saves, the real cause of a failed write.

* A planner whose ``resolve_data`` casts or reshapes loads exactly what stock DCP loads, in every format;
  one that changes the element count is refused by name before anything commits.
* ``use_collectives=False`` and ``no_dist=True`` in a multi-rank world would commit one rank's shards as
  the whole checkpoint: both are refused on every rank before a byte is written.
* With several writer threads, a full disk surfaces as ``StorageError`` (errno 28), never as the internal
  abort of another thread.
"""

from __future__ import annotations

import errno
import glob
import os
import shutil
import tempfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from dcp_atomic import AtomicStorageReader, AtomicStorageWriter, ConfigurationError, StorageError, list_steps
from tests import manifest_view
from tests.harness import assert_all_ok, run_world

RUN = "exp"
BLOCK = 4 << 10  # small blocks: the tensors below span several blocks / zstd frames
FORMATS = {"raw": {}, "torch_save": {"stock_readable": True}, "zstd": {"compression": "zstd"}}


def _state() -> dict:
    torch.manual_seed(0)
    return {
        "w": torch.randn(64, 48),
        "b": torch.linspace(-1, 1, 3000),  # smooth: zstd really compresses it
        "ids": torch.arange(40, dtype=torch.int64).reshape(8, 5),
        "meta": {"epoch": 3},
    }


def _zeros(state: dict) -> dict:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"epoch": -1} for k, v in state.items()}


class _CastingPlanner(DefaultSavePlanner):
    """'Save as bf16': resolves every fp32 item as bfloat16 while the plan (and .metadata) say fp32."""

    def resolve_data(self, write_item):
        data = super().resolve_data(write_item)
        return data.to(torch.bfloat16) if isinstance(data, torch.Tensor) and data.dtype == torch.float32 else data


class _FlatteningPlanner(DefaultSavePlanner):
    """Resolves every tensor flattened: same elements, another shape than planned."""

    def resolve_data(self, write_item):
        data = super().resolve_data(write_item)
        return data.reshape(-1) if isinstance(data, torch.Tensor) else data


class _TruncatingPlanner(DefaultSavePlanner):
    """Resolves ``w`` with its last row missing: fewer elements than planned."""

    def resolve_data(self, write_item):
        data = super().resolve_data(write_item)
        return data[:-1] if write_item.index.fqn == "w" else data


class _ListPlanner(DefaultSavePlanner):
    """Resolves ``ids`` as a Python list: not a tensor at all."""

    def resolve_data(self, write_item):
        data = super().resolve_data(write_item)
        return data.tolist() if write_item.index.fqn == "ids" else data


def _save_ours(root: str, planner, **fmt) -> None:
    writer = AtomicStorageWriter(root, RUN, 1, block_size=BLOCK, thread_count=2, timeout=5, **fmt)
    dcp.save(_state(), storage_writer=writer, planner=planner)


def _load_ours(root: str) -> dict:
    target = _zeros(_state())
    dcp.load(target, storage_reader=AtomicStorageReader(root, RUN, 1, timeout=5))
    return target


def _manifest_items(root: str) -> dict[str, dict]:
    return {item["key"]: item for entry in manifest_view.load(_attempt_dir(root))["files"] for item in entry["items"]}


def _attempt_dir(root: str) -> str:
    (path,) = glob.glob(os.path.join(root, RUN, "step_*", "*", "manifest.json"))
    return os.path.dirname(path)


def _assert_same(loaded: dict, expected: dict) -> None:
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key
        else:
            assert loaded[key] == value, key


def _failures(exc: BaseException) -> list[BaseException]:
    return [wrapped[0] if isinstance(wrapped, tuple) else wrapped for wrapped in exc.failures.values()]


def _chain(exc: BaseException) -> list[BaseException]:
    """The exception, what DCP wrapped inside it, and every cause/context below."""
    found, todo = [], [exc]
    while todo:
        e = todo.pop()
        if e is None or any(e is seen for seen in found):
            continue
        found.append(e)
        if isinstance(e, CheckpointException):
            todo += _failures(e)
        todo += [e.__cause__, e.__context__]
    return found


# -- 1. what the planner resolves ----------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
def test_casting_planner_loads_what_stock_dcp_loads(root, fmt):
    """Needs the reader to decode the recorded stored dtype and cast (the reader's side of the casting planner)."""
    stock = tempfile.mkdtemp(dir=root)
    dcp.save(_state(), storage_writer=FileSystemWriter(stock), planner=_CastingPlanner())
    expected = _zeros(_state())
    dcp.load(expected, storage_reader=FileSystemReader(stock))
    assert not torch.equal(expected["w"], _state()["w"])  # the cast really loses precision

    _save_ours(root, _CastingPlanner(), **FORMATS[fmt])
    _assert_same(_load_ours(root), expected)


@pytest.mark.parametrize("fmt", FORMATS)
def test_casting_planner_records_the_stored_dtype(root, fmt):
    _save_ours(root, _CastingPlanner(), **FORMATS[fmt])
    items = _manifest_items(root)
    assert items["w"]["dtype"] == items["b"]["dtype"] == "torch.bfloat16"
    assert items["ids"]["dtype"] is None and items["meta.epoch"]["dtype"] is None
    if fmt != "torch_save":  # raw items record the bytes of the bf16 tensor actually stored
        assert items["w"]["logical_length"] == 64 * 48 * 2 and items["b"]["logical_length"] == 3000 * 2
    if fmt == "torch_save":  # torch's own reader opens our attempt and casts, exactly as for stock's files
        stock_loaded = _zeros(_state())
        dcp.load(stock_loaded, storage_reader=FileSystemReader(_attempt_dir(root)))
        _assert_same(stock_loaded, {k: v.to(torch.bfloat16).float() if k in ("w", "b") else v
                                    for k, v in _state().items()})


@pytest.mark.parametrize("fmt", FORMATS)
def test_reshaping_planner_stores_the_planned_shape(root, fmt):
    """Stock DCP cannot load a flattened item back at all (narrow_tensor_by_index fails on the shape it
    stored), so the reference is the state itself; with our torch.save format, torch's own reader agrees."""
    stock = tempfile.mkdtemp(dir=root)
    dcp.save(_state(), storage_writer=FileSystemWriter(stock), planner=_FlatteningPlanner())
    with pytest.raises(CheckpointException):
        dcp.load(_zeros(_state()), storage_reader=FileSystemReader(stock))

    _save_ours(root, _FlatteningPlanner(), **FORMATS[fmt])
    _assert_same(_load_ours(root), _state())
    assert all(item["dtype"] is None for item in _manifest_items(root).values())
    if fmt == "torch_save":
        stock_loaded = _zeros(_state())
        dcp.load(stock_loaded, storage_reader=FileSystemReader(_attempt_dir(root)))
        _assert_same(stock_loaded, _state())


@pytest.mark.parametrize("planner, key, resolved", [(_TruncatingPlanner, "w", "(63, 48)"),
                                                    (_ListPlanner, "ids", "list")])
@pytest.mark.parametrize("fmt", FORMATS)
def test_planner_changing_the_element_count_is_refused(root, fmt, planner, key, resolved):
    with pytest.raises(CheckpointException) as info:
        _save_ours(root, planner(), **FORMATS[fmt])
    (error,) = _failures(info.value)
    assert isinstance(error, ConfigurationError), error
    for part in (repr(key), "rank 0", resolved, "(8, 5)" if key == "ids" else "(64, 48)"):
        assert part in error.message, (part, error.message)
    assert list_steps(root, RUN) == []
    assert not glob.glob(os.path.join(root, RUN, "step_*", "COMMITTED"))


@pytest.mark.parametrize("fmt", FORMATS)
def test_manifest_records_every_item_with_its_key_and_chunk_offset_including_empty_ones(root, fmt):
    """Readers key items by (key, chunk offset): a zero-element item shares its file offset with the next one."""
    state = {"empty": torch.zeros(0, 3), "after": torch.arange(5.0), "scalar": torch.tensor(2.0), "b": {"x": 1}}
    writer = AtomicStorageWriter(root, RUN, 1, thread_count=1, timeout=5, **FORMATS[fmt])
    metadata = dcp.save(state, storage_writer=writer)
    extents = [(entry["name"], item) for entry in manifest_view.load(_attempt_dir(root))["files"]
               for item in entry["items"]]
    by_key = {(item["key"], None if item["chunk_offset"] is None else tuple(item["chunk_offset"])): (name, item)
              for name, item in extents}
    assert len(by_key) == len(extents) == len(metadata.storage_data) == 4
    for index, info in metadata.storage_data.items():
        name, item = by_key[(index.fqn, None if index.offset is None else tuple(index.offset))]
        assert (name, item["pos"], item["length"]) == (info.relative_path, info.offset, info.length), index
    empty = by_key[("empty", (0, 0))][1]
    assert empty["payload"] is None and (fmt == "torch_save" or empty["length"] == empty["logical_length"] == 0)


# -- 2. partial saves ----------------------------------------------------------------------------


def _partial_modes_then_normal(ctx):
    import torch.distributed as dist

    state = {"shared": torch.arange(6.0), f"own{ctx.rank}": torch.full((4,), float(ctx.rank))}
    outcome = {}
    for step, mode in ((1, {"use_collectives": False}), (2, {"no_dist": True})):
        try:
            dcp.save(state, storage_writer=AtomicStorageWriter(ctx.root, RUN, step, timeout=10), **mode)
            outcome[str(mode)] = "saved"
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            outcome[str(mode)] = [(type(x).__name__, str(x)) for x in _chain(e)]
        dist.barrier()
    outcome["steps_before"] = list_steps(ctx.root, RUN)
    outcome["files_before"] = sorted(os.path.relpath(p, ctx.root) for p in glob.glob(f"{ctx.root}/**", recursive=True)
                                     if os.path.isfile(p))
    dist.barrier()
    dcp.save(state, storage_writer=AtomicStorageWriter(ctx.root, RUN, 3, timeout=10))
    loaded = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(loaded, storage_reader=AtomicStorageReader(ctx.root, RUN, 3, timeout=10))
    outcome["loaded_ok"] = all(torch.equal(loaded[k], v) for k, v in state.items())
    outcome["steps_after"] = list_steps(ctx.root, RUN)
    return outcome


def test_partial_save_modes_are_refused_on_every_rank_before_writing(root):
    outcomes = assert_all_ok(run_world(_partial_modes_then_normal, 2, root, timeout=60, pg_timeout=20))
    for rank, outcome in enumerate(outcomes):
        for mode, cause in (("{'use_collectives': False}", "use_collectives=False"),
                            ("{'no_dist': True}", "no_dist=True")):
            chain = outcome[mode]
            assert chain != "saved", f"rank {rank} saved with {mode}"
            errors = [text for name, text in chain if name == "ConfigurationError"]
            assert errors and cause in errors[0] and f"global rank {rank}" in errors[0], (rank, mode, chain)
        assert outcome["steps_before"] == [] and outcome["files_before"] == [], (rank, outcome)
        assert outcome["loaded_ok"] and outcome["steps_after"] == [3], (rank, outcome)


# -- 10. the real cause survives -----------------------------------------------------------------


@pytest.mark.tmpfs(size_kib=2048, nr_inodes=256)
def test_full_disk_surfaces_as_storage_error_not_the_abort_of_another_thread(small_tmpfs):
    """Four threads, eight 128 KiB items each, on a 2 MiB tmpfs: whichever thread hits ENOSPC first, the
    others are mid-item or between items (then aborting: closing their file fails on the full disk too).
    Before the fix about one save in three surfaced the abort; thirty saves (~1 s) make that certain."""
    state = {f"t{i:02d}": torch.full((32 << 10,), float(i)) for i in range(32)}
    for attempt in range(30):
        writer = AtomicStorageWriter(small_tmpfs.path, RUN, attempt, thread_count=4, block_size=16 << 10, timeout=5)
        with pytest.raises(CheckpointException) as info:
            dcp.save(state, storage_writer=writer)
        chain = _chain(info.value)
        names = [type(e).__name__ for e in chain]
        assert "_Aborted" not in names, (attempt, names)
        storage = [e for e in chain if isinstance(e, StorageError)]
        assert storage and storage[0].details["errno"] == errno.ENOSPC, (attempt, names)
        assert small_tmpfs.path in storage[0].message and "rank 0" in storage[0].message
        assert list_steps(small_tmpfs.path, RUN) == []
        shutil.rmtree(os.path.join(small_tmpfs.path, RUN))  # the next save starts on an empty disk again


@pytest.mark.tmpfs(size_kib=1024, nr_inodes=256)
def test_full_disk_before_the_data_is_a_storage_error(small_tmpfs):
    """The attempt directory and its claim are written first: ENOSPC there names the path, rank and errno too."""
    small_tmpfs.fill_bytes(leave=0)
    with pytest.raises(CheckpointException) as info:
        dcp.save({"x": torch.ones(4)}, storage_writer=AtomicStorageWriter(small_tmpfs.path, RUN, 1, timeout=5))
    (error,) = _failures(info.value)
    assert isinstance(error, StorageError) and error.details["errno"] == errno.ENOSPC, repr(error)
    assert small_tmpfs.path in error.message and "rank 0" in error.message
