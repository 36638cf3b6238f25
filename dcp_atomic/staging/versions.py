"""The race check of bounded staging: a live tensor's version counter, recorded at the call, compared after read.

Lazily staged tensors are read after the call returned, while training goes on; the contract is that nothing
changes them in place before ``wait_staged()``.  In-place ATen ops (``optimizer.step()``, ``add_``, ``copy_``) bump
the version counter, so a changed counter after the last byte was read means the bytes read may be a mix of two
versions: the save or snapshot fails with :class:`~dcp_atomic.errors.StagingRaceError` naming the key.  Writes
through a raw ``data_ptr`` (a custom kernel) bump no counter and are not caught: ``wait_staged()`` stays the gate
(:class:`ReadGate`: the moment the reading ends, which it waits for).  Two more gates close the gaps a counter cannot
see: every ``torch.optim`` optimizer step waits for the staged copy first (:func:`gate_optimizer_steps`: an optimizer
writing through ``p.data`` moves no counter of ``p``), and a DTensor's local shard is watched beside the wrapper (an
in-place op on ``to_local()`` moves the shard's counter, not the wrapper's).  What remains the user's
``wait_staged()`` to order: writes outside both (a numpy view, a custom loop outside ``torch.optim``, a raw kernel).
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch.distributed.tensor import DTensor

from .._base import internals
from ..errors import StagingRaceError


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor whose bytes this rank reads: a DTensor's local shard, else the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@dataclass
class LiveTensor:
    """A lazily staged tensor: its key, the live (local) tensor whose bytes are read, and the version counter at the
    call of ``watched``, the tensor the caller handed over.  For a DTensor that is the DTensor itself: an in-place op
    on it (an FSDP2 parameter's ``add_`` in ``optimizer.step()``) moves its counter, which a state dict's detached
    alias shares, while its local shard's counter (``to_local()``) does not move."""

    key: str
    tensor: torch.Tensor
    version: int
    watched: torch.Tensor | None = None
    local_version: int | None = None  # the local shard's own counter, when it is not the watched tensor's
    advice: str = "Call manager.wait_staged() before optimizer.step()."  # what the error tells the user to do

    @classmethod
    def record(cls, key: str, tensor: torch.Tensor, advice: str | None = None) -> "LiveTensor":
        local = local_tensor(tensor)
        recorded = cls(key, local, internals.version_counter(tensor), tensor,
                       None if local is tensor else internals.version_counter(local))
        if advice is not None:
            recorded.advice = advice
        return recorded

    def raise_if_changed(self, step: int | None, rank: int | None) -> None:
        now = internals.version_counter(self.watched if self.watched is not None else self.tensor)
        if now == self.version and (self.local_version is None
                                    or internals.version_counter(self.tensor) == self.local_version):
            return
        where = "" if step is None else f" of step {step}"
        what = f"{self.key!r} was changed in place (version {self.version} -> {now})"  # a snapshot's message reuses it
        race = StagingRaceError(
            f"rank {rank}: {what} while the save{where} was still reading it (an optimizer.step() or another in-place "
            f"op before manager.wait_staged() returned). Nothing was committed; the previous checkpoint is intact. "
            f"{self.advice}", step=step, rank=rank, key=self.key)
        race.what = what
        raise race


def gate_optimizer_steps(wait: Callable[[], Any]) -> Any:
    """Make every ``torch.optim`` optimizer step wait for ``wait`` (a bound ``wait_staged``, held weakly) first: a
    global step pre-hook, whatever the optimizer does to its parameters (``p.data``, foreach kernels).  Returns the
    hook's handle (``remove()`` when the owner closes)."""
    owner = weakref.WeakMethod(wait)

    def wait_before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        method = owner()
        if method is not None:
            method()

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    return register_optimizer_step_pre_hook(wait_before_step)


def raise_if_any_changed(live: Iterable[LiveTensor], step: int | None, rank: int | None) -> None:
    for tensor in live:
        tensor.raise_if_changed(step, rank)


class ReadGate:
    """The moment a staging stops reading the live tensors (read, or given up): what ``wait_staged()`` and
    ``StagedCopy.wait()`` wait for, with the time they waited summed."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self.wait_seconds = 0.0

    def open(self) -> None:
        self._open.set()

    def wait(self) -> float:
        """Block until the gate is open; the seconds waited."""
        started = time.perf_counter()
        self._open.wait()
        waited = time.perf_counter() - started
        self.wait_seconds += waited
        return waited
