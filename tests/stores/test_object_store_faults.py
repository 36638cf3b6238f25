"""Object stores say exactly what happened (G7), on moto behind the fault proxy.

Each test names the behaviour it proves and fails without it: a marker PUT
cancelled unanswered and applied later is not reported "not committed"; the
stall deadline, not s3fs's 15 s read timeout, decides when a slow reply is
given up; a refused write where the data goes is found by the probe and named;
a request's retry budget starts when it is sent, not while it queues; a lost
CreateMultipartUpload reply leaves no orphan upload.  Stalls are a few seconds
against stall deadlines of one or two.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_atomic import AtomicStorageWriter, ConfigurationError, StorageError, latest_step
from dcp_atomic.stores.backends import open_storage

RUN = "exp"
pytestmark = pytest.mark.timeout(120)


def _state(seed: int) -> dict:
    return {"w": torch.arange(1000, dtype=torch.float32) + seed, "meta": {"seed": seed}}


def _save(s3, step: int, seed: int, **options) -> AtomicStorageWriter:
    writer = AtomicStorageWriter(s3.root, RUN, step, timeout=20, storage_options=s3.options(**options))
    dcp.save(_state(seed), storage_writer=writer)
    return writer


def _inner(exc: BaseException) -> list[BaseException]:
    return [w[0] if isinstance(w, tuple) else w for w in getattr(exc, "failures", {}).values()]


def _marker_save_id(s3, step: int) -> str:
    import json

    return json.loads(s3.get(f"{RUN}/step_{step:010d}/COMMITTED"))["save_id"]


# -- a marker PUT cancelled unanswered ---------------------------------------------------------


def test_a_marker_put_cancelled_unanswered_and_applied_later_is_not_reported_uncommitted(s3_moto):
    s3 = s3_moto
    _save(s3, 1, seed=1)
    marker = r"step_0000000002/COMMITTED$"
    # the first marker PUT is held 3 s, then applied; the client gave up after 1 s and its retries meet 503s
    s3.proxy.fail("PUT", marker, status=None, stall_s=3, times=1)
    s3.proxy.fail("PUT", marker, status=503, code="SlowDown")
    writer = _save(s3, 2, seed=2, dcp_atomic_stall_timeout_s=1, dcp_atomic_retry_budget_s=1.5,
                   dcp_atomic_max_attempts=None, dcp_atomic_max_backoff_s=0.2)
    assert _marker_save_id(s3, 2) == writer.save_id
    assert latest_step(s3.root, RUN, s3.options()) == 2


def test_a_marker_put_cancelled_unanswered_and_never_applied_is_reported_unknown(s3_moto):
    s3 = s3_moto
    _save(s3, 1, seed=1)
    marker = r"step_0000000002/COMMITTED$"
    s3.proxy.fail("PUT", marker, status=503, code="SlowDown", stall_s=2, times=1)  # held, then refused: never applied
    s3.proxy.fail("PUT", marker, status=503, code="SlowDown")
    with pytest.raises(CheckpointException) as info:
        _save(s3, 2, seed=2, dcp_atomic_stall_timeout_s=1, dcp_atomic_retry_budget_s=1.5,
              dcp_atomic_max_attempts=None, dcp_atomic_max_backoff_s=0.2)
    errors = [e for e in _inner(info.value) if isinstance(e, StorageError)]
    assert errors and errors[0].details["committed"] is None, _inner(info.value)
    message = str(errors[0])
    assert "UNKNOWN" in message and "dcp-atomic show" in message and "not committed" not in message, message
    assert errors[0].details["unanswered"] >= 1


# -- the stall deadline, not s3fs's read timeout -----------------------------------------------


def test_the_stall_deadline_sets_the_clients_socket_timeouts(s3_moto):
    storage = open_storage(s3_moto.root, s3_moto.options(dcp_atomic_stall_timeout_s=30))
    storage._run(storage.fs.set_session())
    config = storage.fs.s3.meta.config
    assert config.read_timeout >= 30 + (5 << 20) / (256 << 10), config.read_timeout  # a whole part's deadline
    assert config.connect_timeout <= 10
    explicit = open_storage(s3_moto.root, s3_moto.options(config_kwargs={"read_timeout": 7}))
    explicit._run(explicit.fs.set_session())
    assert explicit.fs.s3.meta.config.read_timeout == 7, "an explicit config_kwargs value wins"


def test_a_reply_slower_than_s3fs_read_timeout_but_within_the_stall_deadline_is_awaited(s3_moto, monkeypatch):
    import s3fs

    s3 = s3_moto
    monkeypatch.setattr(s3fs.S3FileSystem, "read_timeout", 1)  # s3fs's 15 s, scaled down with the stall
    s3.proxy.fail("PUT", r"slow\.bin$", status=None, stall_s=2.5, times=1)
    storage = open_storage(s3.root, s3.options(dcp_atomic_stall_timeout_s=5, dcp_atomic_max_attempts=1))
    storage.publish(storage.join(storage.root, "slow.bin"), b"x" * 100)
    assert [r.status for r in s3.proxy.requests("PUT", r"slow\.bin$")] == [200], "one request, never resent"


def test_requests_that_keep_stalling_name_the_stall_knob(s3_moto):
    s3 = s3_moto
    s3.proxy.fail("PUT", r"stuck\.bin$", status=None, stall_s=2.5)
    storage = open_storage(s3.root, s3.options(dcp_atomic_stall_timeout_s=1, dcp_atomic_retry_budget_s=2,
                                               dcp_atomic_max_attempts=None))
    with pytest.raises(StorageError) as info:
        storage.publish(storage.join(storage.root, "stuck.bin"), b"x")
    assert "dcp_atomic_stall_timeout_s (now 1)" in str(info.value) and "kept stalling" in str(info.value)


# -- writes where the data goes ------------------------------------------------------------------


def test_credentials_scoped_to_the_run_are_refused_before_any_data_naming_the_data_prefixes(s3_moto):
    s3 = s3_moto
    s3.proxy.fail("PUT", r"/_d[0-9a-f]{2}/", status=403, code="AccessDenied", message="Access Denied")
    with pytest.raises(CheckpointException) as info:
        _save(s3, 1, seed=1)
    refused = [e for e in _inner(info.value) if isinstance(e, ConfigurationError)]
    assert refused, _inner(info.value)
    message = str(refused[0])
    assert f"arn:aws:s3:::{s3.bucket}/ckpt/_d*/{RUN}/*" in message and "dcp_atomic_data_prefixes" in message, message
    assert not s3.proxy.requests("PUT", r"\.distcp$") and not s3.proxy.requests("CREATE_MPU"), "no data was sent"
    writer = _save(s3, 1, seed=1, dcp_atomic_data_prefixes=0)  # the advice works
    assert _marker_save_id(s3, 1) == writer.save_id


def test_a_refused_data_put_names_the_data_prefixes(s3_moto):
    s3 = s3_moto
    s3.proxy.fail("PUT", r"/_d[0-9a-f]{2}/.*\.distcp$", status=403, code="AccessDenied", message="Access Denied")
    with pytest.raises(CheckpointException) as info:
        _save(s3, 1, seed=1)
    errors = [e for e in _inner(info.value) if isinstance(e, StorageError)]
    assert errors and "hashed prefixes" in str(errors[0]) and "_d*" in str(errors[0]), _inner(info.value)


# -- the budget starts when the request is sent ----------------------------------------------------


def test_a_queued_request_gets_its_whole_budget_after_it_is_sent(s3_moto):
    s3 = s3_moto
    s3.put("a.bin", b"a")
    s3.put("b.bin", b"b")
    s3.proxy.fail("GET", r"a\.bin$", status=None, stall_s=2, times=1)  # holds the rank's only slot for 2 s
    s3.proxy.fail("GET", r"b\.bin$", status=503, code="SlowDown", times=1)
    storage = open_storage(s3.root, s3.options(dcp_atomic_max_concurrency=1, dcp_atomic_retry_budget_s=1,
                                               dcp_atomic_max_attempts=None))
    results: dict[str, object] = {}

    def read(name: str) -> None:
        try:
            results[name] = storage.read_file(storage.join(storage.root, name))
        except Exception as e:  # noqa: BLE001 - asserted below
            results[name] = e

    first = threading.Thread(target=read, args=("a.bin",))
    first.start()
    time.sleep(0.3)  # b.bin queues behind a.bin for ~1.7 s: longer than its budget
    read("b.bin")
    first.join(30)
    assert results == {"a.bin": b"a", "b.bin": b"b"}, results


# -- a lost CreateMultipartUpload reply -----------------------------------------------------------


def test_a_lost_create_multipart_reply_leaves_no_orphan_upload(s3_moto):
    s3 = s3_moto
    s3.proxy.fail("CREATE_MPU", status=500, code="InternalError", times=1, after_forward=True)
    storage = open_storage(s3.root, s3.options())
    stream = storage.open_write(storage.join(storage.root, "big.bin"))
    stream.write(b"x" * (11 << 20))
    storage.close_write(stream)
    assert [r.status for r in s3.proxy.requests("CREATE_MPU")] == [500, 200]
    assert s3.uploads() == [], "the upload the lost reply created was aborted"
    assert len(s3.get("big.bin")) == 11 << 20


# -- the CLI takes object-store options from a file or the environment -------------------------------------------


def test_cli_takes_storage_options_from_a_file_or_the_environment(s3_moto, tmp_path, monkeypatch, capsys):
    import json

    from dcp_atomic.tools import cli

    s3 = s3_moto
    _save(s3, 1, seed=1)
    options = tmp_path / "s3.json"
    options.write_text(json.dumps(s3.options()))
    monkeypatch.delenv(cli.STORAGE_OPTIONS_ENV, raising=False)
    assert cli.main(["--json", "--storage-options", f"@{options}", "ls", s3.root, RUN]) == 0
    from_file = capsys.readouterr().out
    assert json.loads(from_file), from_file
    monkeypatch.setenv(cli.STORAGE_OPTIONS_ENV, json.dumps(s3.options()))
    assert cli.main(["--json", "ls", s3.root, RUN]) == 0
    assert capsys.readouterr().out == from_file, "the environment gives the same options"
    monkeypatch.setenv(cli.STORAGE_OPTIONS_ENV, f"@{options}")
    assert cli.main(["--json", "ls", s3.root, RUN]) == 0 and capsys.readouterr().out == from_file
    monkeypatch.delenv(cli.STORAGE_OPTIONS_ENV)
    assert cli.main(["--storage-options", f"@{tmp_path / 'missing.json'}", "ls", s3.root, RUN]) == 2
    assert "cannot read storage options" in "".join(capsys.readouterr())
