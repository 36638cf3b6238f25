"""Long saves show progress: each rank logs how much of its share is done, at most once per interval."""

from __future__ import annotations

import logging

import torch
import torch.distributed.checkpoint as dcp

from dcp_atomic import AtomicStorageWriter


def _save(root, step):
    state = {f"w{i}": torch.ones(1 << 18) for i in range(4)}  # 4 MiB in four items
    dcp.save(state, storage_writer=AtomicStorageWriter(root, "progress", step, thread_count=1))


def test_a_save_longer_than_the_interval_logs_its_progress(root, caplog, monkeypatch):
    monkeypatch.setenv("DCP_ATOMIC_PROGRESS_SECONDS", "1e-9")  # every item is "later than the interval"
    with caplog.at_level(logging.INFO, logger="dcp_atomic.progress"):
        _save(root, 1)
    lines = [r.getMessage() for r in caplog.records if r.name == "dcp_atomic.progress"]
    assert len(lines) == 4, lines
    assert lines[0].startswith("rank 0 saving step 1: 1.0 MiB of 4.0 MiB (25%)")
    assert "4.0 MiB of 4.0 MiB (100%)" in lines[-1]


def test_a_short_save_and_a_disabled_interval_log_nothing(root, caplog, monkeypatch):
    with caplog.at_level(logging.INFO, logger="dcp_atomic.progress"):
        _save(root, 1)  # default interval: 30 s
        monkeypatch.setenv("DCP_ATOMIC_PROGRESS_SECONDS", "0")
        _save(root, 2)
    assert not [r for r in caplog.records if r.name == "dcp_atomic.progress"]


def test_a_load_longer_than_the_interval_logs_its_progress(root, caplog, monkeypatch):
    from dcp_atomic import AtomicStorageReader

    _save(root, 1)
    monkeypatch.setenv("DCP_ATOMIC_PROGRESS_SECONDS", "1e-9")
    state = {f"w{i}": torch.zeros(1 << 18) for i in range(4)}
    with caplog.at_level(logging.INFO, logger="dcp_atomic.progress"):
        dcp.load(state, storage_reader=AtomicStorageReader(root, "progress", 1))
    lines = [r.getMessage() for r in caplog.records if r.name == "dcp_atomic.progress"]
    assert len(lines) == 4 and all(t.startswith("rank 0 loading step 1: ") for t in lines), lines
    assert "4.0 MiB of 4.0 MiB (100%)" in lines[-1]
    assert all(torch.equal(t, torch.ones(1 << 18)) for t in state.values())
