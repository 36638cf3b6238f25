"""One committer: a save, an import and the drain go through the same sequence (``protocol.commit``): the
attempt's claim before any data, the control files, the completeness check, the marker, the claim still there,
``LATEST``.  The drain once restated steps 3-4 and skipped two rules: it wrote no claim (so ``gc``'s lease judged
its attempt by the local save's age) and never checked, after its marker, that the attempt was still there.
"""

from __future__ import annotations

import json
import os
import shutil

import torch

from dcp_atomic._base import failpoints
from tests.harness import assert_all_ok, run_world

RUN = "paths"


def _node(rank: int) -> dict[str, str]:
    return {"DCP_ATOMIC_FAILURE_DOMAIN": "node" + "AB"[rank], "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
            "GROUP_RANK": str(rank)}


def _state(rank: int, step: int) -> dict:
    return {f"w.rank{rank}": torch.full((1000,), float(step * 10 + rank)), "progress": {"step": step}}


def _drain_while_the_attempt_is_removed(ctx):
    """Save step 1 for a durable copy; just before the drain's first marker, something that ignores leases
    removes the durable attempt (an ``rm -r``, a foreign cleanup).  The drain's retry then uploads it again."""
    import logging

    from dcp_atomic import CheckpointManager, LocalTierOptions
    from dcp_atomic.tiers import drain

    drain.RETRY_BACKOFF = 0.05
    seen, records = {}, []

    def remove_attempt(rank, step):
        if step != 1 or "claim" in seen:
            return
        step_dir = os.path.join(ctx.root, RUN, f"step_{step:010d}")
        (attempt,) = [os.path.join(step_dir, n) for n in os.listdir(step_dir) if n != "COMMITTED"]
        seen["claim"] = json.load(open(os.path.join(attempt, "ATTEMPT")))
        shutil.rmtree(attempt)

    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("dcp_atomic").addHandler(handler)
    if ctx.rank == 0:
        failpoints.arm("drain.before_marker", remove_attempt)
    local = LocalTierOptions(ctx.extra["nodes"][ctx.rank], replicas=1, durable_every=None)
    with CheckpointManager(ctx.root, RUN, local=local, timeout=20) as manager:
        manager.save(1, _state(ctx.rank, 1), durable=True)
        manager.wait()
        durable = manager.steps(tier="durable")
    failpoints.disarm_all()
    target = _state(ctx.rank, 0)
    with CheckpointManager(ctx.root, RUN, timeout=20) as reader:  # the durable root alone, no local tier
        reader.load(target, step=1)
    retried = [r.getMessage() for r in records if "retrying" in r.getMessage()]
    return {"claim": seen.get("claim"), "retried": retried, "durable": durable, "w": target[f"w.rank{ctx.rank}"][0].item()}


def test_a_drain_whose_attempt_is_removed_before_its_marker_withdraws_it_and_commits_on_retry(root, nodes):
    """Before the one committer: the drain placed its marker over the removed attempt and reported success, a
    durable step 1 whose files were gone.  Now the marker is withdrawn, the retry uploads again, and step 1 loads
    exact from the durable root alone."""
    outs = assert_all_ok(run_world(_drain_while_the_attempt_is_removed, 2, root, rank_env=_node,
                                   extra={"nodes": nodes}, timeout=240))
    # the drain claims its durable attempt when it starts, as a save does (gc's lease judges the attempt by it)
    claim = outs[0]["claim"]
    assert claim is not None and claim["step"] == 1 and "drained_from" in claim, outs[0]
    assert any("was removed while it committed" in line for line in outs[0]["retried"]), outs[0]
    for rank, out in enumerate(outs):
        assert out["durable"] == [1], out
        assert out["w"] == 10.0 + rank, out


def _copied_step(root: str):
    """A committed single-process step (with ``ranks.json``) and an empty second root to copy it into."""
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageWriter
    from dcp_atomic.format.layout import RunLayout
    from dcp_atomic.protocol.commit import read_committed
    from dcp_atomic._base.retry import Deadline
    from dcp_atomic.stores.storage import LocalStorage

    dcp.save(_state(0, 1), storage_writer=AtomicStorageWriter(os.path.join(root, "a"), RUN, 1))
    source = RunLayout(LocalStorage(os.path.join(root, "a")), RUN)
    committed = read_committed(source, 1, Deadline(5))
    attempt = source.attempt_dir(1, committed.save_id)
    manifest_bytes = source.storage.read_file(os.path.join(attempt, "manifest.json"))
    return source, committed, attempt, manifest_bytes, RunLayout(LocalStorage(os.path.join(root, "b")), RUN)


def test_a_copied_step_gets_the_control_files_its_manifest_seals_and_its_manifest_last(root):
    """copy_control is the one copy of a step's control files (the drain, replica and restored roots): each file of
    Manifest.control_files() as the source holds it, then the manifest; and Marker.for_manifest names that
    manifest as the save's own commit did."""
    from dcp_atomic.format.manifest import Marker
    from dcp_atomic.protocol.commit import copy_control

    source, committed, attempt, manifest_bytes, target = _copied_step(root)
    manifest = committed.manifest
    assert [name for name, _, _ in manifest.control_files()] == [".metadata", "ranks.json"]
    published: list[str] = []
    publish = target.storage.publish
    target.storage.publish = lambda path, data: (published.append(os.path.basename(path)), publish(path, data))[1]
    copy_control(lambda name: source.storage.read_file(os.path.join(attempt, name)), target, manifest, manifest_bytes,
                 source=attempt)
    assert published == [".metadata", "ranks.json", "manifest.json"]
    copied = target.attempt_dir(1, committed.save_id)
    for name in published:
        assert open(os.path.join(copied, name), "rb").read() == open(os.path.join(attempt, name), "rb").read()
    marker = Marker.for_manifest(RUN, manifest, committed.manifest_sha256, committed.marker.sequence)
    assert ({k: v for k, v in marker.record().items() if k != "committed_at"}
            == {k: v for k, v in committed.marker.record().items() if k != "committed_at"})


def test_a_control_file_that_does_not_match_the_manifest_is_refused_before_any_is_copied(root):
    from dcp_atomic.errors import CorruptCheckpointError
    from dcp_atomic.protocol.commit import copy_control

    source, committed, attempt, manifest_bytes, target = _copied_step(root)

    def read(name: str) -> bytes:
        data = source.storage.read_file(os.path.join(attempt, name))
        return data[:-1] + bytes([data[-1] ^ 1]) if name == "ranks.json" else data  # one bit flipped

    try:
        copy_control(read, target, committed.manifest, manifest_bytes, source=attempt)
    except CorruptCheckpointError as e:
        assert "ranks.json does not match the manifest of step 1" in str(e) and attempt in str(e), str(e)
    else:
        raise AssertionError("a damaged ranks.json was copied")
    assert not os.path.exists(target.attempt_dir(1, committed.save_id))  # not even .metadata, which was intact
