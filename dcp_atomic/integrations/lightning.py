"""Lightning's distributed checkpoints through dcp_atomic: ``Trainer(strategy=AtomicModelParallelStrategy(...))``.

Lightning's ``ModelParallelStrategy`` saves a sharded (DCP) checkpoint itself, not through ``CheckpointIO``,
into the directory ``ModelCheckpoint`` names (``<dirpath>/epoch=0-step=10.ckpt/``, files written in place).
Without a local tier, **every path Lightning names is its own checkpoint**: the sharded state of
``<dirpath>/<name>`` is committed as step ``global_step`` of a run named after ``<name>`` under
``<dirpath>/<run_id>/`` (see :func:`checkpoint_id_for`), and the path itself becomes a small file, published by
global rank 0 after the commit, holding Lightning's non-tensor state (a ``torch.save`` archive) and the checkpoint
id it belongs to (a JSON record inside the archive, read without unpickling anything, so foreign ``*.ckpt`` files
are skipped unread).

Why one run per name: Lightning keeps a second run in the same ``dirpath`` apart by versioning the names
(``last-v1.ckpt``), and a weights-only and a full ``ModelCheckpoint`` firing at one step write two names; keyed
by name, neither can replace the other's state.  Re-saving one name (``last.ckpt`` every epoch, the same name
after a rollback) replaces what that name held, as stock Lightning overwrites its file — and nothing else.
So ``ModelCheckpoint``'s bookkeeping (top-k, ``last.ckpt``, ``-vN``, ``ckpt_path="last"``) works unchanged, a
crash never leaves a half-written checkpoint Lightning could resume from, loads verify every byte, and a state
no file names any more is removed through retention (the step, or the name's whole run).

The local tier (``strategy(local_root="/local_nvme/ckpt", replicas=1)``; README "Two tiers"): the sharded state of
every file then goes through one :class:`~dcp_atomic.CheckpointManager` per ``dirpath`` (run ``tier-<digest of
dirpath>`` under ``<dirpath>/<run_id>/``, built on first use, in the same order on every rank), committed first to
each node's ``local_root`` with replicas on other failure domains, then drained to ``dirpath`` in the background.
What changes and why:

* each save takes a *fresh* manager step, above every step either tier holds and every step a file names, so a
  re-saved name or a rollback never reuses a step and the durable root never has to replace a commit; the file
  records that step and its ``save_id``;
* ``ckpt_path`` loads exactly that step (``CheckpointManager.load(step=)`` looks at that step alone in both tiers),
  from whichever copy can be assembled: own local files, a peer's replicas (a replaced node), else the durable copy
  once drained; the save_id is checked against the file's.  Never "the newest" instead: a file whose step has no
  copy left is a :class:`CheckpointNotFoundError` saying so.  ``restored_from`` says which tier served;
* every file is drained (Lightning saves are rare and each is a file a user may resume from), and never skipped:
  the drain queue replaces a waiting step with a newer one, which here would leave a file local-only, so each save
  first waits for the previous file's drain (at most one drain runs behind training);
* a step no file in ``dirpath`` names any more (top-k rotation, a re-saved name) is retired from both tiers at the
  next save and at the end of ``fit``, never while its drain runs (both happen after ``manager.wait()``), so no
  drain can bring it back; the end of ``fit`` waits for the last drain, and a save outside ``fit``
  (``trainer.save_checkpoint`` afterwards) waits for its own, so every file is durable when they return.

The memory tier (``strategy(memory=MemoryTier("/dev/shm/ckpt", every=1))``; docs/memory.md): at the end of each
training batch that made an optimizer step (never mid-accumulation) whose ``global_step`` is a multiple of ``every``
the strategy snapshots the whole Lightning
checkpoint (weights, optimizer states, loops, callbacks) into RAM on each node, with verified copies on other failure domains, through one ``CheckpointManager``
(run ``<run_id>-memory`` under the trainer's ``default_root_dir``); before each optimizer step it waits for
``wait_staged()`` (with ``staging=Staging(...)``).  ``fit(ckpt_path=MEMORY)`` resumes from the newest memory-committed
step (a fresh job on the same nodes; none held is a ``CheckpointNotFoundError``); ``fit(ckpt_path="last")`` (the
``last.ckpt`` file) takes the newest memory snapshot instead when it is of a later step, saying so at WARNING, and
any other file is loaded exactly as asked, never replaced by memory;
``strategy.restored_from`` says which tier served.  Missing: a fresh ``fit()`` without ``ckpt_path`` does not look
in memory (Lightning asks the strategy to load only when a path is given).

Moving a job onto this strategy: ``fit(ckpt_path=<a directory stock ModelParallelStrategy saved>)`` (its DCP
checkpoint and ``meta.pt``) resumes from it, read as stock reads it and said once to be unverified (it carries no
digests); every save from then on is a commit as above, and the stock directories the resumed callbacks rotate out
or save again (``last.ckpt``) are removed or replaced as stock Lightning would.

Both packages work: ``AtomicModelParallelStrategy`` is built over ``pytorch_lightning``'s ``ModelParallelStrategy``
(over ``lightning.pytorch``'s where only that is installed), ``LightningAtomicModelParallelStrategy`` over
``lightning.pytorch``'s.  ``LightningModule.load_from_checkpoint`` on one of these files needs
the module to mix in :class:`AtomicCheckpointHooks` (Lightning calls no strategy there).

Why one module of about 820 lines: one integration, one module (as torchtitan's and Accelerate's): the strategy, its
hooks and the pointer files, for both Lightning packages and both tiers.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import hashlib
import importlib
import json
import logging
import os
import re
import shutil
import warnings
import zipfile
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException

from .._base import arguments
from ..stores.backends import open_storage
from ..stores.storage import publish_stream
from ..protocol.catalog import DEFAULT_TIMEOUT
from ..errors import CheckpointError, CheckpointNotFoundError, shorten
from ..format.layout import RunLayout, parse_checkpoint_id
from ..manager import CheckpointManager
from ..manager.options import Callbacks, LocalTierOptions, MemoryTier
from ..staging import Staging
from ..format.parallelism import Parallelism
from ..dcp.planners import AtomicLoadPlanner, AtomicSavePlanner
from ..dcp.reader import AtomicStorageReader
from ..protocol.retention import remove_run, remove_step
from ..dcp.writer import AtomicStorageWriter

log = logging.getLogger(__name__)

POINTER_KEY = "dcp_atomic_checkpoint_id"
SAVE_ID_KEY = "dcp_atomic_save_id"  # beside POINTER_KEY: the one save of the step the file names
SEQUENCE_KEY = "dcp_atomic_sequence"  # and its commit sequence: a later commit of the step means it is gone
POINTER_RECORD = "dcp_atomic_pointer.json"  # inside the archive: {POINTER_KEY: checkpoint_id}
MAX_POINTER_RECORD_BYTES = 64 * 1024
_LOADING_FILE: contextvars.ContextVar[str | None] = contextvars.ContextVar("dcp_atomic_lightning_file", default=None)
_UNSAFE_RUN_CHARS = re.compile(r"[^A-Za-z0-9._-]")

STOCK_META = "meta.pt"  # stock ModelParallelStrategy's directory: Lightning's non-tensor state (torch.save)
STOCK_DCP_METADATA = ".metadata"  # beside it, torch's FileSystemWriter's index of the __<rank>_<n>.distcp files
_STOCK_FILES = f"DCP's {STOCK_DCP_METADATA} with its *.distcp files, and Lightning's {STOCK_META}"
MEMORY = "dcp_atomic:memory"  # fit(ckpt_path=MEMORY): resume from the newest memory-committed step
LIGHTNING_META_KEY = "lightning"  # in a snapshot: Lightning's non-tensor state, one object
EXPERIMENT_KEY = "dcp_atomic_experiment"  # in that state: the checkpoint directory of the experiment that snapshotted
TIER_DIGEST_CHARS = 12  # "tier-<12 hex>": never a name's run, whose digest has 8 (checkpoint_id_for)


def checkpoint_id_for(path: str, step: int, namespace: str = "lightning") -> str:
    """Where the state of Lightning's ``path`` at ``step`` is committed: ``<dir>/<namespace>/<run>/step_<step>``.

    The run is the file name made safe for a run id, plus a digest of the exact name, so names that differ only in
    characters a run id cannot hold (``epoch=1`` vs ``epoch_1``) never share a run.
    """
    directory, name = os.path.split(os.path.abspath(path))
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    readable = _UNSAFE_RUN_CHARS.sub("_", name).lstrip("._-")[:110] or "checkpoint"
    return f"{directory}/{namespace}/{readable}-{digest}/step_{step}"


def tier_run_for(directory: str, namespace: str = "lightning") -> tuple[str, str]:
    """The (root, run id) of the local tier's run for Lightning files in ``directory``: one run per directory, named
    after its absolute path, because several directories may share one node's ``local_root``."""
    directory = os.path.abspath(directory)
    digest = hashlib.sha256(directory.encode()).hexdigest()[:TIER_DIGEST_CHARS]
    return f"{directory}/{namespace}", f"tier-{digest}"


class _Tier:
    """One directory's manager, and the save_id of rank 0's last commit (``on_saved``) for the file to record."""

    def __init__(self, manager: CheckpointManager, directory: str) -> None:
        self.manager, self.directory = manager, directory
        self.last_save_id: str | None = None
        self.last_step = 0  # the highest step this process handed out: above it even once retired

    def saved(self, stats: dict[str, Any]) -> None:
        self.last_save_id = stats.get("save_id")


class _AtomicCheckpointing:
    """The checkpointing half of the strategy, mixed over a ``ModelParallelStrategy`` (see :func:`strategy_class`)."""

    def __init__(self, *args: Any, run_id: str = "lightning", parallelism: Parallelism | None = None,
                 compression: str | None = None, timeout: float = DEFAULT_TIMEOUT, local_root: str | None = None,
                 replicas: int = 1, keep_local: int = 2, failure_domain: str | None = None, reuse: bool = False,
                 memory: MemoryTier | None = None, staging: Staging | None = None, **kwargs: Any) -> None:
        """``run_id`` names the folder under each ``dirpath`` that holds the runs; ``parallelism`` is recorded
        for reshard checks (None: inferred from the DTensor meshes, Lightning's ``data_parallel`` /
        ``tensor_parallel`` names included).  ``local_root`` (each node's own absolute path), ``replicas``,
        ``keep_local``, ``failure_domain``: the local tier, as ``CheckpointManager`` takes them (module doc).
        ``reuse``: a save stores only what changed since the previous step of its run (P15, README "Reuse"): with
        ``local_root`` every file of a directory (one run per directory); without it, a re-saved name such as
        ``last.ckpt`` (one run per file name).  ``memory``, ``staging``: the memory tier and bounded staging of its
        snapshots (module doc)."""
        if local_root is not None and not os.path.isabs(os.fspath(local_root)):
            raise arguments.refused(f"{type(self).__name__}(local_root=...)", local_root,
                                    "an absolute path on each node's own storage", then="nothing was saved")
        super().__init__(*args, **kwargs)
        arguments.instance(f"{type(self).__name__}(parallelism=...)", parallelism, Parallelism, "a dcp_atomic.Parallelism")
        self.run_id = run_id
        self.parallelism = parallelism
        self.compression = compression
        self.reuse = arguments.flag(f"{type(self).__name__}(reuse=...)", reuse)
        self.timeout = timeout
        self.local_root = None if local_root is None else os.fspath(local_root)
        self.replicas, self.keep_local, self.failure_domain = replicas, keep_local, failure_domain
        self.restored_from: dict[str, Any] | None = None  # after a local-tier load: the manager's restored_from
        self._tiers: dict[tuple[str, str], _Tier] = {}
        self._redrained: set[tuple[str, int]] = set()  # (dirpath, step) this job drained again (_quiet_point)
        self._fitting = False
        arguments.instance(f"{type(self).__name__}(memory=...)", memory, MemoryTier, "a dcp_atomic.MemoryTier")
        arguments.instance(f"{type(self).__name__}(staging=...)", staging, Staging, "a dcp_atomic.Staging")
        self.memory, self.staging = memory, staging
        self.memory_manager: CheckpointManager | None = None  # built at setup, every rank alike
        self.snapshotted: Any = None  # the latest snapshot's future (a SnapshotFuture)
        self._stepped_at: int | None = None  # global_step at the last batch end: a snapshot needs an optimizer step since

    def setup(self, trainer: Any) -> None:
        """With ``memory``: the manager of the snapshots, and the callback that takes them (module doc)."""
        super().setup(trainer)
        if self.memory is None or self.memory_manager is not None:
            return
        # the strategy picks the steps (global_step % every): the tier takes every call it is given
        memory = dataclasses.replace(self.memory, every=1)
        self.memory_manager = CheckpointManager(trainer.default_root_dir, f"{self.run_id}-memory", memory=memory,
                                                staging=self.staging, parallelism=self.parallelism,
                                                timeout=self.timeout)
        if not any(isinstance(c, _MemorySnapshots) for c in trainer.callbacks):
            trainer.callbacks.append(_memory_callback(self._package)())

    def snapshot(self, trainer: Any) -> Any:
        """Snapshot Lightning's whole checkpoint as of now at every ``every``-th step (every rank alike): the
        manager's future, or None at a step not due.  Only right after an optimizer step: a batch that only
        accumulated gradients (``accumulate_grad_batches``) is mid-step, and a snapshot of it would resume without
        the gradients it accumulated."""
        stepped = self._stepped_at is not None and trainer.global_step != self._stepped_at
        self._stepped_at = trainer.global_step
        if not stepped or trainer.global_step % self.memory.every:
            return None
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        state = self._sharded_state(checkpoint)
        checkpoint[EXPERIMENT_KEY] = _experiment_of(trainer)
        state[LIGHTNING_META_KEY] = (checkpoint,)
        self.snapshotted = self.memory_manager.snapshot(trainer.global_step, state)
        return self.snapshotted

    def _restore_from_memory(self, state: dict[str, Any], newer_than: int | None,
                             experiment: str | None = None) -> dict[str, Any] | None:
        """Lightning's checkpoint of the newest memory-committed step, loaded into ``state`` (the model's and
        optimizers' own tensors), when it is above ``newer_than`` and (given ``experiment``, the checkpoint
        directory of the file it would stand in for) was snapshotted by that experiment; else None, ``state`` left
        for the file's load."""
        if self.memory_manager is None:
            return None
        state[LIGHTNING_META_KEY] = (None,)
        try:
            step = self.memory_manager.load(state)
        except CheckpointNotFoundError:
            if newer_than is None:
                raise
            return None
        finally:
            meta = state.pop(LIGHTNING_META_KEY)[0]
        if newer_than is not None and step <= newer_than:
            return None
        taken_by = meta.pop(EXPERIMENT_KEY, None) if isinstance(meta, dict) else None
        if None not in (experiment, taken_by) and taken_by != experiment:  # None: a trainer that saved no files
            log.warning("the memory tier holds step %d, newer than step %d of %s, but another experiment took it "
                        "(its checkpoints: %s): resuming from the file", step, newer_than, experiment, taken_by)
            return None
        self.restored_from = self.memory_manager.restored_from
        if newer_than is None:
            log.info("resuming from step %d of the memory tier (%s)", step, (self.restored_from or {}).get("tier"))
        else:
            log.warning("resuming from step %d of the memory tier (%s), newer than step %d of the last checkpoint "
                        "file: pass that file's named checkpoint (not last) to resume exactly there", step,
                        (self.restored_from or {}).get("tier"), newer_than)
        return meta

    @staticmethod
    def _sharded_state(checkpoint: dict[str, Any]) -> dict[str, Any]:
        """The sharded part of Lightning's ``checkpoint``, taken out of it: what DCP (or a snapshot) stores."""
        state = {"state_dict": checkpoint.pop("state_dict")}
        state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        return state

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options")
        path = os.path.abspath(self.broadcast(os.fspath(filepath)))
        state = self._sharded_state(checkpoint)
        if self.local_root is not None:
            return self._tier_save(checkpoint, path, state)
        checkpoint_id = checkpoint_id_for(path, checkpoint["global_step"], self.run_id)
        # This name's own run: re-saving the name replaces what it held (Lightning overwrites its file), never
        # what another name holds.
        writer = AtomicStorageWriter(overwrite=True, timeout=self.timeout, parallelism=self.parallelism,
                                     compression=self.compression, reuse=self.reuse)
        dcp.save(state, storage_writer=writer, checkpoint_id=checkpoint_id, planner=AtomicSavePlanner())
        marker = writer.last_marker  # rank 0's (the one whose file is written); the state lives beside the file
        self._publish(checkpoint, path, checkpoint_id, {
            "save_id": writer.save_id, "sequence": None if marker is None else marker.sequence})

    def _publish(self, checkpoint: dict[str, Any], path: str, checkpoint_id: str,
                 record: dict[str, Any] | None = None) -> None:
        """Global rank 0 writes Lightning's file naming the committed ``checkpoint_id`` and where it lies relative to
        the file (:func:`checkpoint_id_of`: a copied or moved ``dirpath`` loads its own), then retires the state of
        one tier that the file named before and no file names now; a failure reaches every rank."""
        record = {**(record or {}), "relative": os.path.relpath(checkpoint_id, os.path.dirname(path))}
        checkpoint[POINTER_KEY] = checkpoint_id  # for AtomicCheckpointHooks, outside a Trainer
        checkpoint[SAVE_ID_KEY] = record.get("save_id")  # rank 0's: the one whose file is written
        checkpoint[SEQUENCE_KEY] = record.get("sequence")
        failure = None
        if self.global_rank == 0:
            try:
                replaced = _pointer(path)
                _write_pointer(path, checkpoint, checkpoint_id, record)
            except Exception as e:  # noqa: BLE001 - sent to every rank below, so none waits in a collective for it
                failure = f"{type(e).__name__}: {e}"
            else:
                if replaced != checkpoint_id and not _is_tier_id(replaced):  # a tier's: retired at a quiet point
                    _retire_if_unreferenced(os.path.dirname(path), replaced)  # e.g. last.ckpt moved on
        failure = self.broadcast(failure)
        if failure is not None:
            raise CheckpointError(f"{checkpoint_id} is committed, but global rank 0 could not write Lightning's file "
                                  f"{path} that names it ({failure}); fix the cause and save again", path=path)

    def _tier_save(self, checkpoint: dict[str, Any], path: str, state: dict[str, Any]) -> None:
        """A save through the directory's manager at a fresh step, drained; the file names step and save_id."""
        tier = self._tier(*tier_run_for(os.path.dirname(path), self.run_id), os.path.dirname(path))
        manager = tier.manager
        step = tier.last_step = self._quiet_point(tier)
        tier.last_save_id = None
        manager.save(step, state, metadata={"lightning_file": os.path.basename(path),
                                            "global_step": checkpoint.get("global_step")}, durable=True)
        checkpoint_id = f"{manager.root}/{manager.run_id}/step_{step}"
        save_id = tier.last_save_id if self.global_rank == 0 else None
        self._publish(checkpoint, path, checkpoint_id, {"save_id": save_id, "tier": True})
        if not self._fitting:  # trainer.save_checkpoint outside fit: nothing later would wait for the drain
            manager.wait()

    def _quiet_point(self, tier: _Tier) -> int:
        """Every rank: wait for the drains, retire the steps no file names, and agree on a fresh step.

        After ``wait()`` no drain runs or waits, so a retired step cannot be brought back by one, and the durable
        root's ``LATEST``/journal are not being written while steps leave it."""
        manager = tier.manager
        manager.wait()  # also: a waiting drain would be replaced by the next save's, so that file never drains
        local, durable = manager.steps(tier="local"), manager.steps(tier="durable")  # every rank alike
        held = sorted(set(local) | set(durable))
        plan = None
        if self.global_rank == 0:
            try:
                named = _named_steps(tier)
            except OSError as e:  # sent to every rank: none may wait in the broadcast for a rank that raised
                plan = f"global rank 0 could not read the files of {tier.directory} ({e}): fix access and save again"
            else:  # a named step only on the nodes: its drain failed, or an earlier job stopped before it
                plan = (sorted(set(held) - named), sorted((named & set(local)) - set(durable)),
                        max([tier.last_step, *held, *named]) + 1)
        plan = self.broadcast(plan)
        if isinstance(plan, str):
            raise CheckpointError(plan, path=tier.directory, rank=0)
        unnamed, undrained, step = plan
        _retire(tier, unnamed)
        for named_step in (s for s in undrained if (tier.directory, s) not in self._redrained):
            self._redrained.add((tier.directory, named_step))  # once per job: a drain that cannot succeed never loops
            log.warning("%s: step %d, which a file names, has no durable copy yet (its drain failed or the job "
                        "stopped first); draining it again before the next save", tier.directory, named_step)
            try:
                manager.queue_drain(named_step)
                manager.wait()
            except CheckpointError as e:  # every rank alike (rank 0's marker, the drain's outcome are shared)
                log.error("%s: step %d could not be drained again (%s); its file resumes only while a node holds "
                          "it: save a new checkpoint, or fix the cause and restart", tier.directory, named_step, e)
        return step

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                             set_model_state_dict, set_optimizer_state_dict)

        path = self.broadcast(os.fspath(checkpoint_path))
        state = {"state_dict": get_model_state_dict(self.model)}
        state.update({f"optimizer_{i}": get_optimizer_state_dict(self.model, o) for i, o in enumerate(self.optimizers)})
        if path == MEMORY:
            if self.memory_manager is None:
                raise CheckpointNotFoundError(f"fit(ckpt_path={MEMORY!r}) needs the memory tier: pass "
                                              f"memory=MemoryTier(...) to {type(self).__name__}")
            meta = self._restore_from_memory(state, None)
            self._install(state, set_model_state_dict, set_optimizer_state_dict)
            return meta
        if os.path.isdir(path):  # what stock ModelParallelStrategy saved: a job moving onto this strategy
            meta = self._stock_load(path, state, weights_only)
            self._install(state, set_model_state_dict, set_optimizer_state_dict)
            return meta
        record = _pointer_record(path)
        checkpoint_id = None if record is None else checkpoint_id_of(path, record)
        if checkpoint_id is None:
            raise CheckpointError(f"{path} was not saved by {type(self).__name__} (no dcp_atomic checkpoint id "
                                  f"recorded in it), nor is it a directory stock ModelParallelStrategy saved "
                                  f"({_STOCK_FILES}): resume from one of those", path=path)
        meta = torch.load(path, weights_only=weights_only)  # Lightning's own rule: None is torch's default
        meta.pop(POINTER_KEY, None)  # loaded here: AtomicCheckpointHooks must not load it again
        meta.pop(SAVE_ID_KEY, None)
        meta.pop(SEQUENCE_KEY, None)
        # an explicit file is what the user asked for; only ModelCheckpoint's "last" may mean the newest memory step
        newer = (self._restore_from_memory(state, meta.get("global_step", -1), os.path.dirname(os.path.realpath(path)))
                 if _is_last(path) else None)
        if newer is not None:
            self._install(state, set_model_state_dict, set_optimizer_state_dict)
            return newer
        if record.get("tier") and self.local_root is not None:
            self._tier_load(path, record, state)
        else:  # one tier, or a local-tier file read where this job has no local root: its durable copy
            try:  # that save or nothing, refused before any read
                reader = _resolved_reader(checkpoint_id, record.get("save_id"), _sequence(record),
                                          timeout=self.timeout, parallelism=self.parallelism)
                dcp.load(state, storage_reader=reader, planner=AtomicLoadPlanner())
            except CheckpointNotFoundError as e:
                if not record.get("tier"):
                    raise
                raise CheckpointNotFoundError(
                    f"{path} names {checkpoint_id}, saved to the local tier, and its durable copy is not there "
                    f"({e.message}); pass local_root= (each node's own path) to restore it from the nodes",
                    path=path, checkpoint_id=checkpoint_id) from e
            if record.get("save_id") not in (None, reader.save_id):
                raise CheckpointError(f"{path} names save {record['save_id']} of {checkpoint_id}, but "
                                      f"{reader.save_id} is stored there: resume from another file", path=path)
        self._install(state, set_model_state_dict, set_optimizer_state_dict)
        return meta

    def _install(self, state: dict[str, Any], set_model_state_dict: Any, set_optimizer_state_dict: Any) -> None:
        set_model_state_dict(self.model, state["state_dict"])
        for i, optimizer in enumerate(self.optimizers):
            set_optimizer_state_dict(self.model, optimizer, state[f"optimizer_{i}"])

    def _stock_load(self, path: str, state: dict[str, Any], weights_only: bool | None) -> dict[str, Any]:
        """Fill ``state`` from a directory stock ``ModelParallelStrategy(save_distributed_checkpoint=True)`` saved
        (a stock DCP checkpoint of ``state_dict`` and ``optimizer_<i>``, and ``meta.pt``: loops, callbacks, epoch);
        return that Lightning state.

        So a job moves onto this strategy by resuming, with no conversion step: the tensors are read as stock
        Lightning reads them (torch's ``FileSystemReader``, which wrote them), and every save from then on is a
        dcp_atomic commit.  Such a checkpoint carries no digests: its bytes cannot be verified as a commit's are,
        which global rank 0 says once.  Anything else in a directory is refused before a byte is read.
        """
        missing = [name for name in (STOCK_DCP_METADATA, STOCK_META) if not os.path.isfile(os.path.join(path, name))]
        if missing:
            raise CheckpointError(f"{path} is a directory, but not a checkpoint stock ModelParallelStrategy saved: "
                                  f"{' and '.join(missing)} missing (expected {_STOCK_FILES}); resume from a "
                                  "complete stock checkpoint directory or a file this strategy wrote",
                                  path=path, missing=missing)
        try:
            dcp.load(state, storage_reader=dcp.FileSystemReader(path))
        except CheckpointException as e:  # DCP wraps each rank's failure as (exception, traceback)
            causes = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()] or [e]
            cause = str(causes[0]).strip().splitlines()[0] if str(causes[0]).strip() else type(causes[0]).__name__
            raise CheckpointError(f"{path} is a stock ModelParallelStrategy checkpoint, but this model's state could "
                                  f"not be read from it ({type(causes[0]).__name__}: {shorten(cause, 300)}); it "
                                  "carries no digests, so a damaged or partly copied file shows only here: resume "
                                  "from another checkpoint, or check that it was saved from this model and "
                                  "optimizer", path=path) from e
        meta = torch.load(os.path.join(path, STOCK_META), weights_only=weights_only)  # as stock loads it
        if not isinstance(meta, dict):
            raise CheckpointError(f"{os.path.join(path, STOCK_META)} holds a {type(meta).__name__}, not the dict of "
                                  "Lightning state stock ModelParallelStrategy saves there: resume from another "
                                  "checkpoint", path=path)
        if self.global_rank == 0:
            log.warning("%s: resumed from a checkpoint stock ModelParallelStrategy saved; it carries no digests, so "
                        "its bytes were read unverified (dcp_atomic's commits are verified on every load). "
                        "Checkpoints saved from now on are dcp_atomic commits", path)
        return meta

    def _tier_load(self, path: str, record: dict[str, Any], state: dict[str, Any]) -> None:
        """Exactly the step the file names, from the nearest complete copy of it (module doc)."""
        checkpoint_id, save_id = checkpoint_id_of(path, record), record.get("save_id")
        root, run_id, step = parse_checkpoint_id(checkpoint_id)
        tier = self._tier(root, run_id, os.path.dirname(root))
        try:
            tier.manager.load(state, step=step, save_id=save_id)  # that save or nothing, refused before any read
        except CheckpointNotFoundError as e:
            raise CheckpointNotFoundError(
                f"{path} names step {step} (save {save_id}) of the local tier's run {run_id!r}, and no complete copy "
                f"of it is left: not on any node's local root ({self.local_root} on this one) nor in {root}. "
                f"{e.message} Resume from another file of {os.path.dirname(path)}.",
                path=path, step=step, save_id=save_id) from e
        self.restored_from = dict(tier.manager.restored_from or {})

    def remove_checkpoint(self, filepath: Any) -> None:
        """Rank 0: drop Lightning's file, then the state it named once no other file (``last.ckpt``...) names it
        (the local tier's: at the next save or the end of ``fit``, when every rank retires it)."""
        if not self.is_global_zero:
            return
        path = os.path.abspath(os.fspath(filepath))
        if _is_stock_checkpoint(path):  # a stock directory a resumed callback rotates out: removed as stock would
            try:
                shutil.rmtree(path)
            except OSError as e:
                log.warning("could not remove the stock checkpoint %s (%s)", path, e)
            return
        try:  # rank 0 alone: raising here would leave the other ranks in their next collective
            checkpoint_id = _pointer(path)
            os.remove(path)
        except FileNotFoundError:  # gone already (a resumed callback's state names a file it removed): as stock
            return
        except OSError as e:
            log.warning("could not remove %s (%s); the state it names stays committed", path, e)
            return
        if not _is_tier_id(checkpoint_id):  # a tier's: retired at the next quiet point (every rank takes part)
            _retire_if_unreferenced(os.path.dirname(path), checkpoint_id)

    def on_train_start(self) -> None:
        super().on_train_start()
        self._fitting = True

    def on_train_end(self) -> None:
        """Every file durable before ``fit`` returns: wait for the drains, then retire what no file names."""
        self._fitting = False
        for tier in list(self._tiers.values()):  # the same order on every rank: built in the same order
            if tier_run_for(tier.directory, self.run_id)[1] == tier.manager.run_id:
                self._quiet_point(tier)
            # else a copied or moved dirpath's files were loaded, not saved to: their run id is the original's, and
            # so are the nodes' local steps of it, which a retire of what the copy's files do not name would remove
        super().on_train_end()

    def teardown(self) -> None:
        """Close the managers (their process groups; a drain still running is waited for)."""
        self._fitting = False
        tiers, self._tiers = list(self._tiers.values()), {}
        managers = [(tier.manager, f"the local tier of {tier.directory}") for tier in tiers]
        if self.memory_manager is not None:
            managers.append((self.memory_manager, "the memory tier"))
            self.memory_manager = None
        for manager, what in managers:
            try:
                manager.close()
            except Exception as e:  # noqa: BLE001 - on_train_end raised it already, or an exception is on its way
                log.error("closing %s: %s: %s", what, type(e).__name__, e)
        super().teardown()

    def _local_tier(self) -> LocalTierOptions | None:
        if self.local_root is None:
            return None
        return LocalTierOptions(self.local_root, replicas=self.replicas, keep_local=self.keep_local,
                                failure_domain=self.failure_domain)

    def _tier(self, root: str, run_id: str, directory: str) -> _Tier:
        """The manager of one directory's tier run, built on first use (its process groups: every rank, in order)."""
        tier = self._tiers.get((root, run_id))
        if tier is None:
            tier = _Tier(None, directory)  # type: ignore[arg-type]
            tier.manager = CheckpointManager(root, run_id, parallelism=self.parallelism, compression=self.compression,
                                             reuse=self.reuse, timeout=self.timeout, local=self._local_tier(),
                                             callbacks=Callbacks(on_saved=tier.saved))
            self._tiers[(root, run_id)] = tier
        return tier


_CLASS_NAMES = {"pytorch_lightning": "AtomicModelParallelStrategy",
                "lightning.pytorch": "LightningAtomicModelParallelStrategy"}  # unique names: instances pickle


@functools.cache
def strategy_class(package: str = "pytorch_lightning") -> type:
    """The strategy over ``package``'s ``ModelParallelStrategy`` (``"pytorch_lightning"`` or ``"lightning.pytorch"``):
    a Trainer accepts only strategies of its own package."""
    arguments.choice("strategy_class(package=...)", package, sorted(_CLASS_NAMES))
    base = importlib.import_module(f"{package}.strategies").ModelParallelStrategy
    name = _CLASS_NAMES[package]
    return type(name, (_AtomicCheckpointing, base),
                {"__module__": __name__, "__qualname__": name, "_package": package, "__doc__": f"``{package}``'s ``ModelParallelStrategy`` "
                 "whose sharded checkpoints are dcp_atomic commits (see the module docstring)."})


class _MemorySnapshots:
    """The strategy's callback with ``memory=``: a snapshot at the end of each training batch that made an optimizer
    step (the strategy takes those of every ``every``-th step), ``wait_staged()`` before each optimizer step.  Mixed
    over ``Callback`` of the strategy's package (:func:`_memory_callback`): a Trainer calls only its own package's
    callbacks."""

    def on_train_start(self, trainer: Any, *args: Any) -> None:
        trainer.strategy._stepped_at = trainer.global_step  # after a resume: the step it resumed at

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        trainer.strategy.snapshot(trainer)

    def on_before_optimizer_step(self, trainer: Any, *args: Any) -> None:
        trainer.strategy.memory_manager.wait_staged()


_LAST_FILE = re.compile(r"^last(-v\d+)?\.ckpt$")  # ModelCheckpoint.CHECKPOINT_NAME_LAST, its -vN versions


def _experiment_of(trainer: Any) -> str | None:
    """Which experiment a snapshot belongs to: the directory its checkpoint files go to (ModelCheckpoint's), which
    a "last" file it may stand in for lies in.  Two experiments in one ``default_root_dir`` share the memory run;
    this keeps one from resuming the other's newer snapshot (None: the trainer saves no files)."""
    dirpath = getattr(getattr(trainer, "checkpoint_callback", None), "dirpath", None)
    return None if dirpath is None else os.path.realpath(dirpath)


def _is_last(path: str) -> bool:
    """Whether ``path`` is ModelCheckpoint's ``last`` file (``fit(ckpt_path="last")`` resolves to it): the one file a
    newer memory snapshot may stand in for."""
    return bool(_LAST_FILE.match(os.path.basename(path)))


@functools.cache
def _memory_callback(package: str) -> type:
    base = importlib.import_module(f"{package}.callbacks").Callback
    return type("MemorySnapshots", (_MemorySnapshots, base), {"__module__": __name__})


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

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: Any, *args: Any, **kwargs: Any):
        """Lightning's, noting which file is loaded: its state is found relative to it (:func:`checkpoint_id_of`),
        so a copied or moved ``dirpath`` loads its own."""
        where = os.fspath(checkpoint_path) if isinstance(checkpoint_path, (str, os.PathLike)) else None
        token = _LOADING_FILE.set(where)
        try:
            return super().load_from_checkpoint(checkpoint_path, *args, **kwargs)
        finally:
            _LOADING_FILE.reset(token)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint_id = checkpoint.get(POINTER_KEY)
        where = _LOADING_FILE.get()
        record = None if where is None or not isinstance(checkpoint_id, str) else _pointer_record(where)
        if record is not None and record[POINTER_KEY] == checkpoint_id:  # this dict is that file's
            checkpoint_id = checkpoint_id_of(where, record)
        if isinstance(checkpoint_id, str) and not checkpoint.get("state_dict"):
            state = {"state_dict": self.state_dict()}
            # This process alone, even inside a process group: Lightning calls this per process (often on rank 0
            # only), and a collective would wait for ranks that never come.  The file names one save of one step;
            # a file of an earlier version names only the step: then the save the step holds now.
            save_id = checkpoint.get(SAVE_ID_KEY)
            if not isinstance(save_id, str):
                save_id = _resolved_reader(checkpoint_id, None, None).save_id
            reader = _resolved_reader(checkpoint_id, save_id, _sequence({"sequence": checkpoint.get(SEQUENCE_KEY)}))
            with warnings.catch_warnings(), _quiet_layout_check():
                # no_dist is this hook's choice, not a missing process group
                warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
                dcp.load(state, storage_reader=reader, planner=AtomicLoadPlanner(), no_dist=True)
            checkpoint["state_dict"] = state["state_dict"]
        parent = getattr(super(), "on_load_checkpoint", None)
        if parent is not None:
            parent(checkpoint)


@contextlib.contextmanager
def _quiet_layout_check():
    """``load_from_checkpoint`` reads unsharded tensors into one process: a module outside a Trainer has no layout
    to declare, so "parallel layout check skipped" would be said on every call, with nothing the user could do."""
    def drop(record: logging.LogRecord) -> bool:
        return "parallel layout check skipped" not in record.getMessage()

    logger = logging.getLogger("dcp_atomic.reshard")
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


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


def _is_tier_id(checkpoint_id: str | None) -> bool:
    """Whether ``checkpoint_id`` names a step of a local tier's run (:func:`tier_run_for`), not a name's run."""
    if checkpoint_id is None:
        return False
    try:
        _, run_id, _ = parse_checkpoint_id(checkpoint_id)
    except (CheckpointError, ValueError):
        return False
    return re.fullmatch(f"tier-[0-9a-f]{{{TIER_DIGEST_CHARS}}}", run_id) is not None


def _named_steps(tier: _Tier) -> set[int]:
    """Global rank 0: the steps of ``tier``'s run that some file in its directory names (every file, any suffix)."""
    manager, steps = tier.manager, set()
    if not os.path.isdir(tier.directory):
        return steps  # the first save into a new dirpath
    for name in os.listdir(tier.directory):
        checkpoint_id = _pointer(os.path.join(tier.directory, name))
        if checkpoint_id is None or not _is_tier_id(checkpoint_id):
            continue
        root, run_id, step = parse_checkpoint_id(checkpoint_id)
        if run_id == manager.run_id and os.path.abspath(root) == os.path.abspath(os.fspath(manager.root)):
            steps.add(step)
    return steps


def _retire(tier: _Tier, steps: list[int]) -> None:
    """Every rank, at a quiet point (no drain running or waiting): ``steps`` leave both tiers
    (:meth:`CheckpointManager.retire`; a step left behind is retired at the next quiet point, or by ``dcp-atomic rm``)."""
    if steps:
        tier.manager.retire(steps)
        log.info("retired step(s) %s of %s: no file in %s names them", steps, tier.manager.run_id, tier.directory)


def _write_pointer(path: str, checkpoint: dict[str, Any], checkpoint_id: str,
                   record: dict[str, Any] | None = None) -> None:
    """Publish Lightning's non-tensor state at ``path`` (durable, atomic) with the record :func:`_pointer` reads."""
    os.makedirs(os.path.dirname(path), exist_ok=True)  # the local tier's first save: the drain may not have run yet

    def write(file) -> None:
        torch.save(checkpoint, file)
        with zipfile.ZipFile(file, "a") as archive:  # torch.load ignores records it does not know
            folder = archive.namelist()[0].partition("/")[0]
            archive.writestr(f"{folder}/{POINTER_RECORD}", json.dumps({**(record or {}), POINTER_KEY: checkpoint_id}))

    if os.path.isdir(path):
        _replace_stock_checkpoint(path, write)
    else:
        publish_stream(path, write)


def _is_stock_checkpoint(path: str) -> bool:
    """Whether ``path`` is a directory stock ``ModelParallelStrategy`` saved: DCP's ``.metadata`` and ``meta.pt``."""
    return all(os.path.isfile(os.path.join(path, name)) for name in (STOCK_DCP_METADATA, STOCK_META))


def _replace_stock_checkpoint(path: str, write) -> None:
    """Publish the file ``write(file)`` writes at ``path``, where stock ``ModelParallelStrategy`` saved a directory
    (``last.ckpt`` of the job before it moved onto this strategy): stock Lightning overwrites a name it saves again,
    and so does this.

    A directory cannot be replaced by a file in one rename: it is renamed aside first, so a crash in between leaves
    the stock checkpoint whole at ``<path>.<pid>.stock`` (rename it back to resume from it), then removed.  Any other
    directory is never touched."""
    if not _is_stock_checkpoint(path):
        raise IsADirectoryError(f"{path} is a directory, and not a checkpoint stock ModelParallelStrategy saved "
                                f"({_STOCK_FILES}): move it away, or save under another name")
    aside = f"{path}.{os.getpid()}.stock"
    os.rename(path, aside)
    try:
        publish_stream(path, write)
    except BaseException:
        os.rename(aside, path)
        raise
    try:
        shutil.rmtree(aside)
    except OSError as e:  # the file is published: what is left of the old directory is only space
        log.warning("could not remove %s (%s), the stock checkpoint %s replaced", aside, e, path)


def checkpoint_id_of(path: str, record: dict[str, Any]) -> str:
    """The state a file written by :func:`_write_pointer` names, wherever the file is now.

    A name's state lives beside its file (``<dir>/<namespace>/<run>/step_N``, :func:`checkpoint_id_for`), and the
    record says where relative to the file: so a copied (``cp -a``) or moved ``dirpath`` resumes its own state,
    not the original's.  The absolute id the file recorded is used when that place holds no run (the file was
    copied without its directory, or an older file records no place); the save id pins the version either way.
    """
    relative = record.get("relative")
    if isinstance(relative, str) and not os.path.isabs(relative) and ".." not in relative.split(os.sep):
        here = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(path)), relative))
        if os.path.isdir(os.path.dirname(here)):
            return here
    return record[POINTER_KEY]


def _resolved_reader(checkpoint_id: str, save_id: str | None, sequence: int | None, **options: Any) -> AtomicStorageReader:
    """A reader of exactly that save of ``checkpoint_id``, resolved here: a refusal (the save is gone, the step
    damaged) is dcp_atomic's own typed error, not DCP's wrapping of it."""
    root, run_id, step = parse_checkpoint_id(checkpoint_id)
    reader = AtomicStorageReader(root, run_id, step, save_id=save_id, save_sequence=sequence, **options)
    reader.resolve()
    return reader


def _sequence(record: dict[str, Any]) -> int | None:
    sequence = record.get("sequence")
    return sequence if type(sequence) is int and sequence >= 0 else None


def _pointer(path: str) -> str | None:
    """The checkpoint id a file written by :func:`_write_pointer` names where it is now (:func:`checkpoint_id_of`);
    None for any other file."""
    record = _pointer_record(path)
    return None if record is None else checkpoint_id_of(path, record)


def _pointer_record(path: str) -> dict[str, Any] | None:
    """The record a file written by :func:`_write_pointer` holds (``POINTER_KEY``: the checkpoint id; a local-tier
    file adds ``save_id`` and ``tier``); None for any other file.

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
    if not isinstance(record, dict) or not isinstance(record.get(POINTER_KEY), str):
        return None
    return record
