"""Scale: metadata that does not grow with the world (P12).

Schema 2 keeps each rank's items in its own manifest shard; a loading rank
reads the top manifest plus the shards of the files it reads; rank 0 commits
O(world + keys); retention reads a journal, not every marker.  Schema 1
checkpoints (``tests/fixtures/v1``, written by the dcp_atomic before shards)
still load and verify.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_atomic import AtomicStorageReader, AtomicStorageWriter, CorruptCheckpointError
from tests import manifest_view
from tests.fixtures import make_v1
from tests.harness import assert_all_ok, run_world

RUN = "scale"


def _attempt(root: str, run: str, step: int) -> str:
    step_dir = os.path.join(root, run, f"step_{step:010d}")
    return os.path.join(step_dir, json.load(open(os.path.join(step_dir, "COMMITTED")))["save_id"])


def _template() -> dict:
    return {**{k: torch.full_like(v, 7) for k, v in make_v1.state().items() if isinstance(v, torch.Tensor)},
            "meta": {"epoch": -1, "name": ""}}


def test_schema_1_checkpoints_written_before_shards_load_and_verify_bit_exact(root):
    from dcp_atomic.tools import cli

    shutil.copytree(make_v1.HERE, root, dirs_exist_ok=True)
    for step in make_v1.FORMATS:
        assert json.load(open(os.path.join(_attempt(root, make_v1.RUN, step), "manifest.json")))["schema_version"] == 1
        got = _template()
        dcp.load(got, storage_reader=AtomicStorageReader(root, make_v1.RUN, step))
        want = make_v1.state()
        assert all(torch.equal(got[k], want[k]) for k in want if isinstance(want[k], torch.Tensor)), step
        assert got["meta"] == want["meta"]
    assert cli.main(["verify", root, make_v1.RUN, "--all"]) == 0


def _sharded_save_and_loads(ctx):
    """World 2: rank r holds row block r of 'w' and its own key; each rank then loads (a) its own rows only,
    (b) after rank 1's shard is damaged, its own rows again (rank 0 must not notice), (c) everything."""
    import torch.distributed as dist

    from dcp_atomic.protocol import commit

    rank = ctx.rank
    state = {"w": torch.arange(8.0).reshape(4, 2)[2 * rank: 2 * rank + 2].clone(), f"own{rank}": torch.ones(3) * rank}
    dcp.save(_as_dtensor(state), storage_writer=AtomicStorageWriter(ctx.root, RUN, 1, thread_count=1))
    read: list[int] = []
    original = commit.read_shard

    def counting(layout, committed, shard_rank, deadline):
        read.append(shard_rank)
        return original(layout, committed, shard_rank, deadline)

    commit.read_shard = counting
    got = _as_dtensor({"w": torch.zeros(2, 2), f"own{rank}": torch.zeros(3)})
    dcp.load(got, storage_reader=AtomicStorageReader(ctx.root, RUN, 1))
    own_rows = got["w"].to_local().tolist()
    shards_read = sorted(set(read))
    dist.barrier()
    if rank == 0:
        attempt = _attempt(ctx.root, RUN, 1)
        with open(os.path.join(attempt, "manifest.1.json"), "r+b") as f:
            f.seek(10)
            f.write(b"#")
    dist.barrier()
    errors = None
    try:
        dcp.load(_as_dtensor({"w": torch.zeros(2, 2), f"own{rank}": torch.zeros(3)}),
                 storage_reader=AtomicStorageReader(ctx.root, RUN, 1, timeout=0.5))
    except BaseException as e:  # noqa: BLE001 - CheckpointException: rank 1 refused, DCP reports it everywhere
        errors = str(e)
    return {"rows": own_rows, "shards_read": shards_read, "damaged_load_error": errors}


def _as_dtensor(state: dict) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return {k: DTensor.from_local(v, mesh, [Shard(0)]) if k == "w" else v for k, v in state.items()}


def test_a_loading_rank_reads_only_the_shards_of_the_files_it_reads_and_damage_is_named(root):
    results = assert_all_ok(run_world(_sharded_save_and_loads, 2, root, timeout=120))
    assert results[0]["rows"] == [[0.0, 1.0], [2.0, 3.0]] and results[1]["rows"] == [[4.0, 5.0], [6.0, 7.0]]
    assert results[0]["shards_read"] == [0] and results[1]["shards_read"] == [1], results
    error = results[0]["damaged_load_error"]
    assert error and "manifest.1.json" in error and "rank 1" in error, error


def test_manifest_json_is_o_world_plus_keys_items_live_in_per_rank_shards(root):
    state = {f"k{i}": torch.full((3,), float(i)) for i in range(200)}
    dcp.save(state, storage_writer=AtomicStorageWriter(root, RUN, 1, thread_count=2), no_dist=True)
    attempt = _attempt(root, RUN, 1)
    top = json.load(open(os.path.join(attempt, "manifest.json")))
    assert top["schema_version"] == 5 and [s["name"] for s in top["shards"]] == ["manifest.0.json"]
    assert all("items" not in f for f in top["files"]) and all("chunks" not in r for r in top["keys"].values())
    shard = json.load(open(os.path.join(attempt, "manifest.0.json")))
    assert sum(len(f["items"]) for f in shard["files"]) == 200
    got = {k: torch.zeros(3) for k in state}
    dcp.load(got, storage_reader=AtomicStorageReader(root, RUN, 1))
    assert all(torch.equal(got[k], state[k]) for k in state)


def test_rank_identities_and_statistics_live_in_ranks_json_which_show_reads_and_verify_checks(root, capsys):
    """At 4,096 ranks the per-rank records were half of the 3.3 MB manifest every loading rank read: they move to
    ranks.json, sealed by the manifest; loads never open it, ``show`` and ``verify`` do (and check its digest: damage
    there is a warning of ``verify``, which passes exactly the steps a load takes)."""
    from dcp_atomic.tools import cli

    dcp.save({"x": torch.ones(4)}, storage_writer=AtomicStorageWriter(root, RUN, 1), no_dist=True)
    attempt = _attempt(root, RUN, 1)
    top = json.load(open(os.path.join(attempt, "manifest.json")))
    side = json.load(open(os.path.join(attempt, "ranks.json")))
    assert top["ranks"] == [] and top["stats"] == [] and top["ranks_file"]["name"] == "ranks.json"
    assert [r["rank"] for r in side["ranks"]] == [0] and side["stats"][0]["bytes"] == 16
    assert cli.main(["show", root, RUN]) == 0
    shown = capsys.readouterr().out
    assert "hosts: " + side["ranks"][0]["host"] in shown and "rank 0: " in shown
    with open(os.path.join(attempt, "ranks.json"), "r+b") as f:
        f.write(b"X")  # damage: loads do not care, verify names it in a warning
    got = {"x": torch.zeros(4)}
    dcp.load(got, storage_reader=AtomicStorageReader(root, RUN, 1))
    assert torch.equal(got["x"], torch.ones(4))
    assert cli.main(["verify", root, RUN, "1"]) == 0
    out = capsys.readouterr().out
    assert "step 1: OK, with warnings" in out and "warning: " in out and "ranks.json" in out, out


@pytest.mark.parametrize("edit", ["item_length", "shard_rank", "shard_step", "files_in_shard"])
def test_a_resealed_shard_that_disagrees_is_refused_naming_it(root, edit):
    """Digests recomputed all the way up (marker -> manifest -> shard): the shard's own contents are still
    checked against the manifest and .metadata."""
    state = {"a": torch.arange(50.0), "b": torch.ones(7)}
    dcp.save(state, storage_writer=AtomicStorageWriter(root, RUN, 1, thread_count=1), no_dist=True)
    attempt = _attempt(root, RUN, 1)
    view = manifest_view.load(attempt)
    shard_path = os.path.join(attempt, "manifest.0.json")
    if edit == "item_length":
        view["files"][0]["items"][0]["length"] -= 4
        manifest_view.dump(attempt, view)
    else:
        raw = json.load(open(shard_path))
        if edit == "shard_rank":
            raw["rank"] = 1
        elif edit == "shard_step":
            raw["step"] = 2
        else:
            raw["files"][0]["size"] += 1
        data = json.dumps(raw).encode()
        open(shard_path, "wb").write(data)
        view["_pristine_shards"] = None  # keep the view's shard record: re-record this shard's digest by hand
        import hashlib

        view["shards"][0].update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
        manifest_view.dump(attempt, view)
    _reseal_marker(root, attempt)
    with pytest.raises(BaseException) as raised:
        dcp.load({"a": torch.zeros(50), "b": torch.zeros(7)}, storage_reader=AtomicStorageReader(root, RUN, 1, timeout=0.2))
    assert "CorruptCheckpointError" in repr(raised.value) or isinstance(raised.value, CorruptCheckpointError)
    assert ("manifest.0.json" in str(raised.value)) or edit == "item_length", raised.value


def _reseal_marker(root: str, attempt: str) -> None:
    import hashlib

    from tests.helpers.sealed import seal

    marker_path = os.path.join(os.path.dirname(attempt), "COMMITTED")
    marker = json.load(open(marker_path))
    marker["manifest_sha256"] = hashlib.sha256(open(os.path.join(attempt, "manifest.json"), "rb").read()).hexdigest()
    open(marker_path, "wb").write(seal(marker))


def test_retention_after_a_commit_reads_only_the_markers_it_keeps_or_may_delete(root, monkeypatch):
    from dcp_atomic.protocol import commit, retention
    layout = AtomicStorageWriter(root, RUN, 1).layout
    for step in range(1, 9):
        dcp.save({"x": torch.ones(2) * step}, storage_writer=AtomicStorageWriter(root, RUN, step), no_dist=True)
        marker = commit.read_marker_once(layout, step)
        read: list[int] = []
        monkeypatch.setattr(retention, "read_marker", lambda lay, s, *a, **k: read.append(s) or
                            commit.read_marker(lay, s, *a, **k))
        monkeypatch.setattr(retention, "scan_markers", _refuse_scan if step > 1 else retention.scan_markers)
        plan = retention.retain_after_commit(layout, marker, 2)
        monkeypatch.undo()
        kept_read = [step - 1] if step > 1 else []  # the other kept commit's marker, read for its real order
        deleted = [step - 2] if step > 2 else []  # read for its order, then again after its claim is removed
        assert read == sorted(kept_read + deleted) + deleted, (step, read)
        assert plan.delete_steps == ([step - 2] if step > 2 else [])
    assert sorted(int(d[5:]) for d in os.listdir(os.path.join(root, RUN)) if d.startswith("step_")) == [7, 8]
    os.remove(os.path.join(root, RUN, retention.COMMITS))  # lost journal: rebuilt from one scan, nothing lost
    dcp.save({"x": torch.ones(2)}, storage_writer=AtomicStorageWriter(root, RUN, 9), no_dist=True)
    plan = retention.retain_after_commit(layout, commit.read_marker_once(layout, 9), 2)
    assert plan.delete_steps == [7] and os.path.exists(os.path.join(root, RUN, retention.COMMITS))


def _refuse_scan(*args, **kwargs):
    raise AssertionError("retention scanned every marker")


def test_metadata_is_pickled_and_parsed_without_cyclic_gc_and_a_processs_own_gc_setting_is_kept(root, monkeypatch):
    """At 1,024 ranks x 1k items the cyclic GC re-traverses ~1M fresh objects during ``finish``'s pickle (19.5 s
    vs 11.4 s without it); a 10k-item load spent 0.8 of 2 s in collections while parsing.  A process that
    disabled the GC itself must find it still disabled."""
    import gc
    import pickle
    import types

    from dcp_atomic.dcp import writer
    from dcp_atomic.dcp import read_checks  # where the reader (and verify) unpickle .metadata

    gc_during = []

    def dumps(obj, *args, **kwargs):
        gc_during.append(("pickle", gc.isenabled()))
        return pickle.dumps(obj, *args, **kwargs)

    def load_metadata(data, where, **kwargs):
        gc_during.append(("unpickle", gc.isenabled()))
        return load_dcp_metadata(data, where=where, **kwargs)

    load_dcp_metadata = read_checks.load_dcp_metadata
    monkeypatch.setattr(writer, "pickle", types.SimpleNamespace(dumps=dumps, HIGHEST_PROTOCOL=pickle.HIGHEST_PROTOCOL))
    monkeypatch.setattr(read_checks, "load_dcp_metadata", load_metadata)
    assert gc.isenabled()
    dcp.save({"x": torch.ones(3)}, storage_writer=AtomicStorageWriter(root, RUN, 1), no_dist=True)
    dcp.load({"x": torch.zeros(3)}, storage_reader=AtomicStorageReader(root, RUN, 1), no_dist=True)
    assert gc_during == [("pickle", False), ("unpickle", False)] and gc.isenabled()
    gc.disable()
    try:
        dcp.save({"x": torch.ones(3)}, storage_writer=AtomicStorageWriter(root, RUN, 2), no_dist=True)
        assert not gc.isenabled(), "the save re-enabled a GC the process had disabled"
    finally:
        gc.enable()
