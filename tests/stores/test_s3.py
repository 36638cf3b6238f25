"""The commit protocol on real S3 servers (moto and SeaweedFS on 127.0.0.1, see tests/s3_servers.py).

The core protocol cases of tests/faults/test_worlds.py and tests/manager/test_single_process.py
again, on S3: round trips at world 2, consecutive saves, overwrite, a rank
killed mid-upload, a crash between manifest and marker, corruption — plus
what only object stores have: conditional PUTs racing, throttling and 5xx,
lost replies, multipart uploads left by dead ranks, and stores that ignore
conditional headers.  Faults come from the proxy in front of each server.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import s3fs  # noqa: F401  (the S3 backend's dependency: a missing install fails here, never skips)
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_atomic import (AtomicSavePlanner, AtomicStorageReader, AtomicStorageWriter, CheckpointNotFoundError,
                        CommitConflictError, ConfigurationError, CorruptCheckpointError, StorageError, latest_step,
                        list_steps)
from dcp_atomic._base import failpoints
from dcp_atomic.format.layout import RunLayout
from dcp_atomic.stores.s3 import S3Storage, abort_stale_uploads
from dcp_atomic.stores.backends import open_storage
from tests.harness import assert_all_ok, run_world
from tests.helpers.s3_jobs import RUN, _inner, _job_state, _load_steps, _racing_job, _save_steps, _world_state


pytestmark = pytest.mark.timeout(120)


# -- rank functions (module level: they travel to the workers by reference) -----------------


def _manager_job(ctx, steps):
    """CheckpointManager on S3: sync saves, an async save, retention (gc on S3), load of the latest."""
    from dcp_atomic import CheckpointManager

    options = ctx.extra["options_by_rank"][ctx.rank]
    manager = CheckpointManager(ctx.root, RUN, keep_last=1, timeout=30, storage_options=options)
    for step in steps[:-1]:
        manager.save(step, _world_state(ctx.rank, step, ctx.world_size, False))
    manager.async_save(steps[-1], _world_state(ctx.rank, steps[-1], ctx.world_size, False)).result()
    manager.wait()
    template = _world_state(ctx.rank, 0, ctx.world_size, False)
    loaded = manager.load(template)
    expected = _world_state(ctx.rank, loaded, ctx.world_size, False)
    for key, want in expected.items():
        got = template[key]
        if hasattr(got, "full_tensor"):
            got, want = got.full_tensor(), want.full_tensor()
        assert (torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want), key
    result = {"loaded": loaded, "steps": manager.steps(), "latest": manager.latest_step()}
    manager.close()
    return result


# -- helpers for single-process saves in the test process -----------------------------------------


def _state(seed: int, big: bool = False) -> dict:
    generator = torch.Generator().manual_seed(seed)
    state = {"w": torch.randn(300, 1000, generator=generator), "small": torch.arange(7, dtype=torch.int32) + seed,
             "bf16": torch.randn(33, generator=generator).to(torch.bfloat16), "meta": {"seed": seed}}
    if big:
        state["big"] = torch.randn(3_500_000, generator=generator)  # 14 MB: three 5 MiB parts
    return state


def _zeros(state: dict) -> dict:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"seed": -1} for k, v in state.items()}


def _save(s3, step, seed=0, *, big=False, overwrite=False, **options) -> AtomicStorageWriter:
    writer = AtomicStorageWriter(s3.root, RUN, step, overwrite=overwrite, timeout=10, block_size=256 << 10,
                                 storage_options=s3.options(**options))
    dcp.save(_state(seed, big), storage_writer=writer)
    return writer


def _load(s3, step=None, seed=0, *, big=False, timeout=5, **options):
    reader = AtomicStorageReader(s3.root, RUN, step, timeout=timeout, storage_options=s3.options(**options))
    target = _zeros(_state(seed, big))
    dcp.load(target, storage_reader=reader)
    return reader, target


def _assert_state(loaded: dict, seed: int, big: bool = False) -> None:
    for key, value in _state(seed, big).items():
        assert (torch.equal(loaded[key], value) if isinstance(value, torch.Tensor) else loaded[key] == value), key


def _marker(s3, step) -> dict:
    return json.loads(s3.get(f"{RUN}/step_{step:010d}/COMMITTED"))


def _committed(s3, step) -> bool:
    return f"{RUN}/step_{step:010d}/COMMITTED" in s3.keys(f"{RUN}/")


# -- storage primitives -----------------------------------------------------------------------------


def test_s3_and_s3a_roots_open_s3storage_and_never_touch_the_callers_options():
    options = {"endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s", "dcp_atomic_unsafe_single_writer": True}
    before = dict(options)
    for root in ("s3://bucket/prefix", "s3a://bucket/prefix/"):
        storage = open_storage(root, options)
        assert isinstance(storage, S3Storage) and storage.root == "bucket/prefix"
        assert storage.unsafe_single_writer and not storage.exclusive_create_is_atomic
        assert storage.fs.dircache.use_listings_cache is False
    assert options == before
    assert open_storage("s3://bucket/p", options).fs is not open_storage("s3://bucket/p", options).fs
    with pytest.raises(ConfigurationError, match="5 MiB"):
        open_storage("s3://bucket/p", {"dcp_atomic_part_size": 1 << 20})


def test_unreachable_store_is_a_storage_error_naming_rank_and_key_after_bounded_retries():
    options = {"endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s", "dcp_atomic_max_attempts": 3,
               "dcp_atomic_backoff_s": 0.01, "config_kwargs": {"connect_timeout": 1}}
    started = time.monotonic()
    refused = r"rank 0 .*s3://bucket/p/exp/LATEST.*cannot be reached \(3 attempts"
    with pytest.raises(StorageError, match=refused) as info:
        AtomicStorageReader("s3://bucket/p", RUN, storage_options=options, timeout=5).resolve()
    assert info.value.details["attempts"] == 3 and time.monotonic() - started < 10


def test_exists_is_detected_from_the_412_on_both_servers_and_if_match_guards_replace(s3):
    storage = open_storage(s3.root, s3.options())
    marker = storage.join(storage.root, "x", "COMMITTED")
    assert storage.create_exclusive(marker, b"first")
    assert not storage.create_exclusive(marker, b"second")  # moto: FileExistsError; SeaweedFS: OSError(EINVAL)
    assert [r.status for r in s3.proxy.requests("PUT", r"x/COMMITTED$")] == [200, 412]
    data, version = storage.read_versioned(marker)
    assert data == b"first" and version
    storage.replace_if_unchanged(marker, b"third", version)
    assert "if-match" in s3.proxy.requests("PUT", r"x/COMMITTED$")[-1].conditions
    s3.put("x/COMMITTED", b"someone else")  # another job replaces it after we read it ...
    _, version = storage.read_versioned(marker)
    s3.put("x/COMMITTED", b"and again")
    with pytest.raises(CommitConflictError, match="changed while this save was replacing it"):
        storage.replace_if_unchanged(marker, b"ours", version)  # ... our If-Match fails: no last-writer-wins
    assert storage.read_file(marker) == b"and again"
    assert storage.read_range(marker, 4, 3) == b"aga" and storage.read_range(marker, 7, 100) == b"in"
    assert storage.read_range(marker, 50, 5) == b"" and storage.size(marker) == 9
    assert abs(storage.modified(marker) - time.time()) < 60 and storage.modified(marker + ".nothing") is None
    assert storage.list_dir(storage.root) == ["x"]
    assert storage.list_dir(storage.join(storage.root, "x")) == ["COMMITTED"]
    assert storage.list_dir(storage.join(storage.root, "nothing")) == []
    storage.remove(storage.join(storage.root, "x"))
    assert s3.keys() == []
    with pytest.raises(FileNotFoundError):
        storage.read_file(marker)


def test_multipart_writes_bounded_concurrency_ranged_reads_and_abandoned_uploads(s3):
    storage = open_storage(s3.root, s3.options(dcp_atomic_max_concurrency=2))
    data = os.urandom(23 << 20)
    path = storage.join(storage.root, "big.bin")
    stream = storage.open_write(path)
    for start in range(0, len(data), 3 << 20):
        stream.write(memoryview(data)[start : start + (3 << 20)])
    assert s3.keys() == [], "nothing is visible before close_write"
    storage.close_write(stream)
    assert len(s3.proxy.requests("UPLOAD_PART")) == 5 and len(s3.proxy.requests("COMPLETE_MPU")) == 1
    assert s3.proxy.max_in_flight["UPLOAD_PART"] <= 2
    assert storage.read_range(path, 0, len(data)) == data  # parallel ranged GETs, reassembled
    assert storage.read_range(path, (7 << 20) - 3, 11 << 20) == data[(7 << 20) - 3 : (18 << 20) - 3]
    assert storage.read_range(path, len(data) - 5, 12 << 20) == data[-5:]
    into = bytearray(9 << 20)  # the reader's in-place path: ranged GETs straight into a tensor's memory
    assert storage.readinto_range(path, 100, memoryview(into)) == len(into) and into == data[100 : 100 + len(into)]
    gets = len(s3.proxy.requests("GET"))
    assert storage.read_range(path, 1000, 10) == data[1000:1010]  # an item header: reads ahead 1 MiB
    small = bytearray(300 << 10)
    assert storage.readinto_range(path, 1010, memoryview(small)) == len(small)
    assert small == data[1010 : 1010 + len(small)]
    assert len(s3.proxy.requests("GET")) == gets + 1, "a small item after its header comes from the read-ahead"
    tail = bytearray(1 << 20)
    assert storage.readinto_range(path, len(data) - 7, memoryview(tail)) == 7 and tail[:7] == data[-7:]
    abandoned = storage.open_write(storage.join(storage.root, "abandoned.bin"))
    abandoned.write(data)
    assert len(s3.uploads()) == 1
    abandoned.close()  # the writer's error path: close without close_write aborts, publishes nothing
    assert s3.uploads() == [] and s3.keys() == ["big.bin"]


# -- the core protocol cases on S3 ------------------------------------------------------------------


@pytest.mark.slow
def test_round_trip_at_world_2_over_consecutive_saves_with_no_rank_listing(s3):
    extra = {"storage_options": s3.options()}
    ids = assert_all_ok(run_world(_save_steps, 2, s3.root, args=([1, 2, 3], [3]), extra=extra))
    assert ids[0] == ids[1] and len(set(ids[0])) == 3
    loaded = assert_all_ok(run_world(_load_steps, 2, s3.root, args=([(None, True), (2, False)],), extra=extra))
    assert loaded[0] == loaded[1] == [(3, ids[0][2]), (2, ids[0][1])]
    assert s3.proxy.requests("LIST") == [] and s3.proxy.requests("LIST_UPLOADS") == [], \
        "ranks must read and write by exact key only"
    assert {r.key.rsplit("/", 1)[1] for r in s3.proxy.requests("CREATE_MPU")} == {"__0_0.distcp", "__1_0.distcp"}
    assert s3.uploads() == []
    assert [r.status for r in s3.proxy.requests("PUT", r"COMMITTED$")] == [200, 200, 200]
    assert all(r.conditions == {"if-none-match": "*"} for r in s3.proxy.requests("PUT", r"COMMITTED$"))
    options = s3.options()
    assert list_steps(s3.root, RUN, options) == [1, 2, 3] and latest_step(s3.root, RUN, options) == 3
    assert s3.proxy.requests("LIST"), "the scan (one process) is what lists"


def test_overwrite_false_is_refused_before_writing_and_overwrite_true_replaces_by_if_match(s3):
    first = _save(s3, 4, seed=1)
    before = s3.keys()
    with pytest.raises(CheckpointException, match="already committed"):
        _save(s3, 4, seed=2)
    assert s3.keys() == before, "a refused save must not write a byte"
    second = _save(s3, 4, seed=3, overwrite=True)
    assert _marker(s3, 4)["save_id"] == second.save_id != first.save_id
    replace = s3.proxy.requests("PUT", r"COMMITTED$")[-1]
    assert "if-match" in replace.conditions and replace.status == 200
    assert f"{RUN}/step_0000000004/{first.save_id}/manifest.json" in s3.keys(), "the old attempt is left for gc"
    _, loaded = _load(s3, 4)
    _assert_state(loaded, 3)


def test_overwrite_losing_the_marker_to_another_job_fails_with_conflict(s3):
    _save(s3, 5, seed=1)
    writer = AtomicStorageWriter(s3.root, RUN, 5, overwrite=True, timeout=10, storage_options=s3.options())
    replace = writer.storage.replace_if_unchanged  # the commit's replace of a marker it read
    other = {}

    def another_job_replaces_it_first(path, data, version):
        if path.endswith("COMMITTED") and not other:
            other["save_id"] = _save(s3, 5, seed=2, overwrite=True).save_id
        return replace(path, data, version)

    writer.storage.replace_if_unchanged = another_job_replaces_it_first
    with pytest.raises(CheckpointException) as info:
        dcp.save(_state(3), storage_writer=writer)
    assert any(isinstance(e, CommitConflictError) for e in _inner(info.value)), _inner(info.value)
    assert _marker(s3, 5)["save_id"] == other["save_id"]
    _, loaded = _load(s3, 5)
    _assert_state(loaded, 2)


def test_latest_is_the_most_recent_commit_and_a_crash_before_latest_is_repaired(s3):
    for step in (10, 20, 15):  # a rollback restart: the live branch saves a lower step
        _save(s3, step, seed=step)
    options = s3.options()
    assert list_steps(s3.root, RUN, options) == [10, 15, 20] and latest_step(s3.root, RUN, options) == 15
    failpoints.arm("commit.after_marker", "raise")
    with pytest.raises(CheckpointException, match="injected I/O error"):
        _save(s3, 30, seed=30)
    failpoints.disarm_all()
    assert json.loads(s3.get(f"{RUN}/LATEST"))["step"] == 15, "LATEST is written only after the marker"
    assert latest_step(s3.root, RUN, options) == 30  # the scan finds the commit and repairs LATEST
    assert json.loads(s3.get(f"{RUN}/LATEST"))["step"] == 30
    reader, loaded = _load(s3, seed=30)
    assert reader.step == 30
    _assert_state(loaded, 30)


def test_crashed_overwrite_leaves_the_old_version_and_missing_steps_are_not_found(s3):
    _save(s3, 1, seed=1)
    failpoints.arm("commit.after_manifest", "raise")
    with pytest.raises(CheckpointException, match="injected I/O error"):
        _save(s3, 1, seed=2, overwrite=True)
    failpoints.disarm_all()
    _assert_state(_load(s3, 1)[1], 1)
    with pytest.raises(CheckpointNotFoundError, match="step 2 .* is not committed"):
        AtomicStorageReader(s3.root, RUN, 2, timeout=0.2, storage_options=s3.options()).resolve()
    assert list_steps(s3.root, "nothing-here", s3.options()) == []
    assert latest_step(s3.root, "nothing-here", s3.options()) is None


@pytest.mark.slow
def test_rank_killed_mid_upload_leaves_previous_step_and_gc_aborts_its_upload(s3):
    extra = {"storage_options": s3.options()}
    assert_all_ok(run_world(_save_steps, 2, s3.root, args=([1],), extra=extra))
    outcomes = run_world(_save_steps, 2, s3.root, args=([2], [2], 1), extra=extra, pg_timeout=10, timeout=60,
                         rank_env=lambda r: {"DCP_ATOMIC_FAILPOINTS": "write.mid_data@1=kill"})
    assert outcomes[1].killed and not outcomes[0].ok
    options = s3.options()
    assert list_steps(s3.root, RUN, options) == [1] and latest_step(s3.root, RUN, options) == 1
    assert not _committed(s3, 2)
    left = s3.uploads()
    assert left and all(u["Key"].endswith("/__1_0.distcp") for u in left), left
    storage = open_storage(s3.root, options)
    run_dir = RunLayout(storage, RUN).run_dir
    if s3.name == "seaweedfs":  # moto dates every upload 2010-11-10, so only SeaweedFS can show the lease
        assert abort_stale_uploads(storage, run_dir, older_than_s=3600) == []
        assert len(s3.uploads()) == len(left)
    aborted = abort_stale_uploads(storage, run_dir, older_than_s=0)
    assert sorted(a.upload_id for a in aborted) == sorted(u["UploadId"] for u in left)
    assert s3.uploads() == []
    loaded = assert_all_ok(run_world(_load_steps, 2, s3.root, args=([(None, False)],), extra=extra))
    assert [seen[0][0] for seen in loaded] == [1, 1]


@pytest.mark.slow
def test_rank0_crash_between_manifest_and_marker_leaves_nothing_visible(s3):
    extra = {"storage_options": s3.options()}
    assert_all_ok(run_world(_save_steps, 2, s3.root, args=([1],), extra=extra))
    outcomes = run_world(_save_steps, 2, s3.root, args=([2],), extra=extra, pg_timeout=10, timeout=60,
                         env={"DCP_ATOMIC_FAILPOINTS": "commit.after_manifest@0=kill"})
    assert outcomes[0].killed
    step_keys = s3.keys(f"{RUN}/step_0000000002/")
    assert any(k.endswith("/manifest.json") for k in step_keys) and not _committed(s3, 2)
    assert json.loads(s3.get(f"{RUN}/LATEST"))["step"] == 1
    assert list_steps(s3.root, RUN, s3.options()) == [1]
    loaded = assert_all_ok(run_world(_load_steps, 2, s3.root, args=([(None, False)],), extra=extra))
    assert [seen[0][0] for seen in loaded] == [1, 1]


def test_checkpoint_manager_on_s3_lists_only_on_global_rank_0(s3_moto):
    s3 = s3_moto
    options_by_rank = [s3.options(config_kwargs={"user_agent_extra": f"dcp-test-rank-{r}"}) for r in range(2)]
    results = assert_all_ok(run_world(_manager_job, 2, s3.root, args=([1, 2, 3],),
                                      extra={"options_by_rank": options_by_rank}, timeout=90))
    assert all(r == {"loaded": 3, "steps": [3], "latest": 3} for r in results), results
    assert [k for k in s3.keys(f"{RUN}/") if "step_" in k and "step_0000000003" not in k] == [], "gc on S3"
    lists = s3.proxy.requests("LIST")
    assert lists and all("dcp-test-rank-0" in r.agent for r in lists), {r.agent for r in lists}
    assert any("dcp-test-rank-1" in r.agent for r in s3.proxy.requests("GET")), "rank 1 reads by exact key"


def test_flipped_truncated_and_torn_objects_are_detected(s3):
    writer = _save(s3, 1, seed=1)
    victim = max((k for k in s3.keys() if f"/step_0000000001/{writer.save_id}/" in k and k.endswith(".distcp")),
                 key=lambda k: len(s3.get(k)))  # wherever the layout puts data (hashed prefixes on s3://)
    name = victim.rsplit("/", 1)[1]
    original = s3.get(victim)
    flipped = bytearray(original)
    flipped[len(flipped) // 2] ^= 0x01
    s3.put(victim, bytes(flipped))
    with pytest.raises(CheckpointException) as info:
        _load(s3, 1)
    assert any(isinstance(e, CorruptCheckpointError) and name in str(e) and "checksum mismatch" in str(e)
               for e in _inner(info.value)), _inner(info.value)
    s3.put(victim, original[: len(original) // 2])
    with pytest.raises(CheckpointException) as info:
        _load(s3, 1)
    assert any(isinstance(e, CorruptCheckpointError) and name in str(e) and "truncated" in str(e)
               for e in _inner(info.value)), _inner(info.value)
    s3.put(victim, original)
    _assert_state(_load(s3, 1)[1], 1)
    marker_key = f"{RUN}/step_0000000001/COMMITTED"
    marker = s3.get(marker_key)
    s3.put(marker_key, marker[: len(marker) // 2])
    with pytest.raises(CorruptCheckpointError, match="COMMITTED"):
        AtomicStorageReader(s3.root, RUN, 1, timeout=0.3, storage_options=s3.options()).resolve()


def test_two_jobs_racing_to_commit_one_step_exactly_one_wins_entirely(s3_seaweedfs, tmp_path):
    """On SeaweedFS, whose If-None-Match check is atomic (moto's is not, so a race there proves nothing)."""
    from tests.fault_fixtures import HoldingProxy, conditional_marker_create

    s3 = s3_seaweedfs
    steps = list(range(1, 9))
    holding = HoldingProxy(s3.proxy.url, conditional_marker_create)  # both marker PUTs go upstream together
    try:
        results = assert_all_ok(run_world(_racing_job, 2, s3.root, args=(steps, str(tmp_path)), no_process_group=True,
                                          extra={"storage_options": s3.options(endpoint_url=holding.url)}, timeout=90))
    finally:
        holding.close()
    for i, step in enumerate(steps):
        assert holding.overlapped(f"step_{step:010d}"), f"step {step}: the two conditional PUTs did not overlap: " \
            f"{holding.requests(f'step_{step:010d}')}"
        outcome = {job: results[job][i] for job in (0, 1)}
        winners = [job for job in (0, 1) if outcome[job]["won"]]
        assert len(winners) == 1, f"step {step}: {outcome}"
        winner, loser = outcome[winners[0]], outcome[1 - winners[0]]
        assert "CommitConflictError" in loser["errors"] and winner["save_id"] in loser["message"], loser
        marker_puts = s3.proxy.requests("PUT", rf"step_{step:010d}/COMMITTED$")
        assert sorted(r.status for r in marker_puts) == [200, 412], "both conditional PUTs reached the server"
        assert _marker(s3, step)["save_id"] == winner["save_id"]
        reader = AtomicStorageReader(s3.root, RUN, step, timeout=5, storage_options=s3.options())
        target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"job": -1, "step": -1}
                  for k, v in _job_state(0, 0).items()}
        dcp.load(target, storage_reader=reader)
        expected = _job_state(winners[0], step)
        assert reader.save_id == winner["save_id"] and target["who"] == expected["who"]
        assert torch.equal(target["w"], expected["w"]) and torch.equal(target["b"], expected["b"])
        assert any(k.startswith(f"{RUN}/step_{step:010d}/{loser['save_id']}/") for k in s3.keys(f"{RUN}/")), \
            "the loser's attempt stays behind, unreferenced, for gc"


def test_cli_ls_verify_and_gc_work_on_s3(s3_moto, capsys):
    from dcp_atomic.tools.cli import main

    s3 = s3_moto
    _save(s3, 1, seed=1)
    _save(s3, 2, seed=2)
    dead = s3.client.create_multipart_upload(Bucket=s3.bucket, Key=f"{s3.prefix}/{RUN}/step_0000000003/x/__1_0.distcp")
    flags = ["--storage-options", json.dumps(s3.options()), "--json"]
    assert main(flags + ["ls", s3.root, RUN]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert [step["step"] for step in listing["steps"] if step["committed"]] == [1, 2] and listing["latest"] == 2
    assert main(flags + ["verify", s3.root, RUN, "--all"]) == 0
    assert all(report["problems"] == [] for report in json.loads(capsys.readouterr().out))
    assert main(flags + ["gc", s3.root, RUN, "--keep-last", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["delete_steps"] == [1]
    assert not s3.keys(f"{RUN}/step_0000000001/") and _committed(s3, 2)
    # moto dates every upload 2010-11-10, so gc's default 6 h lease counts this one as abandoned
    assert dead["UploadId"] not in [u["UploadId"] for u in s3.uploads()]
    _assert_state(_load(s3, 2, seed=2)[1], 2)


# -- failures only object stores have -------------------------------------------------------------


def test_throttling_and_5xx_on_some_requests_are_retried_transparently(s3):
    proxy = s3.proxy
    rules = [
        proxy.fail("CREATE_MPU", status=500, code="InternalError", times=1),
        proxy.fail("UPLOAD_PART", status=503, code="SlowDown", times=2),
        proxy.fail("PUT", r"manifest\.json$", status=503, code="SlowDown", times=1),
        proxy.fail("PUT", r"COMMITTED$", status=429, code="TooManyRequests", times=1),
        proxy.fail("GET", r"\.distcp$", status=502, code="BadGateway", times=2),
        proxy.fail("GET", r"LATEST$", status=503, code="SlowDown", times=1),
    ]
    writer = _save(s3, 1, seed=7, big=True)
    reader, loaded = _load(s3, seed=7, big=True)
    assert reader.step == 1 and reader.save_id == writer.save_id
    _assert_state(loaded, 7, big=True)
    assert [rule.hits for rule in rules] == [rule.times for rule in rules]
    assert s3.uploads() == []


def test_manifest_put_failing_past_the_retry_budget_commits_nothing(s3):
    _save(s3, 1, seed=1)
    rule = s3.proxy.fail("PUT", r"manifest\.json$", status=500, code="InternalError")
    with pytest.raises(CheckpointException) as info:
        _save(s3, 2, seed=2)
    errors = [e for e in _inner(info.value) if isinstance(e, StorageError)]
    assert errors and "rank 0" in str(errors[0]) and "manifest.json" in str(errors[0]) and "HTTP 500" in str(errors[0])
    assert rule.hits == 4  # dcp_atomic_max_attempts in the test options
    assert not _committed(s3, 2) and json.loads(s3.get(f"{RUN}/LATEST"))["step"] == 1
    reader, loaded = _load(s3, seed=1)
    assert reader.step == 1
    _assert_state(loaded, 1)


def test_marker_put_failing_commits_nothing_and_a_lost_reply_is_recognised_as_our_own(s3):
    _save(s3, 1, seed=1)
    rule = s3.proxy.fail("PUT", r"step_0000000002/COMMITTED$", status=503, code="SlowDown")
    with pytest.raises(CheckpointException) as info:
        _save(s3, 2, seed=2)
    assert any(isinstance(e, StorageError) and "COMMITTED" in str(e) for e in _inner(info.value))
    assert rule.hits == 4 and not _committed(s3, 2)
    assert json.loads(s3.get(f"{RUN}/LATEST"))["step"] == 1
    s3.proxy.reset()
    # The server applies the conditional PUT but the reply is lost: the retry meets a 412 and the
    # protocol reads the marker back, finding its own save_id: committed, not a conflict.
    s3.proxy.fail("PUT", r"step_0000000003/COMMITTED$", status=500, code="InternalError", times=1, after_forward=True)
    writer = _save(s3, 3, seed=3)
    assert [r.status for r in s3.proxy.requests("PUT", r"COMMITTED$")] == [500, 412]
    assert _marker(s3, 3)["save_id"] == writer.save_id
    assert latest_step(s3.root, RUN, s3.options()) == 3


def test_retry_budget_spent_on_a_data_upload_fails_every_rank_naming_rank_and_key(s3_moto):
    s3 = s3_moto
    s3.proxy.fail("UPLOAD_PART", r"/__1_0\.distcp$", status=503, code="SlowDown")
    outcomes = run_world(_save_steps, 2, s3.root, args=([1], [1]), extra={"storage_options": s3.options()},
                         timeout=60)
    for outcome in outcomes:
        assert not outcome.ok and "StorageError" in outcome.error_chain, outcome.error
        assert "rank 1" in outcome.error and "__1_0.distcp" in outcome.error and "HTTP 503" in outcome.error
    assert not _committed(s3, 1)
    assert s3.uploads() == [], "the failing rank aborts its own multipart upload"


def test_store_ignoring_conditional_writes_is_refused_unless_the_user_opts_out(s3_moto):
    s3 = s3_moto
    s3.proxy.ignore_conditions = True
    with pytest.raises(CheckpointException, match="ignores conditional writes") as info:
        _save(s3, 1, seed=1)
    assert any(isinstance(e, ConfigurationError) for e in _inner(info.value))
    assert s3.keys() == [], "refused before writing anything (the probe object is removed)"
    _save(s3, 1, seed=1, dcp_atomic_unsafe_single_writer=True)
    _assert_state(_load(s3, 1)[1], 1)
    s3.proxy.ignore_conditions = False
    probes_before = len(s3.proxy.requests("PUT", r"\.dcp-atomic-probe-"))
    _save(s3, 2, seed=2)
    _save(s3, 3, seed=3)
    probes = s3.proxy.requests("PUT", r"\.dcp-atomic-probe-")[probes_before:]
    assert len([r for r in probes if r.conditions]) == 3, "one probe (create, create, If-Match) per root per process"
    assert [r.key.split("/")[1:3] for r in probes if not r.conditions] == [["_d00", RUN]], \
        "and one plain PUT where the data goes, per run and process"
