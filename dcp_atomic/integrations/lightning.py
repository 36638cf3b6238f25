"""Lightning's distributed checkpoints through dcp_atomic: ``Trainer(strategy=AtomicModelParallelStrategy(...))``.

Lightning's ``ModelParallelStrategy`` saves a sharded (DCP) checkpoint itself, not through ``CheckpointIO``,
into the directory ``ModelCheckpoint`` names (``<dirpath>/epoch=0-step=10.ckpt/``, files written in place).
Here the sharded state is committed as step ``global_step`` of run ``run_id`` under ``<dirpath>``
(``<dirpath>/<run_id>/step_{N:010d}/<save_id>/``), and the path Lightning names becomes a small file,
published by global rank 0 after the commit, holding Lightning's non-tensor state and which step it
belongs to. So ``ModelCheckpoint``'s bookkeeping (top-k, ``last.ckpt``, ``ckpt_path=``) works unchanged,
a crash never leaves a half-written checkpoint Lightning could resume from, loads verify every byte,
and removal un-commits the step through retention (never an ``rmtree`` of a committed step; the step
``LATEST`` names is kept).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from pytorch_lightning.strategies import ModelParallelStrategy

from ..catalog import DEFAULT_TIMEOUT
from ..commit import read_latest
from ..errors import CheckpointError
from ..layout import RunLayout
from ..planners import AtomicLoadPlanner, AtomicSavePlanner
from ..reader import AtomicStorageReader
from ..retention import GcPlan, apply_gc
from ..retry import Deadline
from ..backends import open_storage
from ..writer import AtomicStorageWriter

POINTER_KEY = "dcp_atomic_checkpoint_id"


class AtomicModelParallelStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` whose sharded checkpoints are dcp_atomic commits (see the module docstring)."""

    def __init__(self, *args: Any, run_id: str = "lightning", timeout: float = DEFAULT_TIMEOUT,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.run_id = run_id
        self.timeout = timeout
        self._last_commit: str | None = None  # one commit serves every path Lightning names for that step

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options")
        path = os.path.abspath(self.broadcast(os.fspath(filepath)))
        checkpoint_id = f"{os.path.dirname(path)}/{self.run_id}/step_{checkpoint['global_step']}"
        state = {"state_dict": checkpoint.pop("state_dict")}
        state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        if checkpoint_id != self._last_commit:  # a re-save of a step by a restarted run replaces it (Lightning's way)
            writer = AtomicStorageWriter(overwrite=True, timeout=self.timeout)
            dcp.save(state, storage_writer=writer, checkpoint_id=checkpoint_id, planner=AtomicSavePlanner())
            self._last_commit = checkpoint_id
        if self.global_rank == 0:
            replaced = _pointer(path)
            temp = f"{path}.{os.getpid()}.tmp"
            torch.save({**checkpoint, POINTER_KEY: checkpoint_id}, temp)
            os.replace(temp, path)
            self._retire_if_unreferenced(os.path.dirname(path), replaced)  # e.g. last.ckpt moved on
        self.barrier()

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                             set_model_state_dict, set_optimizer_state_dict)

        path = self.broadcast(os.fspath(checkpoint_path))
        meta = torch.load(path, weights_only=False if weights_only is None else weights_only)
        checkpoint_id = meta.pop(POINTER_KEY, None)
        if checkpoint_id is None:
            raise CheckpointError(f"{path} was not saved by {type(self).__name__} (no dcp_atomic step recorded)",
                                  path=path)
        state = {"state_dict": get_model_state_dict(self.model)}
        state.update({f"optimizer_{i}": get_optimizer_state_dict(self.model, o) for i, o in enumerate(self.optimizers)})
        dcp.load(state, storage_reader=AtomicStorageReader(timeout=self.timeout), checkpoint_id=checkpoint_id,
                 planner=AtomicLoadPlanner())
        set_model_state_dict(self.model, state["state_dict"])
        for i, optimizer in enumerate(self.optimizers):
            set_optimizer_state_dict(self.model, optimizer, state[f"optimizer_{i}"])
        return meta

    def remove_checkpoint(self, filepath: Any) -> None:
        """Rank 0: drop Lightning's file, then the step once no other file (``last.ckpt``...) refers to it."""
        if not self.is_global_zero:
            return
        path = os.path.abspath(os.fspath(filepath))
        checkpoint_id = _pointer(path)
        os.remove(path)
        self._retire_if_unreferenced(os.path.dirname(path), checkpoint_id)

    def _retire_if_unreferenced(self, directory: str, checkpoint_id: str | None) -> None:
        others = (os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".ckpt"))
        if checkpoint_id is None or any(_pointer(p) == checkpoint_id for p in others):
            return
        root, step = os.path.dirname(os.path.dirname(checkpoint_id)), int(checkpoint_id.rsplit("_", 1)[1])
        layout = RunLayout(open_storage(root), self.run_id)
        try:
            if read_latest(layout, Deadline(0)).step == step:
                return  # LATEST is never deleted: retention would keep it too
        except CheckpointError:
            pass
        apply_gc(layout, GcPlan(delete_steps=[step]))  # un-commit first, then the data


def _pointer(path: str) -> str | None:
    try:
        return torch.load(path, weights_only=False).get(POINTER_KEY)
    except (OSError, EOFError, RuntimeError, AttributeError):
        return None
