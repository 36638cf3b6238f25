"""One definition of a stored item's blocks (``ItemExtent.blocks``) and one check of them (``format.blocks``).

Every path that trusts stored bytes must give the same answer on the same bytes: the load, ``verify``, the
drain's copy, the local tier's check of a file on disk and of a file received in memory.  And an extent that is
invalid for its codec is refused when the shard is parsed, so no two paths can read it two ways.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_atomic import AtomicStorageReader, AtomicStorageWriter, CorruptCheckpointError
from dcp_atomic.errors import CheckpointError
from dcp_atomic.format.blocks import check_block, verify_blocks_from, verify_item
from dcp_atomic.format.integrity import block_digest
from dcp_atomic.format.layout import RunLayout
from dcp_atomic.format.manifest import ItemExtent, ManifestShard
from dcp_atomic.stores.storage import LocalStorage
from dcp_atomic.tiers import verified_copy
from dcp_atomic.tiers.local_tier import check_file, check_stored_file
from dcp_atomic.tools.audit import audit_step

RUN = "blocks"
BLOCK = 16 << 10
MODES = {"raw": {}, "zstd": {"compression": "zstd"}, "torch_save": {"stock_readable": True}}


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"noise": torch.randn(40_000, generator=g),  # ~10 blocks, incompressible
            "smooth": torch.linspace(-1, 1, 40_000).to(torch.bfloat16)}  # compresses: frames differ from blocks


def _saved(root: str, mode: str):
    dcp.save(_state(), storage_writer=AtomicStorageWriter(root, RUN, 1, block_size=BLOCK, **MODES[mode]))
    layout = RunLayout(LocalStorage(root), RUN)
    step_dir = os.path.join(root, RUN, "step_0000000001")
    save_id = json.load(open(os.path.join(step_dir, "COMMITTED")))["save_id"]
    attempt = os.path.join(step_dir, save_id)
    shard = ManifestShard.from_json(open(os.path.join(attempt, "manifest.0.json"), "rb").read(), where="shard")
    return layout, attempt, shard


@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_consumer_names_the_same_damaged_block(root, mode):
    """Flip one byte inside block 2 of an item: the load, ``verify``, the drain's copy and the local tier's two
    checks all refuse, each naming that item, block 2 and its byte range within the item."""
    layout, attempt, shard = _saved(root, mode)
    key = "smooth" if mode == "zstd" else "noise"
    entry, item = next((f, i) for f in shard.files for i in f.items if i.key == key)
    if mode == "zstd":
        assert item.codec == "zstd" and item.frames, "the test needs a compressed item"
    lo, hi = item.blocks()[2]
    path = os.path.join(attempt, entry.name)
    with open(path, "r+b") as f:
        f.seek(item.pos + (lo + hi) // 2)
        byte = f.read(1)
        f.seek(item.pos + (lo + hi) // 2)
        f.write(bytes([byte[0] ^ 0x40]))
    expected = f"item {key!r}: block 2 (bytes {lo}..{hi} of the item) does not match its digest"

    answers = {}
    target = {k: torch.zeros_like(v) for k, v in _state().items()}
    with pytest.raises(CheckpointException) as load:
        dcp.load(target, storage_reader=AtomicStorageReader(root, RUN, step=1, timeout=5))
    answers["load"] = str(load.value)
    report = audit_step(layout, 1)
    assert not report.ok
    answers["verify"] = " | ".join(report.problems)
    for name, check in {"check_stored_file": lambda: check_stored_file(entry, path, path),
                        "check_file": lambda: check_file(entry, open(path, "rb").read(), path),
                        "drain copy": lambda: verified_copy.copy_verified(entry, path, layout.storage,
                                                                   os.path.join(root, "drained"))}.items():
        with pytest.raises(CorruptCheckpointError) as e:
            check()
        answers[name] = str(e.value)
    for name, answer in answers.items():
        assert expected in answer, (name, answer)
    # the drain checks a piece before it uploads it: nothing from the damaged block on reached the durable copy
    assert os.path.getsize(os.path.join(root, "drained")) <= item.pos + lo


def test_an_intact_step_passes_every_consumer(root):
    """The control for the test above: the same checks on undamaged bytes all pass."""
    layout, attempt, shard = _saved(root, "zstd")
    for entry in shard.files:
        path = os.path.join(attempt, entry.name)
        check_stored_file(entry, path, path)
        check_file(entry, open(path, "rb").read(), path)
        verified_copy.copy_verified(entry, path, layout.storage, os.path.join(root, "drained-" + entry.name))
        assert open(os.path.join(root, "drained-" + entry.name), "rb").read() == open(path, "rb").read()
    assert audit_step(layout, 1).ok
    target = {k: torch.zeros_like(v) for k, v in _state().items()}
    dcp.load(target, storage_reader=AtomicStorageReader(root, RUN, step=1))
    assert all(torch.equal(target[k], v) for k, v in _state().items())


def _row(**overrides) -> dict:
    data = b"x" * 100
    row = {"key": "w", "chunk_offset": None, "kind": "bytes", "format": "raw", "pos": 0, "length": 100,
           "checksums": block_digest(data), "block_size": 64}
    row["checksums"] = block_digest(data[:64]) + block_digest(data[64:])
    row.update(overrides)
    return row


def _shard(row: dict) -> bytes:
    return json.dumps({"kind": "dcp_atomic.manifest_shard", "schema_version": 2, "run_id": RUN, "step": 1,
                       "save_id": "20261203T000000Z-0123abcd", "rank": 0,
                       "files": [{"name": "__0_0.distcp", "size": 100, "items": [row]}]}).encode()


def test_an_extent_invalid_for_its_codec_is_refused_when_parsed():
    """Frames on an uncompressed item would be read as frames by one path and as fixed blocks by another: refused
    at parse, typed, as is a compressed ``torch_save`` item.  The well-formed row parses."""
    assert ManifestShard.from_json(_shard(_row()), where="s").files[0].items[0].blocks() == [(0, 64), (64, 100)]
    for bad, words in [(_row(frames=[50, 50]), "only compressed items have frames"),
                       (_row(format="torch_save", codec="zstd", logical_length=100, frames=[50, 50]),
                        "only raw items are compressed")]:
        with pytest.raises(CorruptCheckpointError, match=words):
            ManifestShard.from_json(_shard(bad), where="s")


def test_blocks_refuse_a_digest_count_that_disagrees_and_ranged_checks_need_whole_blocks():
    data = bytes(range(256)) * 4
    item = ItemExtent(key="k", chunk_offset=None, kind="bytes", format="raw", pos=0, length=len(data),
                      checksums=[block_digest(data[i:i + 256]) for i in range(0, 1024, 256)], block_size=256)
    verify_item(item, data, "k")
    verify_item(item, [data[:100], data[100:700], data[700:]], "k")  # pieces straddling blocks
    verify_blocks_from(item, 1, data[256:768], "k")
    check_block(item, 3, data[768:], "k")
    with pytest.raises(CorruptCheckpointError, match="do not end where a block ends"):
        verify_blocks_from(item, 1, data[256:700], "k")
    with pytest.raises(CorruptCheckpointError, match="block 3 is 100 bytes"):
        check_block(item, 3, data[768:868], "k")
    with pytest.raises(CorruptCheckpointError, match="1000 bytes, the shard records 1024"):
        verify_item(item, data[:1000], "k")
    damaged = bytearray(data)
    damaged[600] ^= 1
    with pytest.raises(CorruptCheckpointError, match=r"block 2 \(bytes 512..768 of the item\)"):
        verify_item(item, [bytes(damaged[:300]), bytes(damaged[300:])], "k")
    item.checksums.pop()
    with pytest.raises(CheckpointError, match="4 stored block"):
        item.blocks()
    empty = ItemExtent(key="e", chunk_offset=None, kind="bytes", format="raw", pos=0, length=0,
                       checksums=[block_digest(b"")], block_size=256)
    assert empty.blocks() == [(0, 0)]
    verify_item(empty, b"", "e")
