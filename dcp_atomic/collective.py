"""What ``CheckpointManager`` settles across ranks outside DCP's own collectives, and how a broken collective
becomes a typed error.

A reader of the manager asks two questions this module answers:

* **who decides.** Global rank 0 resolves (the step to load, the latest step, a step's metadata) and every rank
  receives its outcome or its typed error, so all ranks load one version (P5); ranks that asked for different
  things all fail, naming each rank's request; every rank resolves the chosen attempt itself before DCP starts,
  so one rank's stale cache fails all of them at once instead of hanging the others in a collective.
* **what happened.** DCP's ``CheckpointException`` and gloo's untyped ``RuntimeError`` become our own types; a
  peer failure names the ranks that never check in on the rendezvous store within the group timeout (P8).

``CheckpointManager`` mixes :class:`RankAgreement` in; the attributes it relies on are listed there.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any, Callable, NoReturn

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from .errors import CheckpointError, RankConsistencyError, RankFailureError, shorten


class RankAgreement:
    """Mixin of :class:`~dcp_atomic.manager.CheckpointManager`.  Uses its ``rank``, ``world_size``, ``run_id``,
    ``timeout``, ``_distributed``, ``_group``, ``_instance``, ``_ops`` and ``_watch(what)``."""

    def _resolve_everywhere(self, reader: Any, step: int) -> None:
        """Every rank resolves on its own; if any rank cannot, all raise, naming who saw what (P5).

        Done before DCP starts, so a rank that fails here does not leave the
        others waiting in DCP's collectives until the group timeout; the
        exchange waits at a liveness barrier for ranks still reading (a large
        ``.metadata`` on slow storage is work, not death).
        """
        try:
            reader.resolve()
            mine: CheckpointError | None = None
        except CheckpointError as e:
            mine = e
        outcomes = [mine]
        if self._distributed and self.world_size > 1:
            reader.watch.wait_all("check")
            outcomes = [None] * self.world_size
            try:
                dist.all_gather_object(outcomes, mine, group=self._group)
            except BaseException as e:
                _raise_typed(self._translate(e, f"resolving step {step}"))
        failed = [(rank, error) for rank, error in enumerate(outcomes) if error is not None]
        if not failed:
            return
        if mine is not None and len(failed) == 1:
            raise mine
        rank, first = failed[0]
        summary = "; ".join(f"rank {r}: {e}" for r, e in failed)
        raise type(first)(f"{len(failed)} of {len(outcomes)} rank(s) could not resolve step {step} of run "
                          f"{self.run_id!r}, so no rank loads it: {summary}", ranks=[r for r, _ in failed])

    def _on_rank0(self, compute: Callable[[], Any], what: str, request: str | None = None) -> Any:
        """Compute on global rank 0 only and share the outcome; errors there reach every rank.

        Every rank must make the same ``request`` (a rank asking for another step must not silently
        load rank 0's, P5).  The exchange starts at a liveness barrier: rank 0 may be busy for longer
        than the group timeout (retention after the last save, a marker it waits for), and is waited
        for like any work, up to ``work_timeout``.
        """
        outcome = None
        if self.rank == 0:
            try:
                outcome = ("ok", compute())
            except CheckpointError as e:
                outcome = ("error", e)
        if self._distributed and self.world_size > 1:
            watch = self._watch(what)
            watch.wait_all("resolve")
            shared: list[Any] = [None] * self.world_size
            try:
                dist.all_gather_object(shared, (request, outcome), group=self._group)
            except BaseException as e:
                _raise_typed(self._translate(e, what))
            watch.finish()
            requests: dict[str | None, list[int]] = {}
            for rank, (asked, _) in enumerate(shared):
                requests.setdefault(asked, []).append(rank)
            if len(requests) > 1:
                raise RankConsistencyError(
                    f"{what}: the ranks asked for different things, so none goes on: "
                    + "; ".join(f"rank(s) {_rank_list(ranks)}: {asked}" for asked, ranks in requests.items())
                    + ". Every rank must make the same call with the same arguments.",
                    requests={asked: ranks[:8] for asked, ranks in requests.items()})
            outcome = shared[0][1]
        status, value = outcome
        if status == "error":
            raise value
        return value

    def _translate(self, error: BaseException, what: str, op: int | None = None) -> BaseException:
        """Our own error type for anything DCP or the process group raised."""
        if isinstance(error, CheckpointError):
            return error
        if isinstance(error, CheckpointException):
            inner = [w[0] if isinstance(w, tuple) else w for w in error.failures.values()]
            ours = [e for e in inner if isinstance(e, CheckpointError)]
            if ours:
                return ours[0]
            peers = [e for e in inner if _is_peer_failure(e)]
            if peers:
                return self._peer_failure(peers[0], what, op)
            ranks = sorted(error.failures)
            return CheckpointError(f"{what} failed on rank(s) {ranks}: {_first_line(inner[0])}", ranks=ranks)
        if _is_peer_failure(error):
            return self._peer_failure(error, what, op)
        if isinstance(error, Exception):  # DCP's own checks, a bug: still typed (P8); KeyboardInterrupt is not ours
            typed = CheckpointError(f"{what} failed on rank {self.rank} ({socket.gethostname()}): "
                                    f"{_first_line(error)}", rank=self.rank)
            typed.__cause__ = error
            return typed
        return error

    def _peer_failure(self, error: BaseException, what: str, op: int | None) -> RankFailureError:
        silent = self._silent_ranks(self._ops if op is None else op)
        return RankFailureError(
            f"{what}: a peer died or stopped responding inside a collective (seen by rank {self.rank} on "
            f"{socket.gethostname()}); silent rank(s): {silent}. Nothing new is committed unless the step's "
            f"marker names this save; restart the job and resume from the latest committed step. "
            f"Cause: {_first_line(error)}",
            rank=self.rank,
            silent=silent,
        )

    def _silent_ranks(self, op: int) -> str:
        """Which global ranks never check in on the rendezvous store within a short, bounded window.

        The process group is unusable after a peer failure, but the TCP store
        (hosted by global rank 0) still is, unless rank 0 itself is gone.  Every
        live rank reports under the failing operation's id; the ones missing
        after the group timeout are the dead or frozen ranks.
        """
        if not self._distributed:
            return "none (single process)"
        world, me = dist.get_world_size(), dist.get_rank()
        prefix = f"dcp_atomic/{self.run_id}/{self._instance}/op{op}"
        keys = [f"{prefix}/{r}" for r in range(world)]
        # Live ranks still blocked in the broken collective only notice at the group timeout: wait that long.
        window = self.timeout + 1.0
        present: list[int] = []

        def check_in() -> None:
            store = dist.distributed_c10d._get_default_store()
            store.set(keys[me], "alive")
            deadline = time.monotonic() + window
            while True:
                present[:] = [r for r, key in enumerate(keys) if store.check([key])]
                if len(present) == world or time.monotonic() > deadline:
                    return
                time.sleep(0.05)

        # A frozen rank 0 freezes its store too, and store calls then never return: bound them from outside.
        worker = threading.Thread(target=check_in, name="dcp-atomic-liveness", daemon=True)
        worker.start()
        worker.join(window + 2.0)
        if worker.is_alive() or me not in present:
            return "0 (the rendezvous store on global rank 0 does not answer: rank 0 is dead or frozen)"
        silent = sorted(set(range(world)) - set(present))
        return ", ".join(map(str, silent)) if silent else "none (all ranks checked in; a transient network failure?)"


def _is_peer_failure(error: BaseException) -> bool:
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        marker in text for marker in ("Connection closed by peer", "Connection reset by peer", "Timed out", "timed out",
                                      "timeout", "Broken pipe", "connection refused")
    )


def _raise_typed(error: BaseException) -> NoReturn:
    """Raise what ``_translate`` made, chained only to the cause it kept (DCP's wrapping is noise)."""
    raise error from error.__cause__


def _rank_list(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (f", ... ({len(ranks)} ranks)" if len(ranks) > 8 else "")


def _first_line(error: BaseException) -> str:
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return f"{type(error).__name__}: {shorten(lines[-1], 300) if lines else ''}"
