"""Honest mistakes fail fast and clearly: a step that does not exist, a float checkpoint into an integer model,
arguments of the wrong kind (tried as a new user would)."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_atomic import AtomicStorageReader, AtomicStorageWriter, CheckpointNotFoundError

RUN = "mistakes"


def _save(root, step, state):
    dcp.save(state, storage_writer=AtomicStorageWriter(root, RUN, step), no_dist=True)


def test_a_step_that_does_not_exist_is_answered_at_once_and_an_unmarked_one_is_waited_for(tmp_path):
    root = str(tmp_path)
    for step in (1, 2):
        _save(root, step, {"w": torch.arange(4.0) + step})
    started = time.monotonic()
    with pytest.raises(CheckpointNotFoundError) as refused:
        AtomicStorageReader(root, RUN, 99, timeout=60).resolve()  # what dcp.load's read_metadata calls
    assert time.monotonic() - started < 10, "a step that does not exist waited for the timeout"
    assert "step 99" in str(refused.value) and "committed steps: 1, 2" in str(refused.value), refused.value
    os.makedirs(os.path.join(root, RUN, f"step_{98:010d}"))  # a save of step 98 under way: its marker may come
    started = time.monotonic()
    with pytest.raises(CheckpointNotFoundError):
        AtomicStorageReader(root, RUN, 98, timeout=2).resolve()
    assert time.monotonic() - started >= 2, "a step directory without its marker yet must be waited for"
