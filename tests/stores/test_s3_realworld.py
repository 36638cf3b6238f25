"""S3 where users run it (G7): throttling storms, stalls, https stores with their own checksum rules,
honest probes, process-based async saves, ambiguous marker writes, and gc on stores without prefix filters.

Everything runs against the real servers of tests/s3_servers.py (moto, SeaweedFS), faults from the proxy.
"""

from __future__ import annotations

import asyncio
import json
import logging
import pickle
import re
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_atomic import AtomicStorageReader, AtomicStorageWriter, ConfigurationError, StorageError, latest_step
from dcp_atomic.format.layout import RunLayout
from dcp_atomic.stores.s3 import MIN_BOTOCORE, AdaptiveLimit, abort_stale_uploads
from dcp_atomic.stores.backends import open_storage
from tests.harness import assert_all_ok, run_world

RUN = "exp"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def _state(seed: int, big: bool = False) -> dict:
    generator = torch.Generator().manual_seed(seed)
    state = {"w": torch.randn(300, 1000, generator=generator), "small": torch.arange(7, dtype=torch.int32) + seed,
             "meta": {"seed": seed}}
    if big:
        state["big"] = torch.randn(3_500_000, generator=generator)  # 14 MB: three 5 MiB parts
    return state


def _options(s3, **extra) -> dict:
    """The test options without the attempt cap: the time budget alone bounds retries."""
    options = s3.options(**extra)
    if "dcp_atomic_max_attempts" not in extra:
        options.pop("dcp_atomic_max_attempts")
    return options


def _save(s3, step, seed, *, big=False, overwrite=False, options=None) -> AtomicStorageWriter:
    writer = AtomicStorageWriter(s3.root, RUN, step, overwrite=overwrite, timeout=20,
                                 storage_options=options or s3.options())
    dcp.save(_state(seed, big), storage_writer=writer)
    return writer


def _assert_loads(s3, step, seed, *, big=False, options=None) -> None:
    reader = AtomicStorageReader(s3.root, RUN, step, timeout=10, storage_options=options or s3.options())
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"seed": -1} for k, v in _state(seed, big).items()}
    dcp.load(target, storage_reader=reader)
    for key, want in _state(seed, big).items():
        assert (torch.equal(target[key], want) if isinstance(want, torch.Tensor) else target[key] == want), key


def _inner(exc: BaseException) -> list[BaseException]:
    return [w[0] if isinstance(w, tuple) else w for w in getattr(exc, "failures", {}).values()]


def _marker(s3, step) -> dict:
    return json.loads(s3.get(f"{RUN}/step_{step:010d}/COMMITTED"))


# -- throttling, budgets, stalls ------------------------------------------------------------------


def test_a_throttling_storm_is_ridden_out_with_fewer_requests_in_flight(s3):
    """PUTs and part uploads answered 503 SlowDown for seconds, then normal: the save commits, bytes exact."""
    options = _options(s3, dcp_atomic_max_backoff_s=1, dcp_atomic_retry_budget_s=60, dcp_atomic_max_concurrency=4)
    _save(s3, 1, seed=1, options=options)  # the probe (once per root and process) is not what the storm hits
    # every PUT for 6 s (the attempt's first control file rides that out), part uploads for 6 s more
    s3.proxy.fail("PUT", status=503, code="SlowDown", for_s=6)
    s3.proxy.fail("UPLOAD_PART", status=503, code="SlowDown", for_s=12)
    started = time.monotonic()
    writer = _save(s3, 2, seed=2, big=True, options=options)
    assert time.monotonic() - started >= 12
    assert _marker(s3, 2)["save_id"] == writer.save_id
    _assert_loads(s3, 2, seed=2, big=True)
    storm = [r for r in s3.proxy.requests("UPLOAD_PART") if r.injected]
    assert len(storm) >= 6 and all(r.concurrent == 1 for r in storm[-3:]), \
        [r.concurrent for r in storm]  # the rank backed off to one part upload at a time
    assert s3.uploads() == []


def test_adaptive_limit_halves_on_throttling_once_per_round_and_recovers():
    async def scenario() -> list[int]:
        limit = AdaptiveLimit(8)
        seen = []
        for _ in range(3):  # three rounds of throttling, each round several requests
            epochs = [await limit.acquire() for _ in range(min(3, limit.limit))]
            for epoch in epochs:
                await limit.release(epoch, ok=False, throttled=True)
            seen.append(limit.limit)
        while limit.limit < 8:
            await limit.release(await limit.acquire(), ok=True, throttled=False)
        seen.append(limit.limit)
        return seen

    assert asyncio.run(scenario()) == [4, 2, 1, 8]


def test_a_permanent_storm_fails_within_the_time_budget_naming_rank_key_and_status(s3):
    _save(s3, 1, seed=1)
    s3.proxy.fail("PUT", r"manifest\.json$", status=503, code="SlowDown")
    options = _options(s3, dcp_atomic_retry_budget_s=3, dcp_atomic_max_backoff_s=0.5)
    started = time.monotonic()
    with pytest.raises(CheckpointException) as info:
        _save(s3, 2, seed=2, options=options)
    elapsed = time.monotonic() - started
    errors = [e for e in _inner(info.value) if isinstance(e, StorageError)]
    assert errors, _inner(info.value)
    message = str(errors[0])
    assert "rank 0" in message and "manifest.json" in message and "HTTP 503" in message
    assert "dcp_atomic_retry_budget_s" in message and errors[0].details["status"] == 503
    assert 2.5 <= elapsed < 3 + 6, elapsed  # the budget, plus the save's own work and one last attempt
    assert latest_step(s3.root, RUN, s3.options()) == 1


def test_a_stalled_request_is_cancelled_and_retried(s3_moto):
    s3 = s3_moto
    rule = s3.proxy.fail("PUT", r"manifest\.json$", status=None, stall_s=20, times=1)
    started = time.monotonic()
    writer = _save(s3, 1, seed=1, options=s3.options(dcp_atomic_stall_timeout_s=1))
    assert time.monotonic() - started < 12
    # the stalled PUT is still held by the proxy (recorded when it ends); the retry went through
    assert rule.hits == 1 and [r.status for r in s3.proxy.requests("PUT", r"manifest\.json$")] == [200]
    assert _marker(s3, 1)["save_id"] == writer.save_id
    _assert_loads(s3, 1, seed=1)


# -- process-based async save ---------------------------------------------------------------------


def _process_executor_async_save_s3(ctx):
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    writer = AtomicStorageWriter(ctx.root, RUN, 3, timeout=30, storage_options=ctx.extra["storage_options"])
    future = dcp.async_save(_state(10), storage_writer=writer,
                            async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    getattr(future, "upload_completion", future).result(timeout=120)
    return True


def _load_per_rank(ctx):
    reader = AtomicStorageReader(ctx.root, RUN, 3, timeout=20, storage_options=ctx.extra["storage_options"])
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"seed": -1} for k, v in _state(0).items()}
    dcp.load(target, storage_reader=reader)
    return {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in target.items()}


def test_writer_and_reader_pickle_and_process_based_async_save_commits_on_s3(s3_moto):
    s3 = s3_moto
    writer = AtomicStorageWriter(s3.root, RUN, 3, storage_options=s3.options())
    copy = pickle.loads(pickle.dumps(writer))
    assert copy.storage.url == writer.storage.url and copy.storage.fs is not writer.storage.fs
    storage = AtomicStorageReader(s3.root, RUN, storage_options=s3.options(dcp_atomic_max_concurrency=3)).storage
    copy = pickle.loads(pickle.dumps(storage))
    assert copy.max_concurrency == 3 and copy.read_file is not None and copy.fs is not storage.fs
    extra = {"storage_options": s3.options()}
    assert_all_ok(run_world(_process_executor_async_save_s3, 2, s3.root, extra=extra, timeout=170))
    assert latest_step(s3.root, RUN, s3.options()) == 3
    loaded = assert_all_ok(run_world(_load_per_rank, 2, s3.root, extra=extra, timeout=60))
    expected = {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in _state(10).items()}
    assert loaded == [expected, expected]


# -- ambiguous marker writes -------------------------------------------------------------------------


def test_a_marker_applied_with_its_reply_lost_then_5xx_is_reported_committed(s3):
    _save(s3, 1, seed=1)
    marker = r"step_0000000002/COMMITTED$"
    s3.proxy.fail("PUT", marker, status=500, code="InternalError", times=1, after_forward=True)
    s3.proxy.fail("PUT", marker, status=503, code="SlowDown")
    writer = _save(s3, 2, seed=2)
    assert _marker(s3, 2)["save_id"] == writer.save_id
    assert latest_step(s3.root, RUN, s3.options()) == 2
    _assert_loads(s3, 2, seed=2)
    s3.proxy.reset()
    s3.proxy.fail("PUT", r"step_0000000003/COMMITTED$", status=503, code="SlowDown")
    with pytest.raises(CheckpointException) as info:
        _save(s3, 3, seed=3)
    errors = [e for e in _inner(info.value) if isinstance(e, StorageError)]
    assert errors and errors[0].details["committed"] is False, _inner(info.value)
    assert "Read back" in str(errors[0]) and "does not exist" in str(errors[0])
    assert latest_step(s3.root, RUN, s3.options()) == 2


# -- the probe ------------------------------------------------------------------------------------------


PROBE_FAILURES = [  # (rule, the cause the error must name, words its message must contain)
    (dict(op=None, status=403, code="InvalidAccessKeyId", message="The AWS Access Key Id does not exist"), "auth",
     "credentials"),  # op=None: every request fails, a HEAD too (a PUT alone: see the SeaweedFS https case)
    (dict(op=None, status=403, code="SignatureDoesNotMatch", message="The signature we calculated does not match"),
     "auth", "credentials"),
    (dict(status=403, code="AccessDenied", message="Access Denied"), "permissions", "s3:PutObject"),
    (dict(status=400, code="KMS.DisabledException", message="arn:aws:kms:... is disabled"), "kms", "KMS key"),
    (dict(status=400, code="InvalidRequest", message="x-amz-checksum-crc32 is not supported"), "checksum",
     "dcp_atomic_checksum_mode"),
    (dict(status=501, code="NotImplemented", message="A header you provided implies functionality that is not "
          "implemented"), "checksum", "dcp_atomic_checksum_mode"),  # every PUT refused: not the condition
    (dict(status=501, code="NotImplemented", message="A header you provided implies functionality that is not "
          "implemented", header="if-none-match"), "not supported", "dcp_atomic_unsafe_single_writer"),
]


@pytest.mark.parametrize("rule,cause,words", PROBE_FAILURES, ids=[f"{c}-{r['code']}" for r, c, _ in PROBE_FAILURES])
def test_each_probe_failure_names_its_cause_and_probes_under_the_run_prefix(s3_moto, rule, cause, words):
    s3 = s3_moto
    rule = {"op": "PUT", **rule}
    s3.proxy.fail(rule.pop("op"), r"\.dcp-atomic-probe-", **rule)
    storage = open_storage(s3.root, s3.options())
    target = storage.join(storage.root, RUN, "step_0000000001", "attempt", "ATTEMPT")
    with pytest.raises(ConfigurationError) as info:
        storage.publish(target, b"{}")
    assert info.value.details["cause"] == cause and words in str(info.value), str(info.value)
    assert all(r.key.startswith(f"{s3.prefix}/{RUN}/step_0000000001/attempt/.dcp-atomic-probe-")
               for r in s3.proxy.requests("PUT")), [r.key for r in s3.proxy.requests("PUT")]
    assert pickle.loads(pickle.dumps(info.value)).details["cause"] == cause


def test_a_store_enforcing_only_if_none_match_takes_saves_and_refuses_overwrite(s3):
    s3.proxy.ignore_conditions = {"if-match"}
    first = _save(s3, 1, seed=1)
    _assert_loads(s3, 1, seed=1)
    with pytest.raises(CheckpointException) as info:
        _save(s3, 1, seed=2, overwrite=True)
    refused = [e for e in _inner(info.value) if isinstance(e, ConfigurationError)]
    assert refused and "If-Match" in str(refused[0]) and refused[0].details["missing"] == "If-Match"
    assert _marker(s3, 1)["save_id"] == first.save_id


def test_a_refused_probe_delete_is_harmless_and_the_probes_stay_in_the_attempt(s3_moto, caplog):
    s3 = s3_moto
    s3.proxy.fail("DELETE", r"\.dcp-atomic-probe-", status=403, code="AccessDenied")
    with caplog.at_level(logging.WARNING, logger="dcp_atomic"):
        writer = _save(s3, 1, seed=1)
    assert _marker(s3, 1)["save_id"] == writer.save_id
    left = sorted(k for k in s3.keys() if ".dcp-atomic-probe-" in k)
    attempt = f"{RUN}/step_0000000001/{writer.save_id}/"  # the conditional probe, and the data probe under _d00
    assert len(left) == 2 and left[0].startswith("_d00/" + attempt) and left[1].startswith(attempt), left
    assert any("could not delete the probe object" in r.getMessage() for r in caplog.records)


def test_a_botocore_that_drops_conditional_parameters_is_refused_at_start(monkeypatch):
    monkeypatch.setattr("dcp_atomic.stores.s3._put_object_parameters", {"IfNoneMatch"})
    options = {"endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s"}
    with pytest.raises(ConfigurationError, match=rf"does not know IfMatch on PutObject.*botocore >= {MIN_BOTOCORE}"):
        open_storage("s3://bucket/p", options)
    assert open_storage("s3://bucket/p", {**options, "dcp_atomic_unsafe_single_writer": True})


# -- https, checksums, Content-MD5 -------------------------------------------------------------------------


def test_https_store_rejecting_aws_chunked_works_with_the_checksum_switch(s3_tls):
    s3 = s3_tls
    assert s3.proxy.url.startswith("https://")
    switch = {"dcp_atomic_checksum_mode": "when_required"}
    if s3.name == "moto":  # botocore's default over https: aws-chunked bodies with trailing checksums
        _save(s3, 1, seed=1, big=True)
        assert any("aws-chunked" in r.headers.get("content-encoding", "") for r in s3.proxy.requests("UPLOAD_PART"))
        _assert_loads(s3, 1, seed=1, big=True)
    else:  # SeaweedFS misreads them as bad credentials (403 InvalidAccessKeyId): the probe says so, switch named
        with pytest.raises(CheckpointException) as info:
            _save(s3, 1, seed=1)
        refused = [e for e in _inner(info.value) if isinstance(e, ConfigurationError)]
        assert refused and refused[0].details["cause"] == "checksum", _inner(info.value)
        assert "dcp_atomic_checksum_mode" in str(refused[0])
        _save(s3, 1, seed=1, options=s3.options(**switch))
    s3.proxy.reject_chunked = True
    with pytest.raises(CheckpointException) as info:
        _save(s3, 2, seed=2, options=s3.options(dcp_atomic_unsafe_single_writer=True))
    assert "dcp_atomic_checksum_mode" in " ".join(str(e) for e in _inner(info.value)), _inner(info.value)
    s3.proxy.records.clear()
    _save(s3, 3, seed=3, big=True, options=s3.options(**switch))
    _assert_loads(s3, 3, seed=3, big=True, options=s3.options(**switch))
    assert s3.proxy.requests("UPLOAD_PART") and not any(r.injected for r in s3.proxy.records)


def test_a_fresh_root_over_https_without_the_switch_fails_in_the_probe_naming_it(s3_tls):
    s3 = s3_tls
    s3.proxy.reject_chunked = True
    with pytest.raises(CheckpointException) as info:
        _save(s3, 1, seed=1)
    refused = [e for e in _inner(info.value) if isinstance(e, ConfigurationError)]
    assert refused and refused[0].details["cause"] == "checksum" and "dcp_atomic_checksum_mode" in str(refused[0])


def test_delete_objects_carries_content_md5(s3):
    s3.proxy.require_content_md5 = True
    storage = open_storage(s3.root, s3.options())
    for name in ("a", "b"):
        storage.publish(storage.join(storage.root, "x", name), b"data")
    storage.remove(storage.join(storage.root, "x"))
    assert s3.keys() == [] and all("content-md5" in r.headers for r in s3.proxy.requests("DELETE_OBJECTS"))


# -- gc -------------------------------------------------------------------------------------------------------


def test_gc_aborts_uploads_on_a_store_without_prefix_filtering_and_stops_on_a_broken_truncation(s3_moto, caplog):
    s3 = s3_moto
    inside = [s3.client.create_multipart_upload(Bucket=s3.bucket, Key=f"{s3.prefix}/{RUN}/step_0000000001/{n}")
              for n in ("a/__0_0.distcp", "b/__1_0.distcp")]
    outside = s3.client.create_multipart_upload(Bucket=s3.bucket, Key=f"{s3.prefix}/other/__0_0.distcp")
    empty = re.compile(rb"<Upload>.*</Upload>", re.S)
    # MinIO-like: a prefix that is not a whole key matches nothing
    s3.proxy.rewrite("LIST_UPLOADS", lambda query, body: empty.sub(b"", body) if query.get("prefix", [""])[0] else body)
    storage = open_storage(s3.root, s3.options())
    run_dir = RunLayout(storage, RUN).run_dir
    aborted = abort_stale_uploads(storage, run_dir, older_than_s=0)
    assert sorted(a.upload_id for a in aborted) == sorted(u["UploadId"] for u in inside)
    assert [u["UploadId"] for u in s3.uploads()] == [outside["UploadId"]]

    pages = []

    def truncated_without_marker(query, body):  # gives up after 20 pages so a looping client still ends
        pages.append(query)
        if len(pages) > 20:
            return body
        body = re.sub(rb"<IsTruncated>\w+</IsTruncated>", b"<IsTruncated>true</IsTruncated>", body)
        return re.sub(rb"<Next(KeyMarker|UploadIdMarker)>[^<]*</Next\1>|<Next(KeyMarker|UploadIdMarker)/>", b"", body)

    s3.proxy.rewrite("LIST_UPLOADS", truncated_without_marker)
    with caplog.at_level(logging.WARNING, logger="dcp_atomic.s3"):
        assert abort_stale_uploads(storage, run_dir, older_than_s=0) == []
    assert len(pages) == 1, "a truncated reply without a next marker must end the listing"
    assert any("no new continuation marker" in r.getMessage() for r in caplog.records)
