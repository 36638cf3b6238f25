"""The reader (G4): no silent wrong values, no partial checkpoint loading as complete,
one open per data file, empty shards that load.

Single-process checks run in this process (DCP without a process group); the
world-2 checks share one world (``two_rank_results``) that saves and loads in
every format, through plain ``dcp`` and ``CheckpointManager``.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from dcp_atomic import AtomicStorageReader, AtomicStorageWriter, CorruptCheckpointError
from tests.harness import assert_all_ok, run_world
from tests.helpers.sealed import RUN, Sealed, typed

FORMATS = {"raw": {}, "stock_readable": {"stock_readable": True}, "zstd": {"compression": "zstd"}}


def _error_text(exc: BaseException) -> str:
    """Our error's message, wherever DCP put it."""
    parts, stack = [], [exc]
    while stack:
        e = stack.pop()
        if isinstance(e, tuple):
            e = e[0]
        if isinstance(e, BaseException):
            parts.append(str(e))
            stack += list((getattr(e, "failures", None) or {}).values())
    return "\n".join(parts)


# -- 1: a planner that resolves another dtype (or size) than it planned -----------------------------------


class _CastToBf16(DefaultSavePlanner):
    """"Save as bf16": plans fp32 (the state dict's dtype), hands the writer bf16."""

    def resolve_data(self, write_item):
        data = super().resolve_data(write_item)
        return data.to(torch.bfloat16) if isinstance(data, torch.Tensor) and data.dtype == torch.float32 else data


def _float_state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(40, 9, generator=g), "smooth": torch.linspace(-1, 1, 500),
            "ids": torch.arange(30, dtype=torch.int64), "extra": {"lr": 0.5}}


def _sentinel() -> dict:
    return {"w": torch.full((40, 9), -9.0), "smooth": torch.full((500,), -9.0),
            "ids": torch.full((30,), -9, dtype=torch.int64), "extra": {"lr": 0.0}}


def _stock_result(root: str, planner) -> dict:
    """What stock DCP (FileSystemWriter / FileSystemReader) loads for the same planner."""
    path = os.path.join(root, "stock")
    dcp.save(_float_state(), storage_writer=dcp.FileSystemWriter(path), planner=planner)
    got = _sentinel()
    dcp.load(got, storage_reader=dcp.FileSystemReader(path))
    return got


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_casting_planner_round_trip_equals_stock_dcp(root, fmt):
    expected = _stock_result(root, _CastToBf16())
    assert not torch.equal(expected["w"], _float_state()["w"]), "the planner must really cast"
    dcp.save(_float_state(), storage_writer=AtomicStorageWriter(root, RUN, 1, block_size=256, **FORMATS[fmt]),
             planner=_CastToBf16())
    recorded = {item["key"]: item.get("dtype") for _, item in Sealed(root, 1).items()}
    assert recorded == {"w": "torch.bfloat16", "smooth": "torch.bfloat16", "ids": None, "extra.lr": None}, recorded
    got = _sentinel()
    dcp.load(got, storage_reader=AtomicStorageReader(root, RUN, 1))
    for key in ("w", "smooth", "ids"):
        assert got[key].dtype == expected[key].dtype and torch.equal(got[key], expected[key]), key
    assert got["extra"] == expected["extra"]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_stored_dtype_not_recorded_is_refused_naming_the_key_not_loaded_as_garbage(root, fmt):
    dcp.save(_float_state(), storage_writer=AtomicStorageWriter(root, RUN, 1, block_size=256, **FORMATS[fmt]),
             planner=_CastToBf16())
    ck = Sealed(root, 1)
    for _, item in ck.items():
        item["dtype"] = None  # as a writer that does not record the stored dtype would leave it
    ck.write_manifest()
    got = _sentinel()
    with pytest.raises(BaseException) as raised:
        dcp.load(got, storage_reader=AtomicStorageReader(root, RUN, 1, thread_count=1))
    assert typed(raised.value), raised.value
    text = _error_text(raised.value)
    assert "CorruptCheckpointError" in text and ("'w'" in text or "'smooth'" in text), text


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_item_shorter_than_its_chunk_is_refused_before_any_byte_lands(root, fmt):
    """Stored bytes that do not fill the chunk .metadata describes (what a writer that trusted a size-changing
    planner left behind): refused naming the key, and no destination is touched."""
    dcp.save(_float_state(), storage_writer=AtomicStorageWriter(root, RUN, 1, block_size=256, **FORMATS[fmt]))
    ck = Sealed(root, 1)
    metadata = ck.metadata()
    for key in ("w", "ids"):  # .metadata now plans twice the rows that were stored
        md = metadata.state_dict_metadata[key]
        md.size = torch.Size([2 * md.size[0], *md.size[1:]])
        md.chunks[0].sizes = md.size
    ck.write_metadata(metadata)
    for threads in (1, 4):
        got = {**_sentinel(), "w": torch.full((80, 9), -9.0), "ids": torch.full((60,), -9, dtype=torch.int64)}
        with pytest.raises(BaseException) as raised:
            dcp.load(got, storage_reader=AtomicStorageReader(root, RUN, 1, thread_count=threads))
        text = _error_text(raised.value)
        named = {"'w'" in text, "'ids'" in text}
        assert typed(raised.value) and "CorruptCheckpointError" in text and True in named, text
        assert fmt == "stock_readable" or named == {True}, f"raw formats: every short item in one message: {text}"
        assert all(bool((got[k] == -9).all()) for k in ("w", "smooth", "ids")), "a destination was written"


# -- 14: one open per data file ------------------------------------------------------------------------------

_OPENS: list[str] | None = None  # the audit hook records only while a test sets this


def _count_opens(event, args):
    if _OPENS is not None and event == "open" and isinstance(args[0], (str, bytes)):
        _OPENS.append(os.path.abspath(os.fsdecode(args[0])))


sys.addaudithook(_count_opens)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_each_data_file_is_opened_once_per_reader_thread(root, fmt):
    global _OPENS
    g = torch.Generator().manual_seed(5)
    state = {f"p{i}": torch.randn(3 + i % 5, generator=g) for i in range(200)}
    state["big"] = torch.linspace(0, 1, 5000)  # spans many blocks / frames
    dcp.save(state, storage_writer=AtomicStorageWriter(root, RUN, 1, thread_count=3, block_size=1024,
                                                       **FORMATS[fmt]))
    attempt = Sealed(root, 1).attempt
    data_files = sorted(os.path.join(attempt, n) for n in os.listdir(attempt) if n.endswith(".distcp"))
    assert len(data_files) == 3
    for threads in (1, 2):
        got = {k: torch.zeros_like(v) for k, v in state.items()}
        _OPENS = []
        try:
            dcp.load(got, storage_reader=AtomicStorageReader(root, RUN, 1, thread_count=threads))
            opens = {path: _OPENS.count(path) for path in data_files}
        finally:
            _OPENS = None
        assert all(torch.equal(got[k], v) for k, v in state.items())
        assert all(n <= 1 for n in opens.values()) and sum(opens.values()) >= 1, (threads, opens)


# -- 16 (and 2): a shared world-2 run: empty and uneven shards in every format, plain dcp and the manager -----


def _empty_shard_state(mesh, seed: int, template: bool = False) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(seed)
    fill = (lambda t: torch.full_like(t, -5)) if template else (lambda t: t)
    return {
        "one_row": distribute_tensor(fill(torch.randn(1, 5)), mesh, [Shard(0)]),  # rank 1: 0 rows
        "uneven": distribute_tensor(fill(torch.randn(5, 3)), mesh, [Shard(0)]),  # 3 + 2 rows
        "uneven_cols": distribute_tensor(fill(torch.randn(4, 3)), mesh, [Shard(1)]),  # 2 + 1 columns
        "empty": torch.zeros(0),
        "empty_2d": torch.zeros(0, 4),
        "after_empty": fill(torch.arange(6, dtype=torch.float32) + seed),
    }


def _fsdp_model(mesh, seed: int):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 3), torch.nn.Linear(3, 1))  # 1 output row: rank 1 empty
    for layer in model:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _full(value):
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def _compare(got: dict, want: dict) -> dict[str, bool]:
    return {k: bool(torch.equal(_full(got[k]), _full(want[k]))) for k in want}


def _empty_shards_world(ctx):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from dcp_atomic import AtomicLoadPlanner, AtomicSavePlanner, CheckpointManager

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    results = {}
    for step, (fmt, options) in enumerate(FORMATS.items(), start=1):
        model = _fsdp_model(mesh, step)
        state = {"model": get_model_state_dict(model), **_empty_shard_state(mesh, step)}
        writer = AtomicStorageWriter(ctx.root, RUN, step, block_size=64, **options)
        dcp.save(state, storage_writer=writer, planner=AtomicSavePlanner())
        fresh = _fsdp_model(mesh, 100 + step)
        target = {"model": get_model_state_dict(fresh), **_empty_shard_state(mesh, step, template=True)}
        dcp.load(target, storage_reader=AtomicStorageReader(ctx.root, RUN, step), planner=AtomicLoadPlanner())
        flat_got = {**{f"model.{k}": v for k, v in target["model"].items()}, **target}
        flat_want = {**{f"model.{k}": v for k, v in state["model"].items()}, **state}
        flat_got.pop("model"), flat_want.pop("model")
        results[f"dcp/{fmt}"] = _compare(flat_got, flat_want)
    with CheckpointManager(os.path.join(ctx.root, "managed"), RUN, timeout=30) as raw_manager, \
            CheckpointManager(os.path.join(ctx.root, "managed_zstd"), RUN, compression="zstd", timeout=30) as zstd:
        for name, manager in (("manager/raw", raw_manager), ("manager/zstd", zstd)):
            state = _empty_shard_state(mesh, 7)
            manager.save(7, state)
            target = _empty_shard_state(mesh, 7, template=True)
            step = manager.load(target)
            results[name] = {**_compare(target, state), "step is 7": step == 7}
    return results


@pytest.fixture(scope="module")
def two_rank_results():
    base = tempfile.mkdtemp(prefix="dcp-atomic-trust-reader-")
    try:
        outcomes = assert_all_ok(run_world(_empty_shards_world, 2, base, timeout=240, pg_timeout=60))
        yield base, outcomes
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_empty_and_uneven_shards_round_trip_in_every_format_through_dcp_and_the_manager(two_rank_results):
    base, outcomes = two_rank_results
    for rank, result in enumerate(outcomes):
        assert sorted(result) == sorted([f"dcp/{f}" for f in FORMATS] + ["manager/raw", "manager/zstd"])
        wrong = {where: [k for k, ok in checks.items() if not ok] for where, checks in result.items()}
        assert not any(wrong.values()), f"rank {rank}: values differ after load: {wrong}"
        assert {"model.1.bias", "model.1.weight", "one_row", "empty"} <= set(result["dcp/raw"])
    # the cases really occurred: empty chunks stored, and (raw formats) sharing their offset with the next item
    for step, fmt in enumerate(FORMATS, start=1):
        ck = Sealed(base, step)
        chunks = {k: [list(c.sizes) for c in v.chunks] for k, v in ck.metadata().state_dict_metadata.items()
                  if hasattr(v, "chunks")}
        assert [0, 5] in chunks["one_row"] and [0, 3] in chunks["model.1.weight"] and [0] in chunks["model.1.bias"]
        assert chunks["uneven"] == [[3, 3], [2, 3]] and chunks["uneven_cols"] == [[4, 2], [4, 1]], chunks
        if fmt != "stock_readable":  # a torch.save container of nothing is not empty
            empties = [(e["name"], i["pos"]) for e, i in ck.items() if i["length"] == 0]
            shared = [(name, pos) for name, pos in empties
                      if any(e["name"] == name and i["pos"] == pos and i["length"] for e, i in ck.items())]
            assert shared, f"{fmt}: no zero-length item shares its offset with another: {empties}"


# -- 2: a checkpoint that lacks a chunk never loads as complete ---------------------------------------------


def _drop_chunk(ck: Sealed, key: str, rank_offset: int) -> None:
    """Remove one stored chunk of ``key`` from .metadata and the manifest, re-sealing the chain."""
    metadata = ck.metadata()
    chunks = metadata.state_dict_metadata[key].chunks
    dropped = next(c for c in chunks if c.offsets[0] == rank_offset)
    chunks.remove(dropped)
    index = next(i for i in metadata.storage_data if i.fqn == key and tuple(i.offset) == tuple(dropped.offsets))
    del metadata.storage_data[index]
    for entry in ck.manifest["files"]:
        entry["items"] = [i for i in entry["items"]
                          if not (i["key"] == key and i["chunk_offset"] == list(dropped.offsets))]
    ck.write_metadata(metadata)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_checkpoint_missing_chunks_is_refused_naming_every_incomplete_key(two_rank_results, root, fmt):
    base, _ = two_rank_results
    step = list(FORMATS).index(fmt) + 1
    shutil.copytree(os.path.join(base, RUN), os.path.join(root, RUN))
    ck = Sealed(root, step)
    _drop_chunk(ck, "uneven", 3)  # rank 1's two rows
    _drop_chunk(ck, "model.0.weight", 2)  # rank 1's half of a parameter
    reader = AtomicStorageReader(root, RUN, step)
    with pytest.raises(CorruptCheckpointError) as raised:
        reader.resolve()
    message = str(raised.value)
    assert "'uneven'" in message and "'model.0.weight'" in message and "one_row" not in message, message
    target = {"uneven": torch.zeros(5, 3)}
    with pytest.raises(BaseException) as wrapped:  # through plain dcp.load, single process, too
        dcp.load(target, storage_reader=AtomicStorageReader(root, RUN, step))
    assert typed(wrapped.value) and "'uneven'" in _error_text(wrapped.value), wrapped.value


def test_coverage_check_finds_one_hole_or_overlap_among_thousands_of_chunks_quickly():
    import time

    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata as Chunk

    from dcp_atomic.dcp.read_checks import tiling_problem as _tiling_problem

    def rows(n):  # FSDP Shard(0) over n ranks, uneven, with empty shards at the end
        step = 3
        return [Chunk(torch.Size([min(r * step, 3000), 0]), torch.Size([max(0, min(step, 3000 - r * step)), 8]))
                for r in range(n)]

    def grid(dp, tp):  # dp x tp: Shard(0) x Shard(1)
        return [Chunk(torch.Size([i * 4, j * 2]), torch.Size([4, 2])) for i in range(dp) for j in range(tp)]

    layouts = {"rows": ((3000, 8), rows(1100)), "columns": ((8, 4096), [Chunk(torch.Size([0, c]), torch.Size([8, 1]))
                                                                       for c in range(4096)]),
               "grid": ((4 * 256, 2 * 16), grid(256, 16))}
    started = time.monotonic()
    for name, (shape, chunks) in layouts.items():
        assert _tiling_problem(shape, chunks) is None, name
        holed = chunks[:7] + chunks[8:]
        assert "hold" in _tiling_problem(shape, holed), name
        moved = list(holed) + [Chunk(torch.Size(holed[0].offsets), torch.Size(chunks[7].sizes))]  # right size, wrong place
        assert "overlap" in (_tiling_problem(shape, moved) or ""), name
        outside = chunks[:-1] + [Chunk(torch.Size([o + 1 for o in chunks[-1].offsets]), chunks[-1].sizes)]
        assert _tiling_problem(shape, outside) is not None, name
    assert time.monotonic() - started < 10, "quadratic in the number of chunks?"
