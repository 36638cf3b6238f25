"""The CLI (gc, ls, verify, export, exit codes), canonical fingerprints, safe decoding (G13), durable directories."""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import pickle
import random
import stat
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_atomic import AtomicStorageReader, AtomicStorageWriter
from dcp_atomic.cli import main
from dcp_atomic.errors import ConfigurationError, UnsafeItemError
from dcp_atomic.backends import open_storage
from dcp_atomic.storage import FsspecStorage, LocalStorage
from tests import manifest_view
from tests.harness import assert_all_ok, run_world

RUN = "exp"
CLI = os.path.join(os.path.dirname(sys.executable), "dcp-atomic")


def _save(root, step, state=None, run=RUN, **writer_args):
    state = {"w": torch.randn(32, 32), "meta": {"step": step}} if state is None else state
    dcp.save(state, storage_writer=AtomicStorageWriter(root, run, step, **writer_args))


def _step_paths(root, step, run=RUN):
    step_dir = os.path.join(root, run, f"step_{step:010d}")
    marker = json.load(open(os.path.join(step_dir, "COMMITTED")))
    return step_dir, os.path.join(step_dir, marker["save_id"]), marker


def _reseal(root, step, edit_manifest):
    """Edit a committed manifest (items included) and recompute every digest that names it — shard, manifest,
    marker (what someone with write access can do)."""
    step_dir, attempt, marker = _step_paths(root, step)
    manifest = manifest_view.load(attempt)
    edit_manifest(manifest, attempt)
    data = manifest_view.dump(attempt, manifest)
    marker["manifest_sha256"] = hashlib.sha256(data).hexdigest()
    body = {k: v for k, v in marker.items() if k != "checksum"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    sealed = json.dumps({**body, "checksum": hashlib.sha256(canonical).hexdigest()}, indent=1).encode()
    open(os.path.join(step_dir, "COMMITTED"), "wb").write(sealed)


# -- gc names steps whose marker cannot be validated -----------------------------------------


def test_gc_reports_unreadable_steps_and_exits_nonzero(root, capsys, monkeypatch):
    """The CLI side alone: a plan carrying unreadable steps is printed and fails the command."""
    from dcp_atomic import cli
    from dcp_atomic.retention import GcPlan

    _save(root, 1)
    plan = GcPlan(kept_steps=[1])
    plan.unreadable_steps = [(7, "COMMITTED: self-checksum mismatch")]
    monkeypatch.setattr(cli, "plan_gc", lambda *args, **kwargs: plan)
    assert main(["gc", root, RUN, "--keep-last", "1"]) == 1
    captured = capsys.readouterr()
    assert "step 7" in captured.err and "self-checksum mismatch" in captured.err
    assert main(["--json", "gc", root, RUN, "--keep-last", "1"]) == 1
    assert json.loads(capsys.readouterr().out)["unreadable_steps"] == [[7, "COMMITTED: self-checksum mismatch"]]


def test_gc_keeps_and_names_a_step_with_a_damaged_marker(root, capsys):
    """End to end with retention.py's unreadable_steps (G16)."""
    for step in (1, 2, 3):
        _save(root, step)
    step_dir, attempt, _ = _step_paths(root, 1)
    open(os.path.join(step_dir, "COMMITTED"), "ab").write(b"torn")
    assert main(["--json", "gc", root, RUN, "--keep-last", "1", "--lease-hours", "0"]) != 0
    assert [s for s, _ in json.loads(capsys.readouterr().out)["unreadable_steps"]] == [1]
    assert os.path.isdir(attempt), "the data of a step whose marker exists must never be deleted"


# -- content fingerprints do not depend on the hash seed or insertion order ---------------------------------


def test_object_fingerprint_is_canonical_for_sets_and_strict_otherwise():
    from dcp_atomic.reshard import summarize_state_dict

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


# -- verify walks compressed frames the way the reader does ----------------------------------------------


def _zstd_state():
    return {"w": torch.arange(300_000, dtype=torch.float32).reshape(600, 500),  # ~1.2 MB: 5 blocks of 256 KiB
            "h": torch.linspace(-2, 2, 400_000).to(torch.bfloat16), "i": torch.arange(100_000), "obj": {"k": 1}}


def _zstd_file_of(root, key):
    _, attempt, _ = _step_paths(root, 1)
    manifest = manifest_view.load(attempt)
    entry, item = next((f, i) for f in manifest["files"] for i in f["items"] if i["key"] == key)
    return os.path.join(attempt, entry["name"]), item


def test_verify_passes_intact_multi_block_zstd_items_and_names_a_flipped_byte(root, capsys):
    _save(root, 1, _zstd_state(), compression="zstd", block_size=256 << 10)
    path, item = _zstd_file_of(root, "w")
    assert item["codec"] == "zstd" and len(item["frames"]) >= 4 and item["length"] < item["logical_length"]
    assert main(["verify", root, RUN, "1"]) == 0, capsys.readouterr()
    capsys.readouterr()
    data = bytearray(open(path, "rb").read())
    data[item["pos"] + item["length"] // 2] ^= 0x10
    open(path, "wb").write(data)
    assert main(["verify", root, RUN, "1"]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and os.path.basename(path) in out and "'w'" in out


def test_verify_decodes_frames_so_it_cannot_pass_what_the_reader_refuses(root, capsys):
    _save(root, 1, _zstd_state(), compression="zstd", block_size=256 << 10)

    def wrong_planes(manifest, attempt):
        item = next(i for f in manifest["files"] for i in f["items"] if i["key"] == "w")
        item["planes"] = 2  # digests still match the stored frames; they no longer decode

    _reseal(root, 1, wrong_planes)
    assert main(["verify", root, RUN, "1"]) == 1
    out = capsys.readouterr().out
    assert "'w'" in out and "cannot be decoded" in out


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
    from dcp_atomic.safe_pickle import safe_byte_item

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

    from dcp_atomic.safe_pickle import safe_byte_item

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
    from dcp_atomic.safe_pickle import safe_byte_item

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

    from dcp_atomic.integrity import BlockHasher

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


# -- durable directories, honest backends --------------------------------------------------------------


def test_makedirs_fsyncs_the_parent_of_every_directory_it_creates(root, monkeypatch):
    synced: list[str] = []
    real_fsync = os.fsync

    def counting_fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    storage = LocalStorage(root)
    storage.makedirs(os.path.join(root, "run", "step_1", "attempt"))
    assert sorted(synced) == sorted([root, os.path.join(root, "run"), os.path.join(root, "run", "step_1")])
    synced.clear()
    storage.makedirs(os.path.join(root, "run", "step_1", "attempt"))
    assert synced == [], "nothing created, nothing to sync"


def test_file_url_with_storage_options_keeps_the_posix_path(root):
    assert isinstance(open_storage("file://" + root, {"auto_mkdir": True}), LocalStorage)
    with pytest.raises(ConfigurationError, match="fsync"):
        open_storage("file://" + root, {"block_size": 1024})


def test_local_style_fsspec_filesystem_warns_what_it_loses(root):
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    class MyLocal(LocalFileSystem):
        protocol = ("mylocal",)

    fsspec.register_implementation("mylocal", MyLocal, clobber=True)
    with pytest.warns(UserWarning, match="fsync") as record:
        storage = open_storage("mylocal://" + root)
    assert isinstance(storage, FsspecStorage)
    assert "link()" in str(record[0].message) and "MyLocal" in str(record[0].message)


def _count_links(monkeypatch):
    """A spy on ``os.link`` (the real call runs): the destinations the probe tried."""
    calls, real_link = [], os.link

    def link(src, dst, *args, **kwargs):
        calls.append(os.fspath(dst))
        return real_link(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "link", link)
    return calls


def test_commit_support_probe_refuses_a_filesystem_without_hard_links(root, fat_volume, monkeypatch):
    calls = _count_links(monkeypatch)
    storage = LocalStorage(root)
    storage.check_commit_support(root)  # a real hard-link-capable filesystem: fine
    assert os.listdir(root) == [], "the probe leaves nothing behind"
    assert len(calls) == 1
    fresh = LocalStorage(fat_volume)  # a real FAT volume: link() fails with EPERM
    with pytest.raises(ConfigurationError) as info:
        fresh.check_commit_support(fat_volume)
    assert "hard link" in str(info.value) and fat_volume in str(info.value)
    assert os.listdir(fat_volume) == [], "nor on the refused filesystem"
    assert len(calls) == 2 and calls[1].startswith(fat_volume), calls
    storage.check_commit_support(root)  # cached per filesystem: a passed probe is not repeated
    assert len(calls) == 2, calls


def test_save_onto_a_filesystem_without_hard_links_fails_before_any_data(fat_volume):
    """End to end on a real FAT volume (needs the writer's prepare_global_plan to call check_commit_support)."""
    with pytest.raises(CheckpointException) as info:
        _save(fat_volume, 1)
    assert "hard link" in str(info.value)
    written = [f for _, _, files in os.walk(fat_volume) for f in files if f.endswith(".distcp")]
    assert written == [], "no data may be written before the probe"


# -- ls ROOT summarises each run ----------------------------------------------------------------------


def test_ls_root_shows_each_run_with_count_latest_size_and_age(root, capsys):
    _save(root, 1)
    _save(root, 2)
    _save(root, 5, run="other")
    os.makedirs(os.path.join(root, "fresh", "step_0000000001", "20260101T000000Z-deadbeef"))
    assert main(["--json", "ls", root]) == 0
    runs = {r["run"]: r for r in json.loads(capsys.readouterr().out)["runs"]}
    assert set(runs) == {RUN, "other", "fresh"}
    assert runs[RUN]["committed_steps"] == 2 and runs[RUN]["latest_step"] == 2
    assert runs["other"]["committed_steps"] == 1 and runs["other"]["latest_step"] == 5
    assert runs[RUN]["bytes"] > runs["other"]["bytes"] > 0 and 0 <= runs[RUN]["age_seconds"] < 600
    assert runs["fresh"]["committed_steps"] == 0 and runs["fresh"]["latest_step"] is None
    assert main(["ls", root]) == 0
    lines = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[1:]}
    assert lines[RUN][1:3] == ["2", "2"] and lines["other"][1:3] == ["1", "5"] and lines["fresh"][1:3] == ["0", "-"]


# -- CLI hygiene -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("keep", ["0", "-1"])
def test_gc_refuses_keep_last_below_one(root, capsys, keep):
    _save(root, 1)
    _save(root, 2)
    assert main(["gc", root, RUN, "--keep-last", keep]) == 2
    assert "--keep-last" in capsys.readouterr().err
    assert main(["--json", "gc", root, RUN, f"--keep-last={keep}"]) == 2
    assert "--keep-last" in json.loads(capsys.readouterr().out)["error"]["message"]
    assert sorted(os.listdir(os.path.join(root, RUN))) == ["LATEST", "step_0000000001", "step_0000000002"]


def test_errors_are_json_on_stdout_with_json_and_never_tracebacks(root, capsys):
    _save(root, 1)
    assert main(["--json", "show", root, RUN, "7"]) == 1
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["type"] == "CheckpointNotFoundError" and "7" in error["message"]
    assert main(["verify", root, RUN, "--threads", "0"]) == 2
    assert "--threads" in capsys.readouterr().err
    missing = os.path.join(root, "nowhere")
    assert main(["ls", missing]) == 1
    assert missing in capsys.readouterr().err
    assert main(["--json", "ls", missing]) == 1
    assert missing in json.loads(capsys.readouterr().out)["error"]["message"]
    assert main(["--json", "--storage-options", "{not json", "ls", root]) == 2
    assert "storage-options" in json.loads(capsys.readouterr().out)["error"]["message"]


def test_export_refuses_a_missing_directory_and_writes_atomically(root, capsys, monkeypatch):
    _save(root, 1, {"w": torch.arange(6.0), "meta": {"step": 1}})
    missing = os.path.join(root, "no", "such", "dir", "out.pt")
    assert main(["export", root, RUN, "1", missing]) == 1
    assert os.path.join(root, "no", "such", "dir") in capsys.readouterr().err
    out_dir = os.path.join(root, "exports")
    os.makedirs(out_dir)
    out = os.path.join(out_dir, "step1.pt")

    def torch_save_dies_half_way(obj, f, *args, **kwargs):
        stream = open(f, "wb") if isinstance(f, (str, os.PathLike)) else f
        stream.write(b"PK\x03\x04 half an archive")
        stream.flush()
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", torch_save_dies_half_way)
    assert main(["export", root, RUN, "1", out]) == 1
    assert "No space left" in capsys.readouterr().err
    assert os.listdir(out_dir) == [], "neither a partial export nor a temp file may remain"
    monkeypatch.undo()
    assert main(["export", root, RUN, "1", out]) == 0
    assert os.listdir(out_dir) == ["step1.pt"]
    assert torch.equal(torch.load(out, weights_only=True)["w"], torch.arange(6.0))


def test_installed_command_exit_codes_end_to_end(root):
    _save(root, 1)
    bad = subprocess.run([CLI, "--json", "gc", root, RUN, "--keep-last", "0"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "--keep-last" in json.loads(bad.stdout)["error"]["message"], bad
    missing = subprocess.run([CLI, "ls", os.path.join(root, "nowhere")], capture_output=True, text=True, timeout=120)
    assert missing.returncode == 1 and "Traceback" not in missing.stderr and "nowhere" in missing.stderr, missing
    assert os.path.isdir(os.path.join(root, RUN, "step_0000000001"))
