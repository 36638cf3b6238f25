"""Reuse (P15, phase 1) on real gloo worlds of two: unchanged items hard-linked from the base step, decided by their
block digests; every step loads on its own after its base is retired or deleted; damaged or changed bytes are never
linked; what reuse does not support is refused by name."""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil

import pytest
import torch

from tests.harness import assert_all_ok, run_world
from tests.helpers.reuse_state import COLS, ROWS, RUN
from tests.helpers.reuse_state import Messages as _Messages
from tests.helpers.reuse_state import empty as _empty
from tests.helpers.reuse_state import frozen as _frozen
from tests.helpers.reuse_state import full as _full
from tests.helpers.reuse_state import mesh as _mesh
from tests.helpers.reuse_state import state as _state


def _attempt(root, step):
    step_dir = os.path.join(root, RUN, f"step_{step:010d}")
    with open(os.path.join(step_dir, "COMMITTED")) as f:
        return os.path.join(step_dir, json.load(f)["save_id"])


def _stable(root, step, rank):
    return os.path.join(_attempt(root, step), f"__{rank}_s0.distcp")


def _inode(path):
    return os.stat(path).st_ino if os.path.exists(path) else None


def _rank_stats(root, step):
    """Per-rank statistics as the step's manifest records them (ranks.json or inline)."""
    attempt = _attempt(root, step)
    manifest = json.load(open(os.path.join(attempt, "manifest.json")))
    stats = manifest["stats"]
    if manifest.get("ranks_file"):
        stats = json.load(open(os.path.join(attempt, "ranks.json")))["stats"]
    return {s["rank"]: s for s in stats}


# -- (a) a frozen base through CheckpointManager, keep_last=2 --------------------------------------------------------


def _frozen_base_through_the_manager(ctx):
    import torch.distributed as dist

    from dcp_atomic import Callbacks, CheckpointManager

    mesh = _mesh(ctx.world_size)
    saved = []
    manager = CheckpointManager(ctx.root, RUN, keep_last=2, reuse=True, timeout=30,
                                callbacks=Callbacks(on_saved=saved.append))
    inodes = {}
    for step in (1, 2, 3, 4):
        if step == 4:  # the background write of async_save links as the synchronous save does
            manager.async_save(step, _state(mesh, step)).result()
        else:
            manager.save(step, _state(mesh, step))
        inodes[step] = _inode(_stable(ctx.root, step, ctx.rank))
        if step == 1:  # the frozen chunk, the largest item, is in the first plain file
            inodes["plain"] = _inode(os.path.join(_attempt(ctx.root, 1), f"__{ctx.rank}_0.distcp"))
    expected = _full(_state(mesh, 4))
    loaded = _empty(mesh)
    assert manager.load(loaded) == 4
    after_retention = _full(loaded)
    dist.barrier()
    if ctx.rank == 0:  # the base of step 4, deleted by hand
        shutil.rmtree(os.path.join(ctx.root, RUN, f"step_{3:010d}"))
    dist.barrier()
    loaded = _empty(mesh)
    assert manager.load(loaded) == 4
    after_rm = _full(loaded)
    manager.close()
    exact = all(torch.equal(after_retention[k], expected[k]) and torch.equal(after_rm[k], expected[k])
                for k in ("base", "adapter"))
    return {"inodes": inodes, "exact": exact, "steps": sorted(os.listdir(os.path.join(ctx.root, RUN))),
            "saved": [{k: s[k] for k in ("step", "bytes", "bytes_written", "bytes_reused")}
                      | {"ranks": [(r["rank"], r["bytes_written"], r["bytes_reused"]) for r in s["ranks"]]}
                      for s in saved]}


def test_a_frozen_base_is_linked_and_the_newest_step_loads_after_its_base_is_gone(tmp_path):
    values = assert_all_ok(run_world(_frozen_base_through_the_manager, 2, str(tmp_path), timeout=120))
    for rank, value in enumerate(values):
        assert value["exact"], f"rank {rank} loaded other bytes"
        inodes = value["inodes"]
        assert inodes[1] is None  # no base: nothing to compare with, a full save without a stable file
        # step 1's plain file is mostly the frozen chunk: linked under a stable name, and on from there
        assert inodes[2] == inodes["plain"] is not None, f"rank {rank}: plain file not linked: {inodes}"
        assert inodes[3] == inodes[2] and inodes[4] == inodes[2], f"rank {rank}: stable file not linked: {inodes}"
    assert [s for s in values[0]["steps"] if s.startswith("step_")] == [f"step_{4:010d}"]  # 1, 2 retired; 3 rm'd
    saved = {s["step"]: s for s in values[0]["saved"]}
    chunk = ROWS * COLS * 4 // 2
    for step in (2, 3, 4):
        assert saved[step]["bytes_reused"] >= 2 * chunk
        assert saved[step]["bytes_written"] < 4096  # the adapter and the counter
        assert saved[step]["bytes"] == saved[step]["bytes_written"] + saved[step]["bytes_reused"]
        for rank, written, reused in saved[step]["ranks"]:
            assert reused >= chunk and written < 4096, (step, rank, written, reused)


# -- (b) a "frozen" tensor with one changed element; (c) a damaged base file -------------------------------------------


def _changed_element_and_damaged_base(ctx):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageWriter, CheckpointManager

    mesh = _mesh(ctx.world_size)
    messages = _Messages()

    def save(step, **state_args):
        dcp.save(_state(mesh, step, **state_args), storage_writer=AtomicStorageWriter(ctx.root, RUN, step, reuse=True))

    def load(step):
        loaded = _empty(mesh)
        manager = CheckpointManager(ctx.root, RUN, timeout=30)
        try:
            manager.load(loaded, step=step)
            return _full(loaded)
        finally:
            manager.close()

    save(1)
    save(2)  # writes the stable files
    save(3, changed_element=True)  # rank 0's chunk of "base" changed: not linked; rank 1's is
    loaded, expected = load(3), _full(_state(mesh, 3, changed_element=True))
    changed = {"inodes": [_inode(_stable(ctx.root, s, ctx.rank)) for s in (2, 3)],
               "stats": _rank_stats(ctx.root, 3)[ctx.rank],
               "exact": all(torch.equal(loaded[k], expected[k]) for k in ("base", "adapter"))}
    # (c): step 4 saves the changed base (stable file written on rank 0), step 5 links it; damage step 5's copy
    save(4, changed_element=True)
    save(5, changed_element=True)
    linked = _inode(_stable(ctx.root, 5, ctx.rank)) == _inode(_stable(ctx.root, 4, ctx.rank))
    dist.barrier()
    if ctx.rank == 0:
        with open(_stable(ctx.root, 5, 0), "r+b") as f:
            f.seek(1000)
            byte = f.read(1)
            f.seek(1000)
            f.write(bytes([byte[0] ^ 0x01]))
    dist.barrier()
    del messages.lines[:]
    save(6, changed_element=True)
    damaged = {"linked_before": linked, "log": list(messages.lines),
               "inodes": [_inode(_stable(ctx.root, s, ctx.rank)) for s in (5, 6)],
               "stats": _rank_stats(ctx.root, 6)[ctx.rank]}
    loaded, expected = load(6), _full(_state(mesh, 6, changed_element=True))
    damaged["exact"] = all(torch.equal(loaded[k], expected[k]) for k in ("base", "adapter"))
    try:
        load(5)
        damaged["old_step"] = None
    except Exception as e:  # every rank fails the load; rank 0 read the damaged block
        damaged["old_step"] = type(e).__name__
    return {"changed": changed, "damaged": damaged}


def test_b_changed_element_is_stored_and_c_a_damaged_base_is_not_linked(tmp_path):
    values = assert_all_ok(run_world(_changed_element_and_damaged_base, 2, str(tmp_path), timeout=150))
    chunk = ROWS * COLS * 4 // 2
    # (b) rank 0's chunk changed in one element: stored, not linked, and it loads as its new value
    zero, one = values[0]["changed"], values[1]["changed"]
    assert zero["exact"] and one["exact"]
    assert zero["inodes"][1] != zero["inodes"][0]
    assert zero["stats"]["bytes_reused"] == 0 and zero["stats"]["bytes_written"] >= chunk
    assert one["inodes"][1] == one["inodes"][0] and one["stats"]["bytes_reused"] >= chunk  # unchanged: linked
    # (c) rank 0's base stable file damaged: step 6 does not link it (a full write, logged), loads exactly; the
    # damaged step fails typed
    zero, one = values[0]["damaged"], values[1]["damaged"]
    assert zero["linked_before"] and one["linked_before"]
    assert zero["inodes"][1] != zero["inodes"][0]
    assert zero["stats"]["bytes_reused"] == 0 and zero["stats"]["bytes_written"] >= chunk
    assert any("does not match its digests" in line for line in zero["log"]), zero["log"]
    assert one["inodes"][1] == one["inodes"][0] and one["stats"]["bytes_reused"] >= chunk
    assert zero["exact"] and one["exact"]
    assert zero["old_step"] == "CorruptCheckpointError", zero["old_step"]
    assert one["old_step"] is not None


# -- (e) reuse=False writes as before ------------------------------------------------------------------------------


def _without_reuse(ctx):
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageWriter

    mesh = _mesh(ctx.world_size)
    for step in (1, 2):
        dcp.save(_state(mesh, step), storage_writer=AtomicStorageWriter(ctx.root, RUN, step))
    return True


def test_e_without_reuse_no_stable_file_and_every_byte_written(tmp_path):
    assert_all_ok(run_world(_without_reuse, 2, str(tmp_path)))
    assert not glob.glob(os.path.join(str(tmp_path), RUN, "step_*", "*", "__*_s*.distcp"))
    for step in (1, 2):
        names = sorted(os.path.basename(p) for p in glob.glob(os.path.join(_attempt(str(tmp_path), step), "*.distcp")))
        assert names and all(n.split("_")[-1].split(".")[0].isdigit() for n in names), names
        shards = [json.load(open(p)) for p in glob.glob(os.path.join(_attempt(str(tmp_path), step), "manifest.*.json"))]
        assert all("chunk_sizes" not in item for shard in shards for f in shard["files"] for item in f["items"])
        for stats in _rank_stats(str(tmp_path), step).values():
            assert stats["bytes_reused"] == 0 and stats["bytes_written"] == stats["bytes"]


# -- (d) refusals --------------------------------------------------------------------------------------------------


def test_d_reuse_on_a_filesystem_that_cannot_link_in_place_is_refused_and_object_stores_are_not(tmp_path):
    from dcp_atomic import AtomicStorageWriter, CheckpointManager, ConfigurationError

    with pytest.raises(ConfigurationError, match=r"reuse=True\) on memory://.*server-side copies.*reuse=False"):
        AtomicStorageWriter("memory://checkpoints", RUN, 1, reuse=True)
    with pytest.raises(ConfigurationError, match=r"CheckpointManager\(reuse=True\) on memory://"):
        CheckpointManager("memory://checkpoints", RUN, reuse=True)
    writer = AtomicStorageWriter("s3://bucket/checkpoints", RUN, 1, reuse=True,  # S3 copies server-side
                                 storage_options={"endpoint_url": "http://127.0.0.1:9"})
    assert writer.reuse and writer.storage.link_kind == "server-side copy"


def test_d_reuse_with_stock_readable_is_refused(tmp_path):
    from dcp_atomic import AtomicStorageWriter, ConfigurationError

    with pytest.raises(ConfigurationError, match=r"reuse=True, stock_readable"):
        AtomicStorageWriter(str(tmp_path), RUN, 1, reuse=True, stock_readable=True)


def _compressed_frozen_base(ctx):
    """Reuse with zstd: the base is stored compressed, then linked; one changed element is written again."""
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageWriter, Callbacks, CheckpointManager

    mesh = _mesh(ctx.world_size)
    saved = []
    manager = CheckpointManager(ctx.root, RUN, reuse=True, compression="zstd", timeout=30,
                                callbacks=Callbacks(on_saved=saved.append))
    inodes = {}
    for step in (1, 2, 3):
        manager.save(step, _state(mesh, step))
        inodes[step] = _inode(_stable(ctx.root, step, ctx.rank))
    loaded = _empty(mesh)
    assert manager.load(loaded) == 3
    exact = all(torch.equal(_full(loaded)[k], _full(_state(mesh, 3))[k]) for k in ("base", "adapter"))
    manager.close()
    # step 4: one element of rank 0's chunk of the base changed (the writer directly, as a framework does)
    dcp.save(_state(mesh, 4, changed_element=True),
             storage_writer=AtomicStorageWriter(ctx.root, RUN, 4, reuse=True, compression="zstd"))
    return {"inodes": inodes, "exact": exact, "changed": _inode(_stable(ctx.root, 4, ctx.rank)),
            "saved": {s["step"]: (s["bytes_written"], s["bytes_reused"]) for s in saved},
            "step4": _rank_stats(ctx.root, 4)[ctx.rank]}


def test_reuse_with_compression_links_the_compressed_base_and_writes_a_changed_element_again(tmp_path):
    """A block's zstd frame is a function of the block, so the digests of the frames decide."""
    values = assert_all_ok(run_world(_compressed_frozen_base, 2, str(tmp_path), timeout=120))
    chunk = ROWS * COLS * 4 // 2
    for rank, value in enumerate(values):
        assert value["exact"], f"rank {rank} loaded other bytes"
        inodes = value["inodes"]
        assert inodes[2] is not None and inodes[3] == inodes[2], f"rank {rank}: stable file not linked: {inodes}"
    saved = values[0]["saved"]
    assert saved[3][1] > 0 and saved[3][0] < 4096, saved  # linked: only the adapter and the counter written
    shard = json.load(open(os.path.join(_attempt(str(tmp_path), 3), "manifest.0.json")))
    assert "zstd" in json.dumps(shard), "the base was not stored compressed"  # so reuse compared zstd frames
    zero, one = values[0], values[1]
    assert zero["changed"] != zero["inodes"][3] and zero["step4"]["bytes_reused"] == 0  # the changed chunk: written
    assert one["changed"] == one["inodes"][3] and one["step4"]["bytes_reused"] > 0  # rank 1's: still linked
    assert saved[3][0] + saved[3][1] < 2 * chunk  # compressed: the stored bytes are fewer than the raw chunks


def test_d_reuse_with_dcp_plan_caching_is_refused(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner

    from dcp_atomic import AtomicStorageWriter

    writer = AtomicStorageWriter(str(tmp_path), RUN, 1, reuse=True)
    with pytest.raises(BaseException) as raised:
        dcp.save({"w": torch.ones(4)}, storage_writer=writer, planner=DefaultSavePlanner(enable_plan_caching=True))
    assert "ConfigurationError" in repr(raised.value) or type(raised.value).__name__ == "ConfigurationError"
    assert "reuse=True" in str(raised.value) and "enable_plan_caching" in str(raised.value)
    assert not glob.glob(os.path.join(str(tmp_path), RUN, "step_*", "*", "*.distcp"))  # nothing was written


# -- one process: a failed link falls back to a write; show and verify ---------------------------------------------


def _save_one(root, step, base):
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageWriter

    writer = AtomicStorageWriter(root, RUN, step, reuse=True)
    dcp.save({"base": base, "adapter": torch.full((4, 4), float(step))}, storage_writer=writer)
    return writer.last_stats


def _load_one(root, step):
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageReader

    out = {"base": torch.zeros(ROWS, COLS), "adapter": torch.zeros(4, 4)}
    dcp.load(out, storage_reader=AtomicStorageReader(root, RUN, step))
    return out


def test_a_link_that_fails_falls_back_to_writing_the_file(tmp_path, monkeypatch, caplog):
    import errno

    from dcp_atomic.stores.storage import LocalStorage

    root, base = str(tmp_path), _frozen()
    _save_one(root, 1, base)
    _save_one(root, 2, base)

    def cross_device(self, source, target):
        raise OSError(errno.EXDEV, "Invalid cross-device link", target)

    monkeypatch.setattr(LocalStorage, "link", cross_device)
    with caplog.at_level(logging.INFO, logger="dcp_atomic.writer"):
        stats = _save_one(root, 3, base)
    assert stats["bytes_reused"] == 0 and stats["bytes_written"] == stats["bytes"]
    assert any("could not link __0_s0.distcp" in r.getMessage() for r in caplog.records)
    assert _inode(_stable(root, 3, 0)) != _inode(_stable(root, 2, 0))  # written, so the next save can link it
    monkeypatch.undo()
    assert _save_one(root, 4, base)["bytes_reused"] == ROWS * COLS * 4
    for step in (3, 4):
        loaded = _load_one(root, step)
        assert torch.equal(loaded["base"], base) and torch.equal(loaded["adapter"], torch.full((4, 4), float(step)))


def test_show_prints_written_and_reused_bytes_and_verify_passes_a_linked_step(tmp_path, capsys):
    from dcp_atomic.tools.cli import main

    root, base = str(tmp_path), _frozen()
    for step in (1, 2, 3):
        stats = _save_one(root, step, base)
    assert main(["show", root, RUN, "3"]) == 0
    out = capsys.readouterr().out
    assert f"{stats['bytes_written']} bytes written, {ROWS * COLS * 4} bytes linked" in out, out
    assert "MiB reused" in out
    assert main(["verify", root, RUN, "3"]) == 0
    capsys.readouterr()
    # the run's size counts a file that three steps link once: what the disk holds
    assert main(["ls", root, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["runs"][0]["bytes"]
    assert listed == _data_bytes_on_disk(root) < 3 * ROWS * COLS * 4  # 3 steps of 1 MiB, 2 files of it


def test_content_decides_never_requires_grad(tmp_path):
    """A parameter that requires grad but did not change is linked; a tensor that does not require grad but changed
    is written."""
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageWriter

    root = str(tmp_path)
    trained = torch.nn.Parameter(_frozen())  # requires_grad=True, never updated
    for step in (1, 2, 3):
        frozen = torch.full((ROWS, COLS), float(step))  # requires_grad=False, different every step
        writer = AtomicStorageWriter(root, RUN, step, reuse=True)
        dcp.save({"trained": trained, "frozen": frozen}, storage_writer=writer)
    assert writer.last_stats["bytes_reused"] == ROWS * COLS * 4  # "trained" alone
    assert writer.last_stats["bytes_written"] >= ROWS * COLS * 4  # "frozen" written
    shard = json.load(open(os.path.join(_attempt(root, 3), "manifest.0.json")))
    placed = {item["key"]: f["name"] for f in shard["files"] for item in f["items"]}
    assert placed == {"trained": "__0_s0.distcp", "frozen": "__0_0.distcp"}


def test_a_base_saved_without_reuse_means_one_full_save(tmp_path):
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageWriter

    root, base = str(tmp_path), _frozen()
    dcp.save({"base": base, "adapter": torch.zeros(4, 4)}, storage_writer=AtomicStorageWriter(root, RUN, 1))
    assert _save_one(root, 2, base)["bytes_reused"] == 0  # step 1 records no chunk sizes: nothing to compare
    assert not os.path.exists(_stable(root, 2, 0))
    plain = _inode(os.path.join(_attempt(root, 2), "__0_0.distcp"))
    assert _save_one(root, 3, base)["bytes_reused"] == ROWS * COLS * 4  # step 2's plain file, linked
    assert _inode(_stable(root, 3, 0)) == plain
    assert _save_one(root, 4, base)["bytes_reused"] == ROWS * COLS * 4  # and on
    assert torch.equal(_load_one(root, 4)["base"], base)


def _save_tensors(root, step, tensors, **writer_args):
    """One process, one plain file (``thread_count=1``): ``tensors`` and an adapter that changes every step; the
    step loads exactly; the writer's statistics and where each key's item lies."""
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageReader, AtomicStorageWriter

    writer = AtomicStorageWriter(root, RUN, step, reuse=True, thread_count=1, **writer_args)
    dcp.save({**tensors, "adapter": torch.full((4, 4), float(step))}, storage_writer=writer)
    out = {name: torch.zeros_like(t) for name, t in tensors.items()} | {"adapter": torch.zeros(4, 4)}
    dcp.load(out, storage_reader=AtomicStorageReader(root, RUN, step))
    assert all(torch.equal(out[name], t) for name, t in tensors.items()), step
    shard = json.load(open(os.path.join(_attempt(root, step), "manifest.0.json")))
    return writer.last_stats, {item["key"]: f["name"] for f in shard["files"] for item in f["items"]}


def _data_bytes_on_disk(root: str) -> int:
    """The bytes the run's data files hold on disk, each inode once (a file several steps link counts once)."""
    inodes = {}
    for folder, _, names in os.walk(os.path.join(root, RUN)):
        for name in names:
            if name.endswith(".distcp"):
                st = os.stat(os.path.join(folder, name))
                inodes[st.st_ino] = st.st_size
    return sum(inodes.values())


def _inode_of(root, step, name):
    return os.stat(os.path.join(_attempt(root, step), name)).st_ino


def test_one_changed_item_costs_only_that_item_and_its_file_stays_linked(tmp_path):
    """The first reused save after a plain one links the plain file under a stable name; one element of one frozen
    tensor changed writes that item alone (the linked file keeps the other two, its old copy of b is dead), and once
    b stops changing the file it was written into is linked too."""
    root = str(tmp_path)
    tensors = {name: torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(i))
               for i, name in enumerate("abc")}
    tensor = ROWS * COLS * 4
    saved = {}
    for step in range(1, 6):
        if step == 3:
            tensors["b"][7, 7] += 1.0  # from step 3 on, b has one changed element
        saved[step] = _save_tensors(root, step, tensors)
    assert saved[1][1] == {"a": "__0_0.distcp", "b": "__0_0.distcp", "c": "__0_0.distcp", "adapter": "__0_0.distcp"}
    stats, placed = saved[2]
    assert stats["bytes_reused"] == 3 * tensor and stats["bytes_written"] < 4096  # the adapter alone
    assert placed == {"a": "__0_s0.distcp", "b": "__0_s0.distcp", "c": "__0_s0.distcp", "adapter": "__0_0.distcp"}
    assert _inode_of(root, 2, "__0_s0.distcp") == _inode_of(root, 1, "__0_0.distcp")
    stats, placed = saved[3]
    assert stats["bytes_reused"] == 2 * tensor and tensor <= stats["bytes_written"] < tensor + 4096
    assert placed["b"] == "__0_0.distcp" and placed["a"] == placed["c"] == "__0_s0.distcp"
    assert _inode_of(root, 3, "__0_s0.distcp") == _inode_of(root, 1, "__0_0.distcp")
    stats, placed = saved[4]  # b unchanged since step 3: step 3's plain file linked under the next stable name
    assert stats["bytes_reused"] == 3 * tensor and stats["bytes_written"] < 4096
    assert placed["b"] == "__0_s1.distcp" and _inode_of(root, 4, "__0_s1.distcp") == _inode_of(root, 3, "__0_0.distcp")
    assert saved[5][0]["bytes_reused"] == 3 * tensor
    assert _inode_of(root, 5, "__0_s1.distcp") == _inode_of(root, 4, "__0_s1.distcp")
    assert _data_bytes_on_disk(root) < 4 * tensor + 4096  # five steps of three tensors: the three and b's new value


def test_dead_bytes_are_read_by_no_load_and_damage_there_fails_only_the_steps_that_reference_them(tmp_path, capsys):
    """Steps 1, 2 and 3 share one inode (step 1's plain file, linked by 2 and 3 under a stable name); step 3 changed
    b, so b's old bytes in it are dead there.  A byte flipped in them fails steps 1 and 2, which reference them, each
    report naming the other and not step 3, which loads exactly and verifies: no load or ``verify`` of it reads a
    dead byte.  A byte flipped in a, which all three reference, fails all three, each naming the other two."""
    from dcp_atomic.tools.cli import main

    root = str(tmp_path)
    tensors = {name: torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(i))
               for i, name in enumerate("abc")}
    for step in (1, 2, 3):
        if step == 3:
            tensors["b"][7, 7] += 1.0
        _save_tensors(root, step, tensors)
    shared = os.path.join(_attempt(root, 1), "__0_0.distcp")
    assert _inode_of(root, 2, "__0_s0.distcp") == _inode_of(root, 3, "__0_s0.distcp") == _inode(shared)
    records = {step: {f["name"]: f for f in json.load(open(os.path.join(_attempt(root, step), "manifest.0.json")))
                      ["files"]} for step in (1, 3)}
    linked = records[3]["__0_s0.distcp"]
    assert {i["key"] for i in linked["items"]} == {"a", "c"} and linked["size"] == os.path.getsize(shared)
    where = {i["key"]: i["pos"] for i in records[1]["__0_0.distcp"]["items"]}

    def load_step_3():
        import torch.distributed.checkpoint as dcp

        from dcp_atomic import AtomicStorageReader

        out = {name: torch.zeros_like(t) for name, t in tensors.items()} | {"adapter": torch.zeros(4, 4)}
        reader = AtomicStorageReader(root, RUN, 3)
        dcp.load(out, storage_reader=reader)
        referenced = sum(i["length"] for f in records[3].values() for i in f["items"])
        assert reader.read_stats.storage_bytes == referenced  # every referenced byte once, no dead one
        return all(torch.equal(out[name], t) for name, t in tensors.items())

    _flip(shared, where["b"] + 1000)  # b's old bytes: live in steps 1 and 2, dead in step 3
    assert load_step_3()
    capsys.readouterr()
    assert main(["verify", root, RUN, "3"]) == 0
    assert main(["verify", "--all", root, RUN]) == 1
    out = capsys.readouterr().out
    assert "step 3: OK" in out and "step 1: FAILED" in out and "step 2: FAILED" in out, out
    assert "is in step(s) 2, which" in out and "is in step(s) 1, which" in out and "3, which" not in out, out
    _flip(shared, where["b"] + 1000)  # back as it was
    _flip(shared, where["a"] + 1000)  # a: referenced by every step
    assert main(["verify", "--all", root, RUN]) == 1
    out = capsys.readouterr().out
    for step, others in ((1, "2, 3"), (2, "1, 3"), (3, "1, 2")):
        assert f"step {step}: FAILED" in out and f"is in step(s) {others}, which" in out, out


def test_a_file_mostly_changed_is_compacted_and_a_damaged_plain_file_is_not_linked(tmp_path, caplog):
    """Below ``LINK_SHARE`` a base file is not linked: its unchanged items are rewritten into a stable file of their
    own (no step keeps a mostly dead file), which the next save links.  A plain base file that fails its digests is
    written instead, logged, and the step loads exactly."""
    from dcp_atomic.dcp import reuse

    root = str(tmp_path)
    tensors = {name: torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(i))
               for i, name in enumerate("abc")}
    tensor = ROWS * COLS * 4
    _save_tensors(root, 1, tensors)
    tensors["b"] += 1.0
    tensors["c"] += 1.0  # a, a third of step 1's file, is below LINK_SHARE
    assert tensor < reuse.LINK_SHARE * os.path.getsize(os.path.join(_attempt(root, 1), "__0_0.distcp"))
    stats, placed = _save_tensors(root, 2, tensors)
    assert stats["bytes_reused"] == 0 and stats["bytes_written"] >= 3 * tensor
    assert placed["a"] == "__0_s0.distcp" and placed["b"] == placed["c"] == "__0_0.distcp"
    assert _inode_of(root, 2, "__0_s0.distcp") != _inode_of(root, 1, "__0_0.distcp")
    stats, _ = _save_tensors(root, 3, tensors)  # the compacted file and the plain one, linked
    assert stats["bytes_reused"] == 3 * tensor
    _flip(os.path.join(_attempt(root, 3), "__0_s1.distcp"), 4096, keep_mtime=True)  # step 2's plain file: b, c
    with caplog.at_level(logging.INFO, logger="dcp_atomic.writer"):
        stats, placed = _save_tensors(root, 4, tensors)
    assert any("does not match its digests" in r.getMessage() for r in caplog.records)
    assert stats["bytes_reused"] == tensor and stats["bytes_written"] >= 2 * tensor  # a linked; b, c written


def test_resaving_the_latest_step_takes_the_step_below_as_its_base(tmp_path):
    """LATEST names the step being saved again (overwrite=True): the base is the latest committed step below it."""
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageWriter

    root, base = str(tmp_path), _frozen()
    for step in (1, 2, 3):
        _save_one(root, step, base)
    writer = AtomicStorageWriter(root, RUN, 3, reuse=True, overwrite=True)
    dcp.save({"base": base, "adapter": torch.full((4, 4), 9.0)}, storage_writer=writer)
    assert writer.last_stats["bytes_reused"] == ROWS * COLS * 4
    assert _inode(_stable(root, 3, 0)) == _inode(_stable(root, 2, 0))
    loaded = _load_one(root, 3)
    assert torch.equal(loaded["base"], base) and torch.equal(loaded["adapter"], torch.full((4, 4), 9.0))


def _two_saves_at_world_two(ctx):
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageWriter

    mesh = _mesh(ctx.world_size)
    for step in (1, 2):
        dcp.save(_state(mesh, step), storage_writer=AtomicStorageWriter(ctx.root, RUN, step, reuse=True))
    return True


def test_a_base_of_another_world_size_is_not_reused(tmp_path):
    """Saved by a world of two, saved again by one process: rank 0's chunk of "base" has the same offset and other
    sizes, so nothing of the base is linked, and the step loads exactly."""
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageReader, AtomicStorageWriter

    root = str(tmp_path)
    assert_all_ok(run_world(_two_saves_at_world_two, 2, root))
    writer = AtomicStorageWriter(root, RUN, 3, reuse=True)
    dcp.save({"base": _frozen(), "adapter": torch.full((8, 16), 3.0), "step": 3}, storage_writer=writer)
    assert writer.last_stats["bytes_reused"] == 0 and not os.path.exists(_stable(root, 3, 0))
    out = {"base": torch.zeros(ROWS, COLS), "adapter": torch.zeros(8, 16), "step": -1}
    dcp.load(out, storage_reader=AtomicStorageReader(root, RUN, 3))
    assert torch.equal(out["base"], _frozen()) and out["step"] == 3


def test_a_step_with_stable_files_requires_them_by_name_and_its_schema_4_form_still_loads(tmp_path):
    """A step that names a stable file lists ``stable_files`` in ``requires`` (a step without, nothing); the same
    step as dcp_atomic wrote it before features had names (schema 4) still loads, with data under hashed prefixes
    too; a manifest whose ``requires`` or number disagrees with the files it names is refused as malformed."""
    from dcp_atomic import CorruptCheckpointError
    from dcp_atomic.format import manifest as manifest_format
    from tests.helpers.sealed import Sealed

    root, base = str(tmp_path), _frozen()
    for step in (1, 2):
        _save_one(root, step, base)
    with_stable = os.path.join(_attempt(root, 2), "manifest.json")
    raw = json.load(open(with_stable))
    assert raw["schema_version"] == manifest_format.MANIFEST_SCHEMA and raw["requires"] == ["stable_files"]
    assert any(f["name"] == "__0_s0.distcp" for f in raw["files"])
    assert json.load(open(os.path.join(_attempt(root, 1), "manifest.json")))["requires"] == []  # no stable file
    assert manifest_format.Manifest.from_json(open(with_stable, "rb").read(), where=with_stable).requires("stable_files")
    with pytest.raises(CorruptCheckpointError, match="stable_files"):
        manifest_format.Manifest.from_json(json.dumps({**raw, "requires": []}).encode(), where=with_stable)

    schema_4 = {k: v for k, v in raw.items() if k != "requires"} | {"schema_version": 4}
    Sealed(root, 2).write_manifest(json.dumps(schema_4).encode())  # and the marker names its digest
    out = _load_one(root, 2)
    assert torch.equal(out["base"], base) and torch.equal(out["adapter"], torch.full((4, 4), 2.0))
    with pytest.raises(CorruptCheckpointError, match="stable_files"):
        manifest_format.Manifest.from_json(json.dumps({**schema_4, "schema_version": 2}).encode(), where=with_stable)
    # an object store's reuse: schema 4 with the data under hashed prefixes (S3's default); 0 is written by omission
    prefixed = manifest_format.Manifest.from_json(json.dumps({**schema_4, "data_prefixes": 16}).encode(),
                                                  where=with_stable)
    assert prefixed.requires("data_prefixes") and json.loads(prefixed.to_json())["schema_version"] == 4
    with pytest.raises(CorruptCheckpointError, match="data_prefixes 0"):
        manifest_format.Manifest.from_json(json.dumps({**schema_4, "data_prefixes": 0}).encode(), where=with_stable)


def test_export_of_a_step_with_linked_files_is_whole_after_its_base_steps_are_removed(tmp_path):
    """``dcp-atomic export`` reads a reused step as any other: every byte it references, verified, none from the
    removed base steps."""
    from dcp_atomic.tools.cli import main

    root, base = str(tmp_path / "ckpt"), _frozen()
    for step in (1, 2, 3):
        _save_one(root, step, base)
    assert _inode(_stable(root, 3, 0)) == _inode(_stable(root, 2, 0))
    for step in (1, 2):
        shutil.rmtree(os.path.join(root, RUN, f"step_{step:010d}"))
    out = str(tmp_path / "step3.pt")
    assert main(["export", root, RUN, "3", out]) == 0
    exported = torch.load(out, weights_only=True)
    assert torch.equal(exported["base"], base) and torch.equal(exported["adapter"], torch.full((4, 4), 3.0))


def test_verify_names_every_step_that_shares_a_damaged_linked_file(tmp_path, capsys):
    """Steps 2, 3 and 4 link step 1's plain file (step 2 under a stable name): one flipped byte in the frozen
    tensor fails all four, and each report names the other three; step 5, which holds its own copy of the base
    (damaged base bytes are never linked), verifies."""
    from dcp_atomic.tools.cli import main

    root, base = str(tmp_path), _frozen()
    for step in (1, 2, 3, 4):
        _save_one(root, step, base)
    plain = os.path.join(_attempt(root, 1), "__0_0.distcp")
    assert _inode(plain) == _inode(_stable(root, 2, 0)) == _inode(_stable(root, 3, 0)) == _inode(_stable(root, 4, 0))
    _flip(_stable(root, 3, 0), 4096)
    assert main(["verify", root, RUN, "3"]) == 1
    out = capsys.readouterr().out
    assert "step 3: FAILED" in out and "is in step(s) 1, 2, 4, which hold the same damaged bytes" in out, out
    _save_one(root, 5, base)
    assert main(["verify", "--all", root, RUN]) == 1
    out = capsys.readouterr().out
    assert "step 5: OK" in out, out
    for step, others in ((1, "2, 3, 4"), (2, "1, 3, 4"), (3, "1, 2, 4"), (4, "1, 2, 3")):
        assert f"step {step}: FAILED" in out and f"is in step(s) {others}, which" in out, out


# -- crashes and races around a link ---------------------------------------------------------------------------------


def test_the_base_removed_between_planning_and_link_means_a_written_file_and_an_exact_step(tmp_path, caplog):
    """An operator's `dcp-atomic rm` (or another job's retention) takes the base step after rank 0 named it: the
    link fails, the stable file is written, the save commits and loads exactly."""
    from dcp_atomic._base import failpoints
    from dcp_atomic.tools.cli import main

    root, base = str(tmp_path), _frozen()
    for step in (1, 2):
        _save_one(root, step, base)

    def remove_base(rank, base_step):
        assert main(["rm", root, RUN, str(base_step), "--yes"]) == 0

    failpoints.arm("reuse.before_link", remove_base)
    try:
        with caplog.at_level(logging.INFO, logger="dcp_atomic.writer"):
            stats = _save_one(root, 3, base)
    finally:
        failpoints.disarm_all()
    assert not os.path.exists(os.path.join(root, RUN, f"step_{2:010d}"))
    assert stats["bytes_reused"] == 0 and stats["bytes_written"] == stats["bytes"]
    assert any("could not link __0_s0.distcp" in r.getMessage() for r in caplog.records)
    loaded = _load_one(root, 3)
    assert torch.equal(loaded["base"], base) and torch.equal(loaded["adapter"], torch.full((4, 4), 3.0))
    assert _save_one(root, 4, base)["bytes_reused"] == ROWS * COLS * 4  # step 3's stable file, linked


def _killed_after_its_link(ctx):
    from dcp_atomic import CheckpointManager

    mesh = _mesh(ctx.world_size)
    manager = CheckpointManager(ctx.root, RUN, reuse=True, timeout=3, work_timeout=8)
    manager.save(1, _state(mesh, 1))
    try:
        manager.save(2, _state(mesh, 2))  # rank 1 is killed once its link of step 1's file is made and verified
    except Exception as e:  # rank 0: the manager names the silent rank
        return type(e).__name__
    return None


def _restarted(ctx):
    from dcp_atomic import CheckpointManager

    mesh = _mesh(ctx.world_size)
    manager = CheckpointManager(ctx.root, RUN, reuse=True, timeout=30)
    loaded = _empty(mesh)
    latest = manager.load(loaded)
    resumed = _full(loaded)
    manager.save(2, _state(mesh, 2))
    loaded = _empty(mesh)
    manager.load(loaded, step=2)
    again = _full(loaded)
    manager.close()
    want1, want2 = _full(_state(mesh, 1)), _full(_state(mesh, 2))
    return {"latest": latest, "exact": all(torch.equal(resumed[k], want1[k]) and torch.equal(again[k], want2[k])
                                           for k in ("base", "adapter")),
            "stats": _rank_stats(ctx.root, 2)[ctx.rank]}


def test_a_rank_killed_after_its_link_leaves_the_base_whole_and_the_retry_links_again(tmp_path):
    """SIGKILL of rank 1 with the base's file linked into step 2's attempt: step 2 is not committed, step 1 (the
    base) loads exactly on a restart, gc removes the dead attempt and only drops a link count, and the retry of step
    2 links the base's file again."""
    from tests.fault_fixtures import failpoint_env, gc_all_debris

    root = str(tmp_path)
    outcomes = run_world(_killed_after_its_link, 2, root, rank_env=failpoint_env({1: "reuse.after_link=kill"}),
                         timeout=150)
    assert outcomes[1].exitcode == -9, outcomes[1]
    assert outcomes[0].ok and outcomes[0].value is not None, outcomes[0]
    assert not os.path.exists(os.path.join(root, RUN, f"step_{2:010d}", "COMMITTED"))
    base_file = os.path.join(_attempt(root, 1), "__1_0.distcp")
    dead = glob.glob(os.path.join(root, RUN, f"step_{2:010d}", "*", "__1_s0.distcp"))
    assert len(dead) == 1 and os.stat(base_file).st_nlink == 2  # the dead attempt holds a link to the base's file
    assert gc_all_debris(root, RUN) == 0
    assert os.path.exists(base_file) and os.stat(base_file).st_nlink == 1 and not glob.glob(
        os.path.join(root, RUN, f"step_{2:010d}", "*", "__1_s0.distcp"))
    values = assert_all_ok(run_world(_restarted, 2, root, timeout=150))
    assert [v["latest"] for v in values] == [1, 1] and all(v["exact"] for v in values)
    assert all(v["stats"]["bytes_reused"] >= ROWS * COLS * 4 // 2 for v in values)  # the retry linked again


def _flip(path: str, offset: int, keep_mtime: bool = False) -> None:
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))
    if keep_mtime:  # rot: the bytes change, the inode's times do not
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_rot_in_the_only_copy_of_a_linked_file_is_found_by_the_next_save_of_the_same_process(tmp_path, caplog):
    """keep_last=1's one physical copy of the frozen bytes rots (mtime kept): the next save in the same process
    re-verifies before it links, writes the good bytes it holds instead, and that step loads exactly."""
    root, base = str(tmp_path), _frozen()
    for step in (1, 2, 3):  # step 3 links step 2's stable file (verified then)
        _save_one(root, step, base)
    _flip(_stable(root, 3, 0), 4096, keep_mtime=True)
    with caplog.at_level(logging.INFO, logger="dcp_atomic.writer"):
        stats = _save_one(root, 4, base)
    assert stats["bytes_reused"] == 0 and stats["bytes_written"] >= ROWS * COLS * 4
    assert any("does not match its digests" in r.getMessage() for r in caplog.records)
    assert _inode(_stable(root, 4, 0)) != _inode(_stable(root, 3, 0))
    loaded = _load_one(root, 4)
    assert torch.equal(loaded["base"], base)
    with pytest.raises(BaseException, match="CorruptCheckpointError.*does not match its digest"):  # DCP wraps it
        _load_one(root, 3)


def test_a_link_whose_directory_sync_fails_leaves_no_name_and_the_file_is_written(tmp_path, caplog):
    """An EIO from the directory fsync after link() (NFS): the new name is removed, the file written, the save
    commits and loads exactly (it used to fail on the name the link left)."""
    import errno

    from dcp_atomic._base import failpoints
    from dcp_atomic.stores.storage import LocalStorage

    root, base = str(tmp_path), _frozen()
    for step in (1, 2):
        _save_one(root, step, base)
    links = os.stat(_stable(root, 2, 0)).st_nlink  # step 1's plain file and step 2's link of it
    armed, original = [], LocalStorage.sync_dir

    def sync_dir(self, path):
        if armed:
            armed.clear()
            raise OSError(errno.EIO, "Input/output error", path)
        return original(self, path)

    failpoints.arm("reuse.before_link", lambda rank, step: armed.append(True))
    LocalStorage.sync_dir = sync_dir
    try:
        with caplog.at_level(logging.INFO, logger="dcp_atomic.writer"):
            stats = _save_one(root, 3, base)
    finally:
        LocalStorage.sync_dir = original
        failpoints.disarm_all()
    assert stats["bytes_reused"] == 0
    assert any("could not link __0_s0.distcp" in r.getMessage() for r in caplog.records)
    assert os.stat(_stable(root, 2, 0)).st_nlink == links and _inode(_stable(root, 3, 0)) != _inode(_stable(root, 2, 0))
    assert torch.equal(_load_one(root, 3)["base"], base)


def test_a_base_file_that_is_a_symlink_is_not_linked(tmp_path):
    """An operator moved the base's stable file away and left a symlink: link() would copy the symlink, so the new
    step would depend on a file outside the run. It is written instead, a regular file of its own."""
    root, base = str(tmp_path), _frozen()
    for step in (1, 2):
        _save_one(root, step, base)
    moved = os.path.join(str(tmp_path), "elsewhere.distcp")
    shutil.move(_stable(root, 2, 0), moved)
    os.symlink(moved, _stable(root, 2, 0))
    stats = _save_one(root, 3, base)
    assert stats["bytes_reused"] == 0
    assert not os.path.islink(_stable(root, 3, 0)) and os.stat(_stable(root, 3, 0)).st_nlink == 1
    os.remove(moved)
    assert torch.equal(_load_one(root, 3)["base"], base)


def test_the_frozen_bytes_are_split_over_the_writers_threads_so_a_load_reads_them_in_parallel(tmp_path):
    """Loads read a rank's files in parallel, one thread a file: two frozen tensors saved with thread_count=2 go
    into two stable files (not one of 2 MiB), and the next save links both."""
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageWriter

    root = str(tmp_path)
    frozen = {"a": _frozen(), "b": _frozen() + 1}

    def save(step):
        writer = AtomicStorageWriter(root, RUN, step, reuse=True, thread_count=2)
        dcp.save({**frozen, "adapter": torch.full((4, 4), float(step))}, storage_writer=writer)
        return writer.last_stats

    for step in (1, 2, 3):
        stats = save(step)
    names = sorted(n for n in os.listdir(_attempt(root, 3)) if "_s" in n)
    assert names == ["__0_s0.distcp", "__0_s1.distcp"], names
    assert all(_inode(os.path.join(_attempt(root, 3), n)) == _inode(os.path.join(_attempt(root, 2), n))
               for n in names)
    assert stats["bytes_reused"] == 2 * ROWS * COLS * 4


def test_a_writer_built_without_a_location_reuses_through_dcps_checkpoint_id(tmp_path):
    """The frameworks' form (torchtitan, Lightning, Accelerate): one writer built without a location, a
    checkpoint_id per save, an async save among them; a refused save (a committed step again, no overwrite) is
    followed by more saves that still link; a filesystem that cannot link in place, given by checkpoint_id, is refused
    by name."""
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageWriter, ConfigurationError

    root, base = str(tmp_path), _frozen()
    writer = AtomicStorageWriter(reuse=True, timeout=20)

    def save(step, asynchronous=False):
        state = {"base": base, "adapter": torch.full((4, 4), float(step))}
        checkpoint_id = f"{root}/{RUN}/step-{step}"  # torchtitan's form
        if asynchronous:
            future = dcp.async_save(state, storage_writer=writer, checkpoint_id=checkpoint_id)
            getattr(future, "upload_completion", future).result(timeout=60)
        else:
            dcp.save(state, storage_writer=writer, checkpoint_id=checkpoint_id)
        return writer.last_stats

    save(1)
    save(2)
    assert save(3, asynchronous=True)["bytes_reused"] == ROWS * COLS * 4
    with pytest.raises(BaseException, match="already committed|CommitConflictError"):
        save(3)  # refused: step 3 is committed
    assert save(4)["bytes_reused"] == ROWS * COLS * 4
    assert _inode(_stable(root, 4, 0)) == _inode(_stable(root, 2, 0))
    for step in (3, 4):
        loaded = _load_one(root, step)
        assert torch.equal(loaded["base"], base) and torch.equal(loaded["adapter"], torch.full((4, 4), float(step)))
    with pytest.raises(ConfigurationError, match="reuse=True"):
        writer.reset("memory://bucket/exp/step-5")  # a filesystem that can neither hard-link nor copy in place
