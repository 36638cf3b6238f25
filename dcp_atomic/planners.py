"""Thin DCP planners for what the storage layer cannot see.

Storage hooks see item indexes, shapes and dtypes but never tensor contents or
the state dict.  These subclasses of DCP's default planners exist so checks
that need the state dict have a home; they also turn off DCP's plan caching,
which would replay an old ``save_id`` past dcp_atomic's checks.
"""

from __future__ import annotations

from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner


class AtomicSavePlanner(DefaultSavePlanner):
    def __init__(self, *args, **kwargs) -> None:
        kwargs["enable_plan_caching"] = False
        super().__init__(*args, **kwargs)


class AtomicLoadPlanner(DefaultLoadPlanner):
    pass
