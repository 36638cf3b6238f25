"""Retention keeps what it promises: the kept set comes from the markers that exist, never from the ``COMMITS``
journal alone (a hint that can lag the truth: a step removed by hand, a step re-saved by another job)."""

from __future__ import annotations

import logging
import os
import shutil

import torch

from dcp_atomic import CheckpointManager

RUN = "exp"


def _state(step: int) -> dict:
    return {"w": torch.arange(16.0) + step, "progress": {"step": step}}


def _committed(root: str) -> list[int]:
    run_dir = os.path.join(root, RUN)
    return sorted(int(d[5:]) for d in os.listdir(run_dir)
                  if d.startswith("step_") and os.path.exists(os.path.join(run_dir, d, "COMMITTED")))


def test_a_step_removed_by_hand_takes_no_keep_last_slot_and_the_last_good_step_is_kept(tmp_path, caplog):
    root = str(tmp_path / "root")
    with CheckpointManager(root, RUN, keep_last=2, timeout=10) as manager:
        for step in (1, 2, 3):
            manager.save(step, _state(step))
        assert _committed(root) == [2, 3]
        shutil.rmtree(os.path.join(root, RUN, f"step_{3:010d}"))  # an operator's rm -rf, not `dcp-atomic rm`
        with caplog.at_level(logging.WARNING, logger="dcp_atomic"):
            manager.save(4, _state(4))
    assert _committed(root) == [2, 4], "retention deleted the last good step for a journal entry of a removed one"
    assert any("lists step 3, which has no marker" in r.getMessage() for r in caplog.records), caplog.text
    with CheckpointManager(root, RUN, timeout=10) as manager:
        target = _state(-1)
        assert manager.load(target, step=2) == 2
        assert torch.equal(target["w"], _state(2)["w"]) and target["progress"]["step"] == 2
        manager.save(5, _state(5))  # the repaired journal holds from here: keep_last counts real commits
    with CheckpointManager(root, RUN, keep_last=2, timeout=10) as manager:
        manager.save(6, _state(6))
    assert _committed(root) == [5, 6]


def test_a_journal_entry_with_a_raised_sequence_takes_no_keep_last_slot_its_marker_orders_it(tmp_path):
    """A ``COMMITS`` entry that keeps its step's real save id but carries a higher sequence (a re-sealed or
    hand-edited journal) once ranked step 3 above every other: with ``keep_last=3`` and steps 3-5, ``save(6)``
    left [3, 6].  Each step's order is its own marker's sequence."""
    import json

    from tests.helpers.sealed import seal

    root = str(tmp_path / "root")
    with CheckpointManager(root, RUN, keep_last=3, timeout=10) as manager:
        for step in range(1, 6):
            manager.save(step, _state(step))
    assert _committed(root) == [3, 4, 5]
    journal = os.path.join(root, RUN, "COMMITS")
    body = json.loads(open(journal, "rb").read())
    entry = next(c for c in body["commits"] if c["step"] == 3)
    entry["sequence"] = 99
    with open(journal, "wb") as f:
        f.write(seal(body))
    with CheckpointManager(root, RUN, keep_last=3, timeout=10) as manager:
        manager.save(6, _state(6))
    assert _committed(root) == [4, 5, 6], "a journal's sequence, not the markers', decided what keep_last kept"
    with CheckpointManager(root, RUN, timeout=10) as manager:
        for step in (4, 5, 6):
            target = _state(-1)
            assert manager.load(target, step=step) == step and torch.equal(target["w"], _state(step)["w"])
