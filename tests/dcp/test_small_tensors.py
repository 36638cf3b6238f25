"""Many small tensors: the per-item data path.

Round trips of 10k+ small tensors of mixed dtypes and shapes (empty ones too) in every format at world 1
and 2, bit-exact; a damaged byte inside a run of consecutive items read together is caught and named;
consecutive items load through few reads; views whose memory is not their value are saved as values.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from dcp_atomic import AtomicStorageReader, AtomicStorageWriter, CorruptCheckpointError
from tests.harness import assert_all_ok, run_world

RUN = "small"
FORMATS = {"raw": {}, "zstd": {"compression": "zstd"}, "torch_save": {"stock_readable": True}}
KINDS = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.bool, torch.complex64,
         torch.float64]
SHAPES = [(3,), (7, 5), (0,), (2, 0, 3), (), (64,), (16, 33), (1, 1, 1)]


def small_state(count: int, seed: int, prefix: str = "") -> dict[str, torch.Tensor]:
    """``count`` small tensors cycling through dtypes and shapes, including empty and 0-d ones."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for i in range(count):
        dtype, shape = KINDS[i % len(KINDS)], SHAPES[(i // len(KINDS)) % len(SHAPES)]
        values = torch.randn(shape, generator=g)
        if dtype == torch.bool:
            tensor = values > 0
        elif dtype.is_complex:
            tensor = torch.complex(values, -values).to(dtype)
        elif dtype.is_floating_point:
            tensor = values.to(dtype)
        else:
            tensor = (values * 50).to(dtype)
        state[f"{prefix}block{i // 16}.p{i % 16}"] = tensor
    return state


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1)


def _assert_bit_exact(loaded: dict, original: dict) -> None:
    for key, value in original.items():
        assert loaded[key].dtype == value.dtype and loaded[key].shape == value.shape, key
        assert torch.equal(_bits(loaded[key]), _bits(value)), key


def _blank(state: dict) -> dict:
    return {k: torch.full_like(v, 7) if v.dtype != torch.bool else torch.ones_like(v) for k, v in state.items()}


def _round_trip_every_format(ctx, count: int) -> int:
    """Each rank holds its own keys (plain tensors under per-rank names); every format, bit-exact."""
    original = small_state(count, seed=ctx.rank, prefix=f"rank{ctx.rank}.")
    for step, kwargs in enumerate(FORMATS.values()):
        dcp.save(original, storage_writer=AtomicStorageWriter(ctx.root, RUN, step, **kwargs))
        loaded = _blank(original)
        dcp.load(loaded, storage_reader=AtomicStorageReader(ctx.root, RUN, step))
        _assert_bit_exact(loaded, original)
    return len(original)


@pytest.mark.slow
def test_ten_thousand_small_tensors_round_trip_bit_exact_world_1(root):
    assert assert_all_ok(run_world(_round_trip_every_format, 1, root, args=(10_000,), timeout=240)) == [10_000]


@pytest.mark.slow
def test_ten_thousand_small_tensors_round_trip_bit_exact_world_2(root):
    assert assert_all_ok(run_world(_round_trip_every_format, 2, root, args=(5_000,), timeout=240)) == [5_000] * 2


def _item_location(root: str, step: int, key: str) -> tuple[str, int, int]:
    """(data file, offset, length) of ``key``'s item, from DCP's own .metadata (format-independent)."""
    step_dir = os.path.join(root, RUN, f"step_{step:010d}")
    attempt = next(os.path.join(step_dir, d) for d in os.listdir(step_dir) if os.path.isdir(os.path.join(step_dir, d)))
    metadata = FileSystemReader(attempt).read_metadata()
    index, info = next((i, s) for i, s in metadata.storage_data.items() if i.fqn == key)
    return os.path.join(attempt, info.relative_path), info.offset, info.length


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_one_damaged_byte_among_many_small_items_is_caught_naming_the_key(root, fmt):
    original = small_state(2_000, seed=3)
    dcp.save(original, storage_writer=AtomicStorageWriter(root, RUN, 1, thread_count=1, **FORMATS[fmt]))
    victim = "block60.p3"  # an int64 (64,) tensor among its neighbours
    path, offset, length = _item_location(root, 1, victim)
    _flip(path, offset + length // 2)
    with pytest.raises(CheckpointException) as info:
        dcp.load(_blank(original), storage_reader=AtomicStorageReader(root, RUN, 1))
    errors = [w[0] if isinstance(w, tuple) else w for w in info.value.failures.values()]
    assert any(isinstance(e, CorruptCheckpointError) and repr(victim) in str(e) and os.path.basename(path) in str(e)
               for e in errors), errors
    # the neighbours alone still load, verified
    neighbours = {k: v for k, v in original.items() if k != victim}
    loaded = _blank(neighbours)
    dcp.load(loaded, storage_reader=AtomicStorageReader(root, RUN, 1))
    _assert_bit_exact(loaded, neighbours)


def test_consecutive_small_items_load_through_few_reads(root, monkeypatch):
    """One read call per run of consecutive items, not one per item (syscalls dominate small items)."""
    original = small_state(3_000, seed=5)
    dcp.save(original, storage_writer=AtomicStorageWriter(root, RUN, 1, thread_count=1))
    calls = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, buffers, offset: calls.append(offset) or real(fd, buffers, offset))
    loaded = _blank(original)
    dcp.load(loaded, storage_reader=AtomicStorageReader(root, RUN, 1, thread_count=1))
    _assert_bit_exact(loaded, original)
    assert 0 < len(calls) <= len(original) // 50, f"{len(calls)} reads for {len(original)} items"


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_views_whose_memory_is_not_their_value_are_saved_as_values(root, fmt):
    """A lazily conjugated or negated view is contiguous, but its memory holds the other value."""
    base = torch.complex(torch.arange(6.0), torch.arange(6.0) + 10)
    original = {"conj": base.conj(), "neg": torch.complex(torch.arange(4.0), torch.arange(4.0) + 1).conj().imag,
                "plain": base.clone()}
    assert original["conj"].is_conj() and original["neg"].is_neg()
    dcp.save(original, storage_writer=AtomicStorageWriter(root, RUN, 1, **FORMATS[fmt]))
    loaded = {k: torch.zeros_like(v.resolve_conj().resolve_neg()) for k, v in original.items()}
    dcp.load(loaded, storage_reader=AtomicStorageReader(root, RUN, 1))
    for key, value in original.items():
        assert torch.equal(loaded[key], value.resolve_conj().resolve_neg()), key
    # and a conjugated destination receives the stored values, not their conjugates
    destination = {"plain": torch.zeros(6, dtype=torch.complex64).conj()}
    dcp.load(destination, storage_reader=AtomicStorageReader(root, RUN, 1))
    assert torch.equal(destination["plain"].resolve_conj(), base)
