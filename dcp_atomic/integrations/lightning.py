"""Lightning's distributed checkpoints through dcp_atomic: ``Trainer(strategy=AtomicModelParallelStrategy(...))``.

Lightning's ``ModelParallelStrategy`` saves a sharded (DCP) checkpoint itself, not through ``CheckpointIO``,
into the directory ``ModelCheckpoint`` names (``<dirpath>/epoch=0-step=10.ckpt/``, files written in place).
Here **every path Lightning names is its own checkpoint**: the sharded state of ``<dirpath>/<name>`` is committed
as step ``global_step`` of a run named after ``<name>`` under ``<dirpath>/<run_id>/`` (see
:func:`checkpoint_id_for`), and the path itself becomes a small file, published by global rank 0 after the commit,
holding Lightning's non-tensor state (a ``torch.save`` archive) and the checkpoint id it belongs to (a JSON
record inside the archive, read without unpickling anything, so foreign ``*.ckpt`` files are skipped unread).

Why one run per name: Lightning keeps a second run in the same ``dirpath`` apart by versioning the names
(``last-v1.ckpt``), and a weights-only and a full ``ModelCheckpoint`` firing at one step write two names; keyed
by name, neither can replace the other's state.  Re-saving one name (``last.ckpt`` every epoch, the same name
after a rollback) replaces what that name held, as stock Lightning overwrites its file — and nothing else.
So ``ModelCheckpoint``'s bookkeeping (top-k, ``last.ckpt``, ``-vN``, ``ckpt_path="last"``) works unchanged, a
crash never leaves a half-written checkpoint Lightning could resume from, loads verify every byte, and a state
no file names any more is removed through retention (the step, or the name's whole run).

Both packages work: ``AtomicModelParallelStrategy`` is built over ``pytorch_lightning``'s ``ModelParallelStrategy``
(over ``lightning.pytorch``'s where only that is installed), ``LightningAtomicModelParallelStrategy`` over
``lightning.pytorch``'s.  ``LightningModule.load_from_checkpoint`` on one of these files needs
the module to mix in :class:`AtomicCheckpointHooks` (Lightning calls no strategy there).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import logging
import os
import re
import zipfile
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from ..backends import open_storage
from ..catalog import DEFAULT_TIMEOUT
from ..errors import CheckpointError, CheckpointNotFoundError, ConfigurationError
from ..layout import RunLayout, parse_checkpoint_id
from ..parallelism import Parallelism
from ..planners import AtomicLoadPlanner, AtomicSavePlanner
from ..reader import AtomicStorageReader
from ..retention import remove_run, remove_step
from ..writer import AtomicStorageWriter

log = logging.getLogger(__name__)

POINTER_KEY = "dcp_atomic_checkpoint_id"
POINTER_RECORD = "dcp_atomic_pointer.json"  # inside the archive: {POINTER_KEY: checkpoint_id}
MAX_POINTER_RECORD_BYTES = 64 * 1024
_UNSAFE_RUN_CHARS = re.compile(r"[^A-Za-z0-9._-]")

# Why the strategy has no local tier: the tier's truth is "the newest step any copy can assemble, by commit sequence",
# one run per job; here every file Lightning names is its own run, re-saved in place, and ``ckpt_path`` loads exactly
# the step that file's non-tensor state (loops, callbacks) describes.  A tier would have to restore that exact step
# or nothing, and a rollback (``ckpt_path`` of an older file) re-saves names whose drained steps the durable root
# refuses to replace: neither fits without changing what a Lightning file means.
LOCAL_TIER_REFUSAL = (
    "the local tier is not available through Lightning's checkpoint files (each file name is its own run, re-saved "
    "in place, and resuming must load exactly the step the file describes, which a restore from the newest "
    "assemblable copy does not promise). Nothing was saved. Leave local_root out (every file is committed to its "
    "dirpath), or save from a Callback with dcp_atomic.CheckpointManager(root, run_id, local_root=...), which "
    "restores from the node-local tier (README, \"Two tiers\")")


def checkpoint_id_for(path: str, step: int, namespace: str = "lightning") -> str:
    """Where the state of Lightning's ``path`` at ``step`` is committed: ``<dir>/<namespace>/<run>/step_<step>``.

    The run is the file name made safe for a run id, plus a digest of the exact name, so names that differ only in
    characters a run id cannot hold (``epoch=1`` vs ``epoch_1``) never share a run.
    """
    directory, name = os.path.split(os.path.abspath(path))
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    readable = _UNSAFE_RUN_CHARS.sub("_", name).lstrip("._-")[:110] or "checkpoint"
    return f"{directory}/{namespace}/{readable}-{digest}/step_{step}"


class _AtomicCheckpointing:
    """The checkpointing half of the strategy, mixed over a ``ModelParallelStrategy`` (see :func:`strategy_class`)."""

    def __init__(self, *args: Any, run_id: str = "lightning", parallelism: Parallelism | None = None,
                 compression: str | None = None, timeout: float = DEFAULT_TIMEOUT, local_root: str | None = None,
                 **kwargs: Any) -> None:
        """``run_id`` names the folder under each ``dirpath`` that holds the runs; ``parallelism`` is recorded
        for reshard checks (None: inferred from the DTensor meshes, Lightning's ``data_parallel`` /
        ``tensor_parallel`` names included).  ``local_root`` is refused: see :data:`LOCAL_TIER_REFUSAL`."""
        if local_root is not None:
            raise ConfigurationError(f"{type(self).__name__}(local_root={local_root!r}): {LOCAL_TIER_REFUSAL}",
                                     local_root=local_root)
        super().__init__(*args, **kwargs)
        if parallelism is not None and not isinstance(parallelism, Parallelism):
            raise TypeError(f"parallelism must be a dcp_atomic.Parallelism, got {type(parallelism).__name__}")
        self.run_id = run_id
        self.parallelism = parallelism
        self.compression = compression
        self.timeout = timeout

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options")
        path = os.path.abspath(self.broadcast(os.fspath(filepath)))
        checkpoint_id = checkpoint_id_for(path, checkpoint["global_step"], self.run_id)
        state = {"state_dict": checkpoint.pop("state_dict")}
        state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        # This name's own run: re-saving the name replaces what it held (Lightning overwrites its file), never
        # what another name holds.
        writer = AtomicStorageWriter(overwrite=True, timeout=self.timeout, parallelism=self.parallelism,
                                     compression=self.compression)
        dcp.save(state, storage_writer=writer, checkpoint_id=checkpoint_id, planner=AtomicSavePlanner())
        checkpoint[POINTER_KEY] = checkpoint_id  # for AtomicCheckpointHooks, outside a Trainer
        failure = None
        if self.global_rank == 0:
            try:
                replaced = _pointer(path)
                _write_pointer(path, checkpoint, checkpoint_id)
            except Exception as e:  # noqa: BLE001 - sent to every rank below, so none waits in a collective for it
                failure = f"{type(e).__name__}: {e}"
            else:
                if replaced != checkpoint_id:
                    _retire_if_unreferenced(os.path.dirname(path), replaced)  # e.g. last.ckpt moved on
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
            raise CheckpointError(f"{path} was not saved by {type(self).__name__} (no dcp_atomic checkpoint id "
                                  "recorded in it): resume from a file this strategy wrote", path=path)
        meta = torch.load(path, weights_only=weights_only)  # Lightning's own rule: None is torch's default
        meta.pop(POINTER_KEY, None)  # loaded here: AtomicCheckpointHooks must not load it again
        state = {"state_dict": get_model_state_dict(self.model)}
        state.update({f"optimizer_{i}": get_optimizer_state_dict(self.model, o) for i, o in enumerate(self.optimizers)})
        reader = AtomicStorageReader(timeout=self.timeout, parallelism=self.parallelism)
        dcp.load(state, storage_reader=reader, checkpoint_id=checkpoint_id, planner=AtomicLoadPlanner())
        set_model_state_dict(self.model, state["state_dict"])
        for i, optimizer in enumerate(self.optimizers):
            set_optimizer_state_dict(self.model, optimizer, state[f"optimizer_{i}"])
        return meta

    def remove_checkpoint(self, filepath: Any) -> None:
        """Rank 0: drop Lightning's file, then the state it named once no other file (``last.ckpt``...) names it."""
        if not self.is_global_zero:
            return
        path = os.path.abspath(os.fspath(filepath))
        try:  # rank 0 alone: raising here would leave the other ranks in their next collective
            checkpoint_id = _pointer(path)
            os.remove(path)
        except FileNotFoundError:  # gone already (a resumed callback's state names a file it removed): as stock
            return
        except OSError as e:
            log.warning("could not remove %s (%s); the state it names stays committed", path, e)
            return
        _retire_if_unreferenced(os.path.dirname(path), checkpoint_id)


_CLASS_NAMES = {"pytorch_lightning": "AtomicModelParallelStrategy",
                "lightning.pytorch": "LightningAtomicModelParallelStrategy"}  # unique names: instances pickle


@functools.cache
def strategy_class(package: str = "pytorch_lightning") -> type:
    """The strategy over ``package``'s ``ModelParallelStrategy`` (``"pytorch_lightning"`` or ``"lightning.pytorch"``):
    a Trainer accepts only strategies of its own package."""
    if package not in _CLASS_NAMES:
        raise ValueError(f"package must be one of {sorted(_CLASS_NAMES)}, got {package!r}")
    base = importlib.import_module(f"{package}.strategies").ModelParallelStrategy
    name = _CLASS_NAMES[package]
    return type(name, (_AtomicCheckpointing, base),
                {"__module__": __name__, "__qualname__": name, "__doc__": f"``{package}``'s ``ModelParallelStrategy`` "
                 "whose sharded checkpoints are dcp_atomic commits (see the module docstring)."})


def __getattr__(name: str) -> Any:
    """``AtomicModelParallelStrategy`` (over ``pytorch_lightning``, or ``lightning.pytorch`` where only that is
    installed) and ``LightningAtomicModelParallelStrategy`` (over ``lightning.pytorch``), built on first use."""
    if name == "LightningAtomicModelParallelStrategy":
        return strategy_class("lightning.pytorch")
    if name != "AtomicModelParallelStrategy":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        return strategy_class("pytorch_lightning")
    except ImportError:
        return strategy_class("lightning.pytorch")


class AtomicCheckpointHooks:
    """Mix into a ``LightningModule`` (``class Model(AtomicCheckpointHooks, L.LightningModule)``) so that
    ``Model.load_from_checkpoint(path)`` reads the weights a file written by the strategy names.

    Lightning calls no strategy there: it unpickles the file and hands ``checkpoint["state_dict"]`` to the new
    module after ``on_load_checkpoint``, which fills it here from the verified commit (resharded to this module's
    unsharded tensors), read by each process on its own: no collective, so rank 0 alone may call it.
    """

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint_id = checkpoint.get(POINTER_KEY)
        if isinstance(checkpoint_id, str) and not checkpoint.get("state_dict"):
            state = {"state_dict": self.state_dict()}
            # This process alone, even inside a process group: Lightning calls this per process (often on rank 0
            # only), and a collective would wait for ranks that never come.  The id names one step: no LATEST.
            dcp.load(state, storage_reader=AtomicStorageReader(), checkpoint_id=checkpoint_id,
                     planner=AtomicLoadPlanner(), no_dist=True)
            checkpoint["state_dict"] = state["state_dict"]
        parent = getattr(super(), "on_load_checkpoint", None)
        if parent is not None:
            parent(checkpoint)


def _retire_if_unreferenced(directory: str, checkpoint_id: str | None) -> None:
    """Remove ``checkpoint_id``'s state once no file in ``directory`` names it (global rank 0 alone): the step, or
    the whole run when no file names any of its steps (a top-k file rotated out).

    Cleanup after a committed save: a failure is logged, never raised, because the other ranks would wait for rank
    0 in their next collective, and the state stays committed and loadable until ``dcp-atomic gc`` / ``rm``.
    """
    if checkpoint_id is None:
        return
    try:
        root, run_id, step = parse_checkpoint_id(checkpoint_id)
        run_prefix = checkpoint_id.rsplit("/", 1)[0] + "/"
        # every file, whatever its suffix: trainer.save_checkpoint("final.pt") names its state too
        named = {_pointer(os.path.join(directory, n)) for n in os.listdir(directory)}
        if checkpoint_id in named:
            return
        layout = RunLayout(open_storage(root), run_id)
        if any(other is not None and other.startswith(run_prefix) for other in named):
            remove_step(layout, step)
        else:
            remove_run(layout)
    except CheckpointNotFoundError:
        return  # retired already
    except Exception as e:  # noqa: BLE001 - see the docstring
        log.warning("could not retire %s, which no Lightning checkpoint file names any more (%s: %s); it stays "
                    "committed until `dcp-atomic rm` or `gc` removes it", checkpoint_id, type(e).__name__, e)


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
