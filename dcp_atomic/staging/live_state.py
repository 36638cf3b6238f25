"""What ``async_save`` hands DCP with bounded staging: the live state, not a host copy of it.

DCP's ``async_save`` asks its ``AsyncStager`` for a "training-safe" copy of the whole state before the save starts
(torch 2.13 ``state_dict_saver.async_save``): host memory = the state.  :class:`LiveState` is that stager and copies
only what :class:`~.options.Staging` says is copied at the call (non-tensor items, small tensors, the ``eager``
keys); every other tensor stays live, its version counter recorded (:mod:`.versions`).  The writer reads the live
tensors' bytes (CPU tensors in place, device tensors block by block through the pool's windows), then calls
:meth:`LiveState.finished_reading`: the version check, then the release that ``wait_staged()`` waits for.  A
changed tensor fails the rank's ``write_data``, so DCP's failure gathering fails the save on every rank and
nothing is committed.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping
from typing import Any

import torch

from .options import Staging
from .pool import WindowPool
from .versions import LiveTensor, ReadGate, local_tensor, raise_if_any_changed


class LiveState:
    """DCP's ``AsyncStager`` for one save: the state with its eager items copied and the rest live."""

    #: DCP must not wait for the staging at the call: the manager's ``wait_staged()`` is the synchronisation point
    should_synchronize_after_execute = False

    def __init__(self, staging: Staging, pool: WindowPool) -> None:
        self.staging = staging
        self.pool = pool
        self.live: list[LiveTensor] = []
        self.eager_bytes = 0  # host and device bytes copied at the call
        self.call_seconds = 0.0
        self.read = ReadGate()  # opens once the writer no longer reads the live tensors

    # -- DCP's AsyncStager
    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        started = time.perf_counter()
        try:
            return self._staged(state_dict, "")
        finally:
            self.call_seconds = time.perf_counter() - started

    def synchronize_staging(self) -> None:
        """Nothing to wait for at the call (``wait_staged()`` is the gate)."""

    def close(self) -> None:
        """The pool outlives the save (the manager's): nothing to free."""

    # -- the writer and the manager
    def finished_reading(self, step: int, rank: int) -> None:
        """The writer has read every live tensor: raise ``StagingRaceError`` if one changed meanwhile; either way
        the live tensors are free again."""
        try:
            raise_if_any_changed(self.live, step, rank)
        finally:
            self.release()

    def release(self) -> None:
        """Nothing reads the live tensors any more (read, or the save failed before reading them); the references
        to them go too, so that this save keeps no tensor of the model alive."""
        self.live = []
        self.read.open()

    @property
    def peak_host_bytes(self) -> int:
        """The staging's host memory on this rank: the pool's windows and the copies made at the call."""
        return self.pool.allocated_bytes + self.eager_bytes

    def _staged(self, value: Any, key: str) -> Any:
        """DCP's nesting (mappings, lists and tuples; DCP's keys join their path with dots), eager leaves copied."""
        if isinstance(value, Mapping):
            return {name: self._staged(item, f"{key}.{name}" if key else str(name)) for name, item in value.items()}
        if type(value) in (list, tuple):
            return type(value)(self._staged(item, f"{key}.{index}") for index, item in enumerate(value))
        if not isinstance(value, torch.Tensor):
            return copy.deepcopy(value)  # DCP pickles it while writing, after the call
        nbytes = local_tensor(value).nbytes
        if self.staging.copies_eagerly(key, value, nbytes):
            self.eager_bytes += nbytes
            return value.detach().clone()
        self.live.append(LiveTensor.record(key, value))
        return value


class StableState:
    """DCP's ``AsyncStager`` for a state nothing changes until its save is done (a durable copy of a memory slot,
    which stays pinned until then): handed to the writer as it is, no host copy at the call."""

    should_synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict

    def synchronize_staging(self) -> None:
        """Nothing is staged."""

    def close(self) -> None:
        """Nothing to free."""
