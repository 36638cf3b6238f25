"""Reuse (P15) on object stores, on real gloo worlds of two against moto and SeaweedFS through the recording proxy: a
base object (stable, or the plain one of the first save) whose items are mostly unchanged is copied server-side
(CopyObject) from the base step, so not one of its bytes is uploaded again;
the copy is verified against its block digests at every save; every step loads on its own after its base is retired
or deleted; a damaged base object is not kept (that rank uploads the file, logged) and the damaged step fails typed."""

from __future__ import annotations

import re

import pytest

from tests.harness import assert_all_ok, run_world
from tests.helpers.reuse_state import CHUNK, RUN, empty, exact, full, mesh, state
from tests.helpers.reuse_state import load_step_from_a_store as _load_step
from tests.helpers.reuse_state import save_steps_on_a_store as _save_steps

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STABLE_KEY = re.compile(r"/step_(\d{10})/[^/]+/__(\d+)_s\d+\.distcp$")


def _copies(proxy, step: int) -> list:
    """The CopyObject requests that made a stable file of ``step``."""
    return [r for r in proxy.requests("PUT") if "x-amz-copy-source" in r.headers
            and (m := STABLE_KEY.search("/" + r.key)) and int(m.group(1)) == step]


def _uploaded(proxy, step: int, stable_only: bool = False) -> int:
    """Body bytes the job sent for ``step``'s objects (PUTs and part uploads; a copy sends none)."""
    return sum(r.request_bytes for r in proxy.requests() if r.op in ("PUT", "UPLOAD_PART")
               and f"/step_{step:010d}/" in "/" + r.key and (not stable_only or STABLE_KEY.search("/" + r.key)))


# -- a frozen base through CheckpointManager, keep_last=2 -------------------------------------------------------------


def _frozen_base_through_the_manager(ctx):
    from dcp_atomic import Callbacks, CheckpointManager

    world = mesh(ctx.world_size)
    saved = []
    manager = CheckpointManager(ctx.root, RUN, keep_last=2, reuse=True, timeout=30,
                                callbacks=Callbacks(on_saved=saved.append),
                                storage_options=ctx.extra["storage_options"])
    for step in (1, 2, 3, 4):
        if step == 4:  # the background write of async_save copies as the synchronous save does
            manager.async_save(step, state(world, step)).result()
        else:
            manager.save(step, state(world, step))
    loaded = empty(world)
    assert manager.load(loaded) == 4
    manager.close()
    return {"exact": exact(full(loaded), full(state(world, 4))),
            "saved": {s["step"]: {k: s[k] for k in ("bytes", "bytes_written", "bytes_reused")} for s in saved}}


def _load_latest(ctx):
    from dcp_atomic import CheckpointManager

    world = mesh(ctx.world_size)
    manager = CheckpointManager(ctx.root, RUN, timeout=30, storage_options=ctx.extra["storage_options"])
    loaded = empty(world)
    step = manager.load(loaded)
    manager.close()
    return step, exact(full(loaded), full(state(world, step)))


def test_a_frozen_base_is_copied_server_side_never_uploaded_and_loads_after_its_base_is_gone(s3):
    extra = {"storage_options": s3.options()}
    values = assert_all_ok(run_world(_frozen_base_through_the_manager, 2, s3.root, extra=extra, timeout=240))
    assert all(v["exact"] for v in values), values
    saved = values[0]["saved"]
    # step 1: no base; step 2: each rank's plain object of step 1, mostly its frozen chunk, copied under a stable
    # name (the adapter's bytes in it are dead); steps 3 and 4: that stable object, copied on
    assert not _copies(s3.proxy, 1)
    for step in (2, 3, 4):
        copies = _copies(s3.proxy, step)
        assert sorted(STABLE_KEY.search("/" + r.key).group(2) for r in copies) == ["0", "1"], [r.key for r in copies]
        assert all(r.status == 200 and f"step_{step - 1:010d}/" in r.headers["x-amz-copy-source"] for r in copies)
        assert _uploaded(s3.proxy, step, stable_only=True) == 0  # not one byte of the frozen base went up again
        assert _uploaded(s3.proxy, step) < 64 * 1024  # the adapter, the counter, manifests, markers
        assert saved[step]["bytes_reused"] >= 2 * CHUNK and saved[step]["bytes_written"] < 4096
    # keep_last=2 retired steps 1 and 2; now delete step 4's base (step 3) by hand, every object of it
    doomed = [k for k in s3.keys() if f"/step_{3:010d}/" in "/" + k]
    assert any(STABLE_KEY.search("/" + k) for k in doomed), doomed
    for key in doomed:
        s3.client.delete_object(Bucket=s3.bucket, Key=f"{s3.prefix}/{key}")
    assert not [k for k in s3.keys() if re.search(r"/step_000000000[123]/", "/" + k)]
    loaded = assert_all_ok(run_world(_load_latest, 2, s3.root, extra=extra, timeout=120))
    assert loaded == [(4, True), (4, True)]


# -- a damaged base object is not copied into the new step -----------------------------------------------------------


def test_a_damaged_base_object_is_not_kept_that_rank_uploads_and_the_damaged_step_fails_typed(s3_seaweedfs):
    """On SeaweedFS alone (a real store; the copy itself is tested on both servers above): four worlds."""
    s3 = s3_seaweedfs
    extra = {"storage_options": s3.options()}
    assert_all_ok(run_world(_save_steps, 2, s3.root, args=([1, 2],), extra=extra, timeout=180))
    [key] = [k for k in s3.keys() if (m := STABLE_KEY.search("/" + k)) and m.group(1) == f"{2:010d}"
             and m.group(2) == "0"]
    data = bytearray(s3.get(key))
    data[1000] ^= 0x01  # rank 0's stable file of step 2 rots in the bucket
    s3.put(key, bytes(data))
    s3.proxy.reset()
    lines = assert_all_ok(run_world(_save_steps, 2, s3.root, args=([3],), extra=extra, timeout=180))
    assert any("does not match its digests" in line for line in lines[0]), lines[0]
    copies = {STABLE_KEY.search("/" + r.key).group(2): r for r in _copies(s3.proxy, 3)}
    assert set(copies) == {"0", "1"}  # both ranks copied; rank 0's copy failed its check and was deleted
    deleted = [r for r in s3.proxy.requests() if r.op in ("DELETE", "DELETE_OBJECTS") and r.key == copies["0"].key]
    assert deleted or any(r.op == "DELETE_OBJECTS" for r in s3.proxy.requests()), "the bad copy was not removed"
    uploads = [r for r in s3.proxy.requests() if r.op in ("PUT", "UPLOAD_PART") and "x-amz-copy-source" not in r.headers
               and (m := STABLE_KEY.search("/" + r.key)) and m.group(1) == f"{3:010d}"]
    assert {STABLE_KEY.search("/" + r.key).group(2) for r in uploads} == {"0"}  # rank 1's stayed a copy
    assert sum(r.request_bytes for r in uploads) >= CHUNK
    assert assert_all_ok(run_world(_load_step, 2, s3.root, args=(3,), extra=extra, timeout=120)) == [True, True]
    damaged = assert_all_ok(run_world(_load_step, 2, s3.root, args=(2,), extra=extra, timeout=120))
    assert damaged[0] == "CorruptCheckpointError", damaged


# -- the frameworks' form over https: one writer, a checkpoint_id per save ----------------------------------------


def test_a_writer_without_a_location_copies_over_https_through_dcps_checkpoint_id(s3_tls):
    """torchtitan's / Lightning's way of holding the writer (built once, a ``checkpoint_id`` per save) against a
    store reached over https (botocore's TLS path, the CA the test made): the third save copies the frozen tensor
    server-side and uploads none of it; the step loads alone once the first two are deleted."""
    import torch
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageReader, AtomicStorageWriter

    s3 = s3_tls
    assert s3.proxy.url.startswith("https://")
    options = s3.options(dcp_atomic_checksum_mode="when_required")  # SeaweedFS over https: no aws-chunked bodies
    frozen = torch.randn(256, 1024, generator=torch.Generator().manual_seed(0))  # 1 MiB
    writer = AtomicStorageWriter(reuse=True, timeout=20, storage_options=options)
    for step in (1, 2, 3):
        dcp.save({"frozen": frozen, "adapter": torch.full((4, 4), float(step))}, storage_writer=writer,
                 checkpoint_id=f"{s3.root}/{RUN}/step-{step}")
    assert writer.last_stats["bytes_reused"] == frozen.nbytes and writer.last_stats["bytes_written"] < 4096
    assert len(_copies(s3.proxy, 3)) == 1 and _uploaded(s3.proxy, 3, stable_only=True) == 0
    for key in [k for k in s3.keys() if re.search(r"/step_000000000[12]/", "/" + k)]:
        s3.client.delete_object(Bucket=s3.bucket, Key=f"{s3.prefix}/{key}")
    loaded = {"frozen": torch.zeros(256, 1024), "adapter": torch.zeros(4, 4)}
    dcp.load(loaded, storage_reader=AtomicStorageReader(s3.root, RUN, 3, timeout=20, storage_options=options))
    assert torch.equal(loaded["frozen"], frozen) and torch.equal(loaded["adapter"], torch.full((4, 4), 3.0))
