"""Per-checkpoint user metadata: saved with the commit, sealed by the marker, shown by the CLI, returned by the
manager on every rank; refused before a byte is written when it is not small JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.harness import assert_all_ok, run_world

RUN = "meta"


def _save_with_metadata(ctx):
    from dcp_atomic import CheckpointManager

    with CheckpointManager(ctx.root, RUN, timeout=30) as manager:
        manager.save(1, {"w": torch.ones(3)}, metadata={"loss": 2.5, "data": {"epoch": 0, "shard": ctx.rank}})
        manager.async_save(2, {"w": torch.ones(3) * 2}, metadata={"loss": 1.25}).result()
        manager.save(3, {"w": torch.ones(3) * 3})
        return manager.metadata(1), manager.metadata(2), manager.metadata(3), manager.metadata()


def test_metadata_is_saved_with_the_step_and_returned_on_every_rank(root):
    for first, second, third, latest in assert_all_ok(run_world(_save_with_metadata, 2, root)):
        assert first == {"loss": 2.5, "data": {"epoch": 0, "shard": 0}}  # global rank 0's
        assert second == {"loss": 1.25} and third == {} and latest == {}
    shown = subprocess.run([sys.executable, "-m", "dcp_atomic", "show", root, RUN, "1"], capture_output=True,
                           text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert 'user metadata: {"data": {"epoch": 0, "shard": 0}, "loss": 2.5}' in shown.stdout
    step_dir = os.path.join(root, RUN, "step_0000000001")
    marker = json.load(open(os.path.join(step_dir, "COMMITTED")))
    manifest = json.load(open(os.path.join(step_dir, marker["save_id"], "manifest.json")))
    assert manifest["user_metadata"]["loss"] == 2.5  # in the manifest the marker's digest seals
    step_3 = os.path.join(root, RUN, "step_0000000003")
    marker_3 = json.load(open(os.path.join(step_3, "COMMITTED")))
    assert "user_metadata" not in json.load(open(os.path.join(step_3, marker_3["save_id"], "manifest.json")))


@pytest.mark.parametrize("metadata, problem", [
    ({"t": torch.ones(1)}, "must be JSON"),
    ({1: "x"}, "str keys"),
    ({"nan": float("nan")}, "must be JSON"),
    ({"big": "x" * (64 * 1024)}, "more than 65536"),
])
def test_metadata_that_is_not_small_json_is_refused_before_writing(root, metadata, problem):
    from dcp_atomic import AtomicStorageWriter, ConfigurationError

    with pytest.raises(ConfigurationError, match=problem):
        AtomicStorageWriter(root, RUN, 1, metadata=metadata)
    assert not os.path.exists(os.path.join(root, RUN))


def test_metadata_changed_by_the_caller_after_the_writer_was_built_is_not_recorded(root):
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageWriter, CheckpointManager

    notes = {"phase": "warmup"}
    writer = AtomicStorageWriter(root, RUN, 5, metadata=notes)
    notes["phase"] = "changed"
    dcp.save({"w": torch.zeros(2)}, storage_writer=writer)
    assert CheckpointManager(root, RUN).metadata(5) == {"phase": "warmup"}


def test_keys_of_dcp_atomic_s_own_are_refused_in_a_managers_save_before_writing(root):
    """``dcp_atomic.*`` keys order the tiers (a memory snapshot's durable copy names its snapshot's sequence): a
    step's metadata copied into a re-save must not make it count as an old snapshot."""
    from dcp_atomic import ArgumentError, CheckpointManager

    with CheckpointManager(root, RUN) as manager:
        for save in (manager.save, manager.async_save):
            with pytest.raises(ArgumentError, match="dcp_atomic.copy_of_memory_sequence"):
                save(4, {"w": torch.zeros(2)}, metadata={"loss": 1.0, "dcp_atomic.copy_of_memory_sequence": 3})
        assert manager.save(4, {"w": torch.zeros(2)}, metadata={"loss": 1.0}) == 4
        assert manager.steps() == [4]


def test_a_durable_copys_order_is_a_checked_manifest_field_and_the_old_metadata_key_still_orders(root):
    """The order of a memory snapshot's durable copy is the manifest's ``copy_of_sequence``, parsed strictly; a step
    written before the field (the order in its metadata) still orders the same way."""
    import dataclasses

    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageWriter
    from dcp_atomic.errors import CorruptCheckpointError
    from dcp_atomic.format import Manifest, RunLayout
    from dcp_atomic.protocol import memory_order, read_committed
    from dcp_atomic.stores import open_storage
    from dcp_atomic._base.retry import Deadline

    dcp.save({"w": torch.zeros(2)}, storage_writer=AtomicStorageWriter(root, RUN, 5, copy_of_sequence=3))
    committed = read_committed(RunLayout(open_storage(root), RUN), 5, Deadline(10))
    manifest, marker = committed.manifest, committed.marker
    assert (manifest.copy_of_sequence, manifest.user_metadata) == (3, None)
    assert marker.sequence != 3 and memory_order(marker, manifest) == 3
    raw = json.loads(manifest.to_json())
    for bad in (0, -1, True, "3", 2.5, None):
        with pytest.raises(CorruptCheckpointError, match="copy_of_sequence"):
            Manifest.from_json(json.dumps({**raw, "copy_of_sequence": bad}).encode(), where="m")
    del raw["copy_of_sequence"]
    plain = Manifest.from_json(json.dumps(raw).encode(), where="m")
    assert plain.copy_of_sequence is None and memory_order(marker, plain) == marker.sequence
    legacy = dataclasses.replace(plain, user_metadata={"dcp_atomic.copy_of_memory_sequence": 2})
    assert memory_order(marker, legacy) == 2
