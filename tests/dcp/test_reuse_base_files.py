"""Reuse (P15) links a base file whose items are mostly unchanged, a plain file of the first save included, on
real gloo worlds of two: the first reused save after a plain one writes only what changed, one changed
element of a frozen tensor costs that item, the three kept steps store little more than one step, and every step
loads exactly and verifies on its own, also once its base is removed; on S3 not one byte of a linked object is
uploaded."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from tests.harness import assert_all_ok, run_world

RUN = "exp"
LAYERS, ROWS, COLS = 8, 128, 1024
ITEM = ROWS * COLS * 4 // 2  # one rank's chunk of one frozen layer at world 2, in bytes
STEP_BYTES = LAYERS * ROWS * COLS * 4  # the frozen layers of one step, all ranks


def _frozen(changed: bool) -> dict:
    layers = {f"layer{i}": torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(i)) for i in range(LAYERS)}
    if changed:
        layers["layer3"][5, 7] += 1.0  # in rank 0's chunk (rows 0..63)
    return layers


def _expected(step: int) -> dict:
    return _frozen(changed=step == 3) | {"adapter": torch.full((8, 16), float(step))}


def _three_saves(ctx):
    """Step 1 has no base (plain files only), step 2 changes nothing frozen, step 3 one element of layer3."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from dcp_atomic import AtomicStorageWriter

    mesh = init_device_mesh("cpu", (ctx.world_size,), mesh_dim_names=("dp",))
    options = (ctx.extra or {}).get("storage_options")
    for step in (1, 2, 3):
        state = {key: distribute_tensor(t, mesh, [Shard(0)]) for key, t in _expected(step).items()}
        writer = AtomicStorageWriter(ctx.root, RUN, step, reuse=True, thread_count=2, timeout=30,
                                     storage_options=options)
        dcp.save(state | {"step": step}, storage_writer=writer)
    return True


def _load(root: str, step: int, options: dict | None = None) -> bool:
    """One process reads the whole step (a world of two saved it): every key bit-exact."""
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageReader

    expected = _expected(step)
    out = {key: torch.zeros_like(t) for key, t in expected.items()} | {"step": -1}
    dcp.load(out, storage_reader=AtomicStorageReader(root, RUN, step, timeout=30, storage_options=options))
    return all(torch.equal(out[key], t) for key, t in expected.items()) and out["step"] == step


def _attempt(root: str, step: int) -> str:
    step_dir = os.path.join(root, RUN, f"step_{step:010d}")
    with open(os.path.join(step_dir, "COMMITTED")) as f:
        return os.path.join(step_dir, json.load(f)["save_id"])


def _ranks(root: str, step: int) -> dict:
    attempt = _attempt(root, step)
    manifest = json.load(open(os.path.join(attempt, "manifest.json")))
    stats = json.load(open(os.path.join(attempt, "ranks.json")))["stats"] if manifest.get("ranks_file") else \
        manifest["stats"]
    return {s["rank"]: s for s in stats}


def _files(root: str, step: int) -> dict:
    """name -> (inode, size) of the step's data files."""
    attempt = _attempt(root, step)
    return {name: (os.stat(os.path.join(attempt, name)).st_ino, os.path.getsize(os.path.join(attempt, name)))
            for name in os.listdir(attempt) if name.endswith(".distcp")}


def test_the_first_reused_save_links_the_plain_files_and_one_changed_element_costs_its_item(tmp_path):
    from dcp_atomic.tools.cli import main

    root = str(tmp_path)
    assert_all_ok(run_world(_three_saves, 2, root, timeout=150))
    files = {step: _files(root, step) for step in (1, 2, 3)}
    one_step = sum(size for _, size in files[1].values())
    assert one_step >= STEP_BYTES and not any("_s" in name for name in files[1])  # no base: plain files only
    # step 2, the first reused save after a plain one: step 1's plain files linked under stable names, nothing of
    # the frozen layers written
    plain_inodes = {inode for inode, _ in files[1].values()}
    stable = {name: inode for name, (inode, _) in files[2].items() if "_s" in name}
    assert stable and set(stable.values()) <= plain_inodes, (files[1], files[2])
    for rank, stats in _ranks(root, 2).items():
        assert stats["bytes_reused"] == LAYERS * ITEM and stats["bytes_written"] < 4096, (rank, stats)
    # step 3: rank 0 writes layer3's chunk (and the adapter), everything else stays linked
    ranks = _ranks(root, 3)
    assert ITEM <= ranks[0]["bytes_written"] < ITEM + 4096 and ranks[0]["bytes_reused"] == (LAYERS - 1) * ITEM
    assert ranks[1]["bytes_written"] < 4096 and ranks[1]["bytes_reused"] == LAYERS * ITEM
    inodes = {inode: size for step in (1, 2, 3) for inode, size in files[step].values()}
    assert sum(inodes.values()) <= 1.2 * one_step, (sum(inodes.values()), one_step)
    for step in (1, 2, 3):
        assert _load(root, step), step
        assert main(["verify", root, RUN, str(step)]) == 0, step
    assert main(["rm", root, RUN, "1", "--yes"]) == 0  # the base of step 2, whose files steps 2 and 3 link
    assert not os.path.exists(os.path.join(root, RUN, f"step_{1:010d}"))
    for step in (2, 3):
        assert _load(root, step), step
    assert main(["verify", "--all", root, RUN]) == 0


STEP_KEY = re.compile(r"/step_(\d{10})/[^/]+/__\d+_(s?)\d+\.distcp$")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_on_s3_the_plain_objects_are_copied_server_side_and_only_the_changed_item_is_uploaded(s3_moto):
    s3 = s3_moto
    extra = {"storage_options": s3.options()}
    assert_all_ok(run_world(_three_saves, 2, s3.root, extra=extra, timeout=240))
    uploaded = {1: 0, 2: 0, 3: 0}  # body bytes of data objects sent (PUTs and parts; a copy sends none)
    copied = {1: 0, 2: 0, 3: 0}
    for record in s3.proxy.requests():
        match = STEP_KEY.search("/" + record.key)
        if match is None or record.op not in ("PUT", "UPLOAD_PART"):
            continue
        step = int(match.group(1))
        if "x-amz-copy-source" in record.headers:
            assert match.group(2) == "s" and record.status == 200, record.key  # under a stable name
            assert f"step_{step - 1:010d}/" in record.headers["x-amz-copy-source"]
            copied[step] += 1
        else:
            uploaded[step] += record.request_bytes
    assert copied[1] == 0 and uploaded[1] >= STEP_BYTES
    assert copied[2] >= 2 and uploaded[2] < 4096  # every rank's plain object copied; the adapters uploaded
    assert copied[3] >= 2 and ITEM <= uploaded[3] < ITEM + 4096  # layer3's chunk of rank 0, and the adapters
    for step in (1, 2, 3):
        assert _load(s3.root, step, s3.options()), step


def test_a_record_holds_another_only_where_it_records_every_item_the_other_references_at_its_place():
    """The one rule of which record holds which bytes (``protocol.links``): a step that links a base file records
    its whole size and only the items it references (the rest is dead there); another record of the file holds
    those bytes only with the same rank and size and every referenced item at the same place with the same digests.
    The drain relies on it to link a durable file instead of uploading the local one."""
    import dataclasses

    from dcp_atomic.format.manifest import FileEntry, ItemExtent
    from dcp_atomic.protocol.links import holds_referenced, referenced_bytes, referencing

    def extent(key, pos, length, digest):
        return ItemExtent(key=key, chunk_offset=[0], kind="tensor", format="raw", pos=pos, length=length,
                          checksums=[digest], block_size=1 << 22)

    a, b, c = extent("a", 0, 100, "1" * 16), extent("b", 100, 50, "2" * 16), extent("c", 150, 100, "3" * 16)
    plain = FileEntry("__0_0.distcp", 0, 250, [a, b, c], checksum="crc32:00000001")
    linked = referencing(plain, "__0_s0.distcp", 0, [a, c])  # b changed: its bytes are dead in the new step
    assert (linked.name, linked.rank, linked.size, linked.items, linked.checksum) == (
        "__0_s0.distcp", 0, 250, [a, c], "crc32:00000001")
    assert referenced_bytes(linked) == 200 and referenced_bytes(plain) == 250
    assert holds_referenced(plain, linked) and holds_referenced(linked, linked)  # under another name too
    assert not holds_referenced(linked, referencing(plain, "__0_s0.distcp", 0, [a, b]))  # b is dead there
    assert not holds_referenced(dataclasses.replace(plain, size=251), linked)  # another size: another file
    assert not holds_referenced(dataclasses.replace(plain, rank=1), linked)
    assert not holds_referenced(dataclasses.replace(plain, items=[a, b, dataclasses.replace(c, pos=140)]), linked)
    assert not holds_referenced(dataclasses.replace(plain, items=[a, b, dataclasses.replace(c, checksums=["4" * 16])]),
                                linked)
    assert not holds_referenced(plain, referencing(plain, "__0_s0.distcp", 0, []))  # nothing referenced
