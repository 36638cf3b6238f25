"""Ways out and in: safetensors export (Hugging Face layout) and import of stock DCP checkpoints.

One world of 2 ranks saves the same state twice, through AtomicStorageWriter (the export's source) and
through stock ``FileSystemWriter`` (the import's source); every test below reads those copies.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
import subprocess
import sys

import pytest
import safetensors.torch as safetensors_torch
import torch
import torch.distributed.checkpoint as dcp

from dcp_atomic import AtomicStorageReader, AtomicStorageWriter, CommitConflictError, CorruptCheckpointError
from dcp_atomic.tools.cli import main
from tests import manifest_view
from tests.harness import assert_all_ok, run_world


RUN = "exp"
SHARDED = ("model.embed.weight", "model.proj.weight", "optim.state.embed.exp_avg")


def _full_state() -> dict:
    """The state every test compares against, flattened as DCP stores it."""
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed.weight": torch.randn(10, 8, generator=g),
        "model.proj.weight": torch.randn(6, 4, generator=g).to(torch.bfloat16),
        "model.proj.bias": torch.randn(6, generator=g),
        "model.steps": torch.arange(5, dtype=torch.int64),
        "model.mask": torch.tensor([True, False, True]),
        "optim.state.embed.exp_avg": torch.randn(10, 8, generator=g),
        "optim.state.embed.step": torch.tensor(3.0),
    }


def _nested(flat: dict) -> dict:
    nested: dict = {}
    for key, value in flat.items():
        head, *rest = key.split(".", 1)
        nested.setdefault(head, {})[rest[0]] = value
    nested["optim"]["param_groups"] = [{"lr": 0.1, "name": "all"}]
    return nested


def _rank_state(world_size: int) -> dict:
    """The full state with ``SHARDED`` keys as DTensors sharded over dim 0 of a ``dp`` mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    flat = {k: distribute_tensor(v, mesh, [Shard(0)]) if k in SHARDED else v for k, v in _full_state().items()}
    return _nested(flat)


def _save_ours_and_stock(ctx):
    from dcp_atomic import AtomicSavePlanner

    dcp.save(_rank_state(ctx.world_size), storage_writer=AtomicStorageWriter(ctx.root, RUN, 1, timeout=20),
             planner=AtomicSavePlanner())
    dcp.save(_rank_state(ctx.world_size), storage_writer=dcp.FileSystemWriter(ctx.extra["stock"]))


def _load_resharded(ctx, root, run, step):
    """Load an imported step into DTensors of this world: each rank gets its own rows."""
    state = _rank_state(ctx.world_size)
    for key in SHARDED:
        head, rest = key.split(".", 1)
        state[head][rest].to_local().zero_()
    state["optim"]["param_groups"] = [{"lr": 0.0, "name": ""}]
    dcp.load(state, storage_reader=AtomicStorageReader(root, run, step, timeout=20))
    return {f"{head}.{k}": (v.to_local() if hasattr(v, "to_local") else v)
            for head in ("model", "optim") for k, v in state[head].items() if k != "param_groups"} | {
        "param_groups": state["optim"]["param_groups"]}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``root`` holds run ``exp`` step 1 (ours, world 2); ``stock`` the same state by stock DCP (world 2)."""
    base = tmp_path_factory.mktemp("saved")
    root, stock = str(base / "root"), str(base / "stock")
    assert_all_ok(run_world(_save_ours_and_stock, 2, root, extra={"stock": stock}, timeout=120))
    return {"root": root, "stock": stock}


# -- safetensors export ------------------------------------------------------------------------------------------


def _read_like_transformers(out_dir: str) -> tuple[dict, dict]:
    """What ``transformers`` does with a sharded safetensors checkpoint (``get_checkpoint_shard_files`` and
    ``load_state_dict``): the index's weight_map names the shard files, each is opened with safetensors and must
    carry ``format: pt``.  Returns (state, index)."""
    from safetensors import safe_open

    with open(os.path.join(out_dir, "model.safetensors.index.json")) as f:
        index = json.load(f)
    shard_files = sorted(set(index["weight_map"].values()))
    state: dict = {}
    for name in shard_files:
        path = os.path.join(out_dir, name)
        with safe_open(path, framework="pt") as f:
            assert f.metadata().get("format") == "pt", name
        loaded = safetensors_torch.load_file(path)
        assert not set(loaded) & set(state), f"{name} repeats keys"
        assert all(index["weight_map"][key] == name for key in loaded), f"{name} holds keys the index puts elsewhere"
        state.update(loaded)
    assert set(state) == set(index["weight_map"]), "every indexed key in exactly one shard"
    return state, index


def _equal_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN payloads and -0.0 included)."""
    as_bytes = lambda t: t.reshape(-1).view(torch.uint8) if t.dtype != torch.bool else t  # noqa: E731
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(as_bytes(a), as_bytes(b))


def test_safetensors_export_is_bit_exact_in_the_hugging_face_layout(saved, tmp_path, capsys):
    out = str(tmp_path / "hf")
    assert main(["export", "--format", "safetensors", saved["root"], RUN, "1", out]) == 0
    captured = capsys.readouterr()
    assert "optim.param_groups" in captured.err and "non-tensor" in captured.err  # skipped, with a note
    files = sorted(os.listdir(out))
    assert files == ["model-00001-of-00001.safetensors", "model.safetensors.index.json"], files
    state, index = _read_like_transformers(out)
    full = _full_state()
    assert set(state) == set(full)
    for key, tensor in full.items():
        assert _equal_bits(state[key], tensor), key
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in full.values())


def test_safetensors_shard_size_keys_filter_and_dtype_cast(saved, tmp_path):
    full = _full_state()
    model_keys = {k for k in full if k.startswith("model.")}
    out = str(tmp_path / "split")
    assert main(["export", "--format", "safetensors", "--shard-size", "100B", "--keys", "model.*",
                 saved["root"], RUN, "1", out]) == 0
    shards = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    pattern = rf"model-\d{{5}}-of-{len(shards):05d}\.safetensors"
    assert len(shards) >= 3 and all(re.fullmatch(pattern, f) for f in shards), shards
    state, index = _read_like_transformers(out)
    assert set(state) == model_keys  # the optimizer is left out
    for name in shards:  # a shard holds more than 100 bytes only when one tensor alone does
        part = safetensors_torch.load_file(os.path.join(out, name))
        assert sum(t.nbytes for t in part.values()) <= 100 or len(part) == 1, name
    assert all(_equal_bits(state[k], full[k]) for k in model_keys)

    out = str(tmp_path / "bf16")
    assert main(["export", "--format", "safetensors", "--dtype", "bf16", "--keys", "model.embed.*",
                 "--keys", "model.steps", "--keys", "model.proj.*", saved["root"], RUN, "1", out]) == 0
    state, index = _read_like_transformers(out)
    assert set(state) == model_keys - {"model.mask"}
    for key in state:
        want = full[key].to(torch.bfloat16) if full[key].is_floating_point() else full[key]
        assert _equal_bits(state[key], want), key  # floats cast, integers untouched
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in state.values())


def test_safetensors_export_refuses_bad_options_by_name(saved, tmp_path, capsys):
    out = str(tmp_path / "none")
    assert main(["export", "--format", "safetensors", "--keys", "decoder.*", saved["root"], RUN, "1", out]) == 1
    err = capsys.readouterr().err
    assert "decoder.*" in err and "model.embed.weight" in err  # names what exists
    assert not os.path.exists(out)
    assert main(["export", "--format", "safetensors", "--shard-size", "5 parsecs", saved["root"], RUN, "1", out]) == 2
    assert "5 parsecs" in capsys.readouterr().err
    assert main(["export", "--format", "safetensors", "--dtype", "fp7", saved["root"], RUN, "1", out]) == 2
    assert main(["export", "--dtype", "bf16", saved["root"], RUN, "1", str(tmp_path / "x.pt")]) == 2
    assert "--format safetensors" in capsys.readouterr().err


_PEAK_SCRIPT = """
import json, sys
import torch, dcp_atomic.tools.cli, dcp_atomic.tools.export, dcp_atomic.dcp.reader

def high_water_mark():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

before = high_water_mark()
code = dcp_atomic.tools.cli.main(sys.argv[1:])
print(json.dumps({"code": code, "growth": high_water_mark() - before}))
"""


def _peak_growth(*argv: str) -> int:
    done = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, *argv], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["code"] == 0, done.stderr
    return result["growth"]


@pytest.mark.slow
def test_safetensors_export_streams_one_tensor_at_a_time(root, tmp_path):
    """~200 MB in 20 tensors of 10 MB, 20 MB shards: peak growth stays far below the model (torch format: above)."""
    tensor_bytes, count, shard = 10 * 2**20, 20, 20 * 10**6
    dcp.save({f"layer{i}.weight": torch.full((tensor_bytes // 4,), float(i)) for i in range(count)},
             storage_writer=AtomicStorageWriter(root, RUN, 1))
    out = str(tmp_path / "hf")
    growth = _peak_growth("export", "--format", "safetensors", "--shard-size", "20MB", root, RUN, "1", out)
    print(f"safetensors export of {count * tensor_bytes / 2**20:.0f} MiB: peak RSS growth {growth / 2**20:.1f} MiB")
    assert growth < shard + tensor_bytes + 100 * 2**20
    assert len([f for f in os.listdir(out) if f.endswith(".safetensors")]) == count  # two 10 MiB tensors exceed 20 MB
    torch_growth = _peak_growth("export", root, RUN, "1", str(tmp_path / "all.pt"))
    print(f"torch format export: peak RSS growth {torch_growth / 2**20:.1f} MiB")
    assert torch_growth > count * tensor_bytes * 0.9  # the measurement sees a whole model when there is one


# -- import of stock DCP checkpoints -----------------------------------------------------------------------------


def _snapshot(directory: str) -> dict:
    """Name -> (size, sha256, mtime): what "the source is untouched" means."""
    found = {}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        with open(path, "rb") as f:
            found[name] = (os.path.getsize(path), hashlib.sha256(f.read()).hexdigest(), os.stat(path).st_mtime_ns)
    return found


def _plain_template() -> dict:
    state = _nested({k: torch.zeros_like(v) for k, v in _full_state().items()})
    state["optim"]["param_groups"] = [{"lr": 0.0, "name": ""}]
    return state


def _attempt_dir(root: str, run: str, step: int) -> str:
    step_dir = os.path.join(root, run, f"step_{step:010d}")
    with open(os.path.join(step_dir, "COMMITTED")) as f:
        return os.path.join(step_dir, json.load(f)["save_id"])


def _assert_loads_exactly(root: str, run: str, step: int) -> None:
    state = _plain_template()
    reader = AtomicStorageReader(root, run, step, timeout=10)
    dcp.load(state, storage_reader=reader)
    assert reader.step == step
    for key, tensor in _full_state().items():
        head, rest = key.split(".", 1)
        assert _equal_bits(state[head][rest], tensor), key
    assert state["optim"]["param_groups"] == [{"lr": 0.1, "name": "all"}]


def test_import_copies_commits_and_round_trips_bit_exact(saved, tmp_path, capsys):
    stock, root = saved["stock"], str(tmp_path / "root")
    before = _snapshot(stock)
    assert main(["import", stock, root, "imported", "5"]) == 0
    assert "imported" in capsys.readouterr().out
    assert _snapshot(stock) == before, "the stock directory must be left as it was"
    _assert_loads_exactly(root, "imported", 5)
    assert main(["--json", "verify", root, "imported", "5"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["problems"] == []
    attempt = _attempt_dir(root, "imported", 5)
    manifest = manifest_view.load(attempt)
    items = [i for f in manifest["files"] for i in f["items"]]
    assert {(i["kind"], i["format"]) for i in items} == {("tensor", "torch_save"), ("bytes", "raw")}
    assert all(i["payload"] is not None for i in items if i["kind"] == "tensor")  # read in place, one copy
    assert manifest["world_size"] == 2
    for name in before:  # copies, not links: a later change to the source cannot reach the checkpoint
        if name.endswith(".distcp"):
            assert os.stat(os.path.join(attempt, name)).st_ino != os.stat(os.path.join(stock, name)).st_ino
    dcp.load(_plain_template(), storage_reader=dcp.FileSystemReader(attempt))  # still stock-readable

    flipped = os.path.join(attempt, "__0_0.distcp")  # the digests were computed from the bytes committed
    data = bytearray(open(flipped, "rb").read())
    data[len(data) // 2] ^= 1
    os.chmod(flipped, 0o644)
    open(flipped, "wb").write(data)
    assert main(["verify", root, "imported", "5"]) == 1


@pytest.mark.slow
@pytest.mark.parametrize("point", ["commit.after_manifest", "commit.after_marker", "commit.after_latest"])
def test_kill_matrix_an_import_killed_in_its_commit_leaves_the_previous_step_and_a_collectable_attempt(saved, tmp_path,
                                                                                                       point):
    """`dcp-atomic import` commits through the one committer (commit.publish) and so through its kill points: killed
    before its marker, the run's previous step stays the latest and the attempt is gc's; killed after it, the
    imported step is committed and loads exactly (a manager's load takes it; a plain step=None reader follows LATEST,
    which a kill before its write leaves on step 4 until the next commit)."""
    from dcp_atomic.protocol.commit import scan_markers
    from dcp_atomic.format.layout import RunLayout
    from dcp_atomic.protocol.retention import apply_gc, plan_gc
    from dcp_atomic.stores.storage import LocalStorage

    stock, root = saved["stock"], str(tmp_path / "root")
    assert main(["import", stock, root, "run", "4"]) == 0
    killed = subprocess.run([sys.executable, "-c", "import sys; from dcp_atomic.tools.cli import main; "
                             "sys.exit(main(sys.argv[1:]))", "import", stock, root, "run", "5"],
                            env={**os.environ, "DCP_ATOMIC_FAILPOINTS": f"{point}=kill"}, capture_output=True,
                            timeout=240)
    assert killed.returncode == -9, killed.stderr.decode()[-2000:]
    layout = RunLayout(LocalStorage(root), "run")
    committed = [m.step for m in scan_markers(layout)]
    if point == "commit.after_manifest":
        assert committed == [4]
        assert [s for s, _ in plan_gc(layout, None, lease_seconds=0).delete_attempts] == [5]
        apply_gc(layout, plan_gc(layout, None, lease_seconds=0))
        assert not os.path.exists(os.path.join(root, "run", "step_0000000005"))
        _assert_loads_exactly(root, "run", 4)
        assert main(["import", stock, root, "run", "5"]) == 0  # nothing of the killed import is in the way
    else:
        assert committed == [4, 5]
        from dcp_atomic import CheckpointManager

        with CheckpointManager(root, "run", timeout=10) as manager:  # it scans: LATEST may still name step 4
            assert manager.load(_plain_template()) == 5
    _assert_loads_exactly(root, "run", 5)
    assert main(["verify", root, "run", "5"]) == 0


@pytest.mark.tmpfs(size_kib=65536)
def test_import_link_across_filesystems_fails_with_advice_and_commits_nothing(saved, tmp_path, capsys, small_tmpfs):
    stock = os.path.join(small_tmpfs.path, "stock")  # the stock files on a tmpfs of their own: link() says EXDEV
    shutil.copytree(saved["stock"], stock)
    root = str(tmp_path / "root")
    os.makedirs(root)
    assert os.stat(stock).st_dev != os.stat(root).st_dev, "the fixture must give two filesystems"
    assert main(["import", "--link", stock, root, "linked", "4"]) == 1
    err = capsys.readouterr().err
    assert "StorageError" in err and "without --link" in err and "Nothing was committed" in err
    assert not os.path.exists(os.path.join(root, "linked", "step_0000000004", "COMMITTED"))


def test_import_link_mode_hard_links_and_verifies(saved, tmp_path, capsys):
    stock, root = saved["stock"], str(tmp_path / "root")
    before = _snapshot(stock)
    assert main(["import", "--link", stock, root, "linked", "0"]) == 0
    attempt = _attempt_dir(root, "linked", 0)
    data_files = [n for n in before if n.endswith(".distcp")]
    assert data_files and all(os.path.samefile(os.path.join(attempt, n), os.path.join(stock, n)) for n in data_files)
    assert {n: v[:2] for n, v in _snapshot(stock).items()} == {n: v[:2] for n, v in before.items()}
    _assert_loads_exactly(root, "linked", 0)
    assert main(["verify", root, "linked", "0"]) == 0


def test_import_of_a_world_1_checkpoint_reshards_to_world_2(tmp_path):
    stock, root = str(tmp_path / "stock1"), str(tmp_path / "root")
    dcp.save(_nested(_full_state()), storage_writer=dcp.FileSystemWriter(stock))
    assert main(["import", stock, root, "single", "3"]) == 0
    outcomes = assert_all_ok(run_world(_load_resharded, 2, root, args=(root, "single", 3), timeout=120))
    full = _full_state()
    for rank, got in enumerate(outcomes):
        for key, tensor in full.items():
            want = tensor.chunk(2)[rank] if key in SHARDED else tensor
            assert _equal_bits(got[key], want), (rank, key)
        assert got["param_groups"] == [{"lr": 0.1, "name": "all"}]


class _Boom:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_import_refusals_leave_nothing_behind(saved, tmp_path, capsys):
    from dcp_atomic.tools.importer import import_stock

    stock, root = saved["stock"], str(tmp_path / "root")
    assert main(["import", stock, root, "run", "1"]) == 0
    committed = os.listdir(os.path.join(root, "run", "step_0000000001"))
    with pytest.raises(CommitConflictError, match="already committed"):
        import_stock(stock, root, "run", 1)
    assert main(["import", stock, root, "run", "1"]) == 1
    assert "CommitConflictError" in capsys.readouterr().err
    assert os.listdir(os.path.join(root, "run", "step_0000000001")) == committed

    empty = tmp_path / "not_a_checkpoint"
    empty.mkdir()
    (empty / "__0_0.distcp").write_bytes(b"data")
    assert main(["import", str(empty), root, "run", "2"]) == 1
    assert ".metadata" in capsys.readouterr().err

    hostile = tmp_path / "hostile"
    hostile.mkdir()
    (hostile / ".metadata").write_bytes(pickle.dumps(_Boom()))
    with pytest.raises(CorruptCheckpointError, match="posix.system|os.system"):
        import_stock(str(hostile), root, "run", 2)

    renamed = tmp_path / "renamed"
    renamed.mkdir()
    for name in os.listdir(stock):
        target = "shard0.bin" if name == "__0_0.distcp" else name
        (renamed / target).write_bytes(open(os.path.join(stock, name), "rb").read())
    meta = pickle.loads((renamed / ".metadata").read_bytes())
    for info in meta.storage_data.values():
        if info.relative_path == "__0_0.distcp":
            info.relative_path = "shard0.bin"
    (renamed / ".metadata").write_bytes(pickle.dumps(meta))
    assert main(["import", str(renamed), root, "run", "2"]) == 1
    assert "shard0.bin" in capsys.readouterr().err

    meta = pickle.loads((renamed / ".metadata").read_bytes())
    for info in meta.storage_data.values():
        info.relative_path = "__0_0.distcp" if info.relative_path == "shard0.bin" else info.relative_path
    next(iter(meta.storage_data.values())).offset = -1
    (renamed / "__0_0.distcp").write_bytes((renamed / "shard0.bin").read_bytes())
    (renamed / ".metadata").write_bytes(pickle.dumps(meta))
    assert main(["import", str(renamed), root, "run", "2"]) == 1
    assert "not byte counts" in capsys.readouterr().err
    assert not os.path.exists(os.path.join(root, "run", "step_0000000002"))


# -- packaging -----------------------------------------------------------------------------------------------------


def test_the_built_wheel_ships_license_types_and_declared_extras(tmp_path):
    """Build the wheel from a copy of the sources (no build/ debris here) and read what a user would get."""
    import shutil
    import zipfile
    from email.parser import Parser

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    src = tmp_path / "src"
    shutil.copytree(repo, src, ignore=shutil.ignore_patterns(".venv", ".git", "tests", "benchmarks", "*.egg-info",
                                                             "__pycache__", "build", "dist", "docs"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    (wheel,) = (tmp_path / "dist").glob("dcp_atomic-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(z.read(meta_name).decode())
        license_name = next(n for n in names if n.endswith("/LICENSE"))
        license_text = z.read(license_name).decode()
    assert "dcp_atomic/py.typed" in names
    shipped = {n for n in names if n.startswith("dcp_atomic/") and n.endswith(".py")}
    sources = {os.path.relpath(os.path.join(d, f), src).replace(os.sep, "/")
               for d, _, fs in os.walk(src / "dcp_atomic") for f in fs if f.endswith(".py")}
    assert shipped == sources, f"missing from the wheel: {sorted(sources - shipped)}"  # subpackages included
    assert "Redistribution and use in source and binary forms" in license_text and "Neither the name" in license_text
    assert metadata["License-Expression"] == "BSD-3-Clause"
    assert {"s3", "export", "bench", "test"} <= set(metadata.get_all("Provides-Extra"))
    requires = metadata.get_all("Requires-Dist")
    assert any(r.startswith("safetensors") and 'extra == "export"' in r for r in requires)
    assert any(r.startswith("matplotlib") and 'extra == "bench"' in r for r in requires)
    assert "Typing :: Typed" in metadata.get_all("Classifier")
    changelog = open(os.path.join(repo, "CHANGELOG.md")).read()
    assert "## Unreleased" in changelog and "## 0.1.0" in changelog


@pytest.mark.parametrize("form", ["torch", "safetensors"])
def test_an_export_tells_its_progress_from_the_first_tensor_to_the_last_byte(tmp_path, form):
    """What ``dcp-atomic export`` shows on stderr while it runs (``CopyProgress``) hears of every tensor's bytes:
    safetensors as each is written (the total: the tensors exported), torch as each is read, then as the file is
    written (the total: twice the tensors' bytes)."""
    from dcp_atomic.tools.export import export_safetensors, export_torch

    root = str(tmp_path / "ckpt")
    state = {"a": torch.arange(4096.0), "b": torch.ones(64, 64, dtype=torch.bfloat16), "step": 7}
    dcp.save(state, storage_writer=AtomicStorageWriter(root, RUN, 1), no_dist=True)
    seen = []

    def progress(total):
        seen.append([total, 0])

        def tick(n):
            seen[-1][1] += n
        return tick

    tensors = 4096 * 4 + 64 * 64 * 2
    if form == "safetensors":
        export_safetensors(root, RUN, 1, str(tmp_path / "hf"), progress=progress, note=lambda text: None)
        assert seen == [[tensors, tensors]], seen
    else:
        export_torch(root, RUN, 1, str(tmp_path / "model.pt"), progress=progress)
        (total, done), = seen
        assert total == 2 * tensors and done >= total, seen  # the file's bytes: the tensors and torch.save's own
