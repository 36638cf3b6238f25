"""``checkpoint_id``: frameworks (torchtitan, Lightning, Accelerate) reuse one writer and pass a path per save.

``<root>/<run_id>/step_<N>`` and torchtitan's ``<root>/<run_id>/step-<N>`` retarget a writer or reader
through DCP's ``reset``; anything else is refused before a byte is written.
"""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_atomic import AtomicStorageReader, AtomicStorageWriter, list_steps
from dcp_atomic.errors import ConfigurationError
from tests.harness import assert_all_ok, run_world

RUN = "exp"


def _state(rank: int, step: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(step)
    return {
        "sharded": distribute_tensor(torch.randn(8, 6), mesh, [Shard(0)]),
        "bf16": (torch.linspace(-1, 1, 64) * step).to(torch.bfloat16),
        "extra": {"step": step},
    }


def _zeros_like(state):
    from torch.distributed.tensor import DTensor, distribute_tensor

    out = {}
    for key, value in state.items():
        if isinstance(value, DTensor):
            out[key] = distribute_tensor(torch.zeros(value.shape), value.device_mesh, value.placements)
        elif isinstance(value, torch.Tensor):
            out[key] = torch.zeros_like(value)
        else:
            out[key] = {"step": -1}
    return out


def _same(a, b) -> bool:
    from torch.distributed.tensor import DTensor

    for key, value in a.items():
        other = b[key]
        if isinstance(value, DTensor):
            if not torch.equal(value.to_local().view(torch.uint8), other.to_local().view(torch.uint8)):
                return False
        elif isinstance(value, torch.Tensor):
            if value.dtype != other.dtype or not torch.equal(value.view(torch.uint8), other.view(torch.uint8)):
                return False
        elif value != other:
            return False
    return True


def _reused_writer_and_reader(ctx):
    """One writer and one reader, built without a location, through every DCP entry point."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    writer, reader = AtomicStorageWriter(timeout=20), AtomicStorageReader(timeout=20)
    run_dir = f"{ctx.root}/{RUN}"
    ids = {10: f"{run_dir}/step-10", 20: f"{run_dir}/step_20", 30: f"{run_dir}/step-30", 40: f"{run_dir}/step-40"}
    dcp.save(_state(ctx.rank, 10), storage_writer=writer, checkpoint_id=ids[10])  # torchtitan's form
    dcp.save(_state(ctx.rank, 20), storage_writer=writer, checkpoint_id=ids[20])  # our own form
    future = dcp.async_save(_state(ctx.rank, 30), storage_writer=writer, checkpoint_id=ids[30])
    getattr(future, "upload_completion", future).result(timeout=60)
    future = dcp.async_save(_state(ctx.rank, 40), storage_writer=writer, checkpoint_id=ids[40],
                            async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    getattr(future, "upload_completion", future).result(timeout=120)
    refused = []
    for bad in (run_dir, f"{run_dir}/epoch=1.ckpt", f"{ctx.root}/no such run/step-50"):
        try:
            dcp.save(_state(ctx.rank, 50), storage_writer=writer, checkpoint_id=bad)
        except ConfigurationError as e:
            refused.append(str(e))
    exact = {}
    for step, checkpoint_id in ids.items():
        target = _zeros_like(_state(ctx.rank, step))
        dcp.load(target, storage_reader=reader, checkpoint_id=checkpoint_id)
        exact[step] = (_same(_state(ctx.rank, step), target), reader.step)
    pinned = AtomicStorageWriter(ctx.root, RUN, timeout=20)  # built with a root and run: the id must agree
    dcp.save(_state(ctx.rank, 60), storage_writer=pinned, checkpoint_id=f"{run_dir}/step-60")
    return {"exact": exact, "refused": refused, "pinned_step": pinned.step}


def test_reused_writer_and_reader_follow_checkpoint_ids_through_save_async_save_and_load(root):
    results = assert_all_ok(run_world(_reused_writer_and_reader, 2, root, timeout=240))
    for result in results:
        assert result["exact"] == {10: (True, 10), 20: (True, 20), 30: (True, 30), 40: (True, 40)}
        assert len(result["refused"]) == 3, result["refused"]
        assert result["pinned_step"] == 60
    assert list_steps(root, RUN) == [10, 20, 30, 40, 60]
    assert sorted(n for n in os.listdir(os.path.join(root, RUN)) if n.startswith("step")) == [
        f"step_{s:010d}" for s in (10, 20, 30, 40, 60)]  # the on-disk layout stays ours


@pytest.mark.parametrize("checkpoint_id, expected", [
    ("/ckpt/exp/step_5", True),
    ("/ckpt/exp/step-5", True),
    ("/ckpt/exp/step_0000000005/", True),
    ("s3://bucket/prefix/exp/step-10", True),
    ("/ckpt/exp", False),
    ("/ckpt/exp/epoch=0-step=5.ckpt", False),
    ("/ckpt/bad run/step_5", False),
    ("exp/step_5", False),
    ("s3://exp/step_5", False),
    ("/ckpt/exp/step_-5", False),
])
def test_validate_checkpoint_id(checkpoint_id, expected):
    assert AtomicStorageWriter.validate_checkpoint_id(checkpoint_id) is expected
    assert AtomicStorageReader.validate_checkpoint_id(checkpoint_id) is expected


def test_checkpoint_ids_that_cannot_be_honoured_are_refused_before_a_byte_is_written(root, tmp_path):
    state = {"w": torch.arange(4.0)}
    other = str(tmp_path / "elsewhere")
    cases = [
        (AtomicStorageWriter(), f"{root}/{RUN}", "step"),
        (AtomicStorageWriter(), f"{root}/bad run/step_1", "run_id"),
        (AtomicStorageWriter(root), f"{other}/{RUN}/step_1", "root"),
        (AtomicStorageWriter(root, RUN), f"{root}/other/step_1", "run"),
    ]
    for writer, checkpoint_id, names in cases:
        with pytest.raises(ConfigurationError, match=names):
            dcp.save(state, storage_writer=writer, checkpoint_id=checkpoint_id)
    with pytest.raises(ConfigurationError, match="no location"):
        AtomicStorageWriter().reset(None)
    with pytest.raises(CheckpointException, match="AtomicStorageWriter has no location"):  # DCP wraps hook errors
        dcp.save(state, storage_writer=AtomicStorageWriter(root, RUN))  # no step, no checkpoint_id
    with pytest.raises(ConfigurationError, match="root"):
        AtomicStorageReader(root, RUN).reset(f"{other}/{RUN}/step_1")
    with pytest.raises(ConfigurationError, match="no location"):
        AtomicStorageReader().reset(None)
    assert os.listdir(root) == [] and not os.path.exists(other)


def test_writer_and_reader_pickle_before_and_after_use(root):
    writer = AtomicStorageWriter(timeout=5)
    dcp.save({"w": torch.arange(6.0)}, storage_writer=writer, checkpoint_id=f"{root}/{RUN}/step-3")
    reader = AtomicStorageReader()
    target = {"w": torch.zeros(6)}
    dcp.load(target, storage_reader=reader, checkpoint_id=f"{root}/{RUN}/step-3")
    assert torch.equal(target["w"], torch.arange(6.0))
    for used in (writer, reader, AtomicStorageWriter(), AtomicStorageReader()):
        copy = pickle.loads(pickle.dumps(used))
        assert copy.checkpoint_id == used.checkpoint_id
    copy = pickle.loads(pickle.dumps(reader))
    target = {"w": torch.zeros(6)}
    dcp.load(target, storage_reader=copy, checkpoint_id=f"{root}/{RUN}/step_3")
    assert torch.equal(target["w"], torch.arange(6.0)) and copy.step == 3


def test_a_reused_writer_follows_s3_checkpoint_ids_and_reuses_one_client(s3_moto):
    """torchtitan on S3: one location-less writer, ``checkpoint_id=s3://bucket/prefix/run/step-N`` per save."""
    options = s3_moto.options()
    writer = AtomicStorageWriter(storage_options=options)
    reader = AtomicStorageReader(storage_options=options)
    for step in (10, 20):
        dcp.save({"w": torch.full((4, 3), float(step))}, storage_writer=writer,
                 checkpoint_id=f"{s3_moto.root}/titan/step-{step}", no_dist=True)
        if step == 10:
            first_storage = writer.storage
    assert writer.storage is first_storage, "the same root must keep the same client"
    assert list_steps(s3_moto.root, "titan", storage_options=options) == [10, 20]
    target = {"w": torch.zeros(4, 3)}
    dcp.load(target, storage_reader=reader, checkpoint_id=f"{s3_moto.root}/titan/step_10", no_dist=True)
    assert torch.equal(target["w"], torch.full((4, 3), 10.0)) and reader.step == 10
    assert any(k.endswith("titan/step_0000000020/COMMITTED") for k in s3_moto.keys())
