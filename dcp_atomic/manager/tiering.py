"""What ``CheckpointManager`` asks of its storage tiers, and the one-tier answer.

The manager runs every operation the same way and asks its tiers, once per step of the operation, what they change.
Two interfaces, one per kind of tier, each with a "none" answer, so that no method of the manager asks which tiers it
has:

* the storage tiers (:class:`TierPolicy`): which writer a save builds, what happens after DCP returned, what a load
  restores from, what ``steps``/``retire``/``wait``/``close`` add.  :class:`DurableOnly` is ``root`` alone (every
  answer is "nothing more"); :class:`~.two_tier.TwoTier` is the local tier with its drain;
* the snapshot tier (:class:`SnapshotTier`): ``snapshot``, a restore asked before the storage tiers, what it retires
  when another tier served a load, and its share of ``wait``/``close``.  :class:`NoSnapshots` is none;
  :class:`~.snapshot_tier.MemorySnapshotTier` is the memory tier (P16).

Each is built in ``__init__`` with the same :class:`TierContext` (the manager's settings, groups and callables, never
its privates).
"""

from __future__ import annotations

import abc
import concurrent.futures
import contextlib
import dataclasses
import os
from typing import Any, Callable, ContextManager

from ..dcp.watched import WatchedWriter
from ..dcp.writer import AtomicStorageWriter
from ..errors import ConfigurationError
from ..exchange.liveness import Heartbeat, OpWatch
from ..format.layout import RunLayout
from ..format.manifest import Marker
from ..protocol.commit import ResumePoint
from ..protocol.retention_policy import Retention
from .options import Callbacks

NO_DRAIN = "queue_drain needs local_root (and, in a world, the manager's own groups)"


@dataclasses.dataclass(frozen=True)
class TierContext:
    """What a tier policy uses of its manager, built once by the manager's ``__init__``: the settings, the process
    groups, and the manager's ways of agreeing across ranks and of reporting, so that both tiers decide and report
    through one place (the policy holds no reference to the manager)."""

    rank: int
    world_size: int
    run_id: str
    root: str | os.PathLike
    storage_options: dict[str, Any] | None
    layout: RunLayout  # the durable root's
    timeout: float
    work_timeout: float
    thread_count: int | None
    retention: Retention  # the durable root's (the local tier keeps its own count, keep_local)
    lease_seconds: float
    group: Any  # the manager's process group (None without torch.distributed)
    drain_group: Any  # the drain thread's own group; None where the manager could not create one (process_group=)
    memory_group: Any  # the memory tier's thread's own group; None without a memory tier
    heartbeat: Heartbeat | None
    callbacks: Callbacks
    #: our own error type for what DCP or the process group raised (:meth:`.RankAgreement._translate`)
    translate: Callable[[BaseException, str], BaseException]
    #: compute on global rank 0, share the outcome or its error (:meth:`.RankAgreement._on_rank0`)
    on_rank0: Callable[..., Any]
    #: a liveness watch of the current operation's work
    watch: Callable[[str], OpWatch]
    #: the resume point of the manager's last load (P14), None before one
    resumed: Callable[[], ResumePoint | None]
    #: rank 0: a layout's marker of a step, or None (a read failure is a typed error)
    committed_marker: Callable[[RunLayout, int], Marker | None]
    #: hand statistics to a user callback; its failure is logged and counted, never the operation's
    deliver: Callable[[Any, str, Any], None]


class TierPolicy(abc.ABC):
    """The interface (every method is called on every rank alike unless it says otherwise); abstract, so a policy
    that forgets one fails when it is built, not with one tier's answer."""

    #: True where DCP's own ``finish`` writes the commit marker: a save DCP reports as failed may have committed
    #: anyway, and the manager settles it by reading the marker.
    commits_in_dcp: bool
    #: the effective ``durable_every`` (the manager's attribute of that name)
    durable_every: int | None
    #: after a load, which tier served it (the manager's ``restored_from``); None where only the durable root can
    restored_from: dict[str, Any] | None = None
    #: the run's lineage id where the policy knows it (the local tier's, :mod:`~dcp_atomic.protocol.lineage`)
    lineage: str | None = None

    # -- saving
    @abc.abstractmethod
    def drain_decision(self, durable: bool | None) -> bool | None:
        """Whether this save is also drained to the durable root (False: the save itself is durable, or kept
        local; None: not by the policy, but ``close()`` drains it if it is the last).  Counts the save."""

    @abc.abstractmethod
    def refuse_conflicts(self, step: int) -> None:
        """Rank 0, before a save: raise if a tier other than the durable root holds a commit of ``step`` that this
        save may not replace."""

    @abc.abstractmethod
    def durable_may_hold(self, step: int) -> bool:
        """Rank 0: whether the durable root's marker of ``step`` is worth reading for the conflict check."""

    @abc.abstractmethod
    def writer(self, step: int, **options: Any) -> AtomicStorageWriter:
        """The storage writer of a save (``options``: the writer keywords every tier shares)."""

    @abc.abstractmethod
    def failed_attempt_removed(self, step: int, writer: AtomicStorageWriter) -> ContextManager[None]:
        """Around a save's DCP call and :meth:`commit`: what a failure leaves behind is removed."""

    @abc.abstractmethod
    def commit(self, step: int, writer: AtomicStorageWriter, group: Any, drain: bool | None) -> None:
        """After DCP's save returned (``group``: the save's process group): a commit DCP did not make."""

    # -- loading and listing
    @abc.abstractmethod
    def restore(self, step: int | None, state_dict: dict[str, Any],
                save_id: str | None) -> tuple[str, int, str, ResumePoint] | None:
        """(root, step, save_id, resume point) to load from a tier other than the durable root, or None: load the
        durable root's choice."""

    @abc.abstractmethod
    def local_sequence(self) -> int | None:
        """The newest commit sequence held outside the durable root (None: none), on every rank alike: what a
        memory restore must not be older than."""

    @abc.abstractmethod
    def local_steps(self) -> set[int]:
        """The steps committed outside the durable root (``steps(tier="local")``)."""

    @abc.abstractmethod
    def retire(self, step: int) -> None:
        """Remove this rank's share of ``step`` outside the durable root."""

    @abc.abstractmethod
    def queue_drain(self, step: int) -> None:
        """Queue ``step`` for a drain to the durable root."""

    # -- the work in the background
    @abc.abstractmethod
    def wait(self) -> None:
        """Wait for the background work (drains); raise its unreported failure."""

    @abc.abstractmethod
    def drain_last_and_wait(self) -> None:
        """``close()``, no save in flight: send the last step where it still has to go, and wait for it."""

    @abc.abstractmethod
    def wait_at_exit(self) -> None:
        """The interpreter exits and ``close()`` was never called: wait for the work in flight, start nothing."""

    @abc.abstractmethod
    def busy(self) -> bool:
        """Work runs in the background: the process groups must not be destroyed under it."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the background work and release what the policy holds."""


class SnapshotTier(abc.ABC):
    """The snapshot tier's interface (every method on every rank alike unless it says otherwise)."""

    #: after a load: which tier served it, as this tier saw it (None: not this tier's to say)
    restored_from: dict[str, Any] | None = None
    #: snapshots due while the previous one was still in flight (skipped, never queued)
    snapshots_skipped: int = 0

    @abc.abstractmethod
    def snapshot(self, step: int, state_dict: dict[str, Any]) -> concurrent.futures.Future:
        """Snapshot ``state_dict``; the future resolves once it is committed on every rank."""

    @abc.abstractmethod
    def wait_staged(self) -> float:
        """This rank: wait until the latest snapshot reads no live tensor; the seconds waited."""

    @abc.abstractmethod
    def restore(self, state_dict: dict[str, Any], step: int | None, save_id: str | None,
                allow_reshard: bool) -> Any:
        """Asked before the storage tiers: load the newest step this tier holds into ``state_dict`` if no other tier
        holds a newer commit (``step``/``save_id`` given: never, an explicit request is the storage tiers'); what was
        restored (``.step``, ``.tier``, ``.bytes``, ``.bytes_fetched``), else None."""

    @abc.abstractmethod
    def loaded_elsewhere(self, step: int, save_id: str, served_by_local: bool) -> None:
        """A storage tier served ``step`` (save ``save_id``; the local tier if ``served_by_local``, else the durable
        root)."""

    @abc.abstractmethod
    def wait(self) -> None:
        """Wait for the snapshot in flight; raise its unreported failure.  Starts nothing (an exit without close)."""

    @abc.abstractmethod
    def finish(self) -> None:
        """``wait()`` and ``close()``: :meth:`wait`, then what is due in the background (a durable copy) and wait
        for it."""

    @abc.abstractmethod
    def in_flight(self) -> Any:
        """The latest snapshot's future (done or not), or None: what an exit without ``close()`` reports."""

    @abc.abstractmethod
    def busy(self) -> bool:
        """A snapshot runs in the background: the process groups must not be destroyed under it."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the background work and release what the tier holds."""


class NoSnapshots(SnapshotTier):
    """No snapshot tier: ``snapshot`` is refused, every other answer is "nothing"."""

    def snapshot(self, step: int, state_dict: dict[str, Any]) -> concurrent.futures.Future:
        raise ConfigurationError("CheckpointManager.snapshot needs a memory tier: pass memory=MemoryTier(path=...) "
                                 "to CheckpointManager")

    def wait_staged(self) -> float:
        return 0.0

    def restore(self, state_dict: dict[str, Any], step: int | None, save_id: str | None,
                allow_reshard: bool) -> Any:
        return None

    def loaded_elsewhere(self, step: int, save_id: str, served_by_local: bool) -> None:
        """Nothing to retire."""

    def wait(self) -> None:
        """Nothing in flight."""

    def finish(self) -> None:
        """Nothing in flight."""

    def in_flight(self) -> Any:
        return None

    def busy(self) -> bool:
        return False

    def close(self) -> None:
        """Holds nothing."""


class DurableOnly(TierPolicy):
    """One tier, ``root``: a save is durable when DCP's ``finish`` has committed it, and nothing runs after."""

    commits_in_dcp = True
    durable_every = None

    def __init__(self, root: str | os.PathLike, run_id: str, storage_options: dict[str, Any] | None) -> None:
        self.root, self.run_id, self.storage_options = root, run_id, storage_options

    def drain_decision(self, durable: bool | None) -> bool | None:
        return False  # the save itself is durable; ``durable`` is ignored

    def refuse_conflicts(self, step: int) -> None:
        """No tier but the durable root: the writer's own check of the marker is the whole check."""

    def durable_may_hold(self, step: int) -> bool:
        return True

    def writer(self, step: int, **options: Any) -> AtomicStorageWriter:
        return WatchedWriter(self.root, self.run_id, step, storage_options=self.storage_options, **options)

    def failed_attempt_removed(self, step: int, writer: AtomicStorageWriter) -> ContextManager[None]:
        return contextlib.nullcontext()  # an uncommitted attempt is the lease's to collect (retention.py)

    def commit(self, step: int, writer: AtomicStorageWriter, group: Any, drain: bool | None) -> None:
        """DCP's ``finish`` has committed the step: nothing is left to do."""

    def restore(self, step: int | None, state_dict: dict[str, Any],
                save_id: str | None) -> tuple[str, int, str, ResumePoint] | None:
        return None

    def local_sequence(self) -> int | None:
        return None

    def local_steps(self) -> set[int]:
        return set()

    def retire(self, step: int) -> None:
        """Nothing outside the durable root to remove."""

    def queue_drain(self, step: int) -> None:
        raise ConfigurationError(NO_DRAIN)

    def wait(self) -> None:
        """No background work with one tier."""

    def drain_last_and_wait(self) -> None:
        """Every save is already durable."""

    def wait_at_exit(self) -> None:
        """No background work with one tier."""

    def busy(self) -> bool:
        return False

    def close(self) -> None:
        """Holds nothing to release."""
