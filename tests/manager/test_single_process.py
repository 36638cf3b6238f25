"""Protocol behaviour that needs no process group: corruption, hostile input, interop, errors."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from dcp_atomic import (AtomicStorageReader, AtomicStorageWriter, CheckpointError, CheckpointNotFoundError,
                        CommitConflictError, ConfigurationError, CorruptCheckpointError, RankConsistencyError,
                        ReshardError, StorageError, latest_step, list_steps)
from dcp_atomic._base import failpoints
from dcp_atomic.format.manifest import Marker

RUN = "exp"


def _state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    return {
        "big": torch.randn(300, 1000),  # 1.2 MB: several 256 KiB blocks with the small block size below
        "small": torch.arange(7, dtype=torch.int32) + seed,
        "bf16": torch.randn(33).to(torch.bfloat16),
        "meta": {"epoch": seed, "tag": "x"},
    }


def _zeros_like(state: dict) -> dict:
    return {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"epoch": -1, "tag": ""}) for k, v in state.items()}


def _save(root, step, seed=0, **kw):
    writer = AtomicStorageWriter(root, RUN, step, block_size=256 << 10, **kw)
    dcp.save(_state(seed), storage_writer=writer)
    return writer


def _load(root, step=None, **kw):
    reader = AtomicStorageReader(root, RUN, step, timeout=kw.pop("timeout", 2), **kw)
    target = _zeros_like(_state())
    dcp.load(target, storage_reader=reader)
    return reader, target


def _attempt(root, step) -> str:
    step_dir = os.path.join(root, RUN, f"step_{step:010d}")
    return os.path.join(step_dir, json.load(open(os.path.join(step_dir, "COMMITTED")))["save_id"])


def _inner_errors(exc: BaseException) -> list[BaseException]:
    return [wrapped[0] if isinstance(wrapped, tuple) else wrapped for wrapped in exc.failures.values()]


def test_round_trip_is_bit_exact_and_reports_the_step(root):
    _save(root, 3, seed=3)
    reader, loaded = _load(root)
    original = _state(3)
    assert reader.step == 3
    for key in ("big", "small", "bf16"):
        assert torch.equal(loaded[key], original[key])
    assert loaded["meta"] == original["meta"]


def test_stock_filesystem_reader_opens_the_attempt_directory(root):
    _save(root, 1, seed=1, stock_readable=True)
    target = _zeros_like(_state())
    dcp.load(target, storage_reader=FileSystemReader(_attempt(root, 1)))
    for key in ("big", "small", "bf16"):
        assert torch.equal(target[key], _state(1)[key])


@pytest.mark.parametrize("offset_fraction", [0.0, 0.37, 0.999])
def test_flipped_byte_in_a_data_file_is_detected_naming_the_file(root, offset_fraction):
    _save(root, 1)
    attempt = _attempt(root, 1)
    victim = max((f for f in os.listdir(attempt) if f.endswith(".distcp")),
                 key=lambda f: os.path.getsize(os.path.join(attempt, f)))
    path = os.path.join(attempt, victim)
    with open(path, "r+b") as f:
        f.seek(int(os.path.getsize(path) * offset_fraction))
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(CheckpointException) as info:
        _load(root)
    errors = _inner_errors(info.value)
    assert any(isinstance(e, CorruptCheckpointError) and victim in str(e) and "checksum mismatch" in str(e)
               for e in errors), errors


def test_truncated_data_file_is_detected_naming_the_file(root):
    _save(root, 1)
    attempt = _attempt(root, 1)
    victim = sorted(f for f in os.listdir(attempt) if f.endswith(".distcp"))[0]
    path = os.path.join(attempt, victim)
    os.truncate(path, os.path.getsize(path) // 2)
    with pytest.raises(CheckpointException) as info:
        _load(root)
    assert any(isinstance(e, CorruptCheckpointError) and victim in str(e) and "truncated" in str(e)
               for e in _inner_errors(info.value))


def test_garbage_manifest_is_refused_naming_the_file(root):
    _save(root, 1)
    manifest = os.path.join(_attempt(root, 1), "manifest.json")
    with open(manifest, "wb") as f:
        f.write(b"\x00garbage{{{")
    with pytest.raises(CorruptCheckpointError, match="manifest.json"):
        AtomicStorageReader(root, RUN, timeout=0.5).resolve()
    with pytest.raises(CheckpointException, match="manifest.json: manifest sha256"):
        _load(root, timeout=0.5)  # through plain dcp.load the message stands on its own


def test_torn_or_edited_marker_is_never_trusted(root):
    _save(root, 1)
    marker_path = os.path.join(root, RUN, "step_0000000001", "COMMITTED")
    data = open(marker_path, "rb").read()
    with open(marker_path, "wb") as f:
        f.write(data[: len(data) // 2])  # a torn read of a replaced marker looks like this
    with pytest.raises(CorruptCheckpointError, match="COMMITTED"):
        AtomicStorageReader(root, RUN, 1, timeout=0.3).resolve()
    edited = json.loads(data)
    edited["save_id"] = "20200101T000000Z-00000000"
    with open(marker_path, "w") as f:
        json.dump(edited, f)
    with pytest.raises(CorruptCheckpointError, match="self-checksum"):
        AtomicStorageReader(root, RUN, 1, timeout=0.3).resolve()


def test_metadata_that_would_execute_code_is_never_unpickled(root, tmp_path):
    _save(root, 1)
    attempt = _attempt(root, 1)
    canary = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {canary}",))

    with open(os.path.join(attempt, ".metadata"), "wb") as f:
        pickle.dump(Exploit(), f)
    with pytest.raises(CheckpointException, match="does not match the manifest"):
        _load(root)
    assert not canary.exists()
    # Even a .metadata whose digest matches is decoded with an allow-list.
    from dcp_atomic.format.safe_pickle import load_dcp_metadata

    with pytest.raises(CorruptCheckpointError, match="refusing to load posix.system"):
        load_dcp_metadata(pickle.dumps(Exploit()), where="crafted")
    assert not canary.exists()


def test_manifest_naming_files_outside_the_attempt_is_refused(root):
    from dcp_atomic.format.manifest import Manifest, ManifestShard

    _save(root, 1)
    raw = json.load(open(os.path.join(_attempt(root, 1), "manifest.json")))
    raw["files"][0]["name"] = "../../../etc/passwd"
    with pytest.raises(CorruptCheckpointError, match="invalid data file name"):
        Manifest.from_json(json.dumps(raw).encode(), where="m")
    # Items (extents) live in the rank's shard since schema 2: the same names and bounds are enforced there.
    shard = json.load(open(os.path.join(_attempt(root, 1), "manifest.0.json")))
    shard["files"][0]["name"] = "../../../etc/passwd"
    with pytest.raises(CorruptCheckpointError, match="invalid data file name"):
        ManifestShard.from_json(json.dumps(shard).encode(), where="s")
    shard = json.load(open(os.path.join(_attempt(root, 1), "manifest.0.json")))
    shard["files"][0]["items"][0]["length"] = 1 << 60
    with pytest.raises(CorruptCheckpointError, match="below 2\\*\\*50"):
        ManifestShard.from_json(json.dumps(shard).encode(), where="s")
    raw = json.load(open(os.path.join(_attempt(root, 1), "manifest.json")))
    raw["schema_version"] = 99
    with pytest.raises(CorruptCheckpointError, match="schema_version 99 is not supported"):
        Manifest.from_json(json.dumps(raw).encode(), where="m")


@pytest.mark.parametrize("run_id", ["..", "../evil", "a/b", "", ".hidden", "x" * 129, "a\x00b"])
def test_run_id_traversal_is_refused_at_construction(root, run_id):
    with pytest.raises(ValueError, match="run_id must be a name matching"):
        AtomicStorageWriter(root, run_id, 1)
    with pytest.raises(ValueError, match="run_id must be a name matching"):
        AtomicStorageReader(root, run_id)
    assert os.listdir(root) == []


def test_committed_step_conflict_is_raised_before_writing(root):
    _save(root, 1)
    with pytest.raises(CheckpointException, match="CommitConflictError") as info:
        _save(root, 1)
    assert any(isinstance(e, CommitConflictError) for e in _inner_errors(info.value))
    assert len(os.listdir(os.path.join(root, RUN, "step_0000000001"))) == 2  # COMMITTED + one attempt


def test_crashed_overwrite_leaves_the_old_version_loadable(root):
    _save(root, 1, seed=1)
    failpoints.arm("commit.after_manifest", "raise")
    with pytest.raises(CheckpointException, match="injected I/O error"):
        _save(root, 1, seed=2, overwrite=True)
    failpoints.disarm_all()
    _, loaded = _load(root, 1)
    assert torch.equal(loaded["big"], _state(1)["big"])
    _save(root, 1, seed=2, overwrite=True)
    _, loaded = _load(root, 1)
    assert torch.equal(loaded["big"], _state(2)["big"])


def test_latest_is_the_most_recent_commit_not_the_highest_step(root):
    _save(root, 10)
    _save(root, 20)
    _save(root, 15)  # a rollback restart: the live branch saves a lower step
    assert list_steps(root, RUN) == [10, 15, 20]
    assert latest_step(root, RUN) == 15
    reader, _ = _load(root)
    assert reader.step == 15


def test_missing_checkpoint_raises_not_found_within_the_timeout(root):
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint committed"):
        AtomicStorageReader(root, RUN, timeout=0.2).resolve()
    _save(root, 1)
    with pytest.raises(CheckpointNotFoundError, match="step 2 .* is not committed"):
        AtomicStorageReader(root, RUN, 2, timeout=0.2).resolve()
    assert list_steps(root, "nothing-here") == [] and latest_step(root, "nothing-here") is None


def test_cached_plans_save_distinct_attempts_without_a_process_group(root):
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    _save(root, 1)
    planner = DefaultSavePlanner(enable_plan_caching=True)
    ids = []
    for step in (2, 3):
        writer = AtomicStorageWriter(root, RUN, step)
        dcp.save(_state(), storage_writer=writer, planner=planner)
        ids.append(writer.save_id)
    assert ids[0] != ids[1]
    assert list_steps(root, RUN) == [1, 2, 3]
    got = _state()
    for value in got.values():
        if isinstance(value, torch.Tensor):
            value.zero_()
    dcp.load(got, storage_reader=AtomicStorageReader(root, RUN, 3))
    assert all(torch.equal(got[k], v) for k, v in _state().items() if isinstance(v, torch.Tensor))


def test_checkpoint_id_not_naming_a_step_is_refused_before_writing(root):
    with pytest.raises(ConfigurationError, match="checkpoint_id must be <root>/<run_id>/step_<N>"):
        dcp.save(_state(), checkpoint_id=os.path.join(root, "x"), storage_writer=AtomicStorageWriter(root, RUN, 1))
    assert os.listdir(root) == []


def test_tp_change_needs_consent(root):
    from dcp_atomic import Parallelism

    writer = AtomicStorageWriter(root, RUN, 1, parallelism=Parallelism(tp=1))
    dcp.save(_state(), storage_writer=writer)
    with pytest.raises(ReshardError, match="saved with tensor_parallel_size=1 .*; this job has tensor_parallel_size=2 .*; pass allow_reshard=True if intended"):
        AtomicStorageReader(root, RUN, parallelism=Parallelism(tp=2, dp=1), timeout=1).resolve()
    assert AtomicStorageReader(root, RUN, parallelism=Parallelism(tp=2), allow_reshard=True, timeout=1).resolve().step == 1


@pytest.mark.parametrize(
    "error",
    [
        CheckpointError("base", path="/x"),
        CheckpointNotFoundError("missing", step=3),
        CommitConflictError("conflict", step=1, save_id="a", winner="b"),
        CorruptCheckpointError("bad bytes", path="/p", block=2),
        RankConsistencyError("who", problems=["a", "b"]),
        ReshardError("tp", saved={"tp": 2}, current={"tp": 4}),
        StorageError("disk full", rank=1, errno=28),
        ConfigurationError("cfg"),
    ],
)
def test_errors_survive_pickling(error):
    clone = pickle.loads(pickle.dumps(error))
    assert type(clone) is type(error)
    assert str(clone) == str(error) and clone.details == error.details
    assert isinstance(clone, CheckpointError)


def test_failpoints_reject_unknown_names():
    with pytest.raises(ValueError, match="unknown failpoint"):
        failpoints.arm("commit.typo")


def test_marker_roundtrip_and_foreign_manifest_path_refused():
    marker = Marker(run_id="r", step=1, save_id="20260101T000000Z-0000abcd", manifest="20260101T000000Z-0000abcd/manifest.json",
                    manifest_sha256="0" * 64, committed_at=1.0, library_version="t")
    assert Marker.from_json(marker.to_json(), where="m") == marker
    marker.manifest = "../other/manifest.json"
    with pytest.raises(CorruptCheckpointError, match="foreign manifest"):
        Marker.from_json(marker.to_json(), where="m")


def test_any_fsspec_filesystem_round_trips_through_the_fsspec_backend():
    import uuid

    from dcp_atomic.stores.backends import open_storage
    from dcp_atomic.stores.storage import FsspecStorage

    root = f"memory://dcp-atomic-{uuid.uuid4().hex}"
    assert isinstance(open_storage(root), FsspecStorage)
    dcp.save(_state(4), storage_writer=AtomicStorageWriter(root, RUN, 4, block_size=256 << 10))
    dcp.save(_state(5), storage_writer=AtomicStorageWriter(root, RUN, 5, compression="zstd"))
    assert list_steps(root, RUN) == [4, 5] and latest_step(root, RUN) == 5
    for step in (4, 5):
        target = _zeros_like(_state())
        dcp.load(target, storage_reader=AtomicStorageReader(root, RUN, step, timeout=1))
        assert torch.equal(target["big"], _state(step)["big"]) and target["meta"] == _state(step)["meta"]
