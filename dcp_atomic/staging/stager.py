"""``Stager``: a rank's items copied into a sink through a bounded pool of windows, after the call returns (P16).

What a snapshot (the memory tier) needs from staging: the call must return in milliseconds, host memory must stay
within ``Staging.pool_bytes``, and the bytes delivered must be one version of each tensor.  So:

1. At the call, :class:`~.options.Staging`'s rule picks what is copied now: non-tensor items (as ``torch.save``
   bytes, the form DCP stores them in), small tensors and the ``eager`` keys (buffers forward mutates), and tensors
   whose memory is not their value laid out flat (non-contiguous, lazily conjugated or negated).  These are written
   into the sink at the call, straight from the tensor where it is a CPU tensor laid out flat, else through one
   temporary host copy at a time: the sink (a memory slot) is their destination, so no host memory holds them beside
   the pool, however many small tensors the state has.  Every other tensor stays live and its version counter is
   recorded (:mod:`.versions`).
2. A background thread copies the live tensors window by window (``window_bytes``; a larger tensor takes
   several) into windows of the pool and hands each to ``sink.write(index, offset, data)``; the window goes back to
   the pool when ``write`` returns, so ``write`` must have copied or written the bytes by then.  CUDA tensors: the
   copies run on a side stream that first waits for the caller's stream at the call, into pinned windows,
   ``non_blocking``, each followed by an event; a window is handed over (and later reused) only after its event
   completed, while the next windows' copies are already queued.  CPU tensors take the same path, synchronously.
3. After a tensor's last window was copied, its version counter is compared: changed means an in-place op ran
   before ``wait_staged()`` and the copy is aborted with ``StagingRaceError`` naming the key (no ``finish`` for that
   item, nothing after it).  Otherwise ``sink.finish(index)``.

:meth:`StagedCopy.wait` returns once no window reads the live tensors any more (what ``optimizer.step()`` waits
for); :meth:`StagedCopy.result` once the sink has everything, raising the copy's failure.  The CUDA path was
written for the H200 check of issue 43 and is not exercised by the CPU test suite.
"""

from __future__ import annotations

import io
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable, Protocol

import torch

from .._base import failpoints
from ..format.codec import tensor_bytes
from .options import Staging
from .pool import WindowPool
from .versions import LiveTensor, ReadGate, local_tensor


class StageSink(Protocol):
    """Where staged bytes go: ``write`` a window of item ``index`` at byte ``offset`` (copy it before returning),
    ``finish`` once the item is whole.  The memory tier's slot writer is one."""

    def write(self, index: int, offset: int, data: memoryview) -> None:
        """Take bytes ``offset..offset+len(data)`` of item ``index``, in order; the window is reused on return."""

    def finish(self, index: int) -> None:
        """Item ``index`` is whole: its bytes are final (the slot writer computes its digests here)."""


@dataclass
class _Window:
    index: int
    offset: int
    window: torch.Tensor  # the pool's buffer, returned after the hand-over
    host: torch.Tensor  # the part of it this copy filled
    copied: Any  # a CUDA event, or None (the copy was synchronous)


@dataclass
class _LastWindow:
    """Queued after a tensor's last window: check its version, then ``finish``."""

    index: int
    live: LiveTensor


class Stager:
    """Stages items through one bounded pool; one staged copy at a time (a call waits for the previous copy)."""

    def __init__(self, staging: Staging, pool: WindowPool | None = None) -> None:
        self.staging = staging
        self.pool = pool or WindowPool(staging.windows, staging.window_bytes, pinned=torch.cuda.is_available())
        self._previous: StagedCopy | None = None

    def stage(self, items: Iterable[tuple[str, Any]], sink: StageSink, *, step: int | None = None,
              rank: int | None = None) -> "StagedCopy":
        """Copy the eager items now and start the background copy of the others; ``step`` and ``rank`` name
        the snapshot in a ``StagingRaceError``."""
        if self._previous is not None:
            self._previous.done.wait()  # two copies sharing the pool could each hold windows the other waits for
        started = time.perf_counter()
        live: list[tuple[int, LiveTensor]] = []
        eager_bytes = 0
        for index, (key, value) in enumerate(items):
            if not isinstance(value, torch.Tensor):
                buffer = io.BytesIO()
                torch.save(value, buffer)
                _write_whole(sink, index, buffer.getbuffer())
                continue
            local = local_tensor(value).detach()
            flat = local.is_contiguous() and not local.is_conj() and not local.is_neg()
            if not flat or self.staging.copies_eagerly(key, value, local.nbytes):
                if flat and local.device.type == "cpu":
                    _write_whole(sink, index, tensor_bytes(local))  # its own memory: no copy beside the sink's
                else:
                    host = torch.empty(local.shape, dtype=local.dtype)
                    host.copy_(local)  # contiguous, on the host, conjugation and negation resolved
                    _write_whole(sink, index, tensor_bytes(host))
                    eager_bytes = max(eager_bytes, local.nbytes)  # one such copy at a time
            else:
                live.append((index, LiveTensor.record(key, value)))
        ready = {}
        for _, tensor in live:  # the side stream starts where the caller's stream is now
            device = tensor.tensor.device
            if device.type == "cuda" and device not in ready:
                ready[device] = torch.cuda.Event()
                ready[device].record(torch.cuda.current_stream(device))
        copy = StagedCopy(self.pool, sink, live, ready, step, rank)
        copy.eager_bytes = eager_bytes
        copy.call_seconds = time.perf_counter() - started
        self._previous = copy
        copy.start()
        return copy


def _write_whole(sink: StageSink, index: int, data: memoryview) -> None:
    """An eager item, at the call: whole into the sink, finished."""
    sink.write(index, 0, data)
    sink.finish(index)


class StagedCopy:
    """One staging in flight (:meth:`Stager.stage`)."""

    def __init__(self, pool: WindowPool, sink: StageSink, live: list[tuple[int, LiveTensor]],
                 ready: dict[torch.device, Any], step: int | None, rank: int | None) -> None:
        self.pool, self.sink, self.step, self.rank = pool, sink, step, rank
        self._live, self._ready = live, ready
        self.call_seconds = 0.0
        self.eager_bytes = 0  # the largest temporary host copy the call made of an eager item
        self.error: BaseException | None = None
        self.released = ReadGate()  # opens once no window reads the live tensors any more
        self.done = threading.Event()  # the sink has everything, or the copy failed
        self._thread = threading.Thread(target=self._run, name="dcp-atomic-stager", daemon=True)

    @property
    def peak_host_bytes(self) -> int:
        """Host memory of this staging: the pool's windows and the largest temporary copy of an eager item."""
        return self.pool.allocated_bytes + self.eager_bytes

    def start(self) -> None:
        self._thread.start()

    def wait(self) -> float:
        """Block until no window reads the live tensors any more; the seconds waited."""
        return self.released.wait()

    def result(self) -> None:
        """Block until the sink has every item; raise the copy's failure (``StagingRaceError``, the sink's)."""
        self.done.wait()
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        try:
            try:
                failpoints.hit("stage.before_copy", self.rank, self.step)
                self._copy_live()
            finally:
                self.released.open()
        except BaseException as e:  # reported by result(): the thread has no caller
            self.error = e
        finally:
            self.done.set()

    def _copy_live(self) -> None:
        queue: deque[_Window | _LastWindow] = deque()
        windows = 0  # windows in the queue: at most the pool's
        streams = {device: torch.cuda.Stream(device) for device in self._ready}
        for device, ready in self._ready.items():
            streams[device].wait_event(ready)
        try:
            for index, live in self._live:
                flat = live.tensor.detach().reshape(-1).view(torch.uint8)
                for offset in range(0, flat.numel(), self.pool.window_bytes):
                    while windows >= self.pool.capacity:
                        windows -= self._hand_over(queue.popleft())
                    window = self.pool.acquire()
                    piece = flat[offset:offset + self.pool.window_bytes]
                    host = window[:piece.numel()]
                    copied = None
                    if piece.device.type == "cuda":
                        with torch.cuda.stream(streams[piece.device]):
                            host.copy_(piece, non_blocking=True)
                            copied = torch.cuda.Event()
                            copied.record(streams[piece.device])
                    else:
                        host.copy_(piece)
                    queue.append(_Window(index, offset, window, host, copied))
                    windows += 1
                queue.append(_LastWindow(index, live))
            while queue:
                self._hand_over(queue.popleft())
        finally:  # a failure: no copy may still be writing into a window that goes back to the pool
            for stream in streams.values():
                stream.synchronize()
            for entry in queue:
                if isinstance(entry, _Window):
                    self.pool.release(entry.window)

    def _hand_over(self, entry: _Window | _LastWindow) -> int:
        """Give a copied window to the sink and back to the pool (1), or check a finished tensor (0)."""
        if isinstance(entry, _LastWindow):
            entry.live.raise_if_changed(self.step, self.rank)
            self.sink.finish(entry.index)
            return 0
        try:
            if entry.copied is not None:
                entry.copied.synchronize()
            self.sink.write(entry.index, entry.offset, tensor_bytes(entry.host))
        finally:
            self.pool.release(entry.window)
        return 1
