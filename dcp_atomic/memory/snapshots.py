"""The memory tier (P16): a snapshot of every rank's state in RAM at every step, with verified copies on other failure
domains, ordered by the one commit sequence, and restores from it.

A snapshot of ``step``, every rank alike:

1. (the caller's thread) the ranks agree that no snapshot is in flight (else this one is skipped and counted, never
   queued) and, at the first snapshot, that the budget holds ``slot_files x (1 + replicas)`` shares on every node; each
   rank retires its oldest slot (its commit record goes first) and writes its items into it (:mod:`.slots`);
2. (the memory tier's thread, its own process group) every rank sends its slot to its ``replicas`` holders on other
   failure domains (the local tier's placement) through the one transport; a holder verifies every block against
   the sender's record before the copy takes the slot's name;
3. every rank reports to global rank 0, which gives the snapshot the next commit sequence (above every sequence this
   process knows of any tier, :func:`~dcp_atomic.protocol.commit.note_sequence`) and hands it out;
4. every rank, and every holder of a copy, writes the commit record; the ranks agree that all did: the snapshot is
   *memory-committed*, and its future resolves to the step on every rank (or raises the same error on every rank).

A crash anywhere before 4 leaves the new step without a complete set of records: a restore takes the newest
sequence for which every rank's share has a record and verified bytes, on its own node or a holder's, so it never
mixes steps.  A restore compares that sequence with the newest commit of the other tiers; memory wins a tie.

Durable copies (``durable_every``): once every N-th snapshot is memory-committed, the next call on the caller's thread
(a snapshot, or the manager's ``wait()``/``close()``) saves its slot as a durable step through the manager
(:class:`DurableCopies`), from the slot's bytes, and pins the slot until that save is done: the rotation takes the
oldest unpinned slot (one slot file more than ``slots``), so a snapshot is neither skipped nor made to wait for it
(P16: a slot a drain still reads is never rewritten); a copy that failed is raised by the next snapshot call.

At construction every rank tells the others its path's state, the newest sequence of this run's slots on it, and its
settings: a job that snapshots before (or without) a restore numbers above every slot an earlier job left, and
settings that differ are refused by name.

Why one module of about 990 lines: one tier's protocol, a snapshot's and a restore's collectives in the order every
rank runs them (each rank's side of an agreement beside the others'); the slots, their items and the resharding are
:mod:`.slots`', :mod:`.items`' and :mod:`.reshard`'s, and what ties the tier to the manager is
:mod:`dcp_atomic.manager.snapshot_tier`'s.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from .._base import failpoints
from .._base.futures import ReportedFuture
from .._base.mounts import ram_backed
from .._base.stats import SnapshotStats
from ..errors import (CheckpointError, ConfigurationError, CorruptCheckpointError, StagingRaceError,
                      UnsafeItemError)
from ..dcp import check_layout, infer_parallelism
from ..exchange.collective import CollectiveFailed, agreed_phase, first_line, gather, raise_typed
from ..exchange.file_transfer import Part, Spooled, discard, transfer
from ..exchange.transport import PeerError, PeerLink
from ..format.layout import RunLayout
from ..format.parallelism import Parallelism
from ..protocol.commit import known_sequence, next_sequence, note_sequence
from ..staging import StagedCopy, Stager
from ..tiers import Topology, expand_stateful
from . import reshard
from .items import durable_state, flatten, hand_back, install, leaves_of, slot_items, stage_leaves, write_leaves
from .reshard import layout_of
from .slots import InPlaceSlot, SlotDir, SlotRecord, SlotSink, mapped, newest_complete, verify_slot

log = logging.getLogger("dcp_atomic.memory")
CONSEQUENCE = "the snapshot is not memory-committed; the previous one is intact."


class SnapshotFuture(ReportedFuture):
    """A snapshot's outcome: the step once memory-committed on every rank; ``skipped`` when this call took none
    (not due, or the previous snapshot still in flight)."""

    skipped = False


def _skipped() -> SnapshotFuture:
    future = SnapshotFuture()
    future.skipped = True
    future.set_result(None)
    return future


@dataclass(frozen=True)
class Restored:
    """What a memory restore loaded: ``tier`` is ``"memory"`` (every rank from its own node) or ``"memory-replica"``
    (some rank's share came from a holder on another failure domain)."""

    step: int
    sequence: int
    tier: str
    bytes: int  # this rank's share (resharded: the old shares it read)
    bytes_fetched: int  # of which received from a holder
    resharded_from: int | None = None  # the world size that took the snapshot, when it was not this job's

    def to_dict(self) -> dict[str, Any]:
        return {"tier": self.tier, "step": self.step, "sequence": self.sequence, "save_id": None,
                "ranks_fetched": int(bool(self.bytes_fetched)), "bytes_fetched": self.bytes_fetched,
                "resharded_from": self.resharded_from}


class MemorySnapshots:
    """The memory tier of one manager, built by its ``__init__`` on every rank alike (``group``: the manager's, for
    the caller's thread; ``memory_group``: the memory tier's thread's own)."""

    def __init__(self, *, rank: int, world_size: int, run_id: str, layout: RunLayout, options: Any, domain: str,
                 lineage: str, group: Any, memory_group: Any, timeout: float,
                 translate: Callable[[BaseException, str], BaseException], stager: Stager | None = None,
                 deliver: Callable[[SnapshotStats], None] = lambda stats: None,
                 durable: DurableCopies | None = None, parallelism: Parallelism | None = None) -> None:
        """``stager``: bounded staging (``CheckpointManager(staging=...)``): a snapshot's tensors are copied into the
        slot after the call returns, through the stager's pool, and :meth:`wait_staged` says when they may change;
        None: copied at the call.  ``deliver``: each memory-committed snapshot's statistics, on every rank.
        ``durable``: how the manager saves a durable copy (``options.durable_every``; needed when that is set).
        ``parallelism``: the manager's declared layout (else each snapshot records the one its meshes imply)."""
        self.rank, self.world_size, self.run_id, self.layout = rank, world_size, run_id, layout
        self.every, self.replicas, self.slots = options.every, options.replicas, options.slots
        # a durable copy's pinned slot is one more than the rotation's: a pin never makes a snapshot skip
        self.slot_files = self.slots + (options.durable_every is not None)
        self.budget_bytes = options.budget_bytes
        self.lineage, self.timeout, self.translate, self.deliver = lineage, timeout, translate, deliver
        self.group, self.memory_group = group, memory_group
        self.dir = SlotDir(options.path, run_id)
        self.snapshots_taken = self.snapshots_skipped = 0
        self._calls = 0
        self._checked_share = -1  # the largest share the budget was checked for
        self._floor_read = False  # rank 0: the durable root's sequence read once
        self._inflight: SnapshotFuture | None = None
        self.stager = stager
        self._staged: StagedCopy | None = None  # the staging of the latest snapshot (with a stager)
        self.durable_every, self.durable = options.durable_every, durable
        self.parallelism = parallelism
        self._other_worlds_swept = False  # slots an earlier job of another world size left: removed once
        self._since_copy = 0  # memory-committed snapshots since the last durable copy started
        self._due: SlotRecord | None = None  # the newest memory-committed slot, once a durable copy of it is due
        self._pinned: _Pin | None = None  # the slot the latest durable copy reads, until its save is done
        self._shapes: dict[int, Any] = {}  # per slot: the containers of the state it holds (items.flatten)
        facts = self._gathered(self._start_facts(), "checking the memory tier's path and settings")
        refused = [f"rank {r} ({host}): {why}" for r, (host, why, _, _) in enumerate(facts) if why]
        if refused:
            raise ConfigurationError("MemoryTier(path=...) refused: " + "; ".join(refused[:4]) + ". Give each node a "
                                     "writable RAM-backed directory (a tmpfs such as /dev/shm) with room for the "
                                     "budget.", path=self.dir.path)
        _refuse_differing_settings([settings for _, _, _, settings in facts])
        if rank == 0:  # numbered above every slot already on the nodes, restored or not (one sequence, P10)
            note_sequence(layout, max(newest for _, _, newest, _ in facts))
        self.topology = Topology.learn(rank, domain, self.dir.path, self.replicas, group)
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dcp-atomic-memory")

    # -- construction ------------------------------------------------------------------------

    def _start_facts(self) -> tuple[str, str | None, int, dict[str, Any]]:
        """What every rank tells the others at construction: (host, why its path cannot hold the tier or None, the
        newest sequence of this run's slots on its path, its settings)."""
        host, why = self._path_problem()
        newest = max((record.sequence for _, record in self.dir.records() if isinstance(record, SlotRecord)),
                     default=0)
        return host, why, newest, {"every": self.every, "replicas": self.replicas, "slots": self.slots,
                                   "durable_every": self.durable_every}

    def _path_problem(self) -> tuple[str, str | None]:
        """(host, why this rank's path cannot hold the tier, or None).  A missing directory on a RAM-backed parent is
        created (0700): a replaced node starts with an empty /dev/shm."""
        path, host = self.dir.path, socket.gethostname()
        if not os.path.isdir(path):
            parent = os.path.dirname(os.path.abspath(path))
            if not (os.path.isdir(parent) and ram_backed(parent)):
                return host, f"{path} does not exist or is not a directory (and its parent is not RAM-backed)"
            try:
                os.makedirs(path, mode=0o700, exist_ok=True)
            except OSError as e:
                return host, f"{path} could not be created ({os.strerror(e.errno) if e.errno else e})"
            log.info("memory tier: created %s (its parent is RAM-backed)", path)
        if ram_backed(path) is False:
            log.warning("memory tier: %s on %s is not RAM-backed: snapshots go through the page cache to its disk, "
                        "slower than memory and kept across reboots; use a tmpfs such as /dev/shm", path, host)
        try:
            os.makedirs(self.dir.run_dir, exist_ok=True)
            probe = os.path.join(self.dir.run_dir, f".probe.{os.getpid()}")
            with open(probe, "wb") as f:
                f.write(b"\0")
            os.unlink(probe)
        except OSError as e:
            return host, f"{path} is not writable ({os.strerror(e.errno) if e.errno else e})"
        free = _free_bytes(path) + self.dir.held_bytes()
        if self.budget_bytes is not None and self.budget_bytes > free:
            return host, (f"budget_bytes={self.budget_bytes} is more than the {free} bytes {path} can hold (its free "
                          "space and this run's slots)")
        return host, None

    def _check_budget(self, shares: list[tuple[int, str, str, int]]) -> None:
        """Every rank alike, from every rank's (share, host, path, free bytes): what each rank needs at a snapshot's
        peak (:meth:`_peak_bytes`) within ``budget_bytes``, and each node's total within its path's free bytes."""
        slots = f"{self.slots} slot(s)" + (" + 1 for a durable copy" if self.slot_files > self.slots else "")
        peak = [self._peak_bytes(r, [share for share, *_ in shares]) for r in range(len(shares))]
        refused = []
        if self.budget_bytes is not None:
            refused += [f"rank {r} needs {peak[r]} bytes ({slots} of its {share}-byte share and of the "
                        f"{len(self.topology.placement.held_by(r))} share(s) it holds a replica of), over "
                        f"budget_bytes={self.budget_bytes}"
                        for r, (share, _, _, _) in enumerate(shares) if peak[r] > self.budget_bytes]
        nodes: dict[tuple[str, str], list[int]] = {}
        for r, (_, host, path, _) in enumerate(shares):
            nodes.setdefault((host, path), []).append(r)
        for (host, path), ranks in nodes.items():
            needed = sum(peak[r] for r in ranks)
            if needed > shares[ranks[0]][3]:
                refused.append(f"{host}:{path} needs {needed} bytes for ranks {ranks} at a snapshot's peak, and can "
                               f"hold {shares[ranks[0]][3]}")
        if refused:
            raise ConfigurationError("the memory tier cannot hold its snapshots: " + "; ".join(refused[:4]) +
                                     ". Raise budget_bytes and the RAM-backed directory's size, or lower slots or "
                                     "replicas; nothing was snapshotted.", path=self.dir.path,
                                     needed=peak[self.rank], budget=self.budget_bytes)
        self._checked_share = max(share for share, _, _, _ in shares)

    def _peak_bytes(self, rank: int, shares: list[int]) -> int:
        """What ``rank``'s path holds at the peak of a snapshot: its own slot files and its replica slot files (a
        replica is received in place, into the slot it replaces: the peak is the steady state)."""
        held = sum(shares[source] for source in self.topology.placement.held_by(rank))
        return self.slot_files * (shares[rank] + held)

    # -- snapshots -----------------------------------------------------------------------------

    def snapshot(self, step: int, state_dict: dict[str, Any]) -> SnapshotFuture:
        """Steps 1 (here) and 2-4 (on the memory tier's thread); every rank alike."""
        started = time.perf_counter()
        self._calls += 1
        if (self._calls - 1) % self.every:
            return _skipped()
        leaves, shape = flatten(state_dict)
        share = sum(leaf.nbytes for leaf in leaves)
        busy = self._inflight is not None and not self._inflight.done()
        copying = self.durable is not None and self.durable.busy()
        mine = (busy, copying, share, socket.gethostname(), os.path.realpath(self.dir.path),
                _free_bytes(self.dir.path) + self.dir.held_bytes(), self._copy_failed())
        everyone = self._gathered(mine, f"starting the memory snapshot of step {step}")
        self._raise_failed_copy(step, [(r, failed) for r, (*_, failed) in enumerate(everyone) if failed])
        if any(b for b, *_ in everyone):
            return self._skip(step, "the previous snapshot is still in flight")
        if any(share > self._checked_share for _, _, share, *_ in everyone):
            self._check_budget([(share, host, path, free) for _, _, share, host, path, free, _ in everyone])
        self.wait()  # the previous one is done on every rank: raise its failure if nobody has
        if self._due is not None and not any(c for _, c, *_ in everyone):  # every rank alike: all are done
            self._start_durable_copy()
        slot, foreign = self._oldest_slot()
        if foreign is not None:  # another experiment's snapshot: the two share the slot's file
            log.warning("memory tier: rank %d rewrites slot %d of %s, which holds step %d of another lineage (%s; "
                        "this job's: %s): two experiments share run id %r on one memory path; give each its own "
                        "run id or path", self.rank, slot, self.dir.path, foreign.step, foreign.lineage, self.lineage,
                        self.run_id)
        if self._due is not None and self._due.slot == slot:  # its copy could not start yet: the next one is due
            self._due = None
        self.dir.retire(self.rank, slot)  # P1 for slots: the record goes before a byte is rewritten
        failpoints.hit("memory.after_retire", self.rank, step)
        layout = self._layout(leaves)
        self._shapes[slot] = shape
        written: SlotRecord | _Staging | BaseException
        staging = None
        try:
            sink = SlotSink(self.dir.data(self.rank, slot), [leaf.nbytes for leaf in leaves])
            try:
                if self.stager is None:
                    written = self._record(step, slot, sink.length, write_leaves(leaves, sink), layout)
                else:  # finished on the memory tier's thread (_staged_record), which closes the sink
                    copy, checksums = stage_leaves(leaves, sink, self.stager, step=step, rank=self.rank)
                    self._staged = copy
                    written = staging = _Staging(copy, sink, leaves, checksums, slot, layout)
            finally:
                if staging is None:
                    sink.close()
        except OSError as e:
            written = e
        failpoints.hit("memory.after_slot_write", self.rank, step)
        future = self._inflight = SnapshotFuture()
        future.step = step
        self._worker.submit(self._commit, step, written, future, f"memory/{self.run_id}/{self._calls}", started,
                            time.perf_counter() - started)
        return future

    def _skip(self, step: int, why: str) -> SnapshotFuture:
        """Every rank alike: this call takes no snapshot (counted, logged with ``why``), never waits for one."""
        self.snapshots_skipped += 1
        log.info("memory tier: step %d not snapshotted, %s (%d skipped so far)", step, why, self.snapshots_skipped)
        return _skipped()

    # -- durable copies ------------------------------------------------------------------------

    def _pinned_slot(self) -> int | None:
        pin = self._pinned
        return pin.slot if pin is not None and not pin.future.done() else None

    def _copy_failed(self) -> str | None:
        """This rank's durable copy that failed and that nothing reported yet (its first line), else None; the pin
        is gone once its save is done, whatever its outcome."""
        pin = self._pinned
        if pin is None or not pin.future.done():
            return None
        error = concurrent.futures.Future.exception(pin.future)
        if error is None or getattr(pin.future, "reported", False):
            self._pinned = None
            return None
        return first_line(error)

    def _raise_failed_copy(self, step: int, failed: list[tuple[int, str]]) -> None:
        """Every rank alike: a durable copy that failed on any rank is raised by this snapshot call (this rank's own
        error where it has one), once; its slot is unpinned.  Never a silent gap: the snapshots went on meanwhile."""
        if not failed:
            return
        pin, self._pinned = self._pinned, None
        own = None
        if pin is not None:
            # the copy is one save of every rank: failed on another rank, it fails here too, maybe later (this rank's
            # save thread ran late). Its outcome is waited for and raised here, so that it is reported once on every
            # rank; dropped unreported, this rank's next save raised it alone, and the ranks parted ways
            concurrent.futures.wait([pin.future], timeout=self.timeout)
            if pin.future.done() and concurrent.futures.Future.exception(pin.future) is not None:
                own = concurrent.futures.Future.exception(pin.future)
                pin.future.reported = True
        log.warning("memory tier: step %d is not snapshotted: the durable copy of an earlier snapshot failed (%s)",
                    step, "; ".join(f"rank {r}: {why}" for r, why in failed[:4]))
        if own is not None:
            raise own
        rank, why = failed[0]
        raise CheckpointError(f"the durable copy of a memory snapshot failed on rank {rank}: {why}. Step {step} was not "
                              "snapshotted; the snapshots before it stay memory-committed, the next call snapshots "
                              "again.", step=step, rank=rank)

    def _start_durable_copy(self) -> None:
        """Every rank alike, on the caller's thread (the only one that starts manager operations): save the due
        slot as a durable step of its number, from its bytes (read-only, in place), and pin the slot until that
        save is done.  The manager's ``async_save`` reports the outcome; the snapshot stays memory-committed."""
        record, self._due, self._since_copy = self._due, None, 0
        path = self.dir.data(self.rank, record.slot)
        held = contextlib.ExitStack()
        problem = None
        try:
            data = held.enter_context(mapped(path, record.length))
            state = durable_state(self._shapes[record.slot], record.items, data,
                                  f"memory slot {path} (rank {self.rank}, step {record.step})")
        except (OSError, CheckpointError) as e:
            held.close()
            problem = f"rank {self.rank} ({socket.gethostname()}): {first_line(e)}"
        # every rank alike: a slot one rank cannot read is a copy none starts (the others would wait in its save)
        problems = [p for p in self._gathered(problem, f"reading the slots for the durable copy of step {record.step}")
                    if p]
        if problems:
            held.close()
            self._pinned = _Pin(record.slot, record.step, self.durable.refuse(record.step, CorruptCheckpointError(
                f"the durable copy of memory step {record.step} (sequence {record.sequence}) was not started: "
                + "; ".join(problems[:4]) + ". The snapshot stays memory-committed; the next due snapshot is copied "
                "instead (a damaged slot: check the node's RAM, `dcp-atomic verify PATH RUN --memory`)",
                path=path)))  # pinned done: raised by the next snapshot() (_copy_failed), never rewritten before
            return
        try:
            future = self.durable.save(record.step, state, record.sequence)
        except BaseException:
            held.close()
            raise
        self._pinned = _Pin(record.slot, record.step, future)
        future.add_done_callback(lambda _: held.close())  # the mapping goes once the writer has read it
        log.info("memory tier: saving step %d (sequence %d) to the durable root from slot %d", record.step,
                 record.sequence, record.slot)

    def flush_durable(self) -> bool:
        """Every rank alike, with no snapshot in flight (:meth:`wait` returned on every rank): start the durable copy
        that is due, if any (``wait()`` and ``close()``: a job that stops after a due snapshot still gets its copy);
        whether one started."""
        if self._due is None or self.durable.busy():
            return False
        self._start_durable_copy()
        return True

    def _record(self, step: int, slot: int, length: int, items: list, layout: dict | None) -> SlotRecord:
        """This rank's record of ``slot`` (its sequence given at commit, :func:`_with_sequence`)."""
        return SlotRecord(run_id=self.run_id, lineage=self.lineage, rank=self.rank, world_size=self.world_size,
                          step=step, sequence=0, slot=slot, length=length, items=tuple(items), layout=layout)

    def _layout(self, leaves: list) -> dict | None:
        """The job's layout as a load checks it: declared (``CheckpointManager(parallelism=...)``), else inferred
        from the state's named meshes, as a durable save records it."""
        layout = self.parallelism or infer_parallelism(layout_of(leaves))
        return None if layout is None else layout.to_dict()

    def _staged_record(self, step: int, staging: "_Staging") -> SlotRecord | BaseException:
        """On the memory tier's thread: wait for the staged copy into the slot, then its record; a tensor changed in
        place before ``wait_staged()`` on any rank is a ``StagingRaceError`` on every rank (agreed here), with the
        slot left without a record and the previous snapshot intact."""
        race = written = None
        try:
            staging.copy.result()
            written = self._record(step, staging.slot, staging.sink.length,
                                   slot_items(staging.leaves, staging.checksums), staging.layout)
        except StagingRaceError as e:
            race = e
        except OSError as e:
            written = e
        finally:
            staging.sink.close()
        mine = None if race is None else (self.rank, race.details.get("key"), getattr(race, "what", first_line(race)))
        raced = [r for r in self._gathered(mine, f"staging the memory snapshot of step {step}", self.memory_group)
                 if r is not None]
        if raced:
            rank, key, why = raced[0]
            raise StagingRaceError(
                f"the memory snapshot of step {step} was not committed: on rank {rank}, {why} while it was being "
                "copied into the slot" + (f" (and on {len(raced) - 1} more rank(s))" if len(raced) > 1 else "")
                + ". Call wait_staged() before changing the state (an optimizer step outside torch.optim, an in-place "
                "op); the previous snapshot is intact.", step=step, rank=rank, key=key)
        return written

    def wait_staged(self) -> float:
        """Block until the latest snapshot's staging reads no live tensor any more; the seconds waited (0.0 at once
        without a stager or a snapshot)."""
        copy = self._staged
        return 0.0 if copy is None else copy.wait()

    def _oldest_slot(self) -> tuple[int, SlotRecord | None]:
        """The slot to reuse: one without a record, else the one holding the lowest sequence (never the newest with
        two slots or more), never the one a durable copy still reads (its own extra slot: ``slot_files``); and the
        record of another lineage it holds, if it does (one reading of the records)."""
        held: dict[int, SlotRecord] = {}
        for _, record in self.dir.records(self.rank):
            if isinstance(record, SlotRecord) and record.rank == self.rank and record.slot < self.slot_files:
                held[record.slot] = record
        pinned = self._pinned_slot()
        candidates = [k for k in range(self.slot_files) if k != pinned]
        free = [k for k in candidates if k not in held]
        slot = free[0] if free else min(candidates, key=lambda k: held[k].sequence)
        record = held.get(slot)
        return slot, record if record is not None and record.lineage != self.lineage else None

    def _commit(self, step: int, written: SlotRecord | BaseException, future: SnapshotFuture, exchange: str,
                started: float, call_seconds: float) -> None:
        """Steps 2-4 on the memory tier's thread; the outcome goes to ``future`` (``exchange``: this snapshot's name,
        the same on every rank, for the transport's check-in when a peer is lost), its statistics to ``deliver``."""
        what = f"memory snapshot of step {step}"
        try:
            if isinstance(written, _Staging):
                written = self._staged_record(step, written)
            with agreed_phase(self.memory_group, f"the {what}", f"rank {self.rank} could not write its slot",
                              then="The previous snapshot is intact.", step=step) as failures:
                if isinstance(written, BaseException):
                    failures.append(f"rank {self.rank} could not write its slot {self.dir.path}: {written}")
            kept = self._replicate(written, step)
            sequence = self._sequence(step)
            failpoints.hit("memory.before_record", self.rank, step)
            with agreed_phase(self.memory_group, f"the {what}", f"rank {self.rank} could not write a commit record",
                              then="The previous snapshot is intact.", step=step):
                for record in [written, *kept]:
                    self.dir.write_record(_with_sequence(record, sequence))
                failpoints.hit("memory.after_record", self.rank, step)
        except BaseException as e:  # ours pass as they are; a broken collective gets the liveness verdict
            typed = self.translate(e, f"the {what}")
            if isinstance(typed, CollectiveFailed):  # no verdict yet: the transport's check-in names who is gone
                typed = PeerLink(self.memory_group, self.timeout, exchange).lost(
                    PeerError(None, first_line(typed)), f"the {what}", CONSEQUENCE)
            future.set_exception(typed)
            return
        self.snapshots_taken += 1
        self._retire_other_worlds(sequence)
        if self.durable_every is not None:
            self._since_copy += 1
            if self._since_copy >= self.durable_every:
                self._due = _with_sequence(written, sequence)
        self.deliver(SnapshotStats(
            run_id=self.run_id, step=step, sequence=sequence, world_size=self.world_size, rank=self.rank,
            slot=written.slot, call_seconds=call_seconds, committed_seconds=time.perf_counter() - started,
            bytes=written.length, replica_bytes_sent=written.length * len(self.topology.placement.holders[self.rank]),
            replica_bytes_received=sum(copy.length for copy in kept), snapshots_skipped=self.snapshots_skipped,
            gb_per_s=written.length / max(time.perf_counter() - started, 1e-9) / 1e9))
        future.set_result(step)

    def _replicate(self, record: SlotRecord, step: int) -> list[SlotRecord]:
        """Step 2: this rank's slot to its holders, sent from its mapping, and the copies it holds received in place
        into their slots (:meth:`_land_replica`), checked as they landed; the records to write."""
        placement = self.topology.placement
        sources, holders = placement.held_by(self.rank), placement.holders[self.rank]
        failpoints.hit("memory.replica_send", self.rank, step)
        received: dict = {}
        failed: BaseException | None = None
        path = self.dir.data(self.rank, record.slot)
        try:
            data = Part.direct("data", self.dir.maps.view(path, record.length))
        except (OSError, CorruptCheckpointError):  # still streamed: its reads fail and the holders refuse it
            data = Part("data", record.length, path=path)
        outgoing = {holder: [Part.inline("record", record.to_bytes()), data] for holder in holders}
        try:  # a failed write (a full node) is this rank's failure in the agreement below, not a lost peer
            received = transfer(outgoing, {src: self.topology.describe(src) for src in sources}, self.memory_group,
                                self.dir.spool, what=f"sending the memory snapshot of step {step} to its replica "
                                "holders", timeout=self.timeout, exchange_id=f"memory/{self.run_id}",
                                consequence=CONSEQUENCE,
                                land=lambda src, name, size, done: self._land_replica(src, step, name, size, done))
        except (OSError, CorruptCheckpointError) as e:
            failed = e
        del data, outgoing  # the slot's view: the mapping stays for the next snapshot
        kept: list[SlotRecord] = []
        with agreed_phase(self.memory_group, f"replicating the memory snapshot of step {step}",
                          f"{self.topology.describe(self.rank)} could not keep a replica", then="The previous "
                          "snapshot is intact.", step=step):
            try:
                if failed is not None:
                    raise failed
                for src, parts in received.items():
                    copy = self._sent_record(src, step, parts["record"])
                    landed = parts["data"]
                    if isinstance(landed, bytes):  # an empty share travels inline: its slot, emptied in place
                        landed = parts["data"] = self._land_replica(src, step, "data", 0, parts)  # discard() closes it
                    landed.check()
                    kept.append(dataclasses.replace(copy, holder=self.rank))
                failpoints.hit("memory.replica_receive", self.rank, step)
            finally:
                discard(received)
        return kept

    def _sent_record(self, src: int, step: int, raw: bytes | None) -> SlotRecord:
        copy = SlotRecord.from_bytes(raw or b"", f"the record rank {src} sent")
        if (copy.rank, copy.step, copy.run_id) != (src, step, self.run_id):
            raise CorruptCheckpointError(f"rank {src} sent the record of rank {copy.rank} step {copy.step}, not its "
                                         f"own of step {step}", rank=src)
        return copy

    def _land_replica(self, src: int, step: int, name: str, size: int, done: dict) -> InPlaceSlot:
        """Where rank ``src``'s slot lands on this holder: its replica slot, rewritten in place like an own slot (its
        record retired before a byte changes; written only once the sequence is given)."""
        copy = self._sent_record(src, step, done.get("record"))
        if (name, size) != ("data", copy.length):
            raise CorruptCheckpointError(f"rank {src} sent {size} bytes as {name!r}, its record names {copy.length}",
                                         rank=src)
        self.dir.retire(src, copy.slot)
        failpoints.hit("memory.replica_retired", self.rank, step)
        return InPlaceSlot(self.dir.data(src, copy.slot), copy, self.dir.maps, "memory.replica_half_received")

    def _sequence(self, step: int) -> int:
        """Step 3: global rank 0 numbers the snapshot above every commit it knows, and hands the number out."""
        number = 0
        if self.rank == 0:
            if not self._floor_read:  # the durable root's newest commit, once per manager
                try:
                    note_sequence(self.layout, next_sequence(self.layout) - 1)
                except (OSError, CheckpointError) as e:
                    log.warning("memory tier: could not read the durable root's commit sequence (%s); snapshots "
                                "number from this process's commits alone", first_line(e))
                self._floor_read = True
            number = known_sequence(self.layout) + 1
            note_sequence(self.layout, number)
        return self._gathered(number, f"numbering the memory snapshot of step {step}", self.memory_group)[0]

    # -- restoring --------------------------------------------------------------------------

    def restore(self, state_dict: dict[str, Any], newest_elsewhere: int | None,
                allow_reshard: bool = False) -> Restored | None:
        """Every rank alike: load the newest memory-committed step assemblable from every rank's own slot or a
        holder's copy, if its sequence is not below ``newest_elsewhere`` (the other tiers' newest commit); None: the
        other tiers restore.  A snapshot taken at another world size is resharded (:mod:`.reshard`; a
        tensor/pipeline-parallel change needs ``allow_reshard``)."""
        self.wait()
        held, notes = self._scan() if self.topology.is_leader else ([], [])
        everyone = self._gathered((held, notes), "listing the memory tier's snapshots")
        if self.rank == 0:
            for rank, (_, said) in enumerate(everyone):
                for note in said:
                    log.warning("memory tier (%s): %s", self.topology.describe(rank), note)
        listed = [h for h, _ in everyone]
        while True:  # the newest assemblable step whose chosen copies are sound; a damaged one is served around
            sources = self._choose(listed)
            if sources is None:
                return None
            sequence, step, world, places = sources
            if newest_elsewhere is not None and newest_elsewhere > sequence:
                log.info("memory tier: step %d (sequence %d) is older than the newest commit of the other tiers "
                         "(sequence %d): restoring from those", step, sequence, newest_elsewhere)
                return None
            failpoints.hit("memory.restore_check", self.rank, step)
            damaged = self._damaged(places, world)
            if not damaged:
                break
            for leader, owner, slot, why in damaged:
                if self.rank == 0:
                    log.warning("memory tier (%s): rank %d's copy of step %d is damaged, served around: %s",
                                self.topology.describe(leader), owner, step, why)
                listed[leader] = [c for c in listed[leader] if (c[0], c[1]) != (owner, slot)]
        if world == self.world_size:
            restored = self._restore_own(state_dict, sequence, step, places)
        else:
            restored = self._restore_resharded(state_dict, sequence, step, world, places, allow_reshard)
        if restored is not None:
            note_sequence(self.layout, max([sequence] + [r[2] for h, _ in everyone for r in h]))
        return restored

    def _restore_own(self, state_dict: dict[str, Any], sequence: int, step: int,
                     places: dict[int, list[tuple[int, int]]]) -> Restored:
        """The same world size: each rank installs its own share, from its node (own first) or a holder's copy."""
        plan = self._plan(places)
        received, failed = self._fetch(plan, sequence, step)
        holder, slot = plan[self.rank]
        near = holder == self.topology.leader(self.rank)
        try:
            with agreed_phase(self.group, f"restoring step {step} from the memory tier",
                              self.topology.describe(self.rank),
                              then="Nothing more was loaded; restart to restore from another tier.", step=step):
                if failed is not None:
                    raise failed
                if near:
                    record_path, data_path = self.dir.record(self.rank, slot), self.dir.data(self.rank, slot)
                    with open(record_path, "rb") as f:
                        record = SlotRecord.from_bytes(f.read(), record_path)
                    if (record.rank, record.sequence, record.step) != (self.rank, sequence, step):
                        raise CorruptCheckpointError(f"{data_path}: holds rank {record.rank} step {record.step} "
                                                     f"sequence {record.sequence}, not rank {self.rank} step {step} "
                                                     f"sequence {sequence} (rewritten since it was listed)",
                                                     path=data_path)
                    with mapped(data_path, record.length) as data:
                        install(state_dict, record.items, data, f"memory slot {data_path} (rank {self.rank}, step "
                                f"{step})")
                else:  # received into this rank's own slot, checked as it landed
                    received.check()
                    record = received.record
                    install(state_dict, record.items, received.view, f"memory slot {received.path} (rank "
                            f"{self.rank}, step {step}, received from {self.topology.describe(holder)})")
                    self._keep_restored(record)
        finally:
            if received is not None:
                received.close()
        fetched = 0 if near else record.length
        tier = "memory-replica" if any(h != self.topology.leader(r) for r, (h, _) in enumerate(plan)) else "memory"
        log.info("run %r: restored step %d from the memory tier (sequence %d, %s)", self.run_id, step, sequence,
                 "every rank from its own node" if tier == "memory" else "some ranks from replica holders")
        return Restored(step=step, sequence=sequence, tier=tier, bytes=record.length, bytes_fetched=fetched)

    def _restore_resharded(self, state_dict: dict[str, Any], sequence: int, step: int, world: int,
                           places: dict[int, list[tuple[int, int]]], allow_reshard: bool) -> Restored | None:
        """Another world size took the snapshot: every rank reads each old share's record, plans its own state dict
        against them (:func:`.reshard.plan`, the layout policy first), receives the old shares it reads that its node
        lacks from a holder, and fills its tensors and objects from the verified bytes.  None (every rank alike):
        the snapshot predates recorded places, the other tiers restore."""
        what = f"the memory snapshot of step {step} (sequence {sequence}, taken at world size {world})"
        then = "Nothing was loaded; restart to restore from another tier."
        mine = self.topology.leader(self.rank)
        records = self._shared_records(sequence, step, world, places, what)
        if not reshard.reshardable(records):
            log.warning("memory tier: %s predates the records of where each shard lies; this job of %d ranks "
                        "restores from the other tiers", what, self.world_size)
            return None
        expanded = expand_stateful(state_dict)
        leaves = leaves_of(expanded)
        near = {owner for owner, found in places.items() if any(holder == mine for holder, _ in found)}
        problem: CheckpointError | None = None
        try:
            check_layout(saved=records[0].layout, current=self.parallelism or infer_parallelism(layout_of(leaves)),
                         allow_reshard=allow_reshard, where=what)
            chosen = reshard.plan(leaves, records, near, what)
        except CheckpointError as e:
            problem = e
        refused = [e for e in self._gathered(problem, f"planning the restore of {what}") if e is not None]
        if refused:
            raise refused[0]  # every rank alike: the first rank's reason, typed
        needs = self._gathered(sorted(chosen.shares - near), f"planning the restore of {what}")
        outgoing: dict[int, list] = {}
        incoming: dict[int, str] = {}
        for rank, wanted in enumerate(needs):
            for owner in wanted:
                holder, slot = places[owner][0]
                if holder == self.rank:
                    outgoing.setdefault(rank, []).append(Part(f"data/{owner}", records[owner].length,
                                                              path=self.dir.data(owner, slot)))
                if rank == self.rank:
                    incoming[holder] = self.topology.describe(holder)
        received, failed = self._restore_transfer(outgoing, incoming, f"receiving the old shares of {what} from the "
                                                  "nodes holding them", "memory-reshard", f"restoring {what}")
        fetched = 0
        try:
            with agreed_phase(self.group, f"restoring {what}", self.topology.describe(self.rank), then=then,
                              step=step):
                if failed is not None:
                    raise failed
                with contextlib.ExitStack() as stack:
                    data, where = {}, {}
                    for owner in sorted(chosen.shares):
                        path = next((self.dir.data(owner, slot) for holder, slot in places[owner] if holder == mine),
                                    None)
                        if path is None:
                            path = self._spooled(received[places[owner][0][0]][f"data/{owner}"], owner)
                            fetched += records[owner].length
                        data[owner] = stack.enter_context(mapped(path, records[owner].length))
                        where[owner] = f"memory slot {path} (rank {owner} of {world}, step {step})"
                    reshard.fill(expanded, leaves, chosen, data, where)
        finally:
            discard(received)
        hand_back(state_dict, expanded)  # after the agreement: a Stateful's load_state_dict may run collectives
        tier = "memory-replica" if any(needs) else "memory"
        log.info("run %r: restored step %d from the memory tier (sequence %d), resharded from world size %d to %d "
                 "(%s)", self.run_id, step, sequence, world, self.world_size,
                 "every rank from its own node" if tier == "memory" else "some old shares from other nodes")
        return Restored(step=step, sequence=sequence, tier=tier, bytes=sum(records[o].length for o in chosen.shares),
                        bytes_fetched=fetched, resharded_from=world)

    def _shared_records(self, sequence: int, step: int, world: int, places: dict[int, list[tuple[int, int]]],
                        what: str) -> dict[int, SlotRecord]:
        """Every rank alike: the record of each old share, read by its first holder and handed to every rank; a
        record that no longer names the listed step is :class:`CorruptCheckpointError` on every rank."""
        mine: dict[int, bytes] = {}
        for owner, found in places.items():
            holder, slot = found[0]
            if holder == self.rank:
                try:
                    with open(self.dir.record(owner, slot), "rb") as f:
                        mine[owner] = f.read()
                except OSError as e:
                    mine[owner] = b""
                    log.warning("memory tier: could not read %s: %s", self.dir.record(owner, slot), first_line(e))
        records = {}
        for rank, sent in enumerate(self._gathered(mine, f"reading the records of {what}")):
            for owner, raw in sent.items():
                where = f"{self.dir.record(owner, places[owner][0][1])} on {self.topology.describe(rank)}"
                record = SlotRecord.from_bytes(raw, where)
                if (record.rank, record.sequence, record.step, record.world_size) != (owner, sequence, step, world):
                    raise CorruptCheckpointError(f"{where}: names rank {record.rank} of {record.world_size}, step "
                                                 f"{record.step}, sequence {record.sequence}, not rank {owner} of "
                                                 f"{what} (rewritten since it was listed)", path=where)
                records[owner] = record
        return records

    def _spooled(self, data: Any, owner: int) -> str:
        """A received share's path (an empty one travels inline)."""
        if isinstance(data, Spooled):
            return data.path
        path = os.path.join(self.dir.spool, f"r{self.rank}-of-{owner}-inline")
        with open(path, "wb") as f:
            f.write(data)
        return path

    def _keep_restored(self, record: SlotRecord) -> None:
        """This rank's share, received from a holder's copy into its own slot, is its own slot again: the record,
        last, as at a snapshot.  Without it the next snapshot takes that slot (it has no record here: a wiped node,
        or a rank killed before its record) and the holder retires its copy of the restored step to receive the new
        one: a failed snapshot then left the restored step nowhere."""
        try:
            self.dir.write_record(dataclasses.replace(record, holder=None))
        except OSError as e:
            log.warning("memory tier: rank %d could not keep its restored share of step %d as its own slot %s (%s); "
                        "until the next snapshot commits, only the holder's copy holds it", self.rank, record.step,
                        self.dir.data(self.rank, record.slot), first_line(e))

    def _scan(self) -> tuple[list[tuple[int, int, int, int, int]], list[str]]:
        """A node's leader: (owner rank, slot, sequence, step, world size) of every copy on its path with a sound
        record of this run and lineage; and why each other one is not loaded.  Its bytes are checked only if a
        restore chooses it (:meth:`_damaged`): a node holds several slots, a restore reads one per rank."""
        held, notes = [], []
        for where, record in self.dir.records():
            if isinstance(record, CorruptCheckpointError):
                notes.append(f"{where} is not loaded: {record.message}")
                continue
            if (record.run_id, record.lineage) != (self.run_id, self.lineage):
                notes.append(f"{where} (step {record.step}) belongs to another run or lineage ({record.run_id}, "
                             f"{record.lineage}; this job's: {self.run_id}, {self.lineage}): not loaded, not deleted")
                continue
            held.append((record.rank, record.slot, record.sequence, record.step, record.world_size))
        return held, notes

    def _plan(self, places: dict[int, list[tuple[int, int]]]) -> list[tuple[int, int]]:
        """At this world size, the copy each rank reads: its own node's, else the first holder's."""
        plan = []
        for rank in range(self.world_size):
            own = [place for place in places[rank] if place[0] == self.topology.leader(rank)]
            plan.append(own[0] if own else places[rank][0])
        return plan

    def _damaged(self, places: dict[int, list[tuple[int, int]]], world: int) -> list[tuple[int, int, int, str]]:
        """Every rank alike: the chosen copies' bytes judged by :func:`verify_slot` before anything is loaded, each
        by one rank on its node, in parallel: at this world size the one each rank will read (its own node's copy by
        that rank, another node's by the leader that sends it), at another every copy (by its node's leader); the
        damaged ones as (leader, owner rank, slot, why)."""
        mine: list[tuple[int, int, int, str]] = []
        plan = self._plan(places) if world == self.world_size else None
        for owner, found in places.items():
            for leader, slot in found:
                if plan is not None and (leader, slot) != plan[owner]:
                    continue
                near = plan is not None and leader == self.topology.leader(owner)
                if (owner if near else leader) != self.rank:
                    continue
                try:
                    with open(self.dir.record(owner, slot), "rb") as f:
                        record = SlotRecord.from_bytes(f.read(), self.dir.record(owner, slot))
                    verify_slot(record, self.dir.data(owner, slot))
                except (CorruptCheckpointError, UnsafeItemError, OSError) as e:
                    mine.append((leader, owner, slot, str(getattr(e, "message", e))))
        return [d for found in self._gathered(mine, "checking the chosen memory snapshot's copies") for d in found]

    def _choose(self, held: list[list[tuple[int, int, int, int, int]]]
                ) -> tuple[int, int, int, dict[int, list[tuple[int, int]]]] | None:
        """Every rank alike: the newest (sequence, step, world size, per owner rank its copies' (holder, slot)) for
        which every rank of that world size has a verified copy and every copy names the same step."""
        def mixed(sequence: int, steps: list[int]) -> None:
            if self.rank == 0:
                log.warning("memory tier: the records of sequence %d name different steps %s: not loaded", sequence,
                            steps)

        worlds: dict[int, list] = {}
        for leader, copies in enumerate(held):
            for owner, slot, sequence, step, world in copies:
                worlds.setdefault(world, []).append((owner, sequence, step, (leader, slot)))
        found = [(complete, world) for world, copies in worlds.items()
                 for complete in [newest_complete(copies, world, mixed)] if complete is not None]
        if not found:
            return None
        (sequence, step, places), world = max(found, key=lambda f: f[0][0])
        return sequence, step, world, places

    def _fetch(self, plan: list[tuple[int, int]], sequence: int, step: int
               ) -> tuple[InPlaceSlot | None, BaseException | None]:
        """Every rank alike: each share whose copy is on another node comes from that node's leader, sent from its
        mapping and received in place into its rank's own slot (:meth:`_land_restored`); (that slot for this rank,
        None where its own node holds it; this rank's failure to send, receive or read it, for the caller's
        agreement to raise on every rank)."""
        outgoing: dict[int, list] = {}
        incoming: dict[int, str] = {}
        for rank, (holder, slot) in enumerate(plan):
            if holder == self.topology.leader(rank):
                continue
            if holder == self.rank:
                try:
                    with open(self.dir.record(rank, slot), "rb") as f:
                        record = SlotRecord.from_bytes(f.read(), self.dir.record(rank, slot))
                    data = self.dir.maps.view(self.dir.data(rank, slot), record.length)
                    outgoing[rank] = [Part.inline("record", record.to_bytes()), Part.direct("data", data)]
                except (OSError, CorruptCheckpointError) as e:  # the receiver still gets a stream: what went wrong
                    outgoing[rank] = [Part.inline("error", f"{self.topology.describe(self.rank)} could not read "
                                                  f"its copy: {first_line(e)}".encode())]
            if rank == self.rank:
                incoming[holder] = self.topology.describe(holder)
        received, failed = self._restore_transfer(
            outgoing, incoming, f"receiving step {step}'s memory snapshot from replica holders", "memory-restore",
            f"restoring step {step} from the memory tier",
            land=lambda src, name, size, done: self._land_restored(sequence, step, name, size, done))
        if failed is not None or not received:
            return None, failed
        parts = next(iter(received.values()))
        if "error" in parts:
            discard(received)
            return None, CorruptCheckpointError(parts["error"].decode(errors="replace"))
        landed = parts["data"]
        if isinstance(landed, bytes):  # an empty share travels inline: its slot, emptied in place
            try:
                landed = self._land_restored(sequence, step, "data", 0, parts)
            except (OSError, CorruptCheckpointError) as e:
                return None, e
        return landed, None

    def _land_restored(self, sequence: int, step: int, name: str, size: int, done: dict) -> InPlaceSlot:
        """Where this rank's share of ``step`` lands when a holder sends it: this rank's own slot of its number,
        its record retired first (a share this node held would not be sent)."""
        if "error" in done:
            raise CorruptCheckpointError(done["error"].decode(errors="replace"))
        record = SlotRecord.from_bytes(done.get("record", b""), f"the record of step {step} a replica holder sent")
        if (record.rank, record.sequence, record.step, name, size) != (self.rank, sequence, step, "data",
                                                                        record.length):
            raise CorruptCheckpointError(f"a replica holder sent rank {record.rank} step {record.step} sequence "
                                         f"{record.sequence} ({size} bytes as {name!r}), not rank {self.rank} step "
                                         f"{step} sequence {sequence} ({record.length} bytes)")
        self.dir.retire(self.rank, record.slot)
        return InPlaceSlot(self.dir.data(self.rank, record.slot), record, self.dir.maps,
                           "memory.restore_half_received")

    def _restore_transfer(self, outgoing: dict[int, list], incoming: dict[int, str], what: str, exchange: str,
                          failing: str, land: Callable | None = None) -> tuple[dict, BaseException | None]:
        """A restore's one transfer, every rank alike (:func:`transfer`'s ``outgoing``/``incoming``): (what arrived,
        this rank's own failure to keep it, such as a full node, which the caller's agreement raises on every rank);
        a lost peer is raised typed as ``failing``'s, on every rank that exchanged with it."""
        try:
            return transfer(outgoing, incoming, self.group, self.dir.spool, what=what, timeout=self.timeout,
                            exchange_id=f"{exchange}/{self.run_id}", consequence="nothing was loaded.",
                            land=land), None
        except (OSError, CorruptCheckpointError) as e:
            return {}, e
        except BaseException as e:
            raise_typed(self.translate(e, failing))

    def _retire_other_worlds(self, sequence: int) -> None:
        """A node's leader, once this job's first snapshot is memory-committed (``sequence``): the slots of this
        lineage that a job of another world size left (restored from, resharded, or passed over) are removed, data
        too.  No restore takes them over this newer commit, and a rank number the resized job lacks would keep
        their RAM forever.  Once per manager: only an earlier job leaves them."""
        if not self.topology.is_leader or self._other_worlds_swept:
            return
        self._other_worlds_swept = True
        for where, record in self.dir.records():
            if (isinstance(record, SlotRecord) and (record.run_id, record.lineage) == (self.run_id, self.lineage)
                    and record.world_size != self.world_size and record.sequence < sequence):
                self.dir.remove(record.rank, record.slot)
                log.info("memory tier: removed %s (step %d, taken at world size %d; this job of %d ranks committed "
                         "sequence %d)", where, record.step, record.world_size, self.world_size, sequence)

    def retire_above(self, step: int) -> None:
        """After a restore of ``step`` from any tier: snapshots of later steps are an abandoned branch (P14); each
        node's leader retires them (their records first)."""
        if not self.topology.is_leader:
            return
        for where, record in self.dir.records():
            if not isinstance(record, SlotRecord) or record.run_id != self.run_id or record.step <= step:
                continue
            if record.lineage != self.lineage:  # another experiment's branch, not this job's to abandon
                log.info("memory tier: kept %s (step %d of another lineage, %s; this job's: %s)", where, record.step,
                         record.lineage, self.lineage)
                continue
            self.dir.retire(record.rank, record.slot)
            log.info("memory tier: retired %s (step %d, after the restored step %d)", where, record.step, step)

    # -- the work in the background -----------------------------------------------------------

    def wait(self) -> None:
        """Wait for the snapshot in flight; raise its failure if nothing has reported it."""
        inflight = self._inflight
        if inflight is None:
            return
        concurrent.futures.wait([inflight])
        error = concurrent.futures.Future.exception(inflight)
        if error is not None and not inflight.reported:
            inflight.reported = True
            raise error

    def busy(self) -> bool:
        return self._inflight is not None and not self._inflight.done()

    def in_flight(self) -> SnapshotFuture | None:
        """The latest snapshot's future (done or not): what an exit without ``close()`` waits for and reports."""
        return self._inflight

    def close(self) -> None:
        self._worker.shutdown(wait=True)
        self.dir.maps.close()

    def _gathered(self, mine: Any, what: str, group: Any = None) -> list[Any]:
        try:
            return gather(group or self.group, mine, what)
        except BaseException as e:
            raise_typed(self.translate(e, what))


class DurableCopies(Protocol):
    """What the memory tier needs of the manager for durable copies (``MemoryTier(durable_every=...)``)."""

    def save(self, step: int, state_dict: dict[str, Any], sequence: int) -> concurrent.futures.Future:
        """Start saving ``state_dict`` as durable step ``step`` (a copy of memory's ``sequence``) in the background,
        every rank alike; the future says when the save is done (its failure is the manager's to report)."""

    def refuse(self, step: int, error: CheckpointError) -> concurrent.futures.Future:
        """The copy of ``step`` cannot start (every rank alike): reported as that copy's failed save would be; the
        failed future."""

    def busy(self) -> bool:
        """Whether a save of this rank is still in flight (another copy cannot start without waiting for it)."""


@dataclass(frozen=True)
class _Pin:
    """A slot a durable copy still reads: never rewritten until ``future`` is done."""

    slot: int
    step: int
    future: concurrent.futures.Future


@dataclass
class _Staging:
    """A slot being filled by the stager (bounded staging): completed on the memory tier's thread."""

    copy: StagedCopy
    sink: SlotSink
    leaves: list
    checksums: dict
    slot: int
    layout: dict | None


def _refuse_differing_settings(settings: list[dict[str, Any]]) -> None:
    """Every rank alike: the ranks' ``MemoryTier`` settings that shape the protocol (how often, how many copies and
    slots) must agree; a difference is refused by name at construction, never left to look like a lost peer."""
    differ = [f"{name}: " + ", ".join(f"rank {r} has {value!r}" for r, value in
                                      {r: s[name] for r, s in enumerate(settings)}.items()
                                      if value != settings[0][name] or r == 0)
              for name in settings[0] if any(s[name] != settings[0][name] for s in settings)]
    if differ:
        raise ConfigurationError("the ranks' MemoryTier settings differ (" + "; ".join(differ)[:600] + "): pass the "
                                 "same MemoryTier(every=, replicas=, slots=, durable_every=) on every rank; "
                                 "budget_bytes and path may differ per node. Nothing was snapshotted.")


def _with_sequence(record: SlotRecord, sequence: int) -> SlotRecord:
    return dataclasses.replace(record, sequence=sequence)


def _free_bytes(path: str) -> int:
    """What the filesystem of ``path`` can still take (its RAM, for a tmpfs)."""
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize

