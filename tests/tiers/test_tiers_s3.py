"""Two tiers with the durable root on a real S3 server (P13): the drain under throttling, a stuck drain, a full disk.

The worlds of ``tests/tiers/test_tiers.py`` (4 ranks as 2 simulated nodes, each node's ``local_root`` its own tmpfs);
the durable root is an ``s3://`` URL on moto (the first test: and SeaweedFS) behind the fault proxy of
``tests/s3_servers.py``, which answers chosen PUTs with ``503 SlowDown`` or holds them.  The storms are counted
per request, not timed: the S3 layer tries each request ``S3_ATTEMPTS`` times, so ``S3_ATTEMPTS`` refusals of one
rank's data file fail exactly one drain attempt of that rank, whatever the machine's speed.
"""

from __future__ import annotations

import json
import os
import re

import pytest

from dcp_atomic import Callbacks
from dcp_atomic.tiers.drain import DRAIN_ATTEMPTS
from dcp_atomic._base import failpoints
from tests.fault_fixtures import small_tmpfs_ctx
from tests.harness import assert_all_ok
from tests.helpers.fsdp_app import _fsdp_app, _full, _train_step
from tests.helpers.tiers import RUN, WORLD, _exact, _Lines, _manager, _run, _state

S3_ATTEMPTS = 4  # dcp_atomic_max_attempts: one request's tries before the S3 layer gives up


def _options(s3):
    return s3.options(dcp_atomic_max_attempts=S3_ATTEMPTS)


def _data_key(step: int, rank: int) -> str:
    """The key (regex) of ``rank``'s data file of ``step`` in the durable root, whatever the attempt's save id."""
    return rf"/{RUN}/step_{step:010d}/[^/]+/__{rank}_0\.distcp$"


def _durable_steps(s3) -> list[int]:
    return sorted(int(m.group(1)) for key in s3.keys(RUN)
                  if (m := re.fullmatch(rf"{RUN}/step_(\d+)/COMMITTED", key)))


def _on_disk(ctx) -> list[int]:
    run_dir = os.path.join(ctx.extra["nodes"][ctx.rank // 2], RUN)
    return sorted(int(name[5:]) for name in os.listdir(run_dir) if name.startswith("step_"))


def _on_disk_after_retention(ctx) -> list[int]:
    """The node's steps once its leader has applied retention (it does so after the save returns)."""
    import torch.distributed as dist

    dist.barrier()
    return _on_disk(ctx)


def _local_marker(node_root, step):
    with open(os.path.join(node_root, RUN, f"step_{step:010d}", "COMMITTED")) as f:
        return json.load(f)


def _load_plain(ctx, options, step):
    """``step`` through a plain AtomicStorageReader, and the latest through a manager without local_root."""
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicLoadPlanner, AtomicStorageReader, CheckpointManager

    model, optim = _fsdp_app(ctx.world_size, 42)
    state = _state(model, optim, -1)
    dcp.load(state, storage_reader=AtomicStorageReader(ctx.root, run_id=RUN, step=step, storage_options=options),
             planner=AtomicLoadPlanner())
    plain = {"step": state["progress"]["step"], "full": _full(model)}
    model, optim = _fsdp_app(ctx.world_size, 43)
    state = _state(model, optim, -1)
    with CheckpointManager(ctx.root, RUN, timeout=20, storage_options=options) as durable:
        latest = durable.load(state)
    return {"plain": plain, "latest": latest, "full": _full(model)}


# -- a. a drained step is an ordinary durable step -----------------------------------------------------------------


def _drain_one(ctx, options):
    """Step 10 drained, step 20 local only."""
    model, optim = _fsdp_app(ctx.world_size, 0)
    drained, saved = [], {}
    with _manager(ctx, storage_options=options, callbacks=Callbacks(on_drained=drained.append)) as manager:
        for step, durable in ((10, True), (20, False)):
            _train_step(model, optim, step)
            manager.save(step, _state(model, optim, step), durable=durable)
            saved[step] = _full(model)
        manager.wait()
        listed = {tier: manager.steps(tier=tier) for tier in ("local", "durable")}
    return {"saved": saved, "drained": drained, "listed": listed}


@pytest.mark.slow
def test_a_step_drained_to_s3_loads_bit_exactly_for_plain_readers_with_its_local_sequence(s3, nodes, capsys):
    options = _options(s3)  # on moto and on SeaweedFS
    outcomes = assert_all_ok(_run(_drain_one, s3.root, nodes, options))
    assert _durable_steps(s3) == [10]
    assert all(out["listed"] == {"local": [10, 20], "durable": [10]} for out in outcomes), outcomes[0]["listed"]
    durable = json.loads(s3.get(f"{RUN}/step_{10:010d}/COMMITTED"))
    local = _local_marker(nodes[1], 10)
    assert (durable["save_id"], durable["sequence"]) == (local["save_id"], local["sequence"])
    assert json.loads(s3.get(f"{RUN}/LATEST"))["sequence"] == local["sequence"]
    [stats] = outcomes[0]["drained"]
    assert (stats["step"], stats["attempts"], stats["files"]) == (10, 1, WORLD)
    loaded = assert_all_ok(_run(_load_plain, s3.root, nodes, options, 10))
    for out in loaded:
        assert out["plain"]["step"] == 10 and out["latest"] == 10
        _exact(out["plain"]["full"], outcomes[0]["saved"][10])
        _exact(out["full"], outcomes[0]["saved"][10])
    from dcp_atomic.tools import cli

    capsys.readouterr()
    cli_options = ["--storage-options", json.dumps(options)]
    assert cli.main([*cli_options, "verify", s3.root, RUN, "10"]) == 0
    assert capsys.readouterr().out.startswith("step 10: OK (4 files")
    assert cli.main([*cli_options, "--json", "ls", s3.root, RUN, "--local-root", nodes[0]]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert {row["step"]: row["tiers"] for row in listing["steps"]} == {10: ["durable", "local"], 20: ["local"]}


# -- b. a SlowDown storm on the durable PUTs while training keeps saving locally ------------------------------------


def _storm(s3, step, refusals, stall_s=0.0):
    """Every rank's data file of ``step`` is refused ``refusals`` times with 503 SlowDown."""
    for rank in range(WORLD):
        s3.proxy.fail("PUT", _data_key(step, rank), status=503, code="SlowDown", times=refusals, stall_s=stall_s)


def _train_through_a_storm(ctx, options):
    """Step 10 drains into the storm; steps 20 and 30 are saved locally meanwhile.  The drain's second attempt
    waits until training is done, so a save that waited for the drain would hang it (``held`` says so)."""
    import threading

    from dcp_atomic.tiers import drain

    drain.RETRY_BACKOFF = 0.1
    trained, calls, held = threading.Event(), [], {}

    def before_upload(rank, step):
        calls.append(step)
        if len(calls) == 2:
            held["released"] = trained.wait(timeout=60)

    failpoints.arm("drain.before_upload", before_upload)
    model, optim = _fsdp_app(ctx.world_size, 0)
    drained, failures, saved = [], [], {}
    callbacks = Callbacks(on_drained=drained.append, on_failed=failures.append)
    with _manager(ctx, storage_options=options, callbacks=callbacks) as manager:
        for step, durable in ((10, True), (20, False), (30, False)):
            _train_step(model, optim, step)
            manager.save(step, _state(model, optim, step), durable=durable)  # returns: the drain is not waited for
            saved[step] = _full(model)
        durable_while_training = manager.steps(tier="durable")
        trained.set()
        manager.wait()
        durable_after = manager.steps(tier="durable")
    return {"saved": saved, "drained": drained, "failures": failures, "calls": calls, "held": held,
            "durable_while_training": durable_while_training, "durable_after": durable_after}


@pytest.mark.slow
def test_a_slowdown_storm_on_the_drain_never_blocks_local_saves_and_the_retry_commits(s3_moto, nodes):
    s3, options = s3_moto, _options(s3_moto)
    _storm(s3, 10, S3_ATTEMPTS, stall_s=0.2)  # each rank's first drain attempt fails, the second goes through
    outcomes = assert_all_ok(_run(_train_through_a_storm, s3.root, nodes, options))
    for out in outcomes:
        assert out["held"] == {"released": True}, "a local save waited for the drain"
        assert out["calls"] == [10, 10] and out["failures"] == []
        assert out["durable_while_training"] == [] and out["durable_after"] == [10]
    [stats] = outcomes[0]["drained"]
    assert (stats["step"], stats["attempts"]) == (10, 2)
    refused = [r for r in s3.proxy.requests("PUT", r"\.distcp$") if r.injected]
    assert len(refused) == WORLD * S3_ATTEMPTS and {r.status for r in refused} == {503}
    # no durable step half visible: the marker was put once, after every rank's data file was stored
    puts = s3.proxy.requests("PUT", rf"/{RUN}/")
    markers = [i for i, r in enumerate(puts) if r.key.endswith("/COMMITTED")]
    stored = [i for i, r in enumerate(puts) if r.key.endswith(".distcp") and r.status == 200]
    assert len(markers) == 1 and len(stored) == WORLD and max(stored) < markers[0], [(r.key, r.status) for r in puts]
    loaded = assert_all_ok(_run(_load_plain, s3.root, nodes, options, 10))
    for out in loaded:
        assert out["latest"] == 10
        _exact(out["plain"]["full"], outcomes[0]["saved"][10])


def _storm_outlasts_the_drain(ctx, options):
    """Step 10's drain fails for good; step 20 is saved locally meanwhile; step 30's drain, after the storm, commits."""
    from dcp_atomic.tiers import drain

    drain.RETRY_BACKOFF = 0.1
    model, optim = _fsdp_app(ctx.world_size, 0)
    drained, failures, saved = [], [], {}
    callbacks = Callbacks(on_drained=drained.append, on_failed=failures.append)
    with _manager(ctx, storage_options=options, callbacks=callbacks) as manager:
        for step, durable in ((10, True), (20, False)):
            _train_step(model, optim, step)
            manager.save(step, _state(model, optim, step), durable=durable)
            saved[step] = _full(model)
        try:
            manager.wait()
        except Exception as e:  # noqa: BLE001 - returned to the test
            raised = {"type": type(e).__name__, "message": str(e), "details": dict(getattr(e, "details", {}))}
        else:
            raised = None
        manager.wait()  # reported once
        _train_step(model, optim, 30)
        manager.save(30, _state(model, optim, 30), durable=True)
        manager.wait()
        saved[30] = _full(model)
    return {"saved": saved, "drained": [s["step"] for s in drained], "failures": failures, "raised": raised}


@pytest.mark.slow
def test_a_storm_longer_than_the_retries_fails_the_drain_naming_step_and_key_and_the_next_drain_commits(s3_moto,
                                                                                                         nodes):
    s3, options = s3_moto, _options(s3_moto)
    _storm(s3, 10, S3_ATTEMPTS * DRAIN_ATTEMPTS)  # every attempt of step 10's drain, on every rank
    outcomes = assert_all_ok(_run(_storm_outlasts_the_drain, s3.root, nodes, options))
    key = f"{s3.root}/{RUN}/step_{10:010d}/"
    for out in outcomes:
        raised = out["raised"]
        assert raised is not None and raised["type"] == "StorageError", raised
        assert "drain of step 10" in raised["message"] and "SlowDown" in raised["message"], raised["message"]
        assert re.search(re.escape(key) + r"[^/ ]+/__\d_0\.distcp", raised["message"]), raised["message"]
        assert raised["details"]["path"].startswith(key), raised["details"]
        assert len(out["failures"]) == 1, f"on_failed heard {out['failures']}"
        failure = out["failures"][0]
        assert (failure["operation"], failure["step"], failure["error_type"]) == ("drain", 10, "StorageError")
        assert failure["ranks"] == list(range(WORLD)) and failure["path"].startswith(key), failure
    assert outcomes[0]["drained"] == [30]
    assert len([r for r in s3.proxy.requests("PUT") if r.injected]) == WORLD * S3_ATTEMPTS * DRAIN_ATTEMPTS
    assert _durable_steps(s3) == [30]  # step 10 never became visible
    assert not [k for k in s3.keys(RUN) if re.search(rf"step_{10:010d}/[^/]+/(manifest\.json|COMMITTED)$", k)]
    assert json.loads(s3.get(f"{RUN}/LATEST"))["step"] == 30
    for out in assert_all_ok(_run(_load_plain, s3.root, nodes, options, 30)):
        assert out["latest"] == 30
        _exact(out["full"], outcomes[0]["saved"][30])


def _latest_refused_once(ctx, options):
    """Steps 10 and 20 drained; the storm refuses step 20's first ``LATEST`` write after its marker is placed."""
    from dcp_atomic.tiers import drain

    drain.RETRY_BACKOFF = 0.1
    lines = _Lines("dcp_atomic.drain")
    model, optim = _fsdp_app(ctx.world_size, 0)
    drained, saved = [], {}
    with _manager(ctx, storage_options=options, callbacks=Callbacks(on_drained=drained.append)) as manager:
        for step in (10, 20):
            _train_step(model, optim, step)
            manager.save(step, _state(model, optim, step), durable=True)
            manager.wait()
            saved[step] = _full(model)
    return {"saved": saved, "drained": [(s["step"], s["attempts"]) for s in drained],
            "retried": [line for line in lines.lines if "retrying" in line]}


@pytest.mark.slow
def test_a_storm_between_the_durable_marker_and_latest_is_retried_and_latest_names_the_drained_step(s3_moto, nodes):
    s3, options = s3_moto, _options(s3_moto)
    s3.proxy.fail("PUT", rf"/{RUN}/LATEST$", status=503, code="SlowDown", times=S3_ATTEMPTS,
                  body='"step": 20')  # only the write naming step 20: the marker is there, LATEST not yet
    outcomes = assert_all_ok(_run(_latest_refused_once, s3.root, nodes, options))
    assert outcomes[0]["drained"] == [(10, 1), (20, 2)]
    for out in outcomes:  # the failed attempt said what was true: committed, LATEST behind
        [retried] = out["retried"]
        assert "the step is committed to the durable root" in retried and "/LATEST" in retried, retried
        assert "No durable marker" not in retried, retried
    assert _durable_steps(s3) == [10, 20]
    latest = json.loads(s3.get(f"{RUN}/LATEST"))
    assert latest["step"] == 20 and latest["sequence"] == _local_marker(nodes[0], 20)["sequence"], latest
    for out in assert_all_ok(_run(_load_plain, s3.root, nodes, options, None)):
        assert out["plain"]["step"] == 20 and out["latest"] == 20
        _exact(out["plain"]["full"], outcomes[0]["saved"][20])


# -- c. local retention while the drain is stuck on a held PUT -----------------------------------------------------

HOLD_S = 20.0  # rank 0's upload of step 10 is held this long: far longer than five small local saves take


def _save_while_the_drain_is_stuck(ctx, options):
    """Step 10 drains (its PUT held by the proxy); 20, 30 (durable), 40 (durable), 50 saved with keep_local=1;
    after the drain and one more save (60), only 60 is left."""
    drained, seen = [], {}
    model, optim = _fsdp_app(ctx.world_size, 0)
    # timeout (the drain's stall deadline, too) well above the hold: a held PUT is a stall until it ends
    with _manager(ctx, storage_options=options, keep_local=1, callbacks=Callbacks(on_drained=drained.append),
                  timeout=2 * HOLD_S + 5) as manager:
        for step, durable in ((10, True), (20, False), (30, True), (40, True), (50, False)):
            _train_step(model, optim, step)
            manager.save(step, _state(model, optim, step), durable=durable)
        seen["drained_while_stuck"] = list(drained)
        seen["on_disk_while_stuck"] = _on_disk_after_retention(ctx)
        manager.wait()
        seen["on_disk_after_drain"] = _on_disk_after_retention(ctx)
        _train_step(model, optim, 60)
        manager.save(60, _state(model, optim, 60))
        seen["on_disk_after_next_save"] = _on_disk_after_retention(ctx)
    return {**seen, "drained": [(s["step"], s["skipped_steps"]) for s in drained]}


@pytest.mark.slow
def test_local_retention_keeps_the_step_stuck_in_the_drain_and_the_newest_waiting_one(s3_moto, nodes):
    s3, options = s3_moto, _options(s3_moto)
    s3.proxy.fail("PUT", _data_key(10, 0), status=None, stall_s=HOLD_S, times=1)
    outcomes = assert_all_ok(_run(_save_while_the_drain_is_stuck, s3.root, nodes, options))
    assert outcomes[0]["drained_while_stuck"] == [], f"the held PUT ended before training did ({HOLD_S}s): too slow"
    for out in outcomes:
        # keep_local=1 keeps 50 (newest), 10 (in flight) and 40 (waiting: it replaced 30); 20 and 30 are removed
        assert out["on_disk_while_stuck"] == [10, 40, 50], out["on_disk_while_stuck"]
        assert out["on_disk_after_drain"] == [10, 40, 50], out["on_disk_after_drain"]
        assert out["on_disk_after_next_save"] == [60], out["on_disk_after_next_save"]
    assert outcomes[0]["drained"] == [(10, []), (40, [30])]
    assert _durable_steps(s3) == [10, 40]
    [held] = [r for r in s3.proxy.requests("PUT", _data_key(10, 0)) if r.injected]
    assert held.status == 200  # held, then stored: the drain was stuck, not failed


# -- d. a full local disk -------------------------------------------------------------------------------------------


def _save_into_a_full_node(ctx, options, ballast_dir):
    """Step 10 saved; node A's disk filled; step 20 fails; the space freed; step 30 saved; both restored."""
    import shutil

    import torch.distributed as dist

    model, optim = _fsdp_app(ctx.world_size, 0)
    saved = {}
    with _manager(ctx, storage_options=options) as manager:
        _train_step(model, optim, 10)
        manager.save(10, _state(model, optim, 10))
        saved[10] = _full(model)
        dist.barrier()
        if ctx.rank == 0:
            _fill(ballast_dir)
        dist.barrier()
        _train_step(model, optim, 20)
        try:
            manager.save(20, _state(model, optim, 20))
        except Exception as e:  # noqa: BLE001 - returned to the test
            raised = {"type": type(e).__name__, "message": str(e), "details": dict(getattr(e, "details", {}))}
        else:
            raised = None
        listed_full = manager.steps(tier="local")
        dist.barrier()
        node_root = ctx.extra["nodes"][ctx.rank // 2]
        kept_on_node = os.path.exists(os.path.join(node_root, RUN, f"step_{10:010d}", "COMMITTED"))
        if ctx.rank == 0:
            shutil.rmtree(ballast_dir)  # the operator frees space
        dist.barrier()
        _train_step(model, optim, 30)
        manager.save(30, _state(model, optim, 30))
        saved[30] = _full(model)
        listed = manager.steps(tier="local")
    restored = {}
    for step in (10, 30):
        model, optim = _fsdp_app(ctx.world_size, 42)
        with _manager(ctx, storage_options=options) as manager:
            assert manager.load(_state(model, optim, -1), step=step) == step
            restored[step] = {"full": _full(model), "served": manager.restored_from}
    return {"raised": raised, "listed_full": listed_full, "kept_on_node": kept_on_node, "listed": listed,
            "saved": saved, "restored": restored}


def _fill(ballast_dir):
    os.makedirs(ballast_dir, exist_ok=True)
    with open(os.path.join(ballast_dir, "ballast"), "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass


@pytest.mark.slow
def test_a_full_local_disk_fails_the_save_naming_rank_and_path_and_keeps_the_previous_step(s3_moto):
    s3, options = s3_moto, _options(s3_moto)
    with small_tmpfs_ctx(size_kib=2048) as a, small_tmpfs_ctx(size_kib=65536) as b:
        ballast = os.path.join(a.path, ".ballast")
        outcomes = assert_all_ok(_run(_save_into_a_full_node, s3.root, [a.path, b.path], options, ballast))
        for out in outcomes:
            raised = out["raised"]
            assert raised is not None and raised["type"] == "StorageError", raised
            assert raised["details"].get("errno") == 28 and raised["details"]["path"].startswith(a.path), raised
            assert re.search(r"rank [01] ", raised["message"]) and "No space left" in raised["message"], raised
            assert out["listed_full"] == [10], out["listed_full"]  # step 20 is not committed anywhere
            assert out["kept_on_node"], "the full node lost its previous step"
            assert out["listed"] == [10, 30], out["listed"]
            for step in (10, 30):
                assert out["restored"][step]["served"]["tier"] == "local"
                _exact(out["restored"][step]["full"], outcomes[0]["saved"][step])
        for node_root in (a.path, b.path):
            assert not os.path.exists(os.path.join(node_root, RUN, f"step_{20:010d}", "COMMITTED"))
        assert _durable_steps(s3) == []


# -- e. the drain's rules with the durable root on S3: any world drains a step whole, conflicts refused at save --------


def _fresh_save_of(ctx, options, step):
    """A fresh two-tier job (it did not load) on other nodes' disks saves ``step``: refused by save/async_save
    itself when the durable root holds it committed."""
    from dcp_atomic import CommitConflictError

    model, optim = _fsdp_app(ctx.world_size, 7)
    seen = {}
    with _manager(ctx, storage_options=options,
                  local_root=os.path.join(ctx.extra["nodes"][ctx.rank // 2], "other")) as manager:
        for name in ("save", "async_save"):
            try:
                getattr(manager, name)(step, _state(model, optim, step))
                seen[name] = "returned"
            except CommitConflictError as e:
                seen[name] = str(e)
    return seen


@pytest.mark.slow
def test_on_s3_a_resized_job_drains_the_old_worlds_step_whole_and_a_fresh_jobs_save_of_it_is_refused(s3, nodes):
    """4 ranks -> 2 with step 10 undrained (the store refused its uploads): the world-2 job drains all four ranks'
    files to S3 (moto and SeaweedFS), the step loads exactly at world 4, and a fresh job's save of step 10 is refused
    at save and async_save, nothing written."""
    from tests.helpers.drain import (_load_durable, _one_node_each, _resume_saving,
                                               _save_with_a_refusing_store, _two_per_node_of)

    options = _options(s3)
    saved = assert_all_ok(_run(_save_with_a_refusing_store, s3.root, nodes, 10, 2, options,
                               rank_env=_two_per_node_of(4)))
    assert saved[0]["failed"] is not None and _durable_steps(s3) == []
    resumed = assert_all_ok(_run(_resume_saving, s3.root, nodes, 20, 1, False, options, world=2,
                                 rank_env=_one_node_each))
    assert all(out["error"] is None for out in resumed), resumed[0]["error"]
    assert _durable_steps(s3) == [10]
    shards = sorted(m.group(1) for key in s3.keys(RUN)
                    if (m := re.fullmatch(rf"{RUN}/step_0000000010/[^/]+/(manifest\.\d+\.json)", key)))
    assert shards == [f"manifest.{r}.json" for r in range(4)], shards
    for rank, out in enumerate(assert_all_ok(_run(_load_durable, s3.root, nodes, 10, options,
                                                  rank_env=_two_per_node_of(4)))):
        assert out["step"] == 10 and out["progress"] == 10
        _exact(out["full"], saved[rank]["full"])
    before = sorted(s3.keys(RUN))
    for out in assert_all_ok(_run(_fresh_save_of, s3.root, nodes, options, 10)):
        for name in ("save", "async_save"):
            assert "already committed in the durable root" in out[name], (name, out[name])
    assert sorted(s3.keys(RUN)) == before  # nothing written
