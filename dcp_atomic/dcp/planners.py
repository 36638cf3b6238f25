"""Thin DCP planners for what the storage layer cannot see.

Storage hooks see item indexes, shapes and dtypes but never tensor contents or
the state dict.  These subclasses of DCP's default planners add only that:

* :class:`AtomicSavePlanner` summarises each key's content (sampled
  fingerprints) and infers the layout from DTensor meshes, and hands both to
  the writer in ``SavePlan.storage_data``; the writer's coordinator runs the
  checks in :mod:`.reshard`.  With ``enable_plan_caching=True`` it still hands
  the writer every rank's report where DCP answers a rank with its cached plan,
  so the checks run on every save, and each report names the DCP cache the
  plan comes from, so the writer continues that cache's save series.
* :class:`AtomicLoadPlanner` infers this job's layout, then checks every key
  against the checkpoint before DCP starts (DCP's default planner raises at the
  first size mismatch; this one lists them all).

Both plan with Python's cyclic GC paused (:mod:`~dcp_atomic._base.gc_pause`): DCP's per-item planning
allocates 10^4-10^6 objects, and the collections that triggers cost more than the
planning itself.  ``set_up_planner`` begins the operation's lease (the pause that spans
DCP's collectives between hooks) and ``finish_plan``, the planner's last hook before the
data moves, ends the planner's part in it.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

from .._base import arguments, internals
from .._base.gc_pause import PLANNER, hook
from .reshard import LoadContext, SaveReport, infer_parallelism, summarize_state_dict

LOAD_CONTEXT_ATTR = "dcp_atomic_load_context"  # set on DCP's Metadata by AtomicStorageReader


class AtomicSavePlanner(DefaultSavePlanner):
    """DCP's save planner plus what needs the tensors themselves: copies that differ across ranks, layout inference.

    Args:
        divergence: ``"raise"`` (default) refuses keys whose copies differ across ranks;
            ``"warn"`` saves them (DCP keeps rank 0's copy), logs them and marks them per-rank.
        layout_dependent: globs of keys whose layout depends on tensor_parallel_size
            (e.g. ``"*.qkv_proj.weight"``); recorded so a later tp change refuses them.
    """

    def __init__(self, *args, divergence: str = "raise", layout_dependent: Iterable[str] = (), **kwargs) -> None:
        arguments.choice(f"{type(self).__name__}(divergence=...)", divergence, ("raise", "warn"))
        super().__init__(*args, **kwargs)
        self.divergence = divergence
        self.layout_dependent = tuple(layout_dependent)

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        with hook(PLANNER, first=True):
            super().set_up_planner(state_dict, storage_meta, is_coordinator)

    def create_local_plan(self):
        # DCP holds a changed local plan as pending until finish_plan caches it.  A save refused while planning
        # never gets there; reused for the next save, whose plan matches the cache, this planner would then cache
        # the refused plan as if it had been written, and a later save with that plan would replay another one.
        internals.forget_pending_local_plan(self)
        with hook(PLANNER):
            return self._create_local_plan()

    def _create_local_plan(self):
        plan = super().create_local_plan()
        report = SaveReport(
            keys=summarize_state_dict(self.state_dict),
            parallelism=infer_parallelism(self.state_dict),
            divergence=self.divergence,
            layout_dependent=self.layout_dependent,
            plan_cache=internals.plan_cache_key(self) if internals.caches_plans(self) else None,
        )
        return dataclasses.replace(plan, storage_data=report)

    def create_global_plan(self, all_plans):
        """DCP answers a rank whose plan it cached with an empty plan, dropping what the rank's writer reported
        this time (identity, content summary): pass that on, so the writer checks every save."""
        with hook(PLANNER):
            plans, metadata = super().create_global_plan(all_plans)
            if internals.caches_plans(self):
                plans = [dataclasses.replace(plan, storage_data=local.storage_data)
                         for plan, local in zip(plans, all_plans)]
            return plans, metadata

    def finish_plan(self, new_plan):
        with hook(PLANNER, last=True):
            return super().finish_plan(new_plan)


#: what makes a plain local tensor a shard of a global one to DCP (torch >= 2.14's ``CheckpointableTensor``)
_CHECKPOINTABLE_FIELDS = ("global_shape", "global_offsets", "local_offsets", "local_sizes")


def _global_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    """What the checkpoint recorded for this destination: a DTensor's shape is already global; a
    CheckpointableTensor is a local buffer that names its global shape (duck-typed, as torch's runtime protocol
    check is, so older torch needs no import)."""
    if all(hasattr(tensor, name) for name in _CHECKPOINTABLE_FIELDS):
        return tuple(tensor.global_shape)
    return tuple(tensor.shape)


class AtomicLoadPlanner(DefaultLoadPlanner):
    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        with hook(PLANNER, first=True):
            super().set_up_planner(state_dict, metadata, is_coordinator)
        context: LoadContext | None = getattr(metadata, LOAD_CONTEXT_ATTR, None)
        if context is not None and context.current is None:
            context.current = infer_parallelism(self.state_dict)

    def create_local_plan(self):
        with hook(PLANNER):  # the key checks allocate per key too, beside the metadata's 10^5+ live objects
            context: LoadContext | None = getattr(self.metadata, LOAD_CONTEXT_ATTR, None)
            if context is not None:
                requested = {}
                for fqn, value in self.state_dict.items():
                    if isinstance(value, torch.Tensor):
                        requested[fqn] = (_global_shape(value), value.dtype)
                    else:
                        requested[fqn] = None
                context.check_keys(requested)
            return super().create_local_plan()

    def create_global_plan(self, global_plan):
        with hook(PLANNER):
            return super().create_global_plan(global_plan)

    def finish_plan(self, central_plan):
        with hook(PLANNER, last=True):
            return super().finish_plan(central_plan)
