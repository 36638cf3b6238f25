"""Lightning's distributed checkpoints through dcp_atomic: ``Trainer(strategy=AtomicModelParallelStrategy(...))``.

Lightning's ``ModelParallelStrategy`` saves a sharded (DCP) checkpoint itself, not through ``CheckpointIO``,
into the directory ``ModelCheckpoint`` names (``<dirpath>/epoch=0-step=10.ckpt/``, files written in place).
Here the sharded state is committed as step ``global_step`` of run ``run_id`` under ``<dirpath>``
(``<dirpath>/<run_id>/step_{N:010d}/<save_id>/``), and the path Lightning names becomes a small file,
published by global rank 0 after the commit, holding Lightning's non-tensor state (a ``torch.save`` archive)
and which step it belongs to (a JSON record inside that archive, read without unpickling anything, so
other ``*.ckpt`` files in the directory are skipped unread). So ``ModelCheckpoint``'s bookkeeping (top-k,
``last.ckpt``, ``ckpt_path=``) works unchanged, a crash never leaves a half-written checkpoint Lightning could
resume from, loads verify every byte, and removal un-commits the step through retention (never an ``rmtree``
of a committed step; the step ``LATEST`` names is kept).
"""

from __future__ import annotations

import json
import logging
import os
import zipfile
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

log = logging.getLogger(__name__)

POINTER_KEY = "dcp_atomic_checkpoint_id"
POINTER_RECORD = "dcp_atomic_pointer.json"  # inside the archive: {POINTER_KEY: checkpoint_id}
MAX_POINTER_RECORD_BYTES = 64 * 1024


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
        failure = None
        if self.global_rank == 0:
            try:
                replaced = _pointer(path)
                _write_pointer(path, checkpoint, checkpoint_id)
            except Exception as e:  # noqa: BLE001 - sent to every rank below, so none waits in a collective for it
                failure = f"{type(e).__name__}: {e}"
            else:
                self._retire_if_unreferenced(os.path.dirname(path), replaced)  # e.g. last.ckpt moved on
        failure = self.broadcast(failure)
        if failure is not None:
            raise CheckpointError(f"{checkpoint_id} is committed, but global rank 0 could not write Lightning's file "
                                  f"{path} that names it ({failure}); fix the cause and save again", path=path)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                             set_model_state_dict, set_optimizer_state_dict)

        path = self.broadcast(os.fspath(checkpoint_path))
        checkpoint_id = _pointer(path)
        if checkpoint_id is None:
            raise CheckpointError(f"{path} was not saved by {type(self).__name__} (no dcp_atomic step recorded)",
                                  path=path)
        meta = torch.load(path, weights_only=weights_only)  # Lightning's own rule: None is torch's default
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
        try:  # rank 0 alone: raising here would leave the other ranks in their next collective
            checkpoint_id = _pointer(path)
            os.remove(path)
        except OSError as e:
            log.warning("could not remove %s (%s); the step it names stays committed", path, e)
            return
        self._retire_if_unreferenced(os.path.dirname(path), checkpoint_id)

    def _retire_if_unreferenced(self, directory: str, checkpoint_id: str | None) -> None:
        """Un-commit ``checkpoint_id``'s step once no file in ``directory`` names it (global rank 0 alone).

        Cleanup after a committed save: a failure is logged, never raised, because the other ranks would wait
        for rank 0 in their next collective, and the step stays committed and loadable.
        """
        if checkpoint_id is None:
            return
        try:
            if any(_pointer(os.path.join(directory, n)) == checkpoint_id for n in os.listdir(directory)
                   if n.endswith(".ckpt")):
                return
            root, step = os.path.dirname(os.path.dirname(checkpoint_id)), int(checkpoint_id.rsplit("_", 1)[1])
            layout = RunLayout(open_storage(root), self.run_id)
            if not layout.storage.is_dir(layout.step_dir(step)):
                return  # retired already
            try:
                if read_latest(layout, Deadline(0)).step == step:
                    return  # LATEST is never deleted: retention would keep it too
            except CheckpointError:
                pass
            apply_gc(layout, GcPlan(delete_steps=[step]))  # un-commit first, then the data
        except Exception as e:  # noqa: BLE001 - see the docstring
            log.warning("could not retire %s, which no Lightning checkpoint file names any more (%s: %s); it stays "
                        "committed until `dcp-atomic gc` removes it", checkpoint_id, type(e).__name__, e)


def _write_pointer(path: str, checkpoint: dict[str, Any], checkpoint_id: str) -> None:
    """Publish Lightning's non-tensor state at ``path`` (durable, atomic) with the record :func:`_pointer` reads."""
    temp = f"{path}.{os.getpid()}.tmp"
    try:
        torch.save(checkpoint, temp)
        with zipfile.ZipFile(temp, "a") as archive:  # torch.load ignores records it does not know
            folder = archive.namelist()[0].partition("/")[0]
            archive.writestr(f"{folder}/{POINTER_RECORD}", json.dumps({POINTER_KEY: checkpoint_id}))
        with open(temp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(temp, path)
    finally:
        if os.path.exists(temp):
            os.remove(temp)


def _pointer(path: str) -> str | None:
    """The checkpoint id a file written by :func:`_write_pointer` names; None for any other file.

    Only the JSON record is read, never the pickle: a foreign ``*.ckpt`` (Lightning's own, a download,
    notes) is skipped without running code.  An I/O error raises: such a file may well name the step.
    """
    if not os.path.isfile(path):
        return None
    try:
        with zipfile.ZipFile(path) as archive:
            names = [n for n in archive.namelist() if n.rpartition("/")[2] == POINTER_RECORD]
            if len(names) != 1 or archive.getinfo(names[0]).file_size > MAX_POINTER_RECORD_BYTES:
                return None
            record = json.loads(archive.read(names[0]))
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, NotImplementedError, RuntimeError, EOFError):
        return None  # not a zip, or not a record this module wrote
    checkpoint_id = record.get(POINTER_KEY) if isinstance(record, dict) else None
    return checkpoint_id if isinstance(checkpoint_id, str) else None
