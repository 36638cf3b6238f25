"""What ``CheckpointManager`` settles across ranks outside DCP's own collectives, and how a broken collective
becomes a typed error.

A reader of the manager asks two questions this module answers:

* **who decides.** Global rank 0 resolves (the step to load, the latest step, a step's metadata) and every rank
  receives its outcome or its typed error, so all ranks load one version (P5); ranks that asked for different
  things all fail, naming each rank's request; every rank resolves the chosen attempt itself before DCP starts,
  so one rank's stale cache fails all of them at once instead of hanging the others in a collective.
* **what happened.** DCP's ``CheckpointException`` and gloo's untyped ``RuntimeError`` become our own types; a
  failed collective is a peer failure only when the heartbeat says a rank is dead or frozen, and then names it
  (P8); otherwise the error is reported as what it is (the user's own, DCP's check).

``CheckpointManager`` mixes :class:`RankAgreement` in; the attributes it relies on are listed there.  The free
functions below it are the collectives the tiers and integrations share: :func:`gather` and :func:`from_rank0` turn
gloo's untyped failure into a :class:`CollectiveFailed` naming the rank that saw it (the manager's translation then
names the silent ranks), and :func:`agreed_phase` makes one rank's failure every rank's, so no rank is left waiting
in the next collective.
"""

from __future__ import annotations

import contextlib
import socket
from typing import Any, Callable, Iterator, NoReturn

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from ..errors import CheckpointError, RankConsistencyError, RankFailureError, StorageError, shorten
from .liveness import STORE_SILENT
from .transport import PeerLost


class RankAgreement:
    """Mixin of :class:`~dcp_atomic.manager.CheckpointManager`.  Uses its ``rank``, ``world_size``, ``run_id``,
    ``_distributed``, ``_group``, ``_heartbeat`` and ``_watch(what)``."""

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
                raise_typed(self._translate(e, f"resolving step {step}"))
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
                raise_typed(self._translate(e, what))
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

    def _translate(self, error: BaseException, what: str) -> BaseException:
        """Our own error type for anything DCP or the process group raised.  A peer failure is told by type (gloo
        and c10d raise ``RuntimeError``s) and the liveness verdict (:meth:`_gone`), never by words in a message:
        a user's own ``RuntimeError`` (a ``Stateful`` that says "timed out") is reported as what it is."""
        if isinstance(error, CollectiveFailed) and (gone := self._gone()) is not None:
            return self._peer_failure(error.__cause__ or error, what, gone)
        if isinstance(error, CheckpointError):
            return error
        if isinstance(error, CheckpointException):
            inner = [w[0] if isinstance(w, tuple) else w for w in error.failures.values()]
            ours = [e for e in inner if isinstance(e, CheckpointError)]
            if ours:
                return ours[0]
            collective = [e for e in inner if isinstance(e, RuntimeError)]
            if collective and (gone := self._gone()) is not None:
                return self._peer_failure(collective[0], what, gone)
            ranks = sorted(error.failures)
            typed = CheckpointError(f"{what} failed on rank(s) {ranks}: {first_line(inner[0])}", ranks=ranks)
            typed.__cause__ = inner[0] if isinstance(inner[0], BaseException) else None
            return typed
        if isinstance(error, RuntimeError) and (gone := self._gone()) is not None:
            return self._peer_failure(error, what, gone)
        if isinstance(error, Exception):  # DCP's own checks, a bug, the user's code: still typed (P8)
            typed = CheckpointError(f"{what} failed on rank {self.rank} ({socket.gethostname()}): "
                                    f"{first_line(error)}", rank=self.rank)
            typed.__cause__ = error
            return typed
        return error  # KeyboardInterrupt and the like are not ours

    def _peer_failure(self, error: BaseException, what: str, silent: str) -> RankFailureError:
        return RankFailureError(
            f"{what}: a peer died or stopped responding inside a collective (seen by rank {self.rank} on "
            f"{socket.gethostname()}); silent rank(s): {silent}. Nothing new is committed unless the step's "
            f"marker names this save; restart the job and resume from the latest committed step. "
            f"Cause: {first_line(error)}",
            rank=self.rank,
            silent=silent,
        )

    def _gone(self) -> str | None:
        """The heartbeat's verdict (:meth:`.liveness.Heartbeat.silent_peers`): the global ranks that are dead or
        frozen, as named in errors; None when every rank is alive (or there is no peer)."""
        if self._heartbeat is None:
            return None
        silent = self._heartbeat.silent_peers()
        if silent is None:
            return STORE_SILENT
        return ", ".join(map(str, silent)) or None


def raise_typed(error: BaseException) -> NoReturn:
    """Raise what ``_translate`` made, chained only to the cause it kept (DCP's wrapping is noise)."""
    raise error from error.__cause__


def _rank_list(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (f", ... ({len(ranks)} ranks)" if len(ranks) > 8 else "")


def first_line(error: BaseException) -> str:
    """The error's type and its last non-blank line, shortened: the cause, in the one line a message naming a rank
    or a step has room for (a DCP traceback's last line is the error itself)."""
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    text, named = shorten(lines[-1], 300) if lines else "", f"{type(error).__name__}: "
    return text if text.startswith(named) else named + text  # a CheckpointError's text names its type already


class CollectiveFailed(RankFailureError):
    """A collective broke on this rank: gloo raises an untyped ``RuntimeError`` when a peer dies, freezes or loses
    its connection.  The manager's :meth:`RankAgreement._translate` replaces it with the heartbeat's verdict, which
    names the silent ranks."""


def world_of(group: dist.ProcessGroup | None) -> int:
    """The number of ranks in ``group`` (the default group for None); 1 without torch.distributed."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def gather(group: dist.ProcessGroup | None, mine: Any, what: str) -> list[Any]:
    """Every rank's ``mine`` by group rank, on every rank; ``[mine]`` in a world of one.  A broken collective raises
    :class:`CollectiveFailed` saying ``what`` was exchanged."""
    world = world_of(group)
    if world == 1:
        return [mine]
    everyone: list[Any] = [None] * world
    try:
        dist.all_gather_object(everyone, mine, group=group)
    except RuntimeError as e:
        _collective_failed(e, what)
    return everyone


def from_rank0(group: dist.ProcessGroup | None, value: Any, what: str) -> Any:
    """Global rank 0's ``value`` on every rank (the others pass anything); ``value`` itself in a world of one.  A
    broken collective raises :class:`CollectiveFailed` saying ``what`` was shared."""
    if world_of(group) == 1:
        return value
    box = [value]
    try:
        dist.broadcast_object_list(box, src=0, group=group)
    except RuntimeError as e:
        _collective_failed(e, what)
    return box[0]


def _collective_failed(error: RuntimeError, what: str) -> NoReturn:
    rank = dist.get_rank()
    raise CollectiveFailed(
        f"{what}: the collective failed on rank {rank} ({socket.gethostname()}): a peer died, froze or lost its "
        f"connection. Restart the job: it resumes from the latest committed step. Cause: {first_line(error)}",
        rank=rank) from error


@contextlib.contextmanager
def agreed_phase(group: dist.ProcessGroup | None, where: str, failing: str, *, then: str,
                 **details: Any) -> Iterator[list[str]]:
    """One phase that every rank goes through alike, ending in agreement: an ``OSError`` or ``CheckpointError`` the
    block raises is recorded as this rank's failure (``"{failing}: {error}"``) instead of leaving the others waiting
    in the next collective; on exit every rank learns every rank's failure and raises the same
    :class:`StorageError` (``"{where} failed: ... {then}"``, with ``details``), or none does.  The block may append a
    failure it finds without an exception to the yielded list (the first one recorded is this rank's).  A lost peer
    (:class:`PeerLost`) is raised at once: the group is broken, the agreement's gather would only wait out its
    timeout."""
    failures: list[str] = []
    try:
        yield failures
    except PeerLost:
        raise
    except (OSError, CheckpointError) as e:
        failures.append(f"{failing}: {e}")
    everyone = [why for why in gather(group, failures[0] if failures else None, where) if why]
    if everyone:
        raise StorageError(f"{where} failed: " + "; ".join(everyone[:4]) + f". {then}", **details)
