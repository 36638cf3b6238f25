"""The drain: local-committed steps copied to the durable root in the background (P13).

A local commit (:mod:`.local_tier`) survives the loss of a failure domain, not of the whole job's nodes; some
steps must therefore also reach the durable root.  Training must not wait for that upload (it is what the local
tier exists to avoid), so a background thread on every rank does it, while training keeps saving locally.  Which
steps go: ``durable=`` per save, else the manager's ``durable_every`` policy.  One drain, run by every rank:

1. global rank 0 picks the job (the newest step waiting) and announces it; every rank takes that step, never
   one it chose itself (the ranks' queues fill at slightly different moments);
2. every rank reports which of the step's ranks its local root holds (:func:`~.drain_plan.held_ranks`); rank 0
   plans the uploads (:func:`~.drain_plan.plan_uploads`: each rank its own primary files where it holds them, any
   other rank's from a replica, so a job of another world size, or one with a replaced node, drains the step
   whole); each rank uploads its share (manifest shards and data files; one rank also the control files, from
   rank 0's root unless its node was replaced) from its own local root to the durable attempt directory
   ``<root>/<run_id>/step_N/<save_id>/``, as many files at once as a direct save writes (the library's thread count),
   each in one pass (:mod:`.verified_copy`): a piece of about ``COPY_CHUNK`` bytes is read into the thread's buffer,
   every block digest it holds is checked, and only then is it uploaded (onto a disk, written through as it goes
   rather than all at the final fsync).  The stored bytes travel, never re-serialised, never staged from device
   memory again, never a whole file in memory, and never a byte whose block was not checked (a damaged block stops
   the file before it; gc collects the partial attempt);
3. every rank reports what it uploaded; rank 0 alone commits (:func:`~.drain_plan.commit_durable`), through
   :func:`~.commit.commit_step` as a save does, which refuses the marker unless those reports cover every file the
   manifest names (:func:`~.commit.require_complete`: a step no root covers stays local, the error naming the files):
   the control files uploaded (``ranks.json``, ``.metadata``, the local manifest verbatim: its digest is the local
   marker's), fsync, the marker created exclusively, ``LATEST``.  The marker carries the step's *local* commit
   sequence: a step keeps its place in the run's history whichever tier serves it (P10 across tiers), and
   ``LATEST`` never moves back to a lower sequence;
4. rank 0 hands every rank the outcome, so a failure is raised (``wait()``) and reported (``on_failed``) on every
   rank, as an async save's is.

A crash or kill before step 3's marker leaves no marker of the step in the durable root and its previous step
intact; the partial attempt directory is collected by ``gc`` like any crashed save.  A failed attempt is retried
(``DRAIN_ATTEMPTS``, backoff doubling) unless a newer step is waiting by then, which supersedes it.  A failure after
the marker (``LATEST`` refused) fails the attempt too, saying the step is committed: the retry accepts the marker
it placed and writes ``LATEST``.

Falling behind: the queue holds one drain in flight and the newest step waiting.  A step submitted while another
waits replaces it: the replaced step is never drained, and rank 0 logs it by name (a durable copy of an older step
than the newest waiting one protects nothing the newer does not).  Local retention never removes a step that is in
flight or waiting (:meth:`Drainer.protected`).

Coordination: the drain thread speaks only on a gloo group of its own, created on the main thread when the
manager is built; gloo pairs collectives by their order in a group, so sharing a group with the training thread
would interleave the two.  A peer that dies mid-drain surfaces as that group's error: the drain fails on every
rank and drains stop (the group cannot be trusted after it); the local tier is untouched.

Stalls: ``wait()`` is bounded on every rank by one clock, the progress of the whole drain (any rank's uploads, each
phase of a round, rank 0's commit), and every rank reports one verdict (:mod:`~..exchange.stall`): a rank that only
waits in a collective for a peer whose store hangs gives up when that peer does, and rank 0 writes no marker once
the waiters declared the drain stalled.

Why one module of about 520 lines: one thread's protocol, a round's collectives in the order every rank runs them;
what a round plans, uploads and commits is :mod:`.drain_plan`'s.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch.distributed as dist

from .._base import failpoints
from ..dcp.identity import default_thread_count
from ..errors import (CheckpointError, CommitConflictError, DrainStalledError, IncompleteStepError,
                      StorageError)
from ..exchange.collective import CollectiveFailed, first_line, from_rank0, gather
from ..exchange.stall import DURABLE, SILENT, STALLED, StallClock
from ..format.layout import DCP_METADATA, MANIFEST, RunLayout
from ..format.manifest import Marker, now
from ..protocol.commit import Evidence, ResumePoint, claim_attempt
from .drain_plan import DrainJob, Plan, Uploaded, commit_durable, held_ranks, plan_uploads, upload_ranks

log = logging.getLogger("dcp_atomic.drain")  # the name users filter on

DRAIN_ATTEMPTS = 3  # per step; a newer step waiting supersedes the retries
RETRY_BACKOFF = 1.0  # seconds before the second attempt, doubled after each


@dataclass
class Drained:
    """A drain committed to the durable root (rank 0's figures, for ``DrainStats``)."""

    job: DrainJob
    marker: Marker
    seconds: float
    queued_seconds: float
    bytes: int
    files: int
    attempts: int
    skipped: list[int]
    bytes_reused: int = 0


_POLL = 1.0  # seconds between a waiter's looks at the stall clock


class _StoreWork:
    """``with drainer._io():`` this rank works on the stores, not waiting in a collective (a tick of the shared stall
    clock, and what a stall's error says of this rank)."""

    def __init__(self, drainer: "Drainer", what: str) -> None:
        self.drainer, self.what = drainer, what

    def __enter__(self) -> None:
        self.drainer.clock.tick()
        self.drainer._io_since, self.drainer._io_what = time.monotonic(), self.what

    def __exit__(self, *exc: Any) -> None:
        drainer = self.drainer
        now = time.monotonic()
        drainer._io_last = (self.what, now - drainer._io_since, now)
        drainer._io_since = None


# -- the background thread -----------------------------------------------------------------------------------


class Drainer:
    """One manager's drain queue and thread (module doc).  ``submit`` from the thread that committed a step,
    ``wait``/``close`` from the training thread; the thread itself speaks only on ``group``."""

    def __init__(self, *, rank: int, world_size: int, group: dist.ProcessGroup | None, local: RunLayout,
                 durable: RunLayout, timeout: float, where: str,
                 resumed: Callable[[], ResumePoint | None],
                 committed: Callable[[Drained], None],
                 failed: Callable[[DrainJob, CheckpointError, float], None], threads: int | None = None,
                 clock: StallClock | None = None, owns_durable: Callable[[], None] = lambda: None) -> None:
        """``owns_durable``: rank 0, before each claim: raise ``CommitConflictError`` where the durable run belongs to
        another lineage than this job's (the drain is then refused, on every rank, nothing uploaded), another
        ``CheckpointError`` where that cannot be told yet (the drain retries)."""
        self.rank, self.world_size, self.group = rank, world_size, group
        # the whole drain's progress, the same on every rank (exchange/stall.py); None: wait() is unbounded
        self.clock = clock or StallClock(None)
        self.here = f"rank {rank} ({socket.gethostname()}:{local.storage.describe()})"
        self.threads = threads or default_thread_count()  # files uploaded at once: a direct save's writer count
        self.local, self.durable, self.timeout, self.where = local, durable, timeout, where
        self._resumed, self._committed, self._failed, self._owns_durable = resumed, committed, failed, owns_durable
        self._cond = threading.Condition()
        self._pending: list[DrainJob] = []  # rank 0: at most one (the newest); others: until rank 0 takes them
        self._inflight: DrainJob | None = None
        self._retry: tuple[DrainJob, int] | None = None  # rank 0: the job to attempt again, and its attempt number
        self._another_round = False  # other ranks: rank 0 announced that a round follows (a retry)
        self._submitted = 0
        self._taken = 0  # the highest job index a round has taken
        self._queued_at: dict[int, float] = {}
        self._replaced: dict[int, list[int]] = {}  # rank 0: job index -> the waiting steps it replaced
        self._failure: CheckpointError | None = None  # unreported
        self._broken: CheckpointError | None = None  # the group failed: no more drains
        self._thread: threading.Thread | None = None
        self._closed = False
        self._io_since: float | None = None  # this rank works on the stores (not in a collective) since, or None
        self._io_what = ""  # and on what (a stall's error says it)
        # the last work on the stores that ended: what, how long it took, when it ended
        self._io_last: tuple[str, float, float] | None = None
        self._verdict: DrainStalledError | None = None  # the stall this rank's wait() declared: raised again
        self._phase = "idle"  # where the round in flight is (what a failure can say of its step: _stopped)
        # the store's checksums of the data objects this rank's last two uploads wrote (durable path -> checksum):
        # the next drain's reuse links them from there, checked without a download (drain_plan.upload_ranks)
        self._stored: collections.deque[dict[str, str]] = collections.deque(maxlen=2)
        self.drained = self.failed = self.skipped = 0  # counters (every rank; ``skipped`` on rank 0)

    # -- the training side

    def submit(self, step: int, marker: Marker) -> None:
        with self._cond:
            self._submitted += 1
            job = DrainJob(self._submitted, step, marker.save_id, marker.manifest_sha256, marker.sequence)
            if self._broken is not None:
                self._failure = self._failure or self._broken
                log.error("drain of step %d not started: drains stopped after an earlier failure (%s)", step,
                          self._broken)
                return
            self._queued_at[job.index] = time.monotonic()
            if self.rank == 0 and self._pending:
                replaced = [s for j in self._pending for s in [*self._replaced.pop(j.index, []), j.step]]
                self._replaced[job.index] = replaced
                self.skipped += len(self._pending)
                log.warning("drain to %s is behind (step %s in flight): step(s) %s replaced by step %d before they "
                            "started, never drained; the newest waiting step drains next", self.where,
                            self._inflight.step if self._inflight else "none", [j.step for j in self._pending], step)
                self._pending = []
            self._pending.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="dcp-atomic-drain", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def protected(self) -> set[int]:
        """Steps local retention must keep: in flight, waiting, or about to be retried."""
        with self._cond:
            steps = {j.step for j in self._pending}
            if self._inflight is not None:
                steps.add(self._inflight.step)
            if self._retry is not None:
                steps.add(self._retry[0].step)
            return steps

    def busy(self) -> bool:
        with self._cond:
            return self._has_work() or self._inflight is not None

    def wait(self) -> None:
        """Block until nothing is in flight or waiting; raise a failure nothing has reported yet (once).

        Bounded by the stall deadline, on every rank alike: when the *whole* drain (any rank's uploads, a phase of the
        round, rank 0's commit) made no progress for the clock's ``stall`` seconds -- a frozen mount on one node, an
        endpoint that stopped answering, a commit that does not return -- raise :class:`DrainStalledError` naming the
        step, the store and the verdict every rank shares (:mod:`~..exchange.stall`): not durable (no marker follows),
        unknown (rank 0 was writing the marker), or durable (rank 0 wrote it, then did not hand out the outcome).
        Drains then stop until the job restarts (the stuck thread is left to its store; later calls report it)."""
        idle = lambda: not self._has_work() and self._inflight is None  # noqa: E731
        if self._verdict is not None:  # declared stalled and raised on this rank already: drains stopped, never waited
            if self.busy():  # for again, and the verdict is raised once (a later call would say it again, alone)
                log.warning("the drain is still stuck on its store (%s; raised already): not waited for",
                            first_line(self._verdict))
            return
        self.clock.start_waiting()
        while True:
            with self._cond:
                if not idle():
                    self._cond.wait(timeout=_POLL if self.clock.stall is not None else None)
                if idle():
                    failure, self._failure = self._failure, None
                    break
                job = self._inflight
            verdict = self.clock.check(job and job.key)  # outside the lock: it may wait for the store
            if verdict is not None:
                with self._cond:
                    if idle():  # finished meanwhile: its outcome is the verdict
                        continue
                    self._verdict = self._stall_error(verdict)
                    self._broken = self._broken or self._verdict
                    self._cond.notify_all()
                raise self._verdict
        if isinstance(failure, DrainStalledError) and failure.details.get("abandoned"):
            # rank 0 abandoned the step because another rank's waiter declared the stall before this one looked
            # (a loaded rank polls late): this rank says what every waiter says, not the committer's reason
            self._verdict = self._stall_error(STALLED, step=failure.details.get("step"))
            raise self._verdict from failure
        if failure is not None:
            raise failure

    def _stall_error(self, verdict: str, step: int | None = None) -> DrainStalledError:
        """What every rank says when the shared clock ran out (``verdict``: exchange/stall.py's); ``step``: the step
        whose round already ended in the abandonment."""
        job = self._inflight
        what = (f"the drain of step {job.step} (save {job.save_id})" if job is not None else
                f"the drain of step {step}" if step is not None else
                f"the drain of step(s) {sorted(self.protected())}")
        stuck_here = self._io_since is not None
        stall = self.clock.stall  # stuck before: this round ended since the verdict, its work on the store had stalled
        stuck_before = (not stuck_here and self._io_last is not None and stall is not None
                        and self._io_last[1] >= stall and time.monotonic() - self._io_last[2] <= 2 * stall)
        own = (f"this rank is stuck {self._io_what} on the store" if stuck_here else
               f"this rank was stuck {self._io_last[0]} on the store for {self._io_last[1]:.0f}s" if stuck_before else
               "this rank waited for its peers")
        stuck_here = stuck_here or stuck_before
        if verdict == STALLED:
            outcome = ("No durable marker of the step was or will be written by this job (global rank 0 abandons it: "
                       "every rank says so); the durable root's previous step is intact and the step stays on the "
                       "local tier (keep_local keeps it)")
        elif verdict == SILENT:
            outcome = ("The rendezvous store on global rank 0 does not answer (rank 0 dead or frozen), so whether "
                       f"the step became durable is unknown: `dcp-atomic ls {self.durable.storage.describe()} "
                       f"{self.durable.run_id}` tells")
        elif verdict == DURABLE:
            outcome = ("Global rank 0 committed the step to the durable root (its marker is written: the step is "
                       "durable) but has not handed out the outcome within one more stall period")
        else:
            outcome = ("Global rank 0 was writing the step's durable marker and did not finish within one more stall "
                       "period, so whether the step is durable is unknown to every rank: `dcp-atomic ls "
                       f"{self.durable.storage.describe()} {self.durable.run_id}` tells")
        return DrainStalledError(
            f"{what} made no progress on any rank for {self.clock.stall:.0f}s or more (the stall deadline; "
            f"{own}, rank {self.rank}): "
            + ("global rank 0 does not answer" if verdict == SILENT and not stuck_here else
               f"the store ({self.where}, or this node's local root) does not answer" if stuck_here else
               f"another rank's work on its stores made no progress (the durable store as its node reaches it, or its "
               f"local root, does not answer); this rank's own ({self.where}) answered")
            + ". Stopped "
            f"waiting. {outcome}. Drains stop until the job restarts, and the next job drains the newest local step "
            "again. Check the store (a frozen mount, an unreachable endpoint).",
            step=job.step if job is not None else step, rank=self.rank, path=self.where,
            durable={STALLED: False, DURABLE: True}.get(verdict))

    def _io(self, what: str) -> "_StoreWork":
        return _StoreWork(self, what)

    def _progressed(self) -> None:
        self.clock.tick()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout)

    def _has_work(self) -> bool:
        if self._broken is not None:
            return False
        if self.rank == 0:
            return bool(self._pending) or self._retry is not None
        return any(j.index > self._taken for j in self._pending) or self._another_round

    # -- the drain thread

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._has_work())
                if not self._has_work():
                    return
            if self.rank == 0 and self.clock.declared_stalled():
                # a waiter on some rank gave up (its drain thread may be gone): no rank starts another round
                with self._cond:
                    self._broken = self._failure = self._broken or self._stall_error(STALLED)
                    self._pending, self._retry = [], None
                    self._cond.notify_all()
                log.error("%s", self._broken)
                return
            with self._cond:
                planned = self._plan() if self.rank == 0 else None
                if planned is not None:
                    self._inflight = planned[0]  # from here on ``wait`` waits for it
            try:
                self._round(planned)
            except BaseException as e:  # the group failed (a peer died), or a bug: every waiter must hear of it
                error = self._stopped(e)
                with self._cond:
                    job = self._inflight
                    self._broken = error
                    self._failure = error
                    self._pending, self._retry, self._inflight, self._another_round = [], None, None, False
                    self.failed += 1
                    self._cond.notify_all()
                log.error("%s", error)
                if job is not None:
                    self._failed(job, error, 0.0)
                return

    def _stopped(self, e: BaseException) -> CheckpointError:
        """The error of a round that stopped on this rank: ours as they are; a broken collective (a peer died) or a
        bug says what this rank knows of the step in flight (``_phase``: rank 0 knows whether it committed; the
        others, once every share was gathered, cannot)."""
        if isinstance(e, CheckpointError) and not isinstance(e, CollectiveFailed):
            return e
        job = self._inflight
        step = f"step {job.step}" if job is not None else "the step in flight"
        if self._phase == "committed":
            known = f"{step} was committed to the durable root before the group failed"
        elif self._phase == "outcome":
            known = (f"whether {step} became durable is unknown on this rank: global rank 0 may have committed it "
                     f"before the group failed (`dcp-atomic ls {self.durable.storage.describe()} "
                     f"{self.durable.run_id}` tells)")
        else:
            known = (f"no durable marker was written for {step} (the durable root's previous step is intact; gc "
                     "collects the partial attempt)")
        cause = first_line(e)
        if self.clock.declared_stalled():  # what failed the collective: the others gave up on the round, not died
            cause = (f"a waiter declared the drain stalled (no progress on any rank for the stall deadline) and the "
                     f"other ranks left the round; this rank was stuck or waited for one that was ({cause})")
        return StorageError(f"the drain to {self.where} stopped on rank {self.rank} ({cause}): {known}; later "
                            "steps stay local until the job restarts.", rank=self.rank,
                            step=job.step if job is not None else None)

    def _plan(self) -> tuple[DrainJob, int]:
        """Rank 0, under the lock: the newest waiting step, else the retry."""
        if self._pending:
            job = self._pending.pop()
            if self._retry is not None:
                self._replaced.setdefault(job.index, []).insert(0, self._retry[0].step)
                log.warning("drain: step %d is not retried, newer step %d supersedes it", self._retry[0].step,
                            job.step)
                self._retry = None
            return job, 1
        planned, self._retry = self._retry, None
        return planned

    def _round(self, planned: tuple[DrainJob, int] | None) -> None:
        if planned is not None and planned[1] > 1:
            time.sleep(RETRY_BACKOFF * 2 ** (planned[1] - 2))  # rank 0; the others wait in the announcement
        started = time.perf_counter()
        tick = self.clock.tick  # each phase passed is progress of the whole drain, seen by every rank's waiter
        tick()
        self._phase = "round"
        job, attempt = self._share(planned)
        tick()
        with self._cond:
            self._pending = [j for j in self._pending if j.index > job.index]
            self._taken = max(self._taken, job.index)
            self._inflight, self._another_round = job, False
            queued = time.monotonic() - self._queued_at.get(job.index, time.monotonic())
            self._queued_at = {i: t for i, t in self._queued_at.items() if i > job.index}
        holdings = self._gathered((held_ranks(self.local, job), self.here))  # any world drains any step
        tick()
        refused = self._claim(job) if self.rank == 0 else None  # before the plan: no rank uploads before the claim
        # a claim refused outright (the durable run is another lineage's) is a plan that uploads nothing
        plan: Plan = self._share(None if self.rank else Plan({}, None) if isinstance(refused, CommitConflictError)
                                 else plan_uploads([held for held, _ in holdings]))
        tick()
        mine = (Uploaded(error=refused) if refused is not None
                else self._upload(job, plan.sources.get(self.rank, []), control=plan.control == self.rank))
        shares = self._gathered(dataclasses.replace(mine, manifest=None))
        tick()
        self._phase = "outcome"  # rank 0 decides (and may commit): the others cannot know until it says
        outcome: Any = None
        if self.rank == 0:
            outcome = self._decide(job, attempt, shares, mine.manifest, plan, started, queued,
                                   [where for _, where in holdings])
            self._phase = "committed" if outcome[0] == "ok" else "decided"
        status, error, again = self._share(outcome[:3] if outcome is not None else None)
        tick()
        drained = outcome[3] if outcome is not None else None
        with self._cond:
            self._inflight = None
            self._another_round = again
            if status == "ok":
                self.drained += 1
            elif not again:
                self.failed += 1
                if self._verdict is None:  # else this rank's wait() reported the stall of this round already
                    self._failure = error
            self._cond.notify_all()
        if status == "ok":
            if drained is not None:
                self._committed(drained)
        elif again:
            log.warning("drain of step %d to %s failed (attempt %d of %d), retrying: %s", job.step, self.where,
                        attempt, DRAIN_ATTEMPTS, error)
        else:
            log.error("drain of step %d to %s failed: %s", job.step, self.where, error)
            self._failed(job, error, time.perf_counter() - started)

    def _claim(self, job: DrainJob) -> CheckpointError | None:
        """Rank 0: the durable attempt's claim, as every committer writes before any data (gc's lease judges the
        attempt by it, the commit checks it is still there).  Its time is now: an old step drained late is in
        flight from now on."""
        try:
            with self._io("claiming the step's durable attempt"):
                self._owns_durable()
                claim_attempt(self.durable, job.step, job.save_id, started_at=now(), drained_from=self.here)
            return None
        except CheckpointError as e:
            return e
        except OSError as e:
            path = e.filename or self.durable.attempt_dir(job.step, job.save_id)
            return StorageError(f"rank 0 could not start the durable attempt of step {job.step} at {path}: "
                                f"{e.strerror or e}", rank=0, path=str(path), errno=e.errno, step=job.step)

    def _upload(self, job: DrainJob, sources: list[int], control: bool) -> Uploaded:
        try:
            with self._io("uploading its files"):
                failpoints.hit("drain.before_upload", self.rank, job.step)  # where a hung store stops the upload
                uploaded = upload_ranks(self.local, self.durable, job, sources, self.rank, self.threads,
                                        progress=self._progressed, control=control,
                                        stored={path: crc for kept in self._stored for path, crc in kept.items()})
                self._stored.append(uploaded.checksums)
                return uploaded
        except CheckpointError as e:
            return Uploaded(error=e)
        except OSError as e:
            path = e.filename or self.durable.attempt_dir(job.step, job.save_id)
            return Uploaded(error=StorageError(
                f"rank {self.rank} could not upload its files of step {job.step} to {path}: {e.strerror or e}",
                rank=self.rank, path=str(path), errno=e.errno, step=job.step))

    def _decide(self, job: DrainJob, attempt: int, shares: list[Uploaded], manifest: bytes | None, plan: Plan,
                started: float, queued: float, roots: list[str]) -> tuple:
        """Rank 0: commit if every rank uploaded; else whether to try again.  (status, error, again, Drained).
        ``manifest``: rank 0's own upload of it, if it was the control uploader."""
        failed = [(r, s.error) for r, s in enumerate(shares) if s.error is not None]
        error: CheckpointError | None = None
        stalled = False

        def then() -> str:
            """What follows a failed round: a retry, unless a waiter declared the drain stalled while it ran."""
            nonlocal stalled
            stalled = self.clock.declared_stalled()
            return ("no drain follows in this job (a waiter declared the drain stalled): the next job drains the "
                    "newest local step" if stalled else "the next drain retries")
        refused = next((e for _, e in failed if isinstance(e, CommitConflictError)), None)
        if refused is not None:  # rank 0's claim refused: the root is not this job's to commit into; no retry changes it
            with self._cond:
                self._replaced.pop(job.index, None)
            return "error", refused, False, None
        if plan.control is None:  # no retry finds them: they are on no root this job has
            with self._cond:
                self._replaced.pop(job.index, None)
            return "error", IncompleteStepError(
                f"drain of step {job.step} (save {job.save_id}) to {self.where}: no local root holds the step's "
                f"control files ({MANIFEST}, {DCP_METADATA}) named by its local marker; looked in "
                f"{', '.join(roots)}. No durable marker was written; the step stays local (a node that held them "
                "was replaced?)", step=job.step, save_id=job.save_id, files=[MANIFEST, DCP_METADATA]), False, None
        if failed:
            error = StorageError(
                f"drain of step {job.step} (save {job.save_id}) to {self.where}: {len(failed)} rank(s) could not "
                f"upload: " + "; ".join(e.message for _, e in failed[:4]) + ". No durable marker was written; the "
                "durable root's previous step is intact. Check the named paths (space and access on the durable "
                f"root, or a local copy found damaged or missing): {then()}.", step=job.step,
                ranks=[r for r, _ in failed],
                path=failed[0][1].details.get("path"))
        else:
            evidence = Evidence.on_roots({name: who for share in shares for name, who in share.verified.items()}, roots)
            try:
                with self._io("committing the step (its control files and marker)"):
                    marker = commit_durable(self.durable, job, manifest, self._resumed(), self.timeout, evidence,
                                            self.clock)
            except (CommitConflictError, IncompleteStepError, DrainStalledError) as e:
                # retrying finds no other copy, nor another save; a stall declared by the waiters is final
                with self._cond:
                    self._replaced.pop(job.index, None)
                return "error", e, False, None
            except (OSError, CheckpointError) as e:
                committed = e.details.get("committed", False) if isinstance(e, CheckpointError) else False
                if committed:  # only LATEST is missing (commit_durable says so)
                    error = e
                else:
                    where = getattr(e, "filename", None) or self.durable.step_dir(job.step)
                    reason = getattr(e, "message", None) or getattr(e, "strerror", None) or str(e)
                    outcome = ("No durable marker was written" if committed is False else
                               "Whether its durable marker was written is unknown")
                    error = StorageError(f"drain of step {job.step}: global rank 0 could not commit it to {where}: "
                                         f"{reason.rstrip('.')}. {outcome}; {then()}.", step=job.step,
                                         rank=0, path=str(where))
            else:
                failpoints.hit("drain.after_commit", 0, job.step)
                with self._cond:
                    skipped = self._replaced.pop(job.index, [])
                return "ok", None, False, Drained(
                    job=job, marker=marker, seconds=time.perf_counter() - started,
                    queued_seconds=queued,
                    bytes=sum(s.bytes for s in shares), files=sum(s.files for s in shares), attempts=attempt,
                    skipped=skipped, bytes_reused=sum(s.bytes_reused for s in shares))
        again = attempt < DRAIN_ATTEMPTS and not stalled  # the others then enter one more round (a newer step may)
        with self._cond:
            if again:
                self._retry = (job, attempt + 1)
            else:
                self._replaced.pop(job.index, None)
        return "error", error, again, None

    def _share(self, mine: Any) -> Any:
        """Rank 0's value on every rank, over the drain's own group."""
        if self.world_size == 1 or self.group is None:
            return mine
        return from_rank0(self.group, mine, f"the drain to {self.where}")

    def _gathered(self, mine: Any) -> list[Any]:
        if self.world_size == 1 or self.group is None:
            return [mine]
        return gather(self.group, mine, f"the drain to {self.where}")
