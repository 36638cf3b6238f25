"""Stale NFS client caches: rank 0 on bindfs client A, rank 1 on client B of one directory.

First, that the fixture really produces the faults (otherwise the tests below
prove nothing): names another client created stay invisible to ``stat``/``open``
while ``listdir`` shows them, a file replaced by rename is read torn or stale,
``expire()`` (a remount) ends all of it at once, ``frozen()`` blocks every access.

Then the library on top of it:

* save then load immediately, repeated, with every kind of staleness (torn and
  stale-but-complete ``LATEST`` and markers, negative lookups of markers): every
  load is of one version on all ranks with correct values, or a clear error;
  never a mix, never a torn marker or manifest parse; the manager's load (rank 0
  resolves the step) always succeeds by waiting the lag out;
* the library's own waits end within its ``timeout`` when the lag outlasts it;
* ``latest_step`` run on a stale client must never move ``LATEST`` backwards.
"""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch

from dcp_atomic import AtomicStorageReader, AtomicStorageWriter, CheckpointNotFoundError, latest_step
from dcp_atomic._base import failpoints
from tests.fault_fixtures import nfs_clients_ctx, watched_reads
from tests.harness import assert_all_ok, run_world

pytestmark = pytest.mark.slow

RUN = "exp"


# -- the fixture produces real staleness ---------------------------------------------------------


@pytest.mark.nfs(cache_seconds=30)
def test_fixture_client_b_misses_new_names_until_expired(nfs_clients):
    a, b = nfs_clients.a.path, nfs_clients.b.path
    assert not os.path.exists(os.path.join(b, "x"))  # B caches the negative lookup
    with open(os.path.join(a, "x"), "w") as f:
        f.write("new")
    assert "x" in os.listdir(b), "listings are already fresh ..."
    assert not os.path.exists(os.path.join(b, "x")), "... while stat still says ENOENT"
    with pytest.raises(FileNotFoundError):
        open(os.path.join(b, "x"))
    nfs_clients.b.expire()
    assert open(os.path.join(b, "x")).read() == "new"
    assert open(os.path.join(nfs_clients.backing, "x")).read() == "new"


@pytest.mark.nfs(cache_seconds=30)
def test_fixture_replaced_file_is_read_torn_by_the_other_client(nfs_clients):
    a, b = nfs_clients.a.path, nfs_clients.b.path
    with open(os.path.join(a, "L"), "w") as f:
        f.write("1" * 10)
    os.stat(os.path.join(b, "L"))  # B caches the old size
    with open(os.path.join(a, "L.tmp"), "w") as f:
        f.write("2" * 30)
    os.rename(os.path.join(a, "L.tmp"), os.path.join(a, "L"))
    assert open(os.path.join(b, "L")).read() == "2" * 10, "new content cut to the old size"
    nfs_clients.b.expire()
    assert open(os.path.join(b, "L")).read() == "2" * 30


@pytest.mark.nfs(cache_seconds=30, kernel_cache_b=True)
def test_fixture_kernel_cache_client_reads_the_complete_old_version(nfs_clients):
    a, b = nfs_clients.a.path, nfs_clients.b.path
    with open(os.path.join(a, "L"), "w") as f:
        f.write("1" * 30)
    assert open(os.path.join(b, "L")).read() == "1" * 30
    with open(os.path.join(a, "L.tmp"), "w") as f:
        f.write("2" * 30)
    os.rename(os.path.join(a, "L.tmp"), os.path.join(a, "L"))
    assert open(os.path.join(b, "L")).read() == "1" * 30, "a stale but complete read"
    nfs_clients.b.expire()
    assert open(os.path.join(b, "L")).read() == "2" * 30


def test_fixture_frozen_client_blocks_until_thawed(nfs_clients):
    path = os.path.join(nfs_clients.b.path, "y")
    done = threading.Event()
    with nfs_clients.b.frozen():
        worker = threading.Thread(target=lambda: (os.path.exists(path), done.set()), daemon=True)
        worker.start()
        assert not done.wait(0.3), "an access to a frozen client must block (a hung NFS server)"
    assert done.wait(10), "and resume once the server answers again"


# -- save, then load at once, repeated: one version or a clear error ---------------------------------


def _state(rank: int, step: int, version: int) -> dict:
    g = torch.Generator().manual_seed(100 * step + 10 * version + rank)
    return {f"r{rank}": torch.randn(48, generator=g), "shared": torch.full((8,), float(step * 10 + version)),
            "meta": {"step": step, "version": version}}


CLEAR_ERRORS = ("RankConsistencyError", "CorruptCheckpointError", "CheckpointNotFoundError")
PARSE_ERRORS = ("JSONDecodeError", "UnicodeDecodeError", "KeyError", "UnpicklingError", "EOFError")


def _error_record(e: BaseException) -> dict:
    from tests.harness import _describe_chain

    text = str(e)
    chain = _describe_chain(e)
    named = [n for n in CLEAR_ERRORS if n in chain or f"{n}: " in text]
    return {"ok": False, "chain": chain, "named": named, "message": text[:2000],
            "parse_error": [n for n in PARSE_ERRORS if n in chain or f"{n}:" in text]}


def _load_plain(ctx, root, step, versions):
    """Every rank resolves on its own client (plain dcp.load): the stale-cache exposure."""
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageReader

    template = {f"r{ctx.rank}": torch.zeros(48), "shared": torch.zeros(8), "meta": {"step": -1, "version": -1}}
    reader = AtomicStorageReader(root, RUN, step, timeout=6)
    try:
        dcp.load(template, storage_reader=reader)
    except BaseException as e:  # noqa: BLE001
        return _error_record(e)
    step_, version = versions.get(reader.save_id, (None, None))
    want = _state(ctx.rank, step_, version) if step_ is not None else None
    correct = want is not None and reader.step == step_ and all(
        torch.equal(template[k], want[k]) for k in (f"r{ctx.rank}", "shared")) and template["meta"] == want["meta"]
    return {"ok": True, "step": reader.step, "save_id": reader.save_id, "correct": correct}


def _count_refused_control_files() -> dict:
    """Count LATEST / marker reads refused as torn or edited (then retried) in this process.

    ``counter["restore"]()`` puts the original parsers back.
    """
    from dcp_atomic.format import manifest
    from dcp_atomic.errors import CorruptCheckpointError

    originals = {cls: cls.__dict__["from_json"] for cls in (manifest.Latest, manifest.Marker)}
    counter = {"n": 0, "restore": lambda: [setattr(c, "from_json", f) for c, f in originals.items()]}
    for cls in originals:
        original = cls.from_json.__func__

        def from_json(klass, data, *, where, _original=original):
            try:
                return _original(klass, data, where=where)
            except CorruptCheckpointError:
                counter["n"] += 1
                raise

        cls.from_json = classmethod(from_json)
    return counter


def _load_manager(ctx, manager, step):
    """Rank 0 resolves the step and tells the others; each rank then reads that step's marker by exact name."""
    template = {f"r{ctx.rank}": torch.zeros(48), "shared": torch.zeros(8), "meta": {"step": -1, "version": -1}}
    try:
        loaded = manager.load(template)
    except BaseException as e:  # noqa: BLE001
        return _error_record(e)
    version = template["meta"]["version"]
    want = _state(ctx.rank, loaded, version) if version in (0, 1) else None
    correct = want is not None and template["meta"] == want["meta"] and all(
        torch.equal(template[k], want[k]) for k in (f"r{ctx.rank}", "shared"))
    return {"ok": True, "step": loaded, "version": version, "correct": correct}


def _save_load_loop(ctx, iterations):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicSavePlanner, AtomicStorageWriter, CheckpointManager

    from dcp_atomic._base import failpoints

    root = ctx.extra["roots"][ctx.rank]
    manager = CheckpointManager(root, RUN, timeout=6)
    versions: dict[str, tuple[int, int]] = {}
    log = []
    probe = {"marker": None, "stale_after_commit": 0}
    if ctx.rank == 1:
        # A monitoring sidecar on node B looks for the marker while the save is under way (this rank's data is
        # durable, the marker not yet written): node B caches that negative lookup.
        original_hit = failpoints.hit

        def hit(name, rank=None):
            if name == "write.after_data" and probe["marker"]:
                assert not os.path.exists(probe["marker"])
            return original_hit(name, rank)

        failpoints.hit = hit

    def save(step, version, overwrite=False, probe_marker=False):
        marker = os.path.join(root, RUN, f"step_{step:010d}", "COMMITTED")
        probe["marker"] = marker if probe_marker else None
        if ctx.rank == 1:
            os.path.exists(os.path.join(root, RUN, "LATEST"))  # the sidecar's `ls -l`: B caches LATEST's size
        dist.barrier()
        writer = AtomicStorageWriter(root, RUN, step, overwrite=overwrite, timeout=6, thread_count=1)
        dcp.save(_state(ctx.rank, step, version), storage_writer=writer, planner=AtomicSavePlanner())
        versions[writer.save_id] = (step, version)
        if ctx.rank == 1 and probe_marker and not os.path.exists(marker):
            probe["stale_after_commit"] += 1  # committed on the server, still invisible on node B

    for k in range(iterations):
        step = 10**k  # LATEST grows each time: a client that cached its old size reads it torn
        save(step, 0, probe_marker=k % 2 == 0)
        log.append(("latest", step, _load_plain(ctx, root, None, versions)))
        if k % 2:  # an overwrite re-save replaces the marker by rename: torn / stale marker reads
            save(step, 1, overwrite=True)
            log.append(("explicit", step, _load_plain(ctx, root, step, versions)))
        log.append(("manager", step, _load_manager(ctx, manager, step)))
        dist.barrier()
    manager.close()
    return {"log": log, "stale_after_commit": probe["stale_after_commit"]}


@pytest.mark.parametrize("kernel_cache_b", [False, True], ids=["torn-reads", "stale-complete-reads"])
def test_save_then_load_at_once_is_one_version_or_a_clear_error(kernel_cache_b):
    with nfs_clients_ctx(cache_seconds=2.0, kernel_cache_b=kernel_cache_b) as clients:
        results = assert_all_ok(run_world(_save_load_loop, 2, clients.backing, args=(6,),
                                          extra={"roots": clients.roots("AB")}, timeout=120))
    logs = [r["log"] for r in results]
    assert len(logs[0]) == len(logs[1])
    errors = 0
    resaved = {step for kind, step, _ in logs[0] if kind == "explicit"}
    for (kind, step, r0), (_, _, r1) in zip(*logs):
        where = f"{kind} load after saving step {step}: rank 0 {r0}, rank 1 {r1}"
        for r in (r0, r1):
            if r["ok"]:
                assert r["correct"], "loaded values do not match the version loaded: " + where
            else:
                assert not r["parse_error"], "a torn file reached a parser: " + where
                assert r["named"], "not a clear error: " + where
        if r0["ok"] and r1["ok"]:
            assert (r0["step"], r0.get("save_id")) == (r1["step"], r1.get("save_id")), "ranks loaded a mix: " + where
        else:
            assert not (r0["ok"] or r1["ok"]), "one rank loaded while the other failed: " + where
            errors += 1
        if kind == "manager" and step not in resaved:
            # A step's first marker appears by link(): a rank that cached its absence waits the lag out.
            assert r0["ok"] and r1["ok"] and r0["step"] == step, where
        if kind == "manager" and r0["ok"]:
            assert r0["version"] == r1["version"], where
    # Not vacuous: node B missed markers that were committed (negative lookups) and every load waited that out;
    # with kernel_cache, client B also served complete old LATEST files, and the plain loads that hit them
    # failed together, clearly.  (Without it, torn reads depend on cache timing here; the deterministic torn-read
    # case is test_torn_latest_on_a_stale_client_is_refused_and_waited_out.)
    assert results[1]["stale_after_commit"] >= 1, "node B never missed a committed marker: the emulation did not bite"
    if kernel_cache_b:
        assert errors >= 1, "client B never served a stale version: the emulation did not bite"


# -- torn control files, deterministically (one process: A saves, B reads) ---------------------------------


BIG_STEP = 10**9  # LATEST of step 1 -> step 10**9 grows by 9 bytes, more than the commit time's repr varies


def _load_on(root, step=None, timeout=5.0):
    import torch.distributed.checkpoint as dcp

    reader = AtomicStorageReader(root, RUN, step, timeout=timeout)
    got = {"w": torch.zeros(16)}
    dcp.load(got, storage_reader=reader)
    return reader, got["w"]


@pytest.mark.nfs(cache_seconds=1)
def test_torn_latest_on_a_stale_client_is_refused_and_waited_out(nfs_clients):
    a, b = nfs_clients.a.path, nfs_clients.b.path
    _save(a, 1)
    nfs_clients.b.expire()
    os.stat(os.path.join(b, RUN, "LATEST"))  # B caches LATEST's size (an `ls -l` on node B)
    _save(a, BIG_STEP)  # LATEST grows by 9 bytes: B now reads it cut to the old size
    refused = _count_refused_control_files()
    try:
        reader, w = _load_on(b)
    finally:
        refused["restore"]()
    assert refused["n"] >= 1, "the torn LATEST must have been read, refused and retried"
    assert reader.step == BIG_STEP and torch.equal(w, torch.full((16,), float(BIG_STEP)))


# -- the library's own waits end within its timeout ---------------------------------------------------


def _save(root, step, value=None):
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.full((16,), float(step if value is None else value))}
    writer = AtomicStorageWriter(root, RUN, step, thread_count=1)
    dcp.save(state, storage_writer=writer)
    return writer.save_id


@pytest.mark.nfs(cache_seconds=60)
def test_visibility_lag_longer_than_timeout_ends_in_a_typed_error_in_time(nfs_clients):
    a, b = nfs_clients.a.path, nfs_clients.b.path
    _save(a, 1)
    assert not os.path.exists(os.path.join(b, RUN, "step_0000000002", "COMMITTED"))  # B's negative lookup
    _save(a, 2)
    started = time.monotonic()
    with pytest.raises(CheckpointNotFoundError, match="stale"):
        AtomicStorageReader(b, RUN, 2, timeout=0.5).resolve()
    assert time.monotonic() - started < 10, "bounded by the reader's timeout, not by the 60 s cache"
    assert AtomicStorageReader(a, RUN, 2, timeout=0.5).resolve().step == 2
    nfs_clients.b.expire()
    assert AtomicStorageReader(b, RUN, 2, timeout=0.5).resolve().step == 2


@pytest.mark.nfs(cache_seconds=3)
def test_visibility_lag_shorter_than_timeout_is_waited_out(nfs_clients):
    a, b = nfs_clients.a.path, nfs_clients.b.path
    lag = nfs_clients.b.cache_seconds
    _save(a, 1)
    marker_on_b = os.path.join(b, RUN, "step_0000000002", "COMMITTED")
    assert not os.path.exists(marker_on_b)  # B caches the negative lookup for `lag` seconds
    save_id = _save(a, 2)
    with watched_reads() as reads:
        assert AtomicStorageReader(b, RUN, 2, timeout=3 * lag).resolve().save_id == save_id
    misses, found = reads.of(marker_on_b, "FileNotFoundError"), reads.of(marker_on_b, "ok")
    assert misses, "the reader never missed the marker: the lag had ended before it looked, nothing was waited out"
    assert found and misses[-1] < found[0], (misses, found)


# -- latest_step on a stale client ------------------------------------------------------------------------


@pytest.mark.nfs(cache_seconds=30)
def test_latest_step_on_a_stale_client_never_moves_latest_backwards(nfs_clients):
    a, b, server = nfs_clients.a.path, nfs_clients.b.path, nfs_clients.backing
    _save(a, 1)
    failpoints.arm("commit.after_manifest", "raise")  # step 2 crashes before its marker ...
    with pytest.raises(BaseException, match="injected I/O error"):
        _save(a, 2)
    failpoints.disarm_all()
    assert latest_step(b, RUN) == 1  # ... and an eval job polling on node B looks for it: negative lookup cached
    second = _save(a, 2)  # the retry commits step 2 on node A
    assert json.load(open(os.path.join(server, RUN, "LATEST")))["step"] == 2
    polled = latest_step(b, RUN)  # the eval job polls again within the cache timeout
    assert json.load(open(os.path.join(server, RUN, "LATEST")))["step"] == 2, "LATEST moved backwards"
    assert polled in (1, 2)  # a stale answer is tolerable; rewriting LATEST from it is not
    assert AtomicStorageReader(server, RUN, timeout=1).resolve().save_id == second


def test_only_a_posix_root_on_a_filesystem_of_this_machine_shows_names_at_once(nfs_clients, tmp_path):
    """The one rule of when a missing marker or step is missing (no wait, a failed save settled at once) and when a
    cache may hide it (waited for): a local disk or tmpfs shows names at once, a FUSE client of a shared directory
    (the NFS stand-in) and an object store do not."""
    from dcp_atomic.format import RunLayout
    from dcp_atomic.protocol import shows_at_once
    from dcp_atomic.stores import open_storage

    local = RunLayout(open_storage(str(tmp_path)), "exp")
    assert shows_at_once(local, local.step_dir(3))  # the step need not exist
    client = RunLayout(open_storage(nfs_clients.b.path), "exp")
    assert not shows_at_once(client, client.step_dir(3))
    s3 = RunLayout(open_storage("s3://bucket/root", {"endpoint_url": "http://127.0.0.1:9"}), "exp")
    assert not shows_at_once(s3, s3.step_dir(3))
