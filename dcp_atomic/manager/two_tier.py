"""The manager's local tier (README "Two tiers"): saves to node-local roots with replicas, the background drain to
the durable root, restores from whichever tier holds the newest complete step, and local retention.

The rules live in :mod:`dcp_atomic.tiers` (what a local commit, a drain, a restore choice is); this module only
schedules them for the manager: which step is queued for the drain, what local retention must keep, which tier a
load reads.  :class:`TwoTier` gets what it uses of its manager as a :class:`~.tiering.TierContext` (the settings,
the groups, the manager's rank agreement and reporting), so both tiers report through one place.

Why one module of about 690 lines: one class, the local tier's schedule for the manager (saves, the drain's queue,
restores, retention, lineage); the rules it schedules are in :mod:`dcp_atomic.tiers`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
from concurrent.futures import Future, wait as wait_for
from typing import Any

import torch.distributed as dist

from .._base.retry import Deadline
from .._base.stats import DrainStats, FailureStats
from ..dcp.writer import AtomicStorageWriter
from ..errors import (CheckpointError, CheckpointNotFoundError, CommitConflictError, ConfigurationError,
                      RankConsistencyError, StorageError)
from ..exchange.collective import first_line, from_rank0, gather, raise_typed
from ..exchange.stall import StallClock
from ..format.manifest import Marker
from ..protocol.catalog import latest_step as scan_latest_step
from ..protocol.commit import (ResumePoint, commit_order, known_sequence, listed_steps, memory_order, next_sequence,
                               note_sequence, read_marker, refuse_committed)
from ..protocol.lineage import (create_lineage, describe as describe_lineage, ensure_lineage, lineage_path,
                                 new_lineage, read_lineage, refuses_writes)
from ..protocol.retention import retain_after_commit
from ..tiers.drain import Drained, Drainer, DrainJob
from ..tiers.local_tier import (LocalWriter, Topology, commit_local, local_markers, merge_held, of_lineage, open_local,
                                read_manifest, remove_failed_attempt, remove_local_step, retain_local, scan_root,
                                sweep_spool)
from ..tiers.placement import failure_domain as resolve_failure_domain
from ..tiers.tier_restore import DurableCandidate, assemble_step, choose_restore, restore_not_found
from .options import DEFAULT_DURABLE_EVERY, LocalTierOptions
from .tiering import NO_DRAIN, TierContext, TierPolicy

log = logging.getLogger("dcp_atomic.manager")  # the manager's logger: these were its messages, and stay so

def _out_of_space(error: CheckpointError) -> bool:
    """A save that failed for space: the errno a writer records, or the system's words in a peer's report (a
    replica holder's failure arrives as text)."""
    return (error.details.get("errno") in (errno.ENOSPC, errno.EDQUOT)
            or any(os.strerror(code) in error.message for code in (errno.ENOSPC, errno.EDQUOT)))


class TwoTier(TierPolicy):
    """The local tier and its drain for one manager; built by the manager's ``__init__`` on every rank alike."""

    commits_in_dcp = False  # a local save has no marker until commit_local, after DCP returns

    def __init__(self, ctx: TierContext, options: LocalTierOptions) -> None:
        """Raises when the tier cannot be set up (too few failure domains...); the manager then releases what it
        holds, the groups it made for this tier included."""
        self._ctx = ctx
        self.local_root, self.keep_local = options.local_root, options.keep_local
        self.durable_every = options.durable_every
        self._saves = 0  # counts saves for durable_every (identical on every rank: SPMD)
        self._last_undrained: tuple[int, Marker] | None = None  # the newest local save not queued for the drain
        self.drainer: Drainer | None = None
        self._durable_saves: set[str] = set()  # rank 0: save ids known to be in the durable root (_durable_pending)
        self._durable_reads: dict[str, Future] = {}  # rank 0: save id -> is it in the durable root (_known_durable)
        self._drained_sequence = 0  # rank 0: the newest commit sequence this manager drained (supersedes older)
        self._requeues: dict[str, tuple[int, int]] = {}  # rank 0: save id -> (times queued again, at which save)
        self._held_back: int | None = None  # every rank: the durable-pending step retention kept at the last commit
        self._pending: Marker | None = None  # every rank: that step's marker (close() drains it if still pending)
        self._lineage: str | None = None  # the durable run's lineage (lineage.py): which local steps are this job's
        self._provisional_for: str | None = None  # the durable root whose LINEAGE is still to be created (lineage.py)
        self._durable_listed: set[int] | None = None  # rank 0: the durable root's steps (listed once)
        self._sequence = 0  # the newest commit sequence this process knows of, both tiers (rank 0 decides)
        self._sequence_known = False
        self.local = open_local(os.fspath(options.local_root), ctx.run_id)
        self.topology = Topology.learn(ctx.rank, resolve_failure_domain(options.failure_domain),
                                       os.fspath(options.local_root), options.replicas, ctx.group)
        recorded = self._gathered(self._provisional_lineages())
        self._lineage, self._provisional_for = ctx.on_rank0(lambda: self._read_lineage(recorded),
                                                          "read the run's lineage")
        if ctx.world_size == 1 or ctx.drain_group is not None:
            self.drainer = Drainer(rank=ctx.rank, world_size=ctx.world_size, group=ctx.drain_group, local=self.local,
                                   durable=ctx.layout, timeout=ctx.timeout, where=ctx.layout.storage.describe(),
                                   resumed=ctx.resumed, committed=self._drained, failed=self._drain_failed,
                                   threads=ctx.thread_count, clock=StallClock(ctx.timeout, ctx.heartbeat),
                                   owns_durable=self._own_lineage)
        if self.drainer is None:  # given process_group= in a world: no drain group
            if options.durable_every_given and self.durable_every is not None:
                raise ConfigurationError(f"durable_every={self.durable_every} needs a process group of the drain's "
                                         "own, which the manager cannot create when it is given process_group=; leave "
                                         "process_group out, or save durable steps with a manager without a local tier")
            self.durable_every = None
            if ctx.rank == 0:
                log.warning("CheckpointManager(local=LocalTierOptions(%r), process_group=...): the drain needs a "
                            "process group of its own, so no step reaches the durable root %s; every step lives only "
                            "on the nodes' local disks. Leave process_group out to keep durable copies.",
                            os.fspath(options.local_root), ctx.layout.storage.describe())
        elif self.durable_every is None and ctx.rank == 0:
            log.warning("CheckpointManager(local=LocalTierOptions(%r, durable_every=None)): only saves with "
                        "durable=True reach the durable root %s; every other step lives only on the nodes' local "
                        "disks, which are usually wiped when the allocation ends. Leave durable_every at its default "
                        "(%d: every save drains in the background) or set it to N to keep durable copies.",
                        os.fspath(options.local_root), ctx.layout.storage.describe(), DEFAULT_DURABLE_EVERY)

    # -- saving ---------------------------------------------------------------------------

    def drain_decision(self, durable: bool | None) -> bool | None:
        """``durable``, else every ``durable_every``-th local save.  None: not by the policy (``close()`` drains such
        a step if it is the last, :meth:`_drain_last`)."""
        self._saves += 1
        wanted = durable if durable is not None else (
            bool(self.durable_every) and self._saves % self.durable_every == 0) or None
        if wanted and self.drainer is None:
            raise ConfigurationError("draining to the durable root needs a process group of the drain's own, which "
                                     "the manager cannot create when it is given process_group=; leave "
                                     "process_group out, or save durable steps with a manager without a local tier")
        return wanted

    def refuse_conflicts(self, step: int) -> None:
        """The local root's commit of ``step``: another lineage's is never replaced, this job's by the commit rule."""
        ctx, where = self._ctx, f"the local root {self.local_root}"
        marker = ctx.committed_marker(self.local, step)
        if marker is not None and of_lineage([marker], self._lineage, foreign=True):
            step_dir = self.local.step_dir(step)
            raise CommitConflictError(
                f"step {step} of run {ctx.run_id!r} on {where} was saved for another durable root or "
                f"experiment ({describe_lineage(marker.lineage)}; this job's: "
                f"{describe_lineage(self._lineage)}, {lineage_path(ctx.layout)}): it is not this job's to replace, and "
                f"nothing was written. Save another step, use another run_id, or, if nothing needs it, remove it on "
                f"every node: rm -rf {step_dir}", step=step, committed=marker.save_id)
        if marker is not None:
            refuse_committed(marker, step, ctx.run_id, ctx.resumed(), where)

    def durable_may_hold(self, step: int) -> bool:
        """The durable root is listed once per manager (saves must not wait for the durable store each time), and
        its marker read only for a step that listing (or a drain of this manager since) names; an unreadable root
        is warned about and counts as "not committed" (the drain's commit still refuses a conflict)."""
        if self._durable_listed is None:
            layout = self._ctx.layout
            try:
                self._durable_listed = set(listed_steps(layout))
            except (OSError, CheckpointError) as e:
                log.warning("could not list the steps of %s (%s); a save of a step committed there is refused "
                            "only by its drain", layout.storage.describe(), e)
                self._durable_listed = set()
        return step in self._durable_listed

    def writer(self, step: int, **options: Any) -> AtomicStorageWriter:
        writer = LocalWriter(os.fspath(self.local_root), self._ctx.run_id, step, **options)
        writer.topology = self.topology
        writer.provisional_for = self._provisional_for
        return writer

    @contextlib.contextmanager
    def failed_attempt_removed(self, step: int, writer: AtomicStorageWriter):
        """A local save that fails (ENOSPC on a node, a peer lost, a replica refused) leaves nothing on this rank's
        local root: its attempt directory goes before the error is raised, on every rank (the ranks of a root remove
        the same one; whoever is first), so a disk sized for ``keep_local + 1`` steps keeps saving.  Never a step
        rank 0 decided (a rank holding its marker keeps the files: the root's leader may record it after this rank
        fails) or with a marker here: a commit that reached this root is not a failed attempt.  A failure for space while local
        retention keeps a durable-pending step says so (:meth:`_held_back_note`): that step may be what fills it."""
        try:
            yield
        except BaseException as e:
            if writer.save_id is not None and not getattr(writer, "decided", False):
                remove_failed_attempt(self.local, step, writer.save_id, self.topology.describe(self._ctx.rank))
            if isinstance(e, CheckpointError) and _out_of_space(e):
                self._retain(self.drainer.protected() if self.drainer is not None else set())
                if self._held_back is not None:
                    raise type(e)(f"{e.message.rstrip()} {self._held_back_note()}", **e.details) from e
            raise

    def _held_back_note(self) -> str:
        """What a save that failed for space must also say: the step local retention keeps for its durable copy
        takes that space, and what to do about it (every rank alike: ``_held_back`` is rank 0's, handed out)."""
        step, ctx = self._held_back, self._ctx
        return (f"Step {step} is kept on every node's local root, past keep_local={self.keep_local} if need be, "
                f"because it was saved for a durable copy and is not durable yet (its drain to "
                f"{ctx.layout.storage.describe()} failed). Make the durable root writable again (a later save queues "
                f"step {step} for the drain again, or call queue_drain({step})), or free space on the node; to give "
                f"up its durable copy, remove it on every node: rm -rf {self.local.step_dir(step)}")

    def commit(self, step: int, writer: AtomicStorageWriter, group: dist.ProcessGroup | None,
               drain: bool | None) -> None:
        """After DCP's save: replicas, rank 0's decision, the local markers, the drain's queue, then local
        retention (which keeps what the drain still needs)."""
        ctx = self._ctx
        try:
            drainer, pending, again, protected = self.drainer, None, False, None
            if drainer is not None:
                protected = drainer.protected() if ctx.rank == 0 else None
                pending, again = self._durable_pending(protected, group, may_queue=not drain)
                if pending is not None:
                    protected |= {pending.step}
            committed = commit_local(self.topology, self.local, writer, step, group, self._sequence_floor(),
                                     protected, drain=bool(drain), lineage=self._lineage, timeout=ctx.timeout)
            if drainer is not None:
                pending, again = from_rank0(group, (pending, again), "sharing the durable-pending step")
        except BaseException as e:  # ours pass as they are; a broken collective gets the liveness verdict
            raise_typed(ctx.translate(e, f"committing step {step} to the local tier"))
        marker, protected = committed.marker, committed.kept
        self._sequence = max(self._sequence, marker.sequence or 0)
        note_sequence(ctx.layout, self._sequence)  # the memory tier numbers above it (P10)
        self._held_back = pending.step if pending is not None else None
        self._pending = pending
        writer.last_local_commit = committed
        log.info("run %r step %d local-committed (sequence %s, %d replica(s) per rank)%s", ctx.run_id, step,
                 marker.sequence, len(self.topology.placement.holders[ctx.rank]),
                 "; queued for the drain" if drain else "")
        self._last_undrained = (step, marker) if drain is None else None  # an explicit durable=False is kept local
        if drain:
            self.drainer.submit(step, marker)
        elif again:
            self._queue_again(pending)
        self._retain(protected)

    def _retain(self, protected: set[int]) -> None:
        """A root's leader: local retention, the durable-pending step (:attr:`_held_back`) counted inside
        ``keep_local`` (:func:`retain_local`); after a commit, and after a save that failed for space (whatever
        room the previous job or a released pin left is made before the next save)."""
        if not self.topology.is_leader:
            return
        pinned = set() if self._held_back is None else {self._held_back}
        try:
            removed = retain_local(self.local, self.keep_local, protected=protected | pinned, lineage=self._lineage,
                                   pinned=pinned)
            if removed:
                log.info("local tier %s: removed step(s) %s (keep_local=%d%s)", self.local_root, removed,
                         self.keep_local, f", step {self._held_back} pinned for its durable copy inside it"
                         if pinned else "")
        except (OSError, CheckpointError) as e:  # the step is committed (or the save failed): the next one retries
            log.warning("local tier %s: retention failed (the next save retries it): %s", self.local_root, e)

    def _sequence_floor(self) -> int:
        """Rank 0: the newest commit sequence of any tier it knows (a memory snapshot's too); the durable root's
        ``LATEST`` is read once per manager (P10 across tiers: a local commit never sorts below a durable one or a
        snapshot made before it)."""
        if self._ctx.rank == 0 and not self._sequence_known:
            try:
                self._sequence = max(self._sequence, next_sequence(self._ctx.layout) - 1)
            except (OSError, CheckpointError) as e:
                log.warning("local tier: could not read the durable root's commit sequence (%s); local commits "
                            "number from the local roots alone", e)
            self._sequence_known = True
        self._sequence = max(self._sequence, known_sequence(self._ctx.layout))
        return self._sequence

    def _durable_pending(self, queued: set[int] | None, group: dist.ProcessGroup | None,
                         may_queue: bool) -> tuple[Marker | None, bool]:
        """Every rank (a collective); rank 0 returns the newest local step saved for a durable copy
        (:attr:`Marker.drain`) that has none -- the durable-pending step, which local retention keeps for as long as
        it is not durable (a newer durable step supersedes it) -- and whether to queue it for the drain again now.
        Each root reports its own newest such step: global rank 0's node may have been replaced since (an empty
        disk), and the step's files then sit on the other nodes alone.  An unreadable durable root counts as "not
        durable" (kept, retried)."""
        ctx, mine = self._ctx, None
        if self.topology.is_leader:
            resumed = ctx.resumed()
            wanted = [mk for mk in of_lineage(local_markers(self.local), self._lineage)  # nor a rolled-back branch's
                      if mk.drain and (resumed is None or not resumed.supersedes(mk))]
            mine = wanted[-1] if wanted else None
        reported = [mk for mk in self._gathered(mine, group) if mk is not None]
        if ctx.rank != 0 or not reported:
            return None, False
        newest = max(reported, key=commit_order)
        if self._drained_or_superseded(newest):
            return None, False
        if newest.step in queued:
            return newest, False  # the drain carries it
        due = may_queue and not queued and self._queue_again_due(newest.save_id)
        durable = self._known_durable(newest, again=due)
        if durable:
            self._durable_saves.add(newest.save_id)
            return None, False
        return newest, due and durable is False  # not known yet (the durable store does not answer): kept, not queued

    def _drained_or_superseded(self, marker: Marker) -> bool:
        """Rank 0: whether this manager drained ``marker``'s save, or a step committed after it."""
        return marker.save_id in self._durable_saves or (marker.sequence or 0) < self._drained_sequence

    def _known_durable(self, marker: Marker, again: bool) -> bool | None:
        """Rank 0: whether the durable root holds ``marker``'s save (None: not known yet), read on a thread of its
        own once per save id (``again``: once more), because a save must not hang on a durable store that froze (a
        hung NFS server): it waits for the answer at most the stall deadline, once; later saves look without
        waiting."""
        ctx, read = self._ctx, self._durable_reads.get(marker.save_id)
        if read is not None and again and read.done() and read.result() is False:
            read = None  # queued again: look again (a drain whose outcome was unknown may have committed it)
        if read is None:
            read = self._durable_reads[marker.save_id] = Future()

            def look() -> None:
                try:
                    held = read_marker(ctx.layout, marker.step, Deadline(ctx.timeout), missing_ok=True)
                    read.set_result(held.save_id == marker.save_id)
                except Exception:  # noqa: BLE001 - missing or unreadable: not durable (_durable_pending)
                    read.set_result(False)

            threading.Thread(target=look, name="dcp-atomic-durable-read", daemon=True).start()
            wait_for([read], timeout=ctx.timeout)
        return read.result() if read.done() else None

    def _queue_again_due(self, save_id: str) -> bool:
        """Rank 0: a durable-pending step is queued again at the first save that finds the drain idle, then after
        2, 4, 8... more saves: a store that heals drains it within twice the saves it was down for, and one that
        stays down costs a drain attempt per doubling of the saves, never one per save."""
        times, at = self._requeues.get(save_id, (0, 0))
        return times == 0 or self._saves - at >= 2 ** times

    def _queue_again(self, pending: Marker) -> None:
        """Every rank alike: the durable-pending step goes to the drain again (rank 0 counts it)."""
        ctx = self._ctx
        if ctx.rank == 0:
            times = self._requeues.get(pending.save_id, (0, 0))[0] + 1
            self._requeues[pending.save_id] = (times, self._saves)
            log.warning("run %r: step %d was saved for a durable copy that never committed (its drain failed or the "
                        "job stopped first); it is kept on the local tier and queued for the drain again (time %d; "
                        "next after %d more saves if this drain fails too)", ctx.run_id, pending.step, times,
                        2 ** times)
        self.drainer.submit(pending.step, pending)

    # -- the drain's outcomes (called on the drain thread) ----------------------------------

    def _drained(self, drained: Drained) -> None:
        """Rank 0: a step reached the durable root; durable retention, then ``on_drained``."""
        ctx, job, marker = self._ctx, drained.job, drained.marker
        self._durable_saves.add(job.save_id)
        self._drained_sequence = max(self._drained_sequence, marker.sequence or 0)
        if self._durable_listed is not None:
            self._durable_listed.add(job.step)
        log.info("run %r step %d drained to %s (sequence %s, %.1f MiB in %.3fs, attempt %d%s)", ctx.run_id,
                 job.step, ctx.layout.storage.describe(), marker.sequence, drained.bytes / 2**20, drained.seconds,
                 drained.attempts, f"; skipped step(s) {drained.skipped}" if drained.skipped else "")
        if not ctx.retention.keeps_all:
            try:
                retain_after_commit(ctx.layout, marker, ctx.retention, lease_seconds=ctx.lease_seconds)
            except Exception as e:  # the drain is committed; the next one retries
                log.warning("run %r: durable retention after draining step %d failed (the next drain retries it): "
                            "%s", ctx.run_id, job.step, e)
        ctx.deliver(ctx.callbacks.on_drained, "on_drained", DrainStats(
            run_id=ctx.run_id, step=job.step, save_id=job.save_id, sequence=marker.sequence,
            world_size=ctx.world_size, seconds=drained.seconds, queued_seconds=drained.queued_seconds,
            bytes=drained.bytes, files=drained.files, gb_per_s=drained.bytes / max(drained.seconds, 1e-9) / 1e9,
            attempts=drained.attempts, skipped_steps=list(drained.skipped), bytes_reused=drained.bytes_reused))

    def _drain_failed(self, job: DrainJob, error: CheckpointError, seconds: float) -> None:
        """Every rank: a drain failed for good (``wait()`` raises it)."""
        ctx = self._ctx
        if ctx.callbacks.on_failed is None:
            return
        try:
            stats = FailureStats.from_error(error, operation="drain", run_id=ctx.run_id, step=job.step,
                                            world_size=ctx.world_size, rank=ctx.rank, seconds=seconds)
        except Exception:
            log.exception("could not describe the failure of the drain of step %s for on_failed", job.step)
            return
        ctx.deliver(ctx.callbacks.on_failed, "on_failed", stats)

    # -- loading and listing --------------------------------------------------------------

    def restore(self, step: int | None, state_dict: dict[str, Any],
                save_id: str | None) -> tuple[str, int, str, ResumePoint] | None:
        """Choose the step to restore (both tiers); for a local one, each rank receives into its root what its
        load of ``state_dict`` reads there and the root lacks.  Returns (local root, step, save_id, resume point)
        to load from the local root, or None to load the durable tier's choice."""
        ctx, tier = self._ctx, self.topology
        watch = ctx.watch("scanning the local tier")
        mates = [r for r in range(ctx.world_size) if tier.leader(r) == tier.leader(ctx.rank)]
        share = (mates.index(ctx.rank), len(mates))  # the ranks of a root verify it in parallel, a share each
        if tier.is_leader:
            swept = sweep_spool(self.local)
            if swept:
                log.info("local tier %s: removed %d file(s) an interrupted restore left: %s", self.local_root,
                         len(swept), ", ".join(sorted(swept)[:4]))
        held = watch.run("scan", lambda: scan_root(self.local, share=share, lineage=self._lineage))
        foreign = ([mk.step for mk in of_lineage(local_markers(self.local), self._lineage, foreign=True)]
                   if tier.is_leader else [])
        gathered = self._gathered((step, held, foreign))
        watch.finish()
        if ctx.rank == 0:
            self._report_foreign({rank: steps for rank, (_, _, steps) in enumerate(gathered) if steps})
        gathered = [(request, held) for request, held, _ in gathered]
        asked = {request for request, _ in gathered}
        if len(asked) > 1:
            raise RankConsistencyError(f"restoring run {ctx.run_id!r}: the ranks asked for different steps "
                                       f"({sorted(asked, key=str)}), so none loads. Every rank must call load alike.")
        reports = {leader: merge_held([held for rank, (_, held) in enumerate(gathered) if tier.leader(rank) == leader])
                   for leader in tier.leaders}
        outcome = None
        if ctx.rank == 0:
            try:
                outcome = ("ok", choose_restore(tier, reports, self._durable_candidate(step), step, save_id))
            except CheckpointError as e:
                outcome = ("error", e)
            except Exception as e:  # the durable root's storage, say: every rank must hear of it
                outcome = ("error", StorageError(f"global rank 0 could not choose the step to restore: "
                                                 f"{first_line(e)}", rank=0))
        status, choice = self._gathered(outcome)[0]
        if status == "error":
            raise choice
        newest = max([self._sequence, choice.sequence or 0]
                     + [h.sequence or 0 for held in reports.values() for h in held])
        self._sequence = newest  # a save after this restore numbers above everything seen (P10, P14)
        note_sequence(ctx.layout, newest)
        for why in choice.skipped:
            log.warning("restore of run %r: %s", ctx.run_id, why)
        if choice.tier == "none":
            raise restore_not_found(ctx.run_id, choice, ctx.layout.storage.describe())
        if choice.tier == "durable":
            self.restored_from = {"tier": "durable", "step": choice.step, "save_id": choice.save_id, "ranks_fetched": 0,
                               "bytes_fetched": 0}
            log.info("run %r: restoring step %d from the durable tier (%s)%s", ctx.run_id, choice.step,
                     ctx.layout.storage.describe(), " because no newer local step is complete" if choice.skipped else "")
            return None
        try:
            fetched, fetched_bytes = assemble_step(tier, self.local, choice, ctx.group, state_dict, timeout=ctx.timeout)
        except BaseException as e:  # ours pass as they are; a broken collective gets the liveness verdict
            raise_typed(ctx.translate(e, f"assembling local step {choice.step}"))
        self.restored_from = {"tier": "local", "step": choice.step, "save_id": choice.save_id, "ranks_fetched": fetched,
                           "bytes_fetched": fetched_bytes}
        log.info("run %r: restoring step %d from the local tier (sequence %s; this rank received %d byte(s) of %d "
                 "rank(s)' files it reads)", ctx.run_id, choice.step, choice.sequence, fetched_bytes, fetched)
        return os.fspath(self.local_root), choice.step, choice.save_id, ResumePoint(step=choice.step, sequence=newest)

    def _durable_candidate(self, step: int | None) -> DurableCandidate | None:
        """Rank 0: the durable tier's newest commit (or ``step``'s), None when it has none."""
        ctx = self._ctx
        try:
            asked = step is not None
            if step is None:
                step = scan_latest_step(ctx.root, ctx.run_id, ctx.storage_options, timeout=ctx.timeout, missing_root_ok=True)
                if step is None:
                    return None
            elif not ctx.layout.storage.is_dir(ctx.layout.step_dir(step)):
                return None
            # A step asked for by number may hold only an attempt a failed or killed drain left, never marked: not
            # waited for.  The step LATEST names has a marker: waited for (visibility lag on NFS).
            marker = read_marker(ctx.layout, step, Deadline(ctx.timeout), missing_ok=asked)
        except (CheckpointNotFoundError, FileNotFoundError):
            return None
        return DurableCandidate(step=step, save_id=marker.save_id, sequence=marker.sequence)

    def _provisional_lineages(self) -> list[tuple[str, int, int]]:
        """Every rank: (lineage, sequence, step) of each local step on this root (its leader reports) whose lineage
        is provisional for this job's durable root: saved while that root's ``LINEAGE`` could not be created."""
        if not self.topology.is_leader:
            return []
        durable = self._ctx.layout.storage.describe()
        return [(mk.lineage, mk.sequence or 0, mk.step) for mk in local_markers(self.local)
                if mk.provisional_for == durable and mk.lineage is not None]

    def _read_lineage(self, recorded: list[list[tuple[str, int, int]]]) -> tuple[str, str | None]:
        """Rank 0: the durable run's lineage id (:mod:`~dcp_atomic.protocol.lineage`), and the durable root it is provisional for (None:
        ``LINEAGE`` names it).  No ``LINEAGE`` yet: the newest lineage the nodes' local steps ``recorded`` (per
        rank, :meth:`_provisional_lineages`) as provisional for this root and run is adopted, else a new one is
        made; ``LINEAGE`` is created with it.  A root that cannot be written now (full, read-only: ``refuses_writes``)
        must not stop local saves nor orphan them: the id stays provisional, recorded in every local marker, and
        ``LINEAGE`` is created with it at the first drain that reaches the root (:meth:`_own_lineage`)."""
        ctx, layout = self._ctx, self._ctx.layout
        where = layout.storage.describe()
        newest = max((found for per_rank in recorded for found in per_rank), key=lambda c: c[1:], default=None)
        lineage = newest[0] if newest is not None else new_lineage()
        adopted = "" if newest is None else (
            f" (adopted: local step(s) {self._steps_of(recorded, lineage)} recorded it while this root could not be "
            f"written)")
        try:
            try:
                return read_lineage(layout), None
            except FileNotFoundError:
                pass
            created = create_lineage(layout, lineage)
        except (OSError, CheckpointError) as e:
            if not refuses_writes(e):
                raise
            cause = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {e}"  # whole: S3 says why
            log.warning("run %r: the durable root %s cannot be written (%s), so the run's lineage file %s, which says "
                        "which node-local steps belong to this run, could not be created. This job's local steps "
                        "record lineage %s%s as provisional for %s: local saves go on, global rank 0 creates the file "
                        "with this id at the first drain that reaches the root, and a later job of this root and run "
                        "adopts it from the local steps if none did. Free space or restore write access on %s to get "
                        "durable copies.", ctx.run_id, where, cause, lineage_path(layout), lineage, adopted,
                        where, where)
            return lineage, where
        if newest is not None and created == lineage:
            log.warning("run %r: %s did not exist; created it with lineage %s%s, so those steps are restored as this "
                        "run's. If this job is a new experiment rather than a continuation of that one, use another "
                        "run_id.",
                        ctx.run_id, lineage_path(layout), lineage, adopted)
        return created, None

    def _steps_of(self, recorded: list[list[tuple[str, int, int]]], lineage: str) -> str:
        """Rank 0: where the nodes hold local steps of ``lineage`` (``recorded`` per rank), for messages."""
        tier, held = self.topology, {}
        for rank, per_rank in enumerate(recorded):
            steps = sorted(step for found, _, step in per_rank if found == lineage)
            if steps:
                held[f"{tier.hosts[rank]}:{os.path.join(tier.roots[rank], self._ctx.run_id)}"] = steps
        return "; ".join(f"{steps} on {root}" for root, steps in held.items())

    def _own_lineage(self) -> None:
        """Rank 0, before a drain claims its durable attempt: where this job's lineage is still provisional, create the
        durable run's ``LINEAGE`` with it (once), so every later job takes this job's local steps as the run's.  Where
        another job created it first (two jobs of one run id and root, both started while the root could not be
        written), nothing of this job may be committed into that lineage: a ``CommitConflictError`` naming both, and
        the drain is refused on every rank; this job's local steps stay restorable by it."""
        where, ctx = self._provisional_for, self._ctx
        if where is None:
            return
        path = lineage_path(ctx.layout)
        try:
            lineage = ensure_lineage(ctx.layout, self._lineage)
        except (OSError, CheckpointError) as e:
            raise StorageError(f"run {ctx.run_id!r}: could not create {path} with this job's provisional lineage "
                               f"{self._lineage} ({first_line(e)}); nothing was uploaded, the next drain tries again",
                               rank=0, path=path) from e
        if lineage == self._lineage:
            self._provisional_for = None
            log.info("run %r: created %s with lineage %s, which this job's local steps record", ctx.run_id, path,
                     lineage)
            return
        raise CommitConflictError(
            f"run {ctx.run_id!r}: {path} names lineage {lineage}, not this job's {self._lineage}: another job of this "
            f"run id created it while {where} could not be written, so the durable run is that job's. Nothing of this "
            "job was committed there; its local steps stay restorable by this job (manager.load()). Give each "
            "experiment its own run_id (or durable root), or remove this job's local steps if the other job is the "
            "one to keep.", path=path, lineage=lineage, own_lineage=self._lineage)

    def _report_foreign(self, foreign: dict[int, list[int]]) -> None:
        """Rank 0: local steps another lineage left on the nodes (another experiment with this run id, another
        durable root): named, never loaded, never deleted."""
        ctx, tier = self._ctx, self.topology
        for leader, steps in foreign.items():
            root = f"{tier.hosts[leader]}:{os.path.join(tier.roots[leader], ctx.run_id)}"
            log.warning(
                "local tier %s holds step(s) %s of run %r saved for another durable root or experiment (this job's is "
                "%s, %s): they are not loaded and not deleted. If nothing needs them, remove them on that node: "
                "rm -rf %s", root, steps, ctx.run_id, describe_lineage(self._lineage), lineage_path(ctx.layout),
                " ".join(os.path.join(tier.roots[leader], ctx.run_id, f"step_{s:010d}") for s in steps[:8]))

    @property
    def lineage(self) -> str | None:
        return self._lineage

    def local_sequence(self) -> int | None:
        """Every root's leader reports its newest local commit of this lineage, as a memory restore compares it
        (:func:`memory_order`: a local copy of a snapshot counts as that snapshot); every rank gets the newest (a
        collective)."""
        mine = []
        markers = of_lineage(local_markers(self.local), self._lineage) if self.topology.is_leader else []
        if markers:  # sorted by commit order: the newest last
            try:
                mine = [memory_order(markers[-1], read_manifest(self.local, markers[-1]))]
            except (OSError, CheckpointError) as e:
                log.warning("local tier: could not read the manifest of local step %d (%s); it counts at its own "
                            "commit sequence", markers[-1].step, first_line(e))
                mine = [markers[-1].sequence or 0]
        return max((n for found in self._gathered(mine) for n in found), default=None)

    def local_steps(self) -> set[int]:
        """Every root's leader lists its local commits of this lineage; every rank gets the union (a collective)."""
        mine = of_lineage(local_markers(self.local), self._lineage) if self.topology.is_leader else []
        found: set[int] = set()
        for steps in self._gathered([mk.step for mk in mine]):
            found |= set(steps)
        return found

    def retire(self, step: int) -> None:
        if self.topology.is_leader:
            remove_local_step(self.local, step)

    def queue_drain(self, step: int) -> None:
        """Global rank 0 reads the step's local marker and tells the others; every rank submits it."""
        ctx = self._ctx
        if self.drainer is None:
            raise ConfigurationError(NO_DRAIN)
        marker = None
        if ctx.rank == 0:
            try:
                marker = Marker.from_json(self.local.storage.read_file(self.local.marker(step)),
                                          where=self.local.marker(step))
            except (OSError, CheckpointError) as e:
                marker = f"{type(e).__name__}: {e}"
        marker = self._gathered(marker)[0]
        if isinstance(marker, Marker) and not of_lineage([marker], self._lineage):
            raise CommitConflictError(f"step {step} on global rank 0's local root was saved for another durable root "
                                      f"or experiment ({describe_lineage(marker.lineage)}; this job's: "
                                      f"{describe_lineage(self._lineage)}): not drained", step=step)
        if not isinstance(marker, Marker):
            raise CheckpointNotFoundError(f"step {step} of run {ctx.run_id!r} cannot be drained: global rank 0 has "
                                          f"no local marker of it ({marker})", step=step)
        self.drainer.submit(step, marker)

    def _gathered(self, mine: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
        """Every rank's ``mine`` over the save's ``group`` (default: the manager's), a broken collective typed as the
        manager types it (naming the silent ranks)."""
        try:
            return gather(group or self._ctx.group, mine, "exchanging the local tier's state")
        except BaseException as e:
            raise_typed(self._ctx.translate(e, "exchanging the local tier's state"))

    # -- the drain in the background --------------------------------------------------------

    def wait(self) -> None:
        if self.drainer is not None:
            self.drainer.wait()

    def drain_last_and_wait(self) -> None:
        """The last durable step must not be lost to a closing job, nor a step saved for a durable copy whose drain
        failed (its requeue may not be due yet): drained now, once the store answers, or the drain's failure is
        raised, naming it."""
        if self.drainer is not None:
            self._drain_last()
            self.drainer.wait()
            if self._drain_pending():
                self.drainer.wait()

    def _drain_pending(self) -> bool:
        """Every rank alike (rank 0 decides), once the drains in flight are done: the durable-pending step of the
        last commit goes to the drain again unless it or a newer step was drained, or the durable root holds it
        (read bounded by the stall deadline); whether it went."""
        pending, ctx = self._pending, self._ctx
        if pending is None:
            return False
        again = None
        if ctx.rank == 0:
            again = not self._drained_or_superseded(pending) and self._known_durable(pending, True) is not True
        if not from_rank0(ctx.group, again, "deciding whether the durable-pending step drains at close"):
            return False
        if ctx.rank == 0:
            log.warning("run %r: closing; step %d was saved for a durable copy and is not durable yet: draining it to "
                        "%s again", ctx.run_id, pending.step, ctx.layout.storage.describe())
        self.drainer.submit(pending.step, pending)
        return True

    def _drain_last(self) -> None:
        """Every rank alike (SPMD): queue the last local step for the drain if no save queued it (``durable_every``
        N > 1), so a job's final state outlives its nodes; ``durable_every=None`` opted out (warned at construction)."""
        last, self._last_undrained = self._last_undrained, None
        if last is None or self.durable_every is None:
            return
        step, marker = last
        ctx = self._ctx
        if ctx.rank == 0:
            log.info("run %r: closing; draining the last local step %d to %s", ctx.run_id, step,
                     ctx.layout.storage.describe())
        self.drainer.submit(step, marker)

    def wait_at_exit(self) -> None:
        """Wait for a drain in flight, bounded by the stall deadline, and say what became of it; nothing new is
        started (the peers may be gone).  Every rank's exit waits alike, so the drain's collectives still meet."""
        drainer, ctx = self.drainer, self._ctx
        if drainer is None or not drainer.busy():
            return
        steps = sorted(drainer.protected())
        where = ctx.layout.storage.describe()
        log.warning("run %r: the process exits without close() while step(s) %s drain to %s; waiting for the drain "
                    "(stall deadline %.0fs)", ctx.run_id, steps, where, ctx.timeout)
        try:
            drainer.wait()
        except CheckpointError as e:
            log.error("run %r: exiting without close(): step(s) %s did not reach %s (%s: %s). They stay on these "
                      "nodes' local roots; the next job of this run on them drains the newest such step again (or "
                      "a newer durable save supersedes it). Call close() before exiting to be told in time.",
                      ctx.run_id, steps, where, type(e).__name__, e)
        else:
            log.warning("run %r: exiting without close(): step(s) %s drained to %s before exit", ctx.run_id,
                        steps, where)
        # The drain's thread may still be in the collective that hands out that outcome: joined here, it is not
        # inside gloo when the interpreter tears the groups down (a rank aborted with "terminate called without an
        # active exception", exit -6, about once in 12 exits under load).
        drainer.close()

    def busy(self) -> bool:
        return self.drainer is not None and self.drainer.busy()

    def close(self) -> None:
        if self.drainer is not None:
            self.drainer.close()
