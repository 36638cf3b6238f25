"""Loads that say exactly what happened:

* a ``no_dist`` load in a multi-rank job cannot resolve ``LATEST`` on its own on each rank: it must pin a save_id;
* a peer killed during a plain ``dcp.load`` with ``share_reads`` surfaces as the typed RankFailureError naming
  it, on every surviving rank, not as gloo's untyped error;
* a ``.metadata`` whose dtype differs from the manifest's record is refused, in every format;
* a manager load whose non-zero rank dies is blamed on that rank, not on rank 0's store.
"""

from __future__ import annotations

import pytest

from tests.harness import assert_all_ok, run_world

RUN = "exp"

pytestmark = pytest.mark.timeout(300)


# -- no_dist loads in a multi-rank job --------------------------------------------------------------------


def _lone_loads(ctx):
    """Every rank saves step 1 and 2, then loads alone (no_dist): LATEST, an explicit step, a checkpoint_id."""
    import torch
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageReader, AtomicStorageWriter

    for step in (1, 2):
        dcp.save({"x": torch.full((4,), float(step))}, storage_writer=AtomicStorageWriter(ctx.root, RUN, step))
    outcome = {}
    pinned = AtomicStorageReader(ctx.root, RUN, 1).resolve().save_id  # what `dcp-atomic show` prints
    for name, reader, kwargs in (
            ("latest", AtomicStorageReader(ctx.root, RUN), {}),
            ("step", AtomicStorageReader(ctx.root, RUN, 1), {}),
            ("checkpoint_id", AtomicStorageReader(), {"checkpoint_id": f"{ctx.root}/{RUN}/step_1"}),
            ("pinned", AtomicStorageReader(ctx.root, RUN, 1, save_id=pinned), {}),
            ("pinned_id", AtomicStorageReader(save_id=pinned), {"checkpoint_id": f"{ctx.root}/{RUN}/step_1"})):
        got = {"x": torch.zeros(4)}
        try:
            dcp.load(got, storage_reader=reader, no_dist=True, **kwargs)
            outcome[name] = ("loaded", got["x"].tolist())
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            ours = _ours(e)
            outcome[name] = (type(ours).__name__, str(ours))
    return outcome


def _ours(error: BaseException) -> BaseException:
    """Our typed error, wherever DCP put it (its CheckpointException keeps each rank's as (error, traceback))."""
    from dcp_atomic import CheckpointError

    stack = [error]
    while stack:
        e = stack.pop()
        e = e[0] if isinstance(e, tuple) else e
        if isinstance(e, CheckpointError):
            return e
        stack += list((getattr(e, "failures", None) or {}).values())
    return error


def test_a_no_dist_load_in_a_multi_rank_job_must_pin_a_save_id_and_a_pinned_one_loads(root):
    """A step number does not pin a version (a re-save between two ranks' loads): the latest, a step and a
    checkpoint_id are refused, saying how to get the save_id; step and save_id together load."""
    for outcome in assert_all_ok(run_world(_lone_loads, 2, root, timeout=120)):
        for name in ("latest", "step", "checkpoint_id"):
            kind, text = outcome[name]
            assert kind == "ConfigurationError", (name, outcome)
            assert "no_dist=True" in text and "save_id" in text and "dcp-atomic show" in text, text
        assert outcome["pinned"] == outcome["pinned_id"] == ("loaded", [1.0] * 4), outcome


# -- a .metadata whose dtype is not the manifest's --------------------------------------------------------

FORMATS = {"raw": {}, "zstd": {"compression": "zstd"}, "stock_readable": {"stock_readable": True}}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("key,relabel", [("weight", "int32"), ("ids", "float32"), ("norm", "float16"),
                                         ("half", "bfloat16")])
def test_a_metadata_dtype_that_differs_from_the_manifest_is_refused_naming_key_dtypes_and_path(root, fmt, key,
                                                                                                relabel):
    import torch
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageReader, AtomicStorageWriter, CorruptCheckpointError
    from tests.helpers.sealed import Sealed

    g = torch.Generator().manual_seed(5)
    state = {"weight": torch.randn(64, 3, generator=g), "ids": torch.arange(50, dtype=torch.int32),
             "norm": torch.randn(33, generator=g).to(torch.bfloat16),
             "half": torch.randn(20, generator=g).to(torch.float16)}
    dcp.save(state, storage_writer=AtomicStorageWriter(root, RUN, 1, **FORMATS[fmt]))
    ck = Sealed(root, 1)
    metadata = ck.metadata()
    before = metadata.state_dict_metadata[key].properties.dtype
    metadata.state_dict_metadata[key].properties.dtype = getattr(torch, relabel)
    assert getattr(torch, relabel).itemsize == before.itemsize  # every size check still passes
    ck.write_metadata(metadata)
    with pytest.raises(CorruptCheckpointError) as caught:
        AtomicStorageReader(root, RUN, 1).resolve()
    text = str(caught.value)
    assert repr(key) in text and f"torch.{relabel}" in text and str(before) in text, text
    assert ck.metadata_path in text and caught.value.details["keys"] == [key], text
    got = {k: torch.full_like(v, -3) for k, v in state.items()}
    with pytest.raises(BaseException) as through_dcp:  # torch wraps read_metadata's error in an AssertionError
        dcp.load(got, storage_reader=AtomicStorageReader(root, RUN, 1))
    assert "CorruptCheckpointError" in str(through_dcp.value) and repr(key) in str(through_dcp.value)
    assert all(bool((v == -3).all()) for v in got.values()), "nothing may be loaded"


# -- plain dcp.load with share_reads, a peer killed mid-exchange --------------------------------------------


def _plain_shared_load_with_a_killed_peer(ctx):
    import time

    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageReader, AtomicStorageWriter
    from dcp_atomic._base import failpoints
    from tests.helpers.read_once import _blank, _state, _survivors_barrier

    dcp.save(_state(ctx.rank, 1), storage_writer=AtomicStorageWriter(ctx.root, RUN, 1, timeout=30))
    failpoints.arm("read.exchange_send", "kill", rank=2)
    started = time.monotonic()
    try:
        # timeout: the survivors' check-in window when blaming a peer; 6 s was once too short for a loaded 2-core CI
        dcp.load(_blank(ctx.rank), storage_reader=AtomicStorageReader(ctx.root, RUN, 1, timeout=12, share_reads=True))
        outcome, details = ("loaded", ""), {}
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        outcome, details = (type(e).__name__, str(e)), dict(getattr(e, "details", {}))
    seconds = time.monotonic() - started
    _survivors_barrier(ctx, parties=[0, 1, 3])  # rank 0 hosts the store: it must outlive its peers' verdicts
    return outcome, seconds, details


def test_a_peer_killed_during_a_plain_shared_load_reaches_every_survivor_as_a_rank_failure_naming_it(root):
    outcomes = run_world(_plain_shared_load_with_a_killed_peer, 4, root, timeout=150, pg_timeout=60,
                         wait_for=[0, 1, 3])
    assert outcomes[2].killed
    for outcome in (o for o in outcomes if o.rank != 2):
        assert outcome.ok, outcome.error
        (kind, text), seconds, details = outcome.value
        # raised by dcp.load itself, not gloo's: the exchange's PeerLost, a RankFailureError that pickles
        assert kind == "PeerLost", (outcome.rank, kind, text)
        assert "Silent rank(s): 2 " in text and details["silent"] == "2", text
        assert seconds < 30, seconds  # well inside the 60 s group timeout: nobody waits it out


# -- a manager load whose non-zero rank dies names that rank -----------------------------------------------


def _manager_load_with_rank1_killed(ctx, hook: str):
    """Rank 1 is SIGKILLed as its load starts: in ``resolve`` (before the manager's barriers) or in
    ``prepare_local_plan`` (inside DCP's planning, where only the process group sees it)."""
    import os
    import signal
    import time

    import torch

    from dcp_atomic import CheckpointManager
    from dcp_atomic.dcp import reader
    from tests.helpers.read_once import _survivors_barrier

    manager = CheckpointManager(ctx.root, RUN, timeout=4)
    manager.save(1, {"x": torch.ones(8)})
    if ctx.rank == 1:
        setattr(reader.AtomicStorageReader, hook, lambda *_: os.kill(os.getpid(), signal.SIGKILL))
    started = time.monotonic()
    try:
        manager.load({"x": torch.zeros(8)})
        outcome = ("loaded", "", {})
    except Exception as e:  # noqa: BLE001
        outcome = (type(e).__name__, str(e), dict(getattr(e, "details", {})))
    seconds = time.monotonic() - started
    _survivors_barrier(ctx, parties=[0, 2])
    return outcome, seconds


@pytest.mark.parametrize("hook", ["resolve", "prepare_local_plan"])
def test_a_manager_load_whose_rank_1_is_killed_blames_rank_1_not_rank_0(root, hook):
    outcomes = run_world(_manager_load_with_rank1_killed, 3, root, args=(hook,), timeout=120, wait_for=[0, 2])
    assert outcomes[1].killed
    for outcome in (outcomes[0], outcomes[2]):
        assert outcome.ok, outcome.error
        (kind, text, details), seconds = outcome.value
        assert kind == "RankFailureError", (kind, text)
        assert details["silent"].split(" ")[0] == "1" and "store" not in details["silent"], text
        assert seconds < 30, seconds
