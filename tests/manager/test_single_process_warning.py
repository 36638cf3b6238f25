"""A process without a process group: torch's DCP warns at every save and load that it assumes a single process;
the manager says it once, in its own words, with what to do, and torch's repeats are not shown."""

from __future__ import annotations

import logging
import warnings

import torch

from dcp_atomic import CheckpointManager
from dcp_atomic._base import world_of_one


def test_a_single_process_is_explained_once_and_torchs_warning_not_repeated(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(world_of_one, "_said", False)  # another test in this process may have heard it already
    state = {"w": torch.arange(8.0)}
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING, logger="dcp_atomic"):
        warnings.simplefilter("always")
        with CheckpointManager(str(tmp_path), "run") as manager:
            manager.save(1, state)
            manager.async_save(2, state).result()
            target = {"w": torch.zeros(8)}
            assert manager.load(target) == 2 and torch.equal(target["w"], state["w"])
    torch_says = [w for w in caught if "torch.distributed is disabled" in str(w.message)]
    ours = [r for r in caplog.records if "no torch.distributed process group" in r.getMessage()]
    assert torch_says == [], [str(w.message) for w in torch_says]
    assert len(ours) == 1 and "init_process_group" in ours[0].getMessage(), [r.getMessage() for r in ours]
