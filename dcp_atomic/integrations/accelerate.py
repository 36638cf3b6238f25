"""HF Accelerate through dcp_atomic: everything ``Accelerator.save_state`` saves, as one atomic, verified step.

``accelerator.save_state(dir)`` writes each model, each optimizer, the schedulers, samplers, RNG states and the
``register_for_checkpointing`` objects as separate files (under FSDP: model and optimizer as two separate DCP
checkpoints through a hard-coded ``FileSystemWriter``), so a crash between them leaves a directory that mixes two
steps, and retention is an ``rmtree`` of the oldest folder.  :class:`AcceleratorCheckpoint` gathers the same state
into one state dict and hands it to one :class:`dcp_atomic.CheckpointManager`: one commit marker per step, every
byte verified on load, ``keep_last`` retention that never deletes the step ``LATEST`` names, the local tier and
S3/GCS as the manager has them (its keyword arguments pass through)::

    accelerator = Accelerator()
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    checkpoint = AcceleratorCheckpoint(accelerator, "ckpt", run_id="exp1", keep_last=3)
    start = checkpoint.load() or 0          # the latest committed step, or None on a fresh start
    ...
    checkpoint.save(step)                   # instead of accelerator.save_state(...)

The memory tier (docs/memory.md) is one argument, ``memory=MemoryTier("/dev/shm/ckpt")``: ``checkpoint.snapshot(step)``
then keeps the same state in RAM on each node with verified copies on other failure domains, ``load()`` restores the
newest step of any tier (``checkpoint.restored_from`` says which), and ``checkpoint.wait_staged()`` belongs before
``optimizer.step()`` (with ``staging=Staging(...)``, the save in flight reads the live tensors until then).

What goes in, per index as Accelerate numbers them: ``model`` / ``model_<i>`` (``get_model_state_dict``: DDP's
``module.`` prefix dropped, FSDP1/FSDP2 sharded as DTensors, so a changed world size reshards), ``optimizer`` /
``optimizer_<i>`` (``get_optimizer_state_dict`` against the model that owns its parameters), ``scheduler_<i>``,
``scaler``, ``dataloader_<i>`` (epoch counter, a seedable sampler's seed and epoch, a stateful loader's position
per rank), ``custom_<i>`` (``register_for_checkpointing``), ``rng`` (Python, NumPy, torch and accelerator
generators of every rank: gathered, so a job resumed on more ranks than saved says which ranks start fresh) and
Accelerate's own ``step`` counter.  Per-rank values are gathered to every rank before the save: DCP keeps one
copy of a key, and a key every rank holds alike is one copy.
"""

from __future__ import annotations

import contextlib
import io
import logging
import random
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ..errors import (CheckpointError, CheckpointNotFoundError, ConfigurationError, CorruptCheckpointError,
                      UnsafeItemError)
from ..exchange.collective import gather
from ..manager import CheckpointManager
from ..format.safe_pickle import load_refusal

log = logging.getLogger(__name__)

FORMAT = 1  # of the "accelerate" record: a later layout bumps it, and an older reader refuses it by name
RECORD_KEY = "accelerate"
_OPTIONS = StateDictOptions(full_state_dict=False)
_UNSUPPORTED_MODES = ("DEEPSPEED", "MEGATRON_LM", "XLA")  # sharded stays sharded: each rank saves and loads its own part


def _indexed(name: str, i: int) -> str:
    """Accelerate's numbering (``pytorch_model.bin``, ``pytorch_model_1.bin``): the first has no index."""
    return name if i == 0 else f"{name}_{i}"


def _unwrapped_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)  # AcceleratedOptimizer wraps the user's


class AcceleratorCheckpoint:
    """Save and load everything an :class:`accelerate.Accelerator` prepared, as one step of one
    :class:`CheckpointManager` (see the module docstring).

    Args:
        accelerator: the job's ``Accelerator``, after ``prepare``: what it holds then is what is saved (models,
            optimizers, schedulers, dataloaders and ``register_for_checkpointing`` objects).
        root, run_id, manager_kwargs: the manager's (``keep_last``, ``local=LocalTierOptions(...)``,
            ``memory=MemoryTier(...)``, ``staging=Staging(...)``, ``storage_options``, ``compression``...); build it
            after the ``Accelerator``, which starts the process group.
    """

    def __init__(self, accelerator: Any, root: Any, run_id: str, **manager_kwargs: Any) -> None:
        self.accelerator = accelerator
        self.manager = CheckpointManager(root, run_id, **manager_kwargs)
        self._resumed_or_checked = False  # load() called, or the run found empty (see save)
        self._fresh: tuple[bool, ...] = ()
        self._clear_fresh = True
        # Per-rank state (RNG, stateful loaders) is gathered on a gloo group of our own: the default group may be
        # NCCL, where an object gather needs a current CUDA device.
        self._group = None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.manager.timeout))

    # -- what a step holds -----------------------------------------------------------------

    def _owners(self) -> list[torch.nn.Module]:
        """For each optimizer, the prepared model (or models, as one container) whose parameters it updates;
        refuses a save that would hold no model weights (a model Accelerate never prepared is not registered for
        checkpointing, and neither is a parameter outside every model)."""
        acc = self.accelerator
        if acc.distributed_type.value in _UNSUPPORTED_MODES:  # their models hold placeholders, not weights
            raise ConfigurationError(
                f"AcceleratorCheckpoint does not support Accelerate's {acc.distributed_type.value} mode (its models "
                "hold partitioned placeholders, not the weights): use accelerator.save_state there")
        models = acc._models
        if not models:
            raise ConfigurationError(
                "the Accelerator holds no model to checkpoint: a save would hold no model weights. Pass the model "
                "through accelerator.prepare(model, optimizer, ...) (or accelerator.prepare_model(model)) before "
                "AcceleratorCheckpoint.save")
        owned = [{id(p) for p in model.parameters()} for model in models]
        owners: list[torch.nn.Module] = []
        for j, optimizer in enumerate(acc._optimizers):
            params = {id(p) for group in _unwrapped_optimizer(optimizer).param_groups for p in group["params"]}
            single = [i for i, ids in enumerate(owned) if params and params <= ids]
            several = [i for i, ids in enumerate(owned) if params & ids]
            if single:
                owners.append(models[single[0]])
            elif params and params <= set().union(*(owned[i] for i in several)):  # one optimizer, several models
                owners.append(torch.nn.ModuleList([models[i] for i in several]))
            else:
                raise ConfigurationError(
                    f"optimizer {j} updates parameters that are in no model the Accelerator prepared: their values "
                    "would not be in the checkpoint. Prepare every model it updates, accelerator.prepare(model, "
                    "optimizer, ...), and build the optimizer from the models' parameters (a free nn.Parameter "
                    "belongs in a module)")
        return owners

    def _refuse_hooks(self) -> None:
        """Accelerate's save/load-state pre-hooks write and read files beside ``save_state``'s directory (diffusers'
        EMA and LoRA weights); a step here has no such directory, so what they keep would silently be missing."""
        hooks = len(self.accelerator._save_model_state_pre_hook) + len(self.accelerator._load_model_state_pre_hook)
        if hooks:
            raise ConfigurationError(
                f"the Accelerator has {hooks} save/load-state pre-hook(s) (register_save_state_pre_hook / "
                "register_load_state_pre_hook): they save state as files of save_state's directory, which this "
                "checkpoint does not have. Register that state with accelerator.register_for_checkpointing(obj) "
                "(an object with state_dict/load_state_dict) and remove the hooks, or keep using save_state")

    def _gathered(self, mine: Any) -> tuple[Any, ...]:
        """Every rank's ``mine``, by rank: a tuple, which DCP stores as one object (a list or dict it would
        flatten into keys that depend on the world size)."""
        return tuple(gather(self._group, mine, f"gathering the ranks' state for run {self.manager.run_id!r}"))

    def _state(self, *, saving: bool) -> dict[str, Any]:
        """The step's state dict.  Schedulers and registered objects go in whole, as one object each (their
        state may grow, or hold a tensor only later: a fresh object's ``state_dict()`` is no template for what was
        saved); models and optimizers as DCP state dicts, sharded where they are."""
        acc = self.accelerator
        self._refuse_hooks()
        owners = self._owners()
        state: dict[str, Any] = {}
        for i, model in enumerate(acc._models):
            state[_indexed("model", i)] = get_model_state_dict(model, options=_OPTIONS)
        for j, optimizer in enumerate(acc._optimizers):
            state[_indexed("optimizer", j)] = _optimizer_state(owners[j], _unwrapped_optimizer(optimizer),
                                                               target=not saving)
        for k, scheduler in enumerate(acc._schedulers):
            state[_indexed("scheduler", k)] = _whole(scheduler.state_dict() if saving else None)
        if acc.scaler is not None:
            state["scaler"] = _whole(acc.scaler.state_dict() if saving else None)
        for d, loader in enumerate(acc._dataloaders):
            state[_indexed("dataloader", d)] = _whole(_loader_state(loader, self._gathered) if saving else None)
        for c, obj in enumerate(acc._custom_objects):
            state[_indexed("custom", c)] = _whole(obj.state_dict() if saving else None)
        state["rng"] = self._gathered(_rng_state()) if saving else None
        state[RECORD_KEY] = _whole({"format": FORMAT, "step": acc.step, "iteration": acc.save_iteration,
                                    "counts": _counts(acc), "world_size": acc.num_processes,
                                    "fresh_optimizers": self._fresh} if saving else None)
        if saving:  # the user's own objects; the rest this module builds of types the allow-list takes
            _refuse_unloadable({k: v for k, v in state.items() if k.startswith(("scheduler", "scaler", "custom"))},
                               where=f"run {self.manager.run_id!r}")
        return state

    @contextlib.contextmanager
    def _fresh_optimizers(self):
        """Note which optimizers have no state yet (no step taken) and clear what building the state dict gave
        them, so neither a save before the first step nor a fresh start's load changes training."""
        optimizers = [_unwrapped_optimizer(o) for o in self.accelerator._optimizers]
        self._fresh = tuple(not o.state for o in optimizers)
        try:
            yield self._fresh
        finally:
            for optimizer, fresh in zip(optimizers, self._fresh):
                if fresh and self._clear_fresh:
                    optimizer.state.clear()

    # -- save and load -----------------------------------------------------------------------

    def save(self, step: int, metadata: dict[str, Any] | None = None, durable: bool | None = None) -> int:
        """Commit ``step`` (every rank calls it, as ``save_state``): returns the step.  ``metadata`` and
        ``durable`` as :meth:`CheckpointManager.save`.  A job's first save into a run that already holds steps
        is refused unless the job called :meth:`load` first: saving without resuming would start a new branch
        whose retention removes the run's newest steps (another experiment's, under a reused run id)."""
        self._refuse_new_branch()
        self._clear_fresh = True
        with self._fresh_optimizers():
            done = self.manager.save(step, self._state(saving=True), metadata=metadata, durable=durable)
        self.accelerator.project_configuration.iteration += 1  # as save_state counts its saves
        return done

    def snapshot(self, step: int):
        """Snapshot ``step`` into the memory tier (``memory=MemoryTier(...)``; every rank calls it): the same state
        as :meth:`save`, copied before this returns; the returned future resolves to ``step`` once memory-committed
        on every rank (:meth:`CheckpointManager.snapshot`).  Refused before :meth:`load`, as :meth:`save` is."""
        self._refuse_new_branch()
        self._clear_fresh = True
        with self._fresh_optimizers():
            return self.manager.snapshot(step, self._state(saving=True))

    def wait_staged(self) -> float:
        """Before ``optimizer.step()``: wait until the save in flight no longer reads the live tensors
        (:meth:`CheckpointManager.wait_staged`); the seconds waited."""
        return self.manager.wait_staged()

    @property
    def restored_from(self) -> dict[str, Any] | None:
        """After :meth:`load`: which tier served it, as :attr:`CheckpointManager.restored_from` says."""
        return self.manager.restored_from

    def _refuse_new_branch(self) -> None:
        if not self._resumed_or_checked:
            held = self.manager.steps()
            if held:
                raise ConfigurationError(
                    f"run {self.manager.run_id!r} already holds committed steps {held}; call "
                    "AcceleratorCheckpoint.load() first to resume them (a later save of a lower step then starts a "
                    "new branch, on purpose), or save into another run_id")
            self._resumed_or_checked = True

    def load(self, step: int | None = None, *, allow_reshard: bool = False) -> int | None:
        """Load ``step`` (default: the newest step of any tier, the memory tier's included) into everything the
        Accelerator holds; returns the step, or None when the run has no checkpoint yet (a fresh start: nothing is
        changed)."""
        self._resumed_or_checked = True
        if step is None and self.manager.memory is None and not self.manager.steps():
            return None
        self._clear_fresh = True
        with self._fresh_optimizers():
            state = self._state(saving=False)
            try:
                chosen = self.manager.load(state, step=step, allow_reshard=allow_reshard)
            except CheckpointNotFoundError:
                if step is None:  # no tier holds a step (the memory tier is only known by looking): a fresh start
                    return None
                raise
            except CheckpointError as e:  # every rank alike: the manager agrees on a load's failure
                self._refuse_other_objects(step if step is not None else e.details.get("step"), e)
                raise
            self._clear_fresh = False
            self._apply(state, chosen)
        return chosen

    def _refuse_other_objects(self, step: int | None, failure: CheckpointError) -> None:
        """After a failed load: when the step was saved from an Accelerator holding other objects (one more
        scheduler, one optimizer less), say that -- DCP's own error names whichever key it met first -- by loading
        the step's record alone; a record that cannot be read leaves ``failure`` as it was."""
        if step is None:
            return
        record = {RECORD_KEY: _whole(None)}
        try:
            self.manager.load(record, step=step)
        except CheckpointError:
            return
        _check_record(_unwhole(record[RECORD_KEY]), self.accelerator, step, self.manager.run_id, cause=failure)

    def _apply(self, state: dict[str, Any], step: int) -> None:
        acc = self.accelerator
        record = _unwhole(state[RECORD_KEY])
        where = f"step {step} of run {self.manager.run_id!r}"
        _check_record(record, acc, step, self.manager.run_id)
        owners = self._owners()
        for i, model in enumerate(acc._models):
            set_model_state_dict(model, state[_indexed("model", i)], options=_OPTIONS)
        for j, optimizer in enumerate(acc._optimizers):
            inner = _unwrapped_optimizer(optimizer)
            set_optimizer_state_dict(owners[j], inner, state[_indexed("optimizer", j)], options=_OPTIONS)
            if record["fresh_optimizers"][j]:  # saved before its first step: what was loaded is torch's fake one
                inner.state.clear()
        for k, scheduler in enumerate(acc._schedulers):
            scheduler.load_state_dict(_unwhole(state[_indexed("scheduler", k)]))
        if acc.scaler is not None:
            acc.scaler.load_state_dict(_unwhole(state["scaler"]))
        saved_world = record["world_size"]
        for d, loader in enumerate(acc._dataloaders):
            _restore_loader(loader, _unwhole(state[_indexed("dataloader", d)]), acc.process_index,
                            acc.num_processes == saved_world, where)
        for c, obj in enumerate(acc._custom_objects):
            obj.load_state_dict(_unwhole(state[_indexed("custom", c)]))
        rngs = state["rng"]
        if acc.process_index < len(rngs):
            _restore_rng(rngs[acc.process_index], where)
        else:
            log.warning("%s holds the random generators of %d ranks; rank %d (of %d now) keeps its own", where,
                        len(rngs), acc.process_index, acc.num_processes)
        acc.step = record["step"]
        acc.project_configuration.iteration = record["iteration"]

    def close(self) -> None:
        """Wait for background work (drains of the local tier) and release the manager."""
        self.manager.close()
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None

    def __enter__(self) -> "AcceleratorCheckpoint":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _optimizer_state(owner: torch.nn.Module, optimizer: torch.optim.Optimizer, *, target: bool) -> dict[str, Any]:
    """``get_optimizer_state_dict``.  For an optimizer without state torch fakes a step (lr 0) to have one to save
    or load into -- but not where a parameter has a gradient, and a load target without state entries loads
    none, silently.  So a load target's gradients are set aside for that step and put back; the caller clears
    the fake state again where the optimizer had none (``_fresh_optimizers``)."""
    if not target or optimizer.state:
        return get_optimizer_state_dict(owner, optimizer, options=_OPTIONS)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        return get_optimizer_state_dict(owner, optimizer, options=_OPTIONS)
    finally:
        for p, grad in zip(params, grads):
            p.grad = grad


def _whole(value: Any) -> tuple[Any]:
    """One object for DCP (a tuple is a leaf to it): loaded whole, whatever the fresh object's ``state_dict()``
    looks like now."""
    return (value,)


def _unwhole(loaded: Any) -> Any:
    return loaded[0]


def _refuse_unloadable(state: dict[str, Any], *, where: str) -> None:
    """A whole object the load's allow-list will refuse is refused now, before anything is written: found at
    resume, it would cost the run (the writer alone only warns: plain DCP users may widen the list at load)."""
    for key, value in state.items():
        if isinstance(value, tuple):
            buffer = io.BytesIO()
            torch.save(value, buffer)
            refusal = load_refusal(buffer.getvalue(), key=key)
            if refusal is not None:
                raise UnsafeItemError(f"{where}: not saved: {refusal}; allow the type with "
                                      "torch.serialization.add_safe_globals([...]) in the job before it saves and "
                                      "before it loads", key=key)


def _check_record(record: Any, acc: Any, step: int, run_id: str, cause: BaseException | None = None) -> None:
    """The step's record against this Accelerator: the format, and the objects it was saved from."""
    where = f"step {step} of run {run_id!r}"
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise CorruptCheckpointError(f"{where}: its {RECORD_KEY!r} record is {record!r}, not format {FORMAT} "
                                     "of AcceleratorCheckpoint (saved by another dcp_atomic version?)") from cause
    if record.get("counts") != _counts(acc):
        raise ConfigurationError(
            f"{where} was saved from an Accelerator holding {record.get('counts')}; this one holds "
            f"{_counts(acc)}. Prepare the same objects, in the same order, as the job that saved it") from cause


def _counts(acc: Any) -> dict[str, int]:
    return {"models": len(acc._models), "optimizers": len(acc._optimizers), "schedulers": len(acc._schedulers),
            "dataloaders": len(acc._dataloaders), "custom_objects": len(acc._custom_objects)}


def _sampler(loader: Any) -> Any:
    get = getattr(loader, "get_sampler", None)
    sampler = get() if get is not None else getattr(loader, "sampler", None)
    return sampler if hasattr(sampler, "initial_seed") and hasattr(sampler, "epoch") else None  # a seedable one


def _loader_state(loader: Any, gather: Any) -> dict[str, Any]:
    """A dataloader's position: its epoch counter, a seedable sampler's seed and epoch, the generator Accelerate
    synchronises across ranks to shuffle (its default sampler) and, for a stateful loader, each rank's own
    ``state_dict()`` (gathered, as every per-rank value: see the module docstring)."""
    sampler = _sampler(loader)
    generator = getattr(loader, "synchronized_generator", None)
    stateful = getattr(loader, "use_stateful_dataloader", False)
    return {"iteration": getattr(loader, "iteration", 0),
            "sampler": None if sampler is None else {"initial_seed": sampler.initial_seed, "epoch": sampler.epoch},
            "generator": None if generator is None else gather(generator.get_state()),
            "ranks": gather(loader.state_dict()) if stateful else None}


def _restore_loader(loader: Any, saved: dict[str, Any], rank: int, same_world: bool, where: str) -> None:
    if hasattr(loader, "iteration"):
        loader.iteration = saved["iteration"]
    sampler = _sampler(loader)
    if sampler is not None and saved["sampler"] is not None:
        sampler.initial_seed, sampler.epoch = saved["sampler"]["initial_seed"], saved["sampler"]["epoch"]
    generator = getattr(loader, "synchronized_generator", None)
    if generator is not None and saved["generator"] is not None:  # rank 0's is the one Accelerate broadcasts
        generator.set_state(saved["generator"][rank if rank < len(saved["generator"]) else 0])
    ranks = saved["ranks"]
    if getattr(loader, "use_stateful_dataloader", False) and ranks is not None:
        if same_world:
            loader.load_state_dict(ranks[rank])
        else:  # each position belongs to one rank's shard of the data: another world shards it otherwise
            log.warning("%s holds the dataloader positions of %d ranks, which shard the data otherwise than %s: "
                        "this rank's loader starts its epoch afresh", where, len(ranks), "this job")


def _rng_state() -> dict[str, Any]:
    """This process's generators, as plain values and CPU tensors (what a weights-only load accepts)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state(),
                             "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss),
                                       float(cached))}
    if torch.cuda.is_available():  # not exercised on the CPU-only test machines
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _restore_rng(state: dict[str, Any], where: str) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        else:
            log.warning("%s holds the CUDA generators of %d devices; this process sees %d and keeps its own", where,
                        len(cuda), torch.cuda.device_count())
