"""Honest mistakes fail fast and clearly: a step that does not exist, a float checkpoint into an integer model,
arguments of the wrong kind (tried as a new user would)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_atomic import AtomicStorageReader, AtomicStorageWriter, CheckpointNotFoundError

RUN = "mistakes"


def _save(root, step, state):
    dcp.save(state, storage_writer=AtomicStorageWriter(root, RUN, step), no_dist=True)


def test_a_step_that_does_not_exist_on_a_local_disk_is_not_found_at_once_and_the_error_says_how_to_list_steps(
        tmp_path):
    """On a filesystem of this machine (tmp_path: no client cache) a missing step directory is missing: refused at
    once, not after the 120 s a step another node may be writing on NFS is waited for."""
    import time

    root = str(tmp_path)
    _save(root, 1, {"w": torch.arange(4.0)})
    started = time.monotonic()
    with pytest.raises(CheckpointNotFoundError) as refused:
        AtomicStorageReader(root, RUN, 99, timeout=120).resolve()  # what dcp.load's read_metadata calls
    assert time.monotonic() - started < 30, "waited for a step no cache can hide"
    assert "step 99 of run 'mistakes' is not committed" in str(refused.value), refused.value
    assert "does not exist" in str(refused.value) and "dcp-atomic ls" in str(refused.value), refused.value


def test_a_step_not_visible_through_a_fuse_mount_is_waited_for_and_the_wait_is_announced(caplog):
    """Through a FUSE mount (an NFS-like client, as tests/stores/test_stale_cache.py builds) a step directory this process
    cannot see may be one another node just wrote: it is waited for; the wait is announced at once and the error at
    the deadline says the directory never appeared and how to list what exists."""
    import logging

    from tests.fault_fixtures import nfs_clients_ctx

    with nfs_clients_ctx() as nfs:
        client = nfs.a.path
        _save(client, 1, {"w": torch.arange(4.0)})
        with caplog.at_level(logging.WARNING, logger="dcp_atomic"):
            with pytest.raises(CheckpointNotFoundError) as refused:
                AtomicStorageReader(client, RUN, 99, timeout=1).resolve()
    assert any("step 99 of run 'mistakes' is not visible" in r.getMessage() and "shorter timeout=" in r.getMessage()
               for r in caplog.records), caplog.text
    assert "never appeared here" in str(refused.value) and "dcp-atomic ls" in str(refused.value), refused.value


def _into(target_dtype):
    return {"w": torch.zeros(8, dtype=target_dtype), "count": torch.zeros(2, dtype=torch.int64)}


def _load_casting(ctx, target_dtype):
    from dcp_atomic import CheckpointManager, ReshardError

    with CheckpointManager(ctx.root, RUN, timeout=20, share_reads=True) as manager:  # shared reads: world 2
        if target_dtype is None:
            manager.save(1, {"w": torch.linspace(-2.5, 2.5, 8), "count": torch.tensor([3, 4])})
            return None
        state = _into(target_dtype)
        try:
            manager.load(state, step=1)
        except ReshardError as e:
            return {"refused": str(e), "keys": e.details.get("keys"), "w": state["w"]}
        return {"refused": None, "w": state["w"], "count": state["count"]}


@pytest.mark.parametrize("target", [torch.int64, torch.int32, torch.bool])
def test_a_float_checkpoint_into_an_integer_or_bool_tensor_is_refused_by_name_and_nothing_is_loaded(root, target):
    from tests.harness import assert_all_ok, run_world

    assert_all_ok(run_world(_load_casting, 2, root, args=(None,), timeout=120))
    for out in assert_all_ok(run_world(_load_casting, 2, root, args=(target,), timeout=120)):
        assert out["refused"] and out["keys"] == ["w"], out  # the int64 'count' is fine
        assert "saved as torch.float32" in out["refused"] and str(target) in out["refused"], out["refused"]
        assert not out["w"].any(), "the refused load wrote into the target"


def test_float_to_float_casts_stay_allowed(root):
    from tests.harness import assert_all_ok, run_world

    assert_all_ok(run_world(_load_casting, 2, root, args=(None,), timeout=120))
    for out in assert_all_ok(run_world(_load_casting, 2, root, args=(torch.bfloat16,), timeout=120)):
        assert out["refused"] is None
        assert torch.equal(out["w"], torch.linspace(-2.5, 2.5, 8).to(torch.bfloat16))
        assert torch.equal(out["count"], torch.tensor([3, 4]))


@pytest.mark.parametrize("make, argument", [
    (lambda root: AtomicStorageWriter(root, RUN, 1, thread_count=0), "thread_count"),
    (lambda root: AtomicStorageWriter(root, RUN, 1, timeout=-1), "timeout"),
    (lambda root: AtomicStorageWriter(root, RUN, 1, overwrite="no"), "overwrite"),
    (lambda root: AtomicStorageReader(root, RUN, 1, verify="no"), "verify"),
    (lambda root: AtomicStorageReader(root, RUN, 1, timeout=float("nan")), "timeout"),
    (lambda root: AtomicStorageReader(root, RUN, 1, share_reads="false"), "share_reads"),
    (lambda root: __import__("dcp_atomic").CheckpointManager(root, RUN, thread_count=0), "thread_count"),
    (lambda root: __import__("dcp_atomic").CheckpointManager(root, RUN, timeout=0), "timeout"),
    (lambda root: __import__("dcp_atomic").CheckpointManager(root, RUN, allow_divergence="yes"), "allow_divergence"),
    (lambda root: __import__("dcp_atomic").CheckpointManager(root, RUN, keep_last=0), "keep_last"),
])
def test_arguments_of_the_wrong_kind_are_refused_at_construction_naming_the_argument(tmp_path, make, argument):
    from dcp_atomic import ArgumentError

    with pytest.raises(ArgumentError) as refused:
        make(str(tmp_path))
    assert f"({argument}=...)" in str(refused.value) and refused.value.details["argument"].endswith(f"({argument}=...)")
    assert isinstance(refused.value, ValueError)  # what such a mistake raised before, for callers that catch it


def test_list_steps_and_latest_step_of_a_root_that_does_not_exist_say_so(tmp_path):
    from dcp_atomic import latest_step, list_steps

    missing = str(tmp_path / "typo")
    for call in (list_steps, latest_step):
        with pytest.raises(CheckpointNotFoundError, match="does not exist"):
            call(missing, RUN)
    assert list_steps(str(tmp_path), "never-saved") == [] and latest_step(str(tmp_path), "never-saved") is None


@pytest.mark.parametrize("endpoint", ["refused", "http://no-such-host.invalid:9000"])
def test_an_s3_endpoint_that_cannot_be_reached_fails_in_seconds_with_the_endpoint_hint(endpoint):
    """The default retry options (no test-only short budget): a refused connection or an unknown host is a wrong
    endpoint_url, not throttling, and is not retried for the 600 s throttling budget."""
    import socket

    from dcp_atomic import StorageError, list_steps

    if endpoint == "refused":
        with socket.socket() as s:  # a port nothing listens on
            s.bind(("127.0.0.1", 0))
            endpoint = f"http://127.0.0.1:{s.getsockname()[1]}"
    options = {"endpoint_url": endpoint, "key": "k", "secret": "s", "client_kwargs": {"region_name": "us-east-1"}}
    started = time.monotonic()
    with pytest.raises(StorageError) as failed:
        list_steps("s3://bucket/ckpt", RUN, storage_options=options)
    assert time.monotonic() - started < 60, "an unreachable endpoint was retried like a throttling store"
    assert "cannot be reached" in str(failed.value) and "endpoint_url" in str(failed.value), failed.value
    assert endpoint in str(failed.value)


class _Opaque:  # a user's own class: pickled by DCP at save, refused by the weights-only allow-list at load
    def __init__(self, n):
        self.n = n


def test_saving_an_object_the_load_will_refuse_warns_at_save_naming_the_key_and_the_fix(tmp_path, caplog):
    import logging

    from dcp_atomic import UnsafeItemError

    root = str(tmp_path)
    with caplog.at_level(logging.WARNING, logger="dcp_atomic"):
        _save(root, 1, {"w": torch.ones(2), "extra": {"sampler": _Opaque(3)}, "plain": {"epoch": 2}})
    warned = [r.getMessage() for r in caplog.records if "a load will refuse" in r.getMessage()]
    assert len(warned) == 1 and "'extra.sampler'" in warned[0] and "add_safe_globals" in warned[0], warned
    from dcp_atomic import CheckpointManager

    with pytest.raises(UnsafeItemError), CheckpointManager(root, RUN, timeout=10) as manager:  # the warning was true
        manager.load({"w": torch.zeros(2), "extra": {"sampler": None}, "plain": {"epoch": 0}}, step=1)


def test_a_float_checkpoint_into_an_integer_tensor_is_refused_through_plain_dcp_load_with_the_planner(tmp_path):
    """Held as a user of plain dcp.load holds it (no manager): AtomicLoadPlanner refuses before any byte lands;
    DCP wraps the refusal, which still names the key."""
    from dcp_atomic import AtomicLoadPlanner

    root = str(tmp_path)
    _save(root, 1, {"w": torch.linspace(-1.5, 1.5, 6)})
    target = {"w": torch.zeros(6, dtype=torch.int64)}
    with pytest.raises(BaseException) as refused:  # DCP's CheckpointException is a BaseException
        dcp.load(target, storage_reader=AtomicStorageReader(root, RUN, 1), planner=AtomicLoadPlanner(), no_dist=True)
    assert "ReshardError" in str(refused.value) and "'w'" in str(refused.value), refused.value
    assert not target["w"].any()
    plain = {"w": torch.zeros(6, dtype=torch.bfloat16)}  # float to float: loads
    dcp.load(plain, storage_reader=AtomicStorageReader(root, RUN, 1), planner=AtomicLoadPlanner(), no_dist=True)
    assert torch.equal(plain["w"], torch.linspace(-1.5, 1.5, 6).to(torch.bfloat16))
