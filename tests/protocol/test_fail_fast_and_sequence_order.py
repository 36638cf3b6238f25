"""Corruption is reported at once, a fresh run fails fast (P9), gc never deletes a step
whose marker it cannot validate, and commits are ordered by sequence number, not by clocks (P10, G15; G16 for gc)."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_atomic import (AtomicStorageReader, AtomicStorageWriter, CheckpointManager, CheckpointNotFoundError,
                        CorruptCheckpointError, latest_step)
from dcp_atomic._base import failpoints
from dcp_atomic.protocol.catalog import most_recent, scan_markers
from dcp_atomic.format.layout import RunLayout
from dcp_atomic.format.manifest import sealed_json
from dcp_atomic.protocol.retention import apply_gc, plan_gc
from dcp_atomic.stores.backends import open_storage
from tests.fault_fixtures import ReadLog, watched_reads

RUN = "exp"
SKEW = -600.0  # a host whose clock is ten minutes behind


def _save(root, step, value=None, **kw):
    writer = AtomicStorageWriter(root, RUN, step, thread_count=1, **kw)
    dcp.save({"w": torch.full((16,), float(step if value is None else value))}, storage_writer=writer)
    return writer.save_id


def _layout(root) -> RunLayout:
    return RunLayout(open_storage(root), RUN)


def _step_dir(root, step) -> str:
    return os.path.join(root, RUN, f"step_{step:010d}")


def _marker_json(root, step) -> dict:
    with open(os.path.join(_step_dir(root, step), "COMMITTED")) as f:
        return json.load(f)


def _latest_json(root) -> dict:
    with open(os.path.join(root, RUN, "LATEST")) as f:
        return json.load(f)


def _reseal(path, **changes) -> None:
    """Rewrite a control file with ``changes`` (None deletes a field) and a valid self-checksum."""
    with open(path) as f:
        body = json.load(f)
    body.pop("checksum")
    body.update(changes)
    body = {k: v for k, v in body.items() if v is not None}
    with open(path, "wb") as f:
        f.write(sealed_json(body))


def _as_old_format(root, steps) -> None:
    """Markers and LATEST as dcp_atomic wrote them before sequence numbers existed (in another process)."""
    from dcp_atomic.protocol import commit

    commit._last_sequence.clear()
    for step in steps:
        _reseal(os.path.join(_step_dir(root, step), "COMMITTED"), sequence=None)
    _reseal(os.path.join(root, RUN, "LATEST"), sequence=None)


@pytest.fixture
def skewed_clock(monkeypatch):
    """``skewed_clock(seconds)`` shifts this process's wall clock (time, time_ns, gmtime) by ``seconds``."""
    real_time, real_time_ns, real_gmtime = time.time, time.time_ns, time.gmtime

    def shift(seconds: float) -> None:
        monkeypatch.setattr(time, "time", lambda: real_time() + seconds)
        monkeypatch.setattr(time, "time_ns", lambda: real_time_ns() + int(seconds * 1e9))
        monkeypatch.setattr(time, "gmtime",
                            lambda secs=None: real_gmtime(real_time() + seconds if secs is None else secs))

    return shift


def _elapsed(fn):
    started = time.monotonic()
    try:
        return fn(), time.monotonic() - started
    except BaseException as e:  # noqa: BLE001
        return e, time.monotonic() - started


# -- G4: corruption is reported at once ---------------------------------------------------------------------


def test_garbled_manifest_is_reported_at_once_not_after_the_timeout(root):
    _save(root, 1)
    manifest = os.path.join(_step_dir(root, 1), _marker_json(root, 1)["manifest"])
    with open(manifest, "r+b") as f:
        f.seek(40)
        f.write(b"#garbled#")
    for step in (1, None):
        error, seconds = _elapsed(lambda: AtomicStorageReader(root, RUN, step, timeout=120).resolve())
        assert isinstance(error, CorruptCheckpointError) and "manifest sha256" in str(error), error
        assert seconds < 5, f"resolve(step={step}) took {seconds:.1f}s: corruption was waited for"
    error, seconds = _elapsed(lambda: dcp.load({"w": torch.zeros(16)},
                                               storage_reader=AtomicStorageReader(root, RUN, timeout=120)))
    assert isinstance(error, BaseException) and "CorruptCheckpointError" in str(error), error
    assert seconds < 5, f"dcp.load took {seconds:.1f}s: corruption was waited for"


def test_damaged_or_future_marker_is_reported_at_once(root):
    _save(root, 1)
    _save(root, 2)
    with open(os.path.join(_step_dir(root, 1), "COMMITTED"), "r+b") as f:
        f.truncate(50)  # a torn marker that stays torn: bit rot, a half-copied backup
    _reseal(os.path.join(_step_dir(root, 2), "COMMITTED"), schema_version=99)
    for step, says in ((1, "not valid JSON"), (2, "schema_version 99")):
        error, seconds = _elapsed(lambda: AtomicStorageReader(root, RUN, step, timeout=120).resolve())
        assert isinstance(error, CorruptCheckpointError) and says in str(error), error
        assert seconds < 5, f"step {step}: {seconds:.1f}s"


class _AppearsAfterMiss:
    """``path`` (moved aside now) reappears ``delay`` s after the library first fails to read it, so a load that
    succeeds must have waited; the read log shows the miss, the reappearance and the read that found it."""

    def __init__(self, path: str, delay: float) -> None:
        self.path, self.delay = path, delay
        os.rename(path, path + ".hidden")
        self.revealed_at: float | None = None
        self.timer: threading.Timer | None = None

    def on_miss(self, path: str) -> None:
        if path == os.path.realpath(self.path) and self.timer is None:
            self.timer = threading.Timer(self.delay, self._reveal)
            self.timer.start()

    def _reveal(self) -> None:
        self.revealed_at = time.monotonic()
        os.rename(self.path + ".hidden", self.path)

    def join(self) -> None:
        if self.timer is not None:
            self.timer.join()

    def assert_waited(self, reads: ReadLog) -> None:
        misses, found = reads.of(self.path, "FileNotFoundError"), reads.of(self.path, "ok")
        assert misses and self.revealed_at is not None and found, (misses, self.revealed_at, found)
        assert misses[0] < self.revealed_at < found[0], "the read that found the file came after it reappeared"


def test_a_manifest_not_visible_yet_is_still_waited_for(root):
    _save(root, 1)
    manifest = _AppearsAfterMiss(os.path.join(_step_dir(root, 1), _marker_json(root, 1)["manifest"]), 0.5)
    try:
        with watched_reads(manifest.on_miss) as reads:
            assert AtomicStorageReader(root, RUN, 1, timeout=10).resolve().step == 1
    finally:
        manifest.join()
    manifest.assert_waited(reads)


# -- a fresh run fails fast -----------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["no-root", "empty-root", "empty-run-dir"])
def test_a_fresh_run_is_not_found_at_once(root, where):
    if where == "no-root":
        root = os.path.join(root, "never-created")
    elif where == "empty-run-dir":
        os.makedirs(os.path.join(root, RUN))
    timeout = 120.0
    latest = os.path.join(root, RUN, "LATEST")
    # "At once": LATEST is looked for once, never retried; and the call ends far inside the timeout.
    with watched_reads() as reads:
        error, seconds = _elapsed(lambda: AtomicStorageReader(root, RUN, timeout=timeout).resolve())
    assert isinstance(error, CheckpointNotFoundError) and "no step directory" in str(error), error
    assert len(reads.of(latest)) <= 1 and seconds < timeout / 4, (reads.events, seconds)
    with watched_reads() as reads:
        found, seconds = _elapsed(lambda: latest_step(root, RUN, timeout=timeout))
    if where == "no-root":  # a root that does not exist is a typo, said at once, not an empty run
        assert isinstance(found, CheckpointNotFoundError) and "does not exist" in str(found), found
    else:
        assert found is None, found
    assert len(reads.of(latest)) <= 1 and seconds < timeout / 4, (found, reads.events, seconds)
    with CheckpointManager(root, RUN, timeout=timeout) as manager:
        with watched_reads() as reads:
            error, seconds = _elapsed(lambda: manager.load({"w": torch.zeros(16)}))
    assert isinstance(error, CheckpointNotFoundError), error
    assert len(reads.of(latest)) <= 1 and seconds < timeout / 4, (reads.events, seconds)


def test_a_missing_latest_beside_a_step_directory_is_still_waited_for(root):
    _save(root, 1)
    latest = _AppearsAfterMiss(os.path.join(root, RUN, "LATEST"), 0.7)  # the first commit is between its marker
    try:                                                                  # and LATEST
        with watched_reads(latest.on_miss) as reads:
            assert AtomicStorageReader(root, RUN, timeout=10).resolve().step == 1
    finally:
        latest.join()
    latest.assert_waited(reads)


# -- G16: gc never deletes a step whose marker cannot be validated -----------------------------------------


def _files_under(path) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), path) for d, _, files in os.walk(path) for f in files}


@pytest.mark.parametrize("scanned_by", ["plan_gc", "caller"])
def test_gc_keeps_every_file_of_a_step_whose_marker_cannot_be_validated(root, scanned_by):
    for step in (1, 2, 3, 4):
        _save(root, step)
    with open(os.path.join(_step_dir(root, 1), "COMMITTED"), "r+b") as f:
        f.seek(30)
        f.write(b"rot")
    _reseal(os.path.join(_step_dir(root, 2), "COMMITTED"), schema_version=2)  # written by a newer dcp_atomic
    before = {step: _files_under(_step_dir(root, step)) for step in (1, 2)}
    layout = _layout(root)
    markers = scan_markers(layout) if scanned_by == "caller" else None  # the manager passes its own scan
    plan = plan_gc(layout, 1, lease_seconds=0, markers=markers)
    apply_gc(layout, plan)
    for step in (1, 2):
        assert _files_under(_step_dir(root, step)) == before[step], f"gc deleted data of step {step}"
    assert not os.path.exists(_step_dir(root, 3)) and os.path.exists(_step_dir(root, 4))
    assert [step for step, _ in plan.unreadable_steps] == [1, 2]
    reasons = dict(plan.unreadable_steps)
    assert "self-checksum" in reasons[1] and "schema_version 2" in reasons[2], reasons


# -- G15: order without clocks -------------------------------------------------------------------------------


def test_a_clock_ten_minutes_behind_does_not_move_latest_backwards(root, skewed_clock):
    _save(root, 1)
    skewed_clock(SKEW)
    _save(root, 2)
    skewed_clock(0.0)
    assert _marker_json(root, 2)["committed_at"] < _marker_json(root, 1)["committed_at"], "the clock was not skewed"
    assert latest_step(root, RUN) == 2
    assert _latest_json(root)["step"] == 2
    assert AtomicStorageReader(root, RUN, timeout=2).resolve().step == 2
    plan = plan_gc(_layout(root), 1)
    assert plan.kept_steps == [2] and plan.delete_steps == [1]


def test_markers_from_before_sequences_order_below_new_commits(root, skewed_clock):
    _save(root, 5)
    _save(root, 3)  # a rollback restart: step 3 is the live branch
    _as_old_format(root, (5, 3))
    assert latest_step(root, RUN) == 3, "old markers keep their order among themselves (commit time)"
    skewed_clock(SKEW)
    _save(root, 4)  # the first commit by the new version, from a host whose clock is behind
    skewed_clock(0.0)
    assert _marker_json(root, 4)["sequence"] == 1
    assert latest_step(root, RUN) == 4
    assert most_recent(scan_markers(_layout(root))).step == 4
    assert AtomicStorageReader(root, RUN, timeout=2).resolve().step == 4
    plan = plan_gc(_layout(root), 2)
    assert plan.kept_steps == [3, 4] and plan.delete_steps == [5]


def test_a_replaced_marker_is_current_by_sequence_not_by_clock(root, skewed_clock):
    first = _save(root, 1)
    skewed_clock(SKEW)
    failpoints.arm("commit.after_marker", "raise")  # the re-save crashes between its marker and LATEST
    with pytest.raises(BaseException, match="injected"):
        _save(root, 1, value=7, overwrite=True)
    failpoints.disarm_all()
    skewed_clock(0.0)
    second = _marker_json(root, 1)["save_id"]
    assert second != first and _latest_json(root)["save_id"] == first
    resolved, seconds = _elapsed(lambda: AtomicStorageReader(root, RUN, timeout=3).resolve())
    assert not isinstance(resolved, BaseException) and resolved.save_id == second, (resolved, seconds)


def _sequence(root, step) -> int:
    return _marker_json(root, step)["sequence"]


def test_sequence_numbers_increase_when_latest_lags(root):
    from dcp_atomic.protocol import commit

    _save(root, 1)
    _save(root, 2)
    assert (_sequence(root, 1), _sequence(root, 2)) == (1, 2)
    assert _latest_json(root)["sequence"] == 2

    failpoints.arm("commit.after_marker", "raise")  # crash between marker and LATEST ...
    with pytest.raises(BaseException, match="injected"):
        _save(root, 3)
    failpoints.disarm_all()
    assert _latest_json(root)["step"] == 2
    _save(root, 4)  # ... and the same process saves again
    assert _sequence(root, 4) > _sequence(root, 3)

    commit._last_sequence.clear()  # a new process: only what storage says
    failpoints.arm("commit.after_marker", "raise")  # an overwrite re-save of the step LATEST names crashes
    with pytest.raises(BaseException, match="injected"):
        _save(root, 4, value=9, overwrite=True)
    failpoints.disarm_all()
    commit._last_sequence.clear()
    _save(root, 5)  # the marker LATEST names is newer than LATEST itself
    assert _sequence(root, 5) > _sequence(root, 4)

    failpoints.arm("commit.after_marker", "raise")  # another step's commit crashes before LATEST
    with pytest.raises(BaseException, match="injected"):
        _save(root, 6)
    failpoints.disarm_all()
    commit._last_sequence.clear()
    assert latest_step(root, RUN) == 6  # what the manager does on resume: repairs LATEST
    _save(root, 7)
    assert _sequence(root, 7) > _sequence(root, 6)
    assert [m.step for m in sorted(scan_markers(_layout(root)), key=lambda m: m.sequence)] == [1, 2, 3, 4, 5, 6, 7]


def test_old_dcp_atomic_still_reads_new_markers_and_latest(root):
    """What the released Marker/Latest.from_json check: the seal over every field, schema 1, and the old fields."""
    from dcp_atomic.format.integrity import sha256_hex

    _save(root, 1)
    old_fields = {"marker": ["run_id", "step", "save_id", "manifest", "manifest_sha256", "committed_at",
                             "library_version", "kind", "schema_version"],
                  "latest": ["run_id", "step", "save_id", "committed_at", "kind", "schema_version"]}
    for name, raw in (("marker", _marker_json(root, 1)), ("latest", _latest_json(root))):
        claimed = raw.pop("checksum")
        assert claimed == sha256_hex(json.dumps(raw, sort_keys=True, separators=(",", ":")).encode())
        assert raw["schema_version"] == 1 and raw["sequence"] == 1
        assert set(old_fields[name]) <= set(raw), f"{name} lost a field old readers require"
