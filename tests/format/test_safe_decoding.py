"""What a load decodes and what a save compares: canonical fingerprints of objects across ranks, and object items
decoded without running code (G13)."""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import random

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_atomic import AtomicStorageReader, AtomicStorageWriter
from dcp_atomic.errors import UnsafeItemError
from tests.harness import assert_all_ok, run_world
from tests.helpers.steps import RUN, _reseal, _save, _step_paths

def test_object_fingerprint_is_canonical_for_sets_and_strict_otherwise():
    from dcp_atomic.dcp.reshard import summarize_state_dict

    words = [f"word-{i:02d}" for i in range(20)] + [0, 1 << 20]  # 0 and 2**20 collide: order = insertion order
    forward, backward = set(), set()
    for w in words:
        forward.add(w)
    for w in reversed(words):
        backward.add(w)
    assert pickle.dumps(forward) != pickle.dumps(backward), "precondition: equal sets, different pickles"

    def fingerprint(value):
        return summarize_state_dict({"k": value})["k"]["fingerprint"]

    assert fingerprint(forward) == fingerprint(backward)
    assert fingerprint(frozenset(forward)) == fingerprint(frozenset(backward))
    assert fingerprint({"s": forward, "n": (1, 2.5)}) == fingerprint({"n": (1, 2.5), "s": backward})
    assert fingerprint(forward) != fingerprint(forward | {"extra"})
    assert fingerprint(forward) != fingerprint(frozenset(forward))
    assert fingerprint({"a": 1}) != fingerprint({"a": 1.0}) != fingerprint({"a": True})
    assert fingerprint([1, 2]) != fingerprint([2, 1])


_WORDS = [f"word-{i:02d}" for i in range(20)]


def _rank_set(rank: int) -> set:
    """The same 20 strings on every rank, inserted in a rank-dependent order (as hash seeds would order them)."""
    items = [0, 1 << 20] + _WORDS  # two colliding ints make the iteration order differ for sure
    built: set = set()
    for item in items if rank == 0 else reversed(items):
        built.add(item)
    return built


def _save_equal_sets_then_different_ones(ctx):
    from dcp_atomic import AtomicSavePlanner

    equal = _rank_set(ctx.rank)
    dcp.save({"s": equal, "f": frozenset(equal)}, storage_writer=AtomicStorageWriter(ctx.root, RUN, 1, timeout=20),
             planner=AtomicSavePlanner())
    try:
        dcp.save({"s": equal | {f"only-on-rank-{ctx.rank}"}},
                 storage_writer=AtomicStorageWriter(ctx.root, RUN, 2, timeout=20), planner=AtomicSavePlanner())
        refused = None
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        refused = str(e)
    return {"pickle": hashlib.sha256(pickle.dumps(equal)).hexdigest(), "refused": refused}


@pytest.mark.slow
def test_equal_sets_ordered_differently_per_rank_save_and_different_ones_are_refused(root):
    first, second = assert_all_ok(run_world(_save_equal_sets_then_different_ones, 2, root, timeout=120))
    assert first["pickle"] != second["pickle"], "precondition: the ranks' pickles of the set differ"
    assert os.path.exists(os.path.join(root, RUN, "step_0000000001", "COMMITTED"))
    for outcome in (first, second):
        assert outcome["refused"] and "'s': object differs across ranks" in outcome["refused"], outcome
    assert not os.path.exists(os.path.join(root, RUN, "step_0000000002", "COMMITTED"))


def _save_equal_tensors_inside_objects_then_different_ones(ctx):
    from dcp_atomic import AtomicSavePlanner

    def gathered(value):  # what an integration gathers to every rank: each rank's copy unpickled from the others'
        return tuple(pickle.loads(pickle.dumps({"generator": torch.full((4,), float(value))})) for _ in range(2))

    dcp.save({"o": gathered(1)}, storage_writer=AtomicStorageWriter(ctx.root, RUN, 1, timeout=20),
             planner=AtomicSavePlanner())
    try:
        dcp.save({"o": gathered(ctx.rank)}, storage_writer=AtomicStorageWriter(ctx.root, RUN, 2, timeout=20),
                 planner=AtomicSavePlanner())
        return None
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        return str(e)


def test_equal_tensors_inside_an_object_save_and_different_ones_are_refused(root):
    # a tensor's pickle names its storage's address: equal tensors inside objects looked diverged (refused)
    for refused in assert_all_ok(run_world(_save_equal_tensors_inside_objects_then_different_ones, 2, root)):
        assert refused and "'o': object differs across ranks" in refused, refused
    assert os.path.exists(os.path.join(root, RUN, "step_0000000001", "COMMITTED"))
    assert not os.path.exists(os.path.join(root, RUN, "step_0000000002", "COMMITTED"))


# -- G13: non-tensor items are decoded with an allow-list ------------------------------------------------------


class _Exploit:
    def __init__(self, canary: str) -> None:
        self.canary = canary

    def __reduce__(self):
        return (os.system, (f"touch {self.canary}",))


class _UserConfig:
    def __init__(self, lr: float) -> None:
        self.lr = lr


def _torch_saved(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def test_safe_byte_item_refuses_code_and_names_key_and_global(root):
    from dcp_atomic.format.safe_pickle import safe_byte_item

    canary = os.path.join(root, "pwned")
    for payload in (_torch_saved({"x": _Exploit(canary)}), pickle.dumps(_Exploit(canary))):
        with pytest.raises(UnsafeItemError) as info:
            safe_byte_item(payload, key="optim.extra", where="/ckpt/__0_0.distcp")
        message = str(info.value)
        assert "'optim.extra'" in message and "/ckpt/__0_0.distcp" in message
        assert "add_safe_globals" in message and "weights_only=False" not in message
    with pytest.raises(UnsafeItemError, match="posix.system"):
        safe_byte_item(_torch_saved(_Exploit(canary)), key="k", where="w")
    assert not os.path.exists(canary), "decoding must not execute anything"


def test_safe_byte_item_accepts_what_dcp_state_dicts_hold():
    import numpy as np

    from dcp_atomic.format.safe_pickle import safe_byte_item

    values = {
        "set": {"a", "b", 3},
        "frozenset": frozenset({1, 2}),
        "dict": {"a": [1, 2.5, None, True], "b": (1, "x")},
        "float": 0.125,
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False,
                          "maximize": False, "foreach": None, "capturable": False, "params": ["w", "b"]}],
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        "numpy_rng": np.random.get_state(),
        "numpy_generator": np.random.default_rng(0).bit_generator.state,
        "numpy_scalars": {"loss": np.float64(1.5), "count": np.int64(3)},
        "extra_state": io.BytesIO(b"opaque bytes of a module's extra state"),
        "tensor_in_tuple": (torch.arange(3), torch.ones(2, dtype=torch.bfloat16)),
    }
    for name, value in values.items():
        data = _torch_saved(value)
        stream = safe_byte_item(data, key=name, where="w")
        got = torch.load(stream, weights_only=False)
        if name == "extra_state":
            assert got.getvalue() == value.getvalue()
        elif name == "numpy_rng":
            assert got[0] == value[0] and (got[1] == value[1]).all() and got[2:] == value[2:]
        elif name == "tensor_in_tuple":
            assert all(torch.equal(a, b) for a, b in zip(got, value))
        elif name == "torch_rng":
            assert torch.equal(got, value)
        else:
            assert got == value, name


def test_safe_byte_item_honours_users_safe_globals():
    from dcp_atomic.format.safe_pickle import safe_byte_item

    data = _torch_saved({"config": _UserConfig(0.5)})
    with pytest.raises(UnsafeItemError, match="_UserConfig"):
        safe_byte_item(data, key="cfg", where="w")
    with torch.serialization.safe_globals([_UserConfig]):
        got = torch.load(safe_byte_item(data, key="cfg", where="w"), weights_only=False)
    assert got["config"].lr == 0.5
    import numpy as np

    assert np.ndarray not in torch.serialization.get_safe_globals(), "our additions must not outlive the call"


def _replace_object_item(root, step, key, new_bytes):
    """Swap a BYTE_IO item's bytes, keeping .metadata, manifest and marker consistent (every digest recomputed)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    from dcp_atomic.format.integrity import BlockHasher

    _, attempt, _ = _step_paths(root, step)
    metadata_path = os.path.join(attempt, ".metadata")
    metadata = pickle.loads(open(metadata_path, "rb").read())  # our own, untampered file
    index, info = next((i, s) for i, s in metadata.storage_data.items() if i.fqn == key)
    data_path = os.path.join(attempt, info.relative_path)
    new_pos = os.path.getsize(data_path)
    open(data_path, "ab").write(new_bytes)
    metadata.storage_data[index] = _StorageInfo(info.relative_path, new_pos, len(new_bytes))
    metadata_bytes = pickle.dumps(metadata)
    open(metadata_path, "wb").write(metadata_bytes)

    def edit(manifest, _attempt):
        entry = next(f for f in manifest["files"] if f["name"] == info.relative_path)
        item = next(i for i in entry["items"] if i["key"] == key)
        hasher = BlockHasher(item["block_size"])
        hasher.update(new_bytes)
        item.update(pos=new_pos, length=len(new_bytes), checksums=hasher.finish())
        entry["size"] = new_pos + len(new_bytes)
        manifest["dcp_metadata"].update(size=len(metadata_bytes), sha256=hashlib.sha256(metadata_bytes).hexdigest())

    _reseal(root, step, edit)


def test_tampered_object_item_is_refused_at_load_without_running_code(root):
    """End to end (needs the call of safe_byte_item in the reader's _deliver)."""
    canary = os.path.join(root, "pwned")
    _save(root, 1, {"w": torch.ones(4), "extra": ("benign", 1)}, thread_count=1)
    _replace_object_item(root, 1, "extra", _torch_saved(_Exploit(canary)))
    target = {"w": torch.zeros(4), "extra": None}
    with pytest.raises(CheckpointException) as info:
        dcp.load(target, storage_reader=AtomicStorageReader(root, RUN, 1, timeout=1))
    assert not os.path.exists(canary), "loading executed code from the checkpoint"
    assert "'extra'" in str(info.value) and "posix.system" in str(info.value)
