"""One error type for every bad argument of the public API: ``ArgumentError``, a ``CheckpointError`` naming the
argument, what it got and what it accepts; a wrong type is an ``ArgumentTypeError``, also a ``TypeError``.  Both stay
``ValueError``s, as the run id, step, root and parallelism checks raised before, so old ``except`` clauses still hold.

The walk below gives each public constructor and function a bad value of each argument it checks, one at a time,
through the top-level names a user imports."""

from __future__ import annotations

import os
import pickle

import pytest

import dcp_atomic
from dcp_atomic.stores.backends import register_backend
from dcp_atomic import (ArgumentError, ArgumentTypeError, AtomicSavePlanner, AtomicStorageReader, AtomicStorageWriter,
                        Callbacks, CheckpointError, CheckpointManager, LocalTierOptions, Parallelism, latest_step,
                        list_steps, resume_point)

RUN = "args"
STEP = 1

# (the call, given the root; the argument it names; the bad value as given; whether it is of the wrong type)
CASES = [
    (lambda root: AtomicStorageWriter(root, RUN, STEP, thread_count=0), "thread_count", 0, False),
    (lambda root: AtomicStorageWriter(root, RUN, STEP, thread_count="4"), "thread_count", "4", True),
    (lambda root: AtomicStorageWriter(root, RUN, STEP, timeout=-1), "timeout", -1, False),
    (lambda root: AtomicStorageWriter(root, RUN, STEP, timeout="5"), "timeout", "5", True),
    (lambda root: AtomicStorageWriter(root, RUN, STEP, overwrite="no"), "overwrite", "no", True),
    (lambda root: AtomicStorageWriter(root, RUN, STEP, stock_readable=1), "stock_readable", 1, True),
    (lambda root: AtomicStorageWriter(root, RUN, STEP, block_size=0), "block_size", 0, False),
    (lambda root: AtomicStorageWriter(root, RUN, STEP, reuse="yes"), "reuse", "yes", True),
    (lambda root: AtomicStorageWriter(root, RUN, STEP, compression="lz4"), "compression", "lz4", False),
    (lambda root: AtomicStorageWriter(root, RUN, STEP, parallelism={"tp": 2}), "parallelism", {"tp": 2}, True),
    (lambda root: AtomicStorageWriter(root, RUN, -1), "step", -1, False),
    (lambda root: AtomicStorageWriter(root, RUN, "1"), "step", "1", True),
    (lambda root: AtomicStorageWriter(root, "../escape", STEP), "run_id", "../escape", False),
    (lambda root: AtomicStorageWriter(root, 7, STEP), "run_id", 7, True),
    (lambda root: AtomicStorageWriter("", RUN, STEP), "root", "", False),
    (lambda root: AtomicStorageWriter(7, RUN, STEP), "root", 7, True),
    (lambda root: AtomicStorageWriter(root, RUN, STEP, storage_options="{}"), "storage_options", "{}", True),
    (lambda root: AtomicStorageWriter(root, RUN, STEP).reset(os.path.join(root, "x")), "checkpoint_id",
     None, False),
    (lambda root: AtomicStorageWriter(root, RUN, STEP).reset(7), "checkpoint_id", 7, True),
    (lambda root: AtomicStorageReader(root, RUN, STEP, verify="no"), "verify", "no", True),
    (lambda root: AtomicStorageReader(root, RUN, STEP, allow_reshard=1), "allow_reshard", 1, True),
    (lambda root: AtomicStorageReader(root, RUN, STEP, share_reads="false"), "share_reads", "false", True),
    (lambda root: AtomicStorageReader(root, RUN, STEP, thread_count=0), "thread_count", 0, False),
    (lambda root: AtomicStorageReader(root, RUN, STEP, timeout=float("nan")), "timeout", float("nan"), False),
    (lambda root: AtomicStorageReader(root, RUN, STEP, share_buffer_bytes=0), "share_buffer_bytes", 0, False),
    (lambda root: AtomicStorageReader(root, RUN, STEP, save_sequence=-1), "save_sequence", -1, False),
    (lambda root: AtomicStorageReader(root, RUN, STEP, save_id="latest"), "save_id", "latest", False),
    (lambda root: AtomicStorageReader(root, RUN, -3), "step", -3, False),
    (lambda root: AtomicStorageReader(root, RUN, STEP, parallelism=2), "parallelism", 2, True),
    (lambda root: AtomicStorageReader(root, "a/b"), "run_id", "a/b", False),
    (lambda root: AtomicSavePlanner(divergence="ignore"), "divergence", "ignore", False),
    (lambda root: CheckpointManager(root, RUN, keep_last=0), "keep_last", 0, False),
    (lambda root: CheckpointManager(root, RUN, thread_count=2.0), "thread_count", 2.0, True),
    (lambda root: CheckpointManager(root, RUN, timeout=0), "timeout", 0, False),
    (lambda root: CheckpointManager(root, RUN, work_timeout=-5), "work_timeout", -5, False),
    (lambda root: CheckpointManager(root, RUN, lease_seconds=float("inf")), "lease_seconds", float("inf"), False),
    (lambda root: CheckpointManager(root, RUN, allow_divergence="yes"), "allow_divergence", "yes", True),
    (lambda root: CheckpointManager(root, RUN, share_reads=0), "share_reads", 0, True),
    (lambda root: CheckpointManager(root, RUN, reuse="no"), "reuse", "no", True),
    (lambda root: CheckpointManager(root, RUN, parallelism="tp=2"), "parallelism", "tp=2", True),
    (lambda root: CheckpointManager(root, ".hidden"), "run_id", ".hidden", False),
    (lambda root: CheckpointManager("", RUN), "root", "", False),
    (lambda root: CheckpointManager(root, RUN).save(-1, {}), "step", -1, False),
    (lambda root: CheckpointManager(root, RUN).async_save("2", {}), "step", "2", True),
    (lambda root: CheckpointManager(root, RUN).save(STEP, {}, durable="yes"), "durable", "yes", True),
    (lambda root: CheckpointManager(root, RUN).load({}, step=-2), "step", -2, False),
    (lambda root: CheckpointManager(root, RUN).load({}, step=STEP, save_id="x"), "save_id", "x", False),
    (lambda root: CheckpointManager(root, RUN).load({}, save_id="20260101T000000Z-deadbeef"), "save_id",
     "20260101T000000Z-deadbeef", False),
    (lambda root: CheckpointManager(root, RUN).steps(tier="all"), "tier", "all", False),
    (lambda root: LocalTierOptions(local_root=""), "local_root", "", False),
    (lambda root: LocalTierOptions(local_root=root, keep_local=0), "keep_local", 0, False),
    (lambda root: LocalTierOptions(local_root=root, durable_every=0), "durable_every", 0, False),
    (lambda root: LocalTierOptions(local_root=root, replicas=-1), "replicas", -1, False),
    (lambda root: LocalTierOptions(local_root=root, replicas="1"), "replicas", "1", True),
    (lambda root: LocalTierOptions(local_root=root, failure_domain=3), "failure_domain", 3, True),
    (lambda root: Callbacks(on_saved="log"), "on_saved", "log", True),
    (lambda root: Callbacks(on_drained=1), "on_drained", 1, True),
    (lambda root: Parallelism(tp=0), "tp", 0, False),
    (lambda root: Parallelism(dp="2"), "dp", "2", True),
    (lambda root: Parallelism(dp=2, ep=3), "ep", 3, False),
    (lambda root: list_steps("", RUN), "root", "", False),
    (lambda root: list_steps(root, "../x"), "run_id", "../x", False),
    (lambda root: list_steps(root, RUN, storage_options=[]), "storage_options", [], True),
    (lambda root: latest_step(root, RUN, timeout=0), "timeout", 0, False),
    (lambda root: latest_step(root, RUN, repair="no"), "repair", "no", True),
    (lambda root: latest_step(root, None), "run_id", None, True),
    (lambda root: resume_point(root, RUN, -1), "step", -1, False),
    (lambda root: register_backend("team://", "team_sdk:Store"), "scheme", "team://", False),
    (lambda root: register_backend("team", "team_sdk.Store"), "target", "team_sdk.Store", False),
]


@pytest.mark.parametrize("call, argument, value, wrong_type", CASES,
                         ids=[f"{i}-{case[1]}={case[2]!r}" for i, case in enumerate(CASES)])
def test_every_bad_argument_is_an_argument_error_naming_it_what_it_got_and_what_it_accepts(
        root, call, argument, value, wrong_type):
    with pytest.raises(CheckpointError) as refused:
        call(root)
    error = refused.value
    assert type(error) is (ArgumentTypeError if wrong_type else ArgumentError), repr(error)
    assert argument in error.details["argument"], error.details
    assert f"{error.details['argument']} must be " in error.message, error.message  # what it accepts
    if value is not None:
        assert f"got {value!r}" in error.message, error.message
    assert isinstance(error, ValueError), "what a bad value raised before: old `except ValueError` still catch it"
    assert isinstance(error, TypeError) is wrong_type, "`except TypeError` catches a wrong type, and only that"
    again = pickle.loads(pickle.dumps(error))  # DCP carries errors from rank to rank pickled
    assert type(again) is type(error) and again.details == error.details and str(again) == str(error)


def test_the_argument_errors_are_public_names():
    assert {"ArgumentError", "ArgumentTypeError"} <= set(dcp_atomic.__all__)
    assert issubclass(ArgumentTypeError, ArgumentError) and issubclass(ArgumentError, dcp_atomic.ConfigurationError)
