"""The drain's one-pass copy (dcp_atomic/tiers/verified_copy.py, step 2 of tiers/drain.py): each local data file
read once, a piece at a time, every block in a piece checked before the piece is uploaded, several files at once.

The copy itself on hand-made files (small blocks and pieces, so pieces cut blocks, a frame outgrows a piece, items
leave gaps); then a real world of 4 ranks as 2 nodes draining two files per rank on two threads, one rank's local
primary damaged.
"""

from __future__ import annotations

import glob
import os

import pytest

from dcp_atomic.tiers import drain
from dcp_atomic.tiers import drain_plan, verified_copy
from dcp_atomic.errors import CorruptCheckpointError
from dcp_atomic.format.integrity import block_digest
from dcp_atomic.format.manifest import FileEntry, ItemExtent
from dcp_atomic.stores.storage import LocalStorage
from dcp_atomic._base import failpoints
from tests.harness import assert_all_ok, run_world
from tests.helpers.tiers import RUN, _exact, _manager, _node_env, _state

PIECE = 2500  # COPY_CHUNK in these tests: not a multiple of the blocks, so pieces must stop where a block starts


def _item(key: str, pos: int, data: bytes, block: int, frames: list[int] | None = None) -> ItemExtent:
    sizes = frames or [min(block, len(data) - i) for i in range(0, len(data), block)] or [0]
    checksums, at = [], 0
    for size in sizes:
        checksums.append(block_digest(data[at:at + size]))
        at += size
    return ItemExtent(key=key, chunk_offset=None, kind="bytes", format="raw", pos=pos, length=len(data),
                      checksums=checksums, block_size=block, frames=frames)


def _data_file(path: str) -> tuple[FileEntry, bytes]:
    """A header gap, an item of five 1000-byte blocks, a gap, an empty item, an item whose middle frame (4000 bytes)
    is larger than a piece, a trailing gap."""
    body = bytes((n * 7 + 3) % 251 for n in range(10_000))
    a, c = body[:5000], body[5000:9350]
    content = b"H" * 10 + a + b"g" * 7 + c + b"tail"
    items = [_item("a", 10, a, 1000), _item("b", 5017, b"", 1000), _item("c", 5017, c, 1000, frames=[300, 4000, 50])]
    with open(path, "wb") as f:
        f.write(content)
    return FileEntry(name="f", rank=0, size=len(content), items=items), content


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr(verified_copy, "COPY_CHUNK", PIECE)
    reads: list[int] = []
    real = verified_copy._read_exactly
    monkeypatch.setattr(verified_copy, "_read_exactly", lambda fd, view, offset, path: (reads.append(len(view)),
                                                                                  real(fd, view, offset, path))[1])
    return reads


def test_one_pass_copy_is_exact_across_pieces_blocks_gaps_and_empty_items_and_reads_each_byte_once(root, small_pieces):
    entry, content = _data_file(os.path.join(root, "local"))
    verified_copy.copy_verified(entry, os.path.join(root, "local"), LocalStorage(root), os.path.join(root, "durable"))
    with open(os.path.join(root, "durable"), "rb") as f:
        assert f.read() == content
    assert sum(small_pieces) == len(content)  # one pass: no separate verification read
    assert max(small_pieces) <= 4000  # a piece is COPY_CHUNK, or one block when a block is larger
    assert len(small_pieces) > 3


def test_a_damaged_block_stops_the_upload_before_any_byte_of_its_piece_leaves(root, small_pieces):
    source, target = os.path.join(root, "local"), os.path.join(root, "durable")
    entry, content = _data_file(source)
    damaged = 10 + 2100  # item "a", block 2 (its bytes 2000..3000): the first piece would cut it at byte 2500
    with open(source, "r+b") as f:
        f.seek(damaged)
        f.write(bytes([content[damaged] ^ 0xFF]))
    with pytest.raises(CorruptCheckpointError) as failed:
        verified_copy.copy_verified(entry, source, LocalStorage(root), target)
    assert "item 'a': block 2 (bytes 2000..3000 of the item) does not match its digest" in str(failed.value)
    assert failed.value.details["path"] == source
    with open(target, "rb") as f:  # the pieces before it went up (checked); nothing of the damaged block did
        uploaded = f.read()
    assert uploaded == content[:len(uploaded)] and len(uploaded) <= 10 + 2000


def test_a_file_shorter_than_its_shard_says_is_refused_before_any_upload(root, small_pieces):
    source, target = os.path.join(root, "local"), os.path.join(root, "durable")
    entry, _ = _data_file(source)
    os.truncate(source, entry.size - 1)
    with pytest.raises(CorruptCheckpointError, match="bytes, the shard records"):
        verified_copy.copy_verified(entry, source, LocalStorage(root), target)
    assert not os.path.exists(target)


# -- a world ---------------------------------------------------------------------------------------------------


def _drain_two_files_per_rank(ctx):
    """Two data files per rank (thread_count=2), drained two at a time; step 10's drain meets a damaged byte in
    rank 1's second local file; step 20 drains; the durable step 20 then loads exactly without the local tier."""
    import torch.distributed as dist

    from dcp_atomic import Callbacks, CheckpointManager
    from tests.helpers.fsdp_app import _fsdp_app, _full, _train_step

    drain.DRAIN_ATTEMPTS = 1
    drain.default_thread_count = lambda: 2
    pieces: list[int] = []
    real = verified_copy._read_exactly
    verified_copy._read_exactly = lambda fd, view, offset, path: (pieces.append(len(view)),
                                                                  real(fd, view, offset, path))[1]
    import threading

    threads: set[str] = set()
    real_copy = drain_plan.copy_verified
    together = threading.Barrier(2)  # a rank's two files: each copy waits (a moment) for the other to start

    def copy(*a, **k):
        threads.add(threading.current_thread().name)
        try:
            together.wait(timeout=5)  # on one thread, the second never starts: the barrier breaks, and threads == 1
        except threading.BrokenBarrierError:
            together.reset()
        return real_copy(*a, **k)
    drain_plan.copy_verified = copy

    def damage(rank, step):
        if step == 10 and rank == 1:
            [path] = [p for p in glob.glob(os.path.join(ctx.extra["nodes"][0], RUN, "step_*10", "*", "**", "*_1_1*"),
                                           recursive=True)]
            with open(path, "r+b") as f:
                first = f.read(1)
                f.seek(0)
                f.write(bytes([first[0] ^ 0xFF]))

    failpoints.arm("drain.before_upload", damage)
    model, optim = _fsdp_app(ctx.world_size, 0)
    failures, drained = [], []
    callbacks = Callbacks(on_failed=failures.append, on_drained=drained.append)
    with _manager(ctx, thread_count=2, keep_local=2, callbacks=callbacks) as manager:
        _train_step(model, optim, 10)
        manager.save(10, _state(model, optim, 10), durable=True)
        try:
            manager.wait()
            raised = None
        except Exception as e:
            raised = str(e)
        _train_step(model, optim, 20)
        manager.save(20, _state(model, optim, 20), durable=True)
        manager.wait()
        want = _full(model)
    dist.barrier()
    model2, optim2 = _fsdp_app(ctx.world_size, 42)
    with CheckpointManager(ctx.root, RUN, timeout=20) as durable:
        state = _state(model2, optim2, -1)
        loaded = durable.load(state)
    step_dirs = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ctx.root, RUN, "step_*")))
    marked = sorted(os.path.basename(os.path.dirname(p)) for p in glob.glob(os.path.join(ctx.root, RUN, "step_*",
                                                                                         "COMMITTED")))
    return {"raised": raised, "failures": [(f["step"], f["error_type"]) for f in failures],
            "drained": [d["step"] for d in drained], "loaded": loaded, "exact": _full(model2), "want": want,
            "pieces": max(pieces), "threads": len(threads), "dirs": step_dirs, "marked": marked}


def test_two_files_per_rank_drain_on_two_threads_and_a_damaged_primary_fails_the_drain_naming_rank_and_file(root,
                                                                                                           nodes):
    outcomes = assert_all_ok(run_world(_drain_two_files_per_rank, 4, root, rank_env=_node_env,
                                       extra={"nodes": nodes}, timeout=120, pg_timeout=30))
    for rank, out in enumerate(outcomes):
        assert out["raised"] is not None and "rank(s) could not upload" in out["raised"], out["raised"]
        assert "does not match its digest" in out["raised"] and "_1_1" in out["raised"], out["raised"]
        assert out["failures"] == [(10, "StorageError")]
        assert out["loaded"] == 20
        _exact(out["exact"], out["want"])
        assert out["threads"] == 2, rank  # both of the rank's files, each on a thread of its own
        assert out["pieces"] <= verified_copy.COPY_CHUNK
    assert outcomes[0]["drained"] == [20]
    assert outcomes[0]["marked"] == ["step_0000000020"] and "step_0000000010" in outcomes[0]["dirs"]
