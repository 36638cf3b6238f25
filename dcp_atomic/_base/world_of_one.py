"""A process without a process group saves and loads as a world of one (rank 0 of 1).

Torch's DCP says so in a ``UserWarning`` at every save and load ("torch.distributed is disabled, unavailable or
uninitialized, assuming the intent is to save in a single process"): a notebook or a single-GPU job gets one per
checkpoint, and a job that forgot ``init_process_group`` learns nothing from the repeats.  The manager says it once
per process in its own words, with what to do if that was not the intent, and from then on torch's repeats are
filtered out in this process (an ``async_save`` warns from its own thread, after the call: a filter around the call
would miss it).
"""

from __future__ import annotations

import logging
import re
import warnings

import torch.distributed as dist

log = logging.getLogger("dcp_atomic")
_TORCH_SAYS = "torch.distributed is disabled, unavailable or uninitialized"
_said = False


def explain() -> None:
    """Before one of the manager's DCP calls: nothing with a process group; without one, the explanation (the first
    time in this process) and torch's warning about it filtered out (again, if something reset the filters)."""
    global _said
    if dist.is_available() and dist.is_initialized():
        return
    if not _said:
        _said = True
        log.warning("dcp_atomic: no torch.distributed process group in this process, so it saves and loads as a world "
                    "of one (rank 0 of 1); torch warns of this at every save and load, said once here. For a job of "
                    "several processes, call torch.distributed.init_process_group (torchrun sets RANK and "
                    "WORLD_SIZE) before creating the CheckpointManager.")
    if not any(action == "ignore" and pattern is not None and pattern.pattern == re.escape(_TORCH_SAYS)
               for action, pattern, *_ in warnings.filters):
        warnings.filterwarnings("ignore", message=re.escape(_TORCH_SAYS), category=UserWarning)
