"""torchtitan checkpointing through dcp_atomic: select it with ``checkpoint=AtomicCheckpointManager.Config(...)``.

torchtitan's own DCP manager decides *what* to save and when (interval, last step model-only in
``export_dtype``, async modes, staging); this subclass changes only *how*: every save goes through one
reused :class:`AtomicStorageWriter` (``<folder>/step_<N>`` becomes ``<dirname(folder)>/<basename(folder)>/
step_{N:010d}/<save_id>/``, committed by a marker), "latest" is the latest *committed* step (a crashed
save is never resumed from), loads verify every byte, and ``keep_latest_k`` runs through retention,
which counts only committed steps and never deletes what ``LATEST`` names — so ``keep_latest_k=1`` is safe.
It runs on global rank 0 in a background thread, as torchtitan's own purge does: training never waits for it.

Rollbacks (P14): after loading an earlier step (``load_step=8`` while step 10 is committed), the saves of steps
above it supersede the abandoned branch's — where stock torchtitan overwrites the folder in place, and a plain
re-save is refused.  ``initial_load_path`` may name a step of another dcp_atomic run
(``<root>/<run>/step_{N:010d}``): it is read and verified like our own; anything else goes to torchtitan's
stock loader.

The local tier (``local_root="/local_nvme/ckpt"``; README, "Two tiers"): every save torchtitan makes lands first on
each node's own ``<local_root>/<basename(folder)>/``, with each rank's files copied to ``replicas`` ranks on other
failure domains (``$DCP_ATOMIC_FAILURE_DOMAIN``, else the host name) and committed there; it is *not* in ``folder``.
Only the steps that are multiples of ``interval * durable_every``, and the last step, are drained to ``folder`` in
the background (training never waits; ``close()`` does, for the last one).  ``keep_latest_k`` then counts the steps
in ``folder``, ``keep_local`` those on each node.  A load takes the newest step that can be assembled completely and
verified from the local roots, the replicas on other nodes (a replaced node gets its files back) or ``folder``;
``load_step`` names a step of either tier.  Everything runs through one :class:`dcp_atomic.CheckpointManager` built
with the trainer (its own process groups: the drain needs one), so rollbacks, interval saves and the async modes
keep their meaning; ``async_with_pinned_mem`` stages synchronously there, as ``async`` does.

The memory tier (``memory_path="/dev/shm/ckpt"``; docs/memory.md): every ``memory_interval``-th step torchtitan's
``save(step)`` also snapshots the whole training state into RAM on each node, with ``memory_replicas`` verified copies
on other failure domains, while ``interval`` keeps deciding the saves to ``folder`` (or ``local_root``).  A load takes
the newest step by commit sequence over memory, the local roots and ``folder``; ``self.tier.restored_from`` says which
tier served.  ``staging_pool_bytes`` bounds the host memory the async saves stage through (no whole host copy of the
state): ``maybe_wait_for_staging()``, which the trainer calls before the optimizer step, waits for the live tensors.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse
from torchtitan.components.checkpointer.base import MODEL
from torchtitan.components.checkpointer.dcp import AsyncMode, CheckpointManager

from ..protocol.catalog import DEFAULT_TIMEOUT, latest_step
from ..protocol.commit import read_marker, resume_point
from ..errors import CheckpointError, CheckpointNotFoundError, StorageError
from ..format.layout import RunLayout, parse_checkpoint_id, root_key, step_dir_name
from ..dcp.planners import AtomicLoadPlanner, AtomicSavePlanner
from ..stores.backends import open_storage
from ..dcp.reader import AtomicStorageReader
from .._base import arguments
from .._base.retry import Deadline
from ..protocol.retention import apply_gc, plan_gc
from ..manager import CheckpointManager as TierManager
from ..manager.options import LocalTierOptions, MemoryTier
from ..staging import Staging
from ..dcp.writer import AtomicStorageWriter

log = logging.getLogger(__name__)


class AtomicCheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager`` with dcp_atomic storage (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        timeout: float = DEFAULT_TIMEOUT
        """Seconds dcp_atomic's own waits (visibility, retries, commit) may take."""

        compression: str | None = None
        """None or "zstd"."""

        reuse: bool = False
        """Each save stores only what changed since the run's previous step (P15, README "Reuse"): a frozen base
        (LoRA, a frozen embedding) is stored once and linked (POSIX) or copied server-side (S3, GCS) after."""

        local_root: str | None = None
        """This node's own storage (a local path, the same on every node): saves land there, replicated to other
        failure domains, and only some are drained to ``folder`` (module docstring).  None: every save to ``folder``."""

        replicas: int = 1
        """With ``local_root``: copies of each rank's files on ranks of other failure domains."""

        durable_every: int = 1
        """With ``local_root``: steps that are multiples of ``interval * durable_every`` (and the last step) are
        drained to ``folder``; the others stay on the nodes.  1: every save, still without waiting for the durable
        store."""

        keep_local: int = 2
        """With ``local_root``: steps kept on each node (a step still draining is kept besides)."""

        memory_path: str | None = None
        """A RAM-backed directory on each node (a tmpfs such as ``/dev/shm/ckpt``): the memory tier (module docstring).
        None: no snapshots."""

        memory_interval: int = 1
        """With ``memory_path``: snapshot the steps that are multiples of it (``interval`` still decides the saves)."""

        memory_replicas: int = 1
        """With ``memory_path``: copies of each rank's snapshot on ranks of other failure domains."""

        memory_slots: int = 2
        """With ``memory_path``: snapshots kept per rank."""

        staging_pool_bytes: int | None = None
        """Host memory the async saves stage through (``dcp_atomic.Staging``): no whole host copy of the state.
        None: DCP's own staging."""

        def __post_init__(self) -> None:
            arguments.count("checkpoint.durable_every", self.durable_every, optional=False)
            arguments.count("checkpoint.memory_interval", self.memory_interval, optional=False)
            for name in ("local_root", "memory_path"):
                path = getattr(self, name)
                if path is not None and not os.path.isabs(path):
                    raise arguments.refused(f"checkpoint.{name}", path, "an absolute path on each node's own storage")
            keep = self.keep_latest_k  # torchtitan refuses 1 (its purge may hit the save in flight); ours cannot
            self.keep_latest_k = 0 if keep == 1 else keep
            try:
                CheckpointManager.Config.__post_init__(self)
            finally:
                self.keep_latest_k = keep

    def __init__(self, config: Config, **kwargs: Any) -> None:
        # torchtitan's purge thread would rmtree step folders: retention replaces it, so build it without one.
        super().__init__(dataclasses.replace(config, keep_latest_k=0), **kwargs)
        if not self.enable:
            return
        self.keep_latest_k = config.keep_latest_k
        self.root, self.run_id = os.path.split(self.folder.rstrip("/"))
        self.writer = AtomicStorageWriter(self.root, self.run_id, compression=config.compression,
                                          reuse=config.reuse, timeout=config.timeout)
        self.reader = AtomicStorageReader(self.root, self.run_id, timeout=config.timeout)
        self.timeout = config.timeout
        self._retention: concurrent.futures.ThreadPoolExecutor | None = None  # rank 0: purges off the training thread
        self._retiring: concurrent.futures.Future | None = None
        self.durable_every = config.durable_every
        self._saving_last = False
        self.memory_interval = config.memory_interval
        self.snapshotted = None  # the latest snapshot's future (a SnapshotFuture), with memory_path
        self.tier: TierManager | None = None  # the tiered manager, with local_root, memory_path or staging_pool_bytes
        local = None if config.local_root is None else LocalTierOptions(
            config.local_root, replicas=config.replicas, keep_local=config.keep_local)
        memory = None if config.memory_path is None else MemoryTier(
            config.memory_path, replicas=config.memory_replicas, slots=config.memory_slots)
        staging = None if config.staging_pool_bytes is None else Staging(
            pool_bytes=config.staging_pool_bytes, window_bytes=min(Staging.window_bytes, config.staging_pool_bytes))
        if local or memory or staging:  # its own groups (not self.pg): the drain and the snapshots need their own
            self.tier = TierManager(self.root, self.run_id, local=local, memory=memory, staging=staging,
                                    keep_last=config.keep_latest_k or None,
                                    compression=config.compression, reuse=config.reuse, timeout=config.timeout)

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if self.tier is not None and self.tier.memory is not None and curr_step % self.memory_interval == 0:
            # copied before this returns (the trainer may step at once); committed in the background, never queued
            self.snapshotted = self.tier.snapshot(curr_step, self._flattened_model_states_sd())
        self._saving_last = last_step  # the local tier drains the last step whatever durable_every says
        try:
            return super()._save(curr_step, last_step)
        finally:
            self._saving_last = False

    def _maybe_wait_for_staging(self) -> None:
        """torchtitan's trainer calls it before the optimizer step: with bounded staging, the save in flight must have
        read the live tensors by then."""
        super()._maybe_wait_for_staging()
        if self.tier is not None:
            self.tier.wait_staged()

    def _load(self, step: int = -1) -> bool:
        """With a tier: the newest step assemblable from any tier (or ``step``), through the manager.

        Only when no tier holds a step does torchtitan's own ``_load`` run (``initial_load_path``, Hugging Face
        assets, a fresh start), so a restart never takes an initial checkpoint over this run's own steps.
        """
        if self.tier is None:
            return super()._load(step)
        held = self.tier.steps()
        if not held and self.tier.memory is not None and step == -1:
            try:  # only the memory tier may hold a step: the manager's load looks there first
                self._load_from_tier(step, model_only=False)
                return True
            except CheckpointNotFoundError:
                return super()._load(step)
        if not held:
            if step != -1:
                raise CheckpointNotFoundError(
                    f"checkpoint.load_step={step}: run {self.run_id!r} has no committed step on the local roots "
                    f"({self.tier.local_root} on this node) nor in {self.folder}; set load_step=-1 for a fresh start",
                    step=step)
            return super()._load(step)
        # torchtitan's seed checkpoint is the model alone; with memory the newest may be a (full) snapshot instead
        self._load_from_tier(step, model_only=(held[-1] if step == -1 else step) == 0 and self.tier.memory is None)
        return True

    def _load_from_tier(self, step: int, model_only: bool) -> None:
        states = self._states_to_load(model_only)
        loaded = self.tier.load(states, step=None if step == -1 else step)
        if MODEL in self.states:  # torchtitan flattens the model's keys into the state dict, as its own dcp_load
            self.states[MODEL].load_state_dict(states)
        log.info("loaded step %d of run %s from the %s tier", loaded, self.run_id,
                 (self.tier.restored_from or {}).get("tier", "durable"))

    def _create_checkpoint_id(self, step: int, folder: str = "") -> str:
        """Our step directory, so torchtitan's "is it there" checks look where the checkpoint is."""
        return os.path.join(folder or self.folder, step_dir_name(step))

    def _find_load_step(self, folder: str = "") -> int:
        """The latest committed step (never a half-written one), or -1, the same on every rank.

        Global rank 0 scans and tells the others over the default group (the one ``dcp.load`` then uses): ranks
        listing on their own could pick different steps from stale NFS caches, and overload object stores.
        A failed scan reaches every rank as rank 0's error.
        """
        root, run_id = os.path.split((folder or self.folder).rstrip("/"))
        outcome: list[Any] = [None]
        if dist.get_rank() == 0:
            try:
                step = latest_step(root, run_id, missing_root_ok=True)
                outcome[0] = -1 if step is None else step
            except CheckpointError as e:
                outcome[0] = e
            except Exception as e:  # noqa: BLE001 - typed, so that it pickles, and sent like the others
                outcome[0] = StorageError(f"global rank 0 could not find the latest step in {root}/{run_id}: "
                                          f"{type(e).__name__}: {e}", path=f"{root}/{run_id}")
        dist.broadcast_object_list(outcome, src=0)
        if isinstance(outcome[0], CheckpointError):
            raise outcome[0]
        return outcome[0]

    def _is_ours(self, checkpoint_id: str) -> bool:
        return root_key(os.path.dirname(os.fspath(checkpoint_id).rstrip("/"))) == root_key(self.folder)

    def _is_another_run(self, checkpoint_id: str) -> bool:
        """``initial_load_path`` naming a committed step of another dcp_atomic run (one exact-name read)."""
        try:
            root, run_id, step = parse_checkpoint_id(checkpoint_id)
            read_marker(RunLayout(open_storage(root), run_id), step, Deadline(0), missing_ok=True)
        except (CheckpointError, FileNotFoundError, OSError, ValueError):
            return False
        return True

    def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: AsyncMode,
                 enable_garbage_collection: bool = False, to_hf: bool = False):
        if to_hf:  # a Hugging Face export is not a training checkpoint: torchtitan writes it itself
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        if self.tier is not None:
            return self._tier_save(state_dict, checkpoint_id, async_mode)
        kwargs = dict(storage_writer=self.writer, checkpoint_id=checkpoint_id, planner=AtomicSavePlanner())
        if async_mode == AsyncMode.DISABLED:
            return dcp.save(state_dict, **kwargs)
        if async_mode == AsyncMode.ASYNC:
            return dcp.async_save(state_dict, process_group=self.pg, **kwargs)
        return dcp.async_save(state_dict, process_group=self.pg, async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                              async_stager=self.stager, **kwargs)

    def _tier_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: AsyncMode):
        """A local-tier save, returned in the shape torchtitan expects of each mode (the step is the id's)."""
        _, _, step = parse_checkpoint_id(checkpoint_id)
        durable = self._saving_last or step % (self.interval * self.durable_every) == 0
        if async_mode == AsyncMode.DISABLED:
            self.tier.save(step, state_dict, durable=durable)
            return None
        future = self.tier.async_save(step, state_dict, durable=durable)  # staged when it returns
        if async_mode == AsyncMode.ASYNC:
            return future
        staged: concurrent.futures.Future = concurrent.futures.Future()
        staged.set_result(None)
        return AsyncSaveResponse(staging_completion=staged, upload_completion=future)

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        ours = not from_hf and self._is_ours(checkpoint_id)
        if not ours and (from_hf or not self._is_another_run(checkpoint_id)):  # a stock DCP or HF checkpoint
            return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        reader = self.reader if ours else AtomicStorageReader(timeout=self.timeout)  # another run: follow the id
        dcp.load(state_dict, storage_reader=reader, checkpoint_id=checkpoint_id, planner=AtomicLoadPlanner())
        if MODEL in self.states:  # torchtitan flattens the model's keys into the state dict, as its own dcp_load
            self.states[MODEL].load_state_dict(state_dict)
        if ours and dist.get_rank() == 0:  # P14: saves above the loaded step supersede the abandoned branch
            self.writer.resumed_from = resume_point(reader.layout, reader.step)
            log.info("resumed run %s from step %d: later saves supersede steps above it committed before now",
                     self.run_id, reader.step)

    def _purge_stale_checkpoints(self) -> None:
        """Keep the ``keep_latest_k`` most recently *committed* steps (an in-flight save is not counted).

        Global rank 0 alone, in a background thread (torchtitan purges in one too): deleting a step's files on a
        busy store can take long, and training must not wait.  Purges run one at a time, at most one queued; a failure
        is logged, and the next purge tries again.
        """
        if self.keep_latest_k <= 0 or dist.get_rank() != 0 or self.tier is not None:
            return  # with the local tier, the manager applies keep_latest_k after each drain
        pending = self._retiring
        if pending is not None and not pending.running() and not pending.done():
            return  # a queued purge has not started: it will see this save too
        if self._retention is None:
            self._retention = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dcp_atomic-purge")
        self._retiring = self._retention.submit(self._purge, RunLayout(self.writer.storage, self.run_id))

    def _purge(self, layout: RunLayout) -> None:
        try:
            plan = plan_gc(layout, self.keep_latest_k)
            if not plan.empty:
                apply_gc(layout, plan)
        except Exception as e:  # noqa: BLE001 - see _purge_stale_checkpoints
            log.warning("purging old steps of run %s failed (%s: %s); the next save's purge retries", self.run_id,
                        type(e).__name__, e)

    def _close(self) -> None:
        try:
            if getattr(self, "tier", None) is not None:  # closing twice does nothing; a save after it is refused
                self.tier.close()  # waits for the save and the drains in flight: the last durable step must not be lost
        finally:
            super()._close()
            if getattr(self, "_retention", None) is not None:
                self._retention.shutdown(wait=True)  # a purge in flight finishes; the process may exit next
                self._retention = None
