"""The manager: ``CheckpointManager`` (:mod:`.checkpoint_manager`) saves every N steps in the background, keeps the
last K and resumes; what one tier or two change is its tier policy (:mod:`.tiering`, :mod:`.two_tier`), what a user
configures as a group travels in :mod:`.options`.

The manager is imported on first use of its name, so importing one module of this package (the tier policy, the
options) does not run the manager nor import torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .options import Callbacks, LocalTierOptions, MemoryTier

if TYPE_CHECKING:
    from .checkpoint_manager import CheckpointManager

__all__ = ["CheckpointManager", "LocalTierOptions", "MemoryTier", "Callbacks"]


def __getattr__(name: str):
    if name == "CheckpointManager":
        return importlib.import_module(".checkpoint_manager", __name__).CheckpointManager
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
