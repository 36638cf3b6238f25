"""What ``async_save`` hands DCP with bounded staging: the live state, not a host copy of it.

DCP's ``async_save`` asks its ``AsyncStager`` for a "training-safe" copy of the whole state before the save starts
(torch 2.13 ``state_dict_saver.async_save``): host memory = the state.  :class:`LiveState` is that stager and copies
only what :class:`~.options.Staging` says is copied at the call (non-tensor items, small tensors, the ``eager``
keys); every other tensor stays live, its version counter recorded (:mod:`.versions`).  The writer reads the live
tensors' bytes (CPU tensors in place, device tensors block by block through the pool's windows), then calls
:meth:`LiveState.finished_reading`: the version check, then the release that ``wait_staged()`` waits for.  A
changed tensor fails the rank's ``write_data``, so DCP's failure gathering fails the save on every rank and
nothing is committed.

Host memory is the pool for the copies made at the call too: a CPU tensor's copy is packed into the pool's windows
(:class:`_Packed`; all but one, which the writer keeps for device tensors), so a state made of small tensors (every
FSDP shard at scale) does not grow host memory by itself.  A small tensor that finds no room is read live like a
large one: the optimizer gate (:func:`~.versions.gate_optimizer_steps`) covers what ``optimizer.step()`` changes,
and a buffer that forward changes before ``wait_staged()`` fails the save with ``StagingRaceError`` naming it
(never a silent mix).  A tensor ``Staging(eager=...)`` names is copied whatever the room: beside the pool when it
has none (counted in ``peak_host_bytes``).  Device tensors' copies stay on the device (``clone``), as before.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .options import Staging
from .pool import WindowPool
from .versions import LiveTensor, ReadGate, local_tensor, raise_if_any_changed

_ALIGN = 64  # bytes: where each packed copy starts in its window (any dtype's alignment)


class _Packed:
    """Copies made at the call, packed into windows of the pool, held until nothing reads them (:meth:`release`).
    It never takes the pool's last window: the writer reads device tensors through it."""

    def __init__(self, pool: WindowPool) -> None:
        self.pool = pool
        self.windows: list[torch.Tensor] = []
        self.used = 0  # bytes of the newest window taken

    @staticmethod
    def packs(tensor: torch.Tensor) -> bool:
        """A plain (dense, not quantized) CPU tensor: the kind a window holds."""
        return tensor.device.type == "cpu" and tensor.layout == torch.strided and not tensor.is_quantized

    def copy(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """A copy of ``tensor`` (:meth:`packs`) in a window, of its dtype and shape, or None where no window the
        pool can spare has room for it."""
        nbytes = tensor.nbytes
        if nbytes > self.pool.window_bytes:
            return None
        if not self.windows or self.used + nbytes > self.pool.window_bytes:
            window = self.pool.try_acquire(keep=1)
            if window is None:
                return None
            self.windows.append(window)
            self.used = 0
        start = self.used
        packed = self.windows[-1][start:start + nbytes].view(tensor.dtype).view(tensor.shape)
        packed.copy_(tensor.detach())
        self.used = -(-(start + nbytes) // _ALIGN) * _ALIGN
        return packed

    def release(self) -> None:
        windows, self.windows = self.windows, []
        for window in windows:
            self.pool.release(window)


class LiveState:
    """DCP's ``AsyncStager`` for one save: the state with its eager items copied and the rest live."""

    #: DCP must not wait for the staging at the call: the manager's ``wait_staged()`` is the synchronisation point
    should_synchronize_after_execute = False

    def __init__(self, staging: Staging, pool: WindowPool) -> None:
        self.staging = staging
        self.pool = pool
        self.live: list[LiveTensor] = []
        self.eager_bytes = 0  # host bytes copied at the call beside the pool, and device bytes copied on the device
        self.packed = _Packed(pool)  # the host copies made at the call, in the pool's windows
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
        """Nothing reads the live tensors or the copies any more (read, or the save failed before reading them): the
        references to the live ones go, so that this save keeps no tensor of the model alive, and the copies' windows
        go back to the pool."""
        self.live = []
        self.packed.release()
        self.read.open()

    @property
    def peak_host_bytes(self) -> int:
        """The staging's host memory on this rank: the pool's windows (the packed copies in them) and the copies
        made at the call beside the pool."""
        return self.pool.allocated_bytes + self.eager_bytes

    def _staged(self, value: Any, key: str) -> Any:
        """DCP's nesting (mappings, lists and tuples; DCP's keys join their path with dots), eager leaves copied."""
        if isinstance(value, Mapping):
            return {name: self._staged(item, f"{key}.{name}" if key else str(name)) for name, item in value.items()}
        if type(value) in (list, tuple):
            return type(value)(self._staged(item, f"{key}.{index}") for index, item in enumerate(value))
        if not isinstance(value, torch.Tensor):
            return copy.deepcopy(value)  # DCP pickles it while writing, after the call
        local = local_tensor(value)
        if self.staging.copies_eagerly(key, value, local.nbytes):
            packed = self.packed.copy(local) if self.packed.packs(local) else None
            if packed is not None:
                return packed if local is value else DTensor.from_local(
                    packed, value.device_mesh, value.placements, run_check=False, shape=value.shape,
                    stride=value.stride())
            if not self.packed.packs(local) or self.staging.names_eagerly(key):  # on the device, or asked for
                self.eager_bytes += local.nbytes
                return value.detach().clone()
            self.live.append(LiveTensor.record(key, value, advice=(
                f"It is small ({local.nbytes} bytes), copied at the call while the staging pool has room, and the pool "
                "had none, so it was read after the call: call manager.wait_staged() before changing it, or, if "
                "forward changes it (a BatchNorm statistic), name it in Staging(eager=...) or raise pool_bytes.")))
            return value
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
