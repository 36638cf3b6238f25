"""Retention and garbage collection, run by one process (global rank 0 or the CLI).

Known failures elsewhere: cleanup that counted half-written directories, that
deleted the previous good checkpoint as soon as an async save *returned*, or
that kept the highest step numbers after a rollback restart.  Here:

* only committed steps count, ordered by commit sequence number (P10), not by
  step number or clock, and only those of the live branch: after a rollback
  (a job resumed from step k and saved on), steps above the live branch's that
  were committed before it are the abandoned branch's; they are not counted,
  and go only once they are older than every step kept (see :func:`.retention_policy.retained`);
* the step ``LATEST`` names is never deleted;
* a step whose marker exists but cannot be validated (damaged, torn, written by
  a newer dcp_atomic) is left whole and reported in ``unreadable_steps``: its
  committed attempt cannot be told from debris;
* a step is un-committed first (marker removed), then its data deleted, so a
  crash half-way leaves debris, never a committed step with missing files;
* attempts without a marker (crashed or in-flight saves) are deleted only once
  their lease has expired (their ``ATTEMPT`` record is older than ``lease_seconds``),
  and never under a committing save, however short the lease: gc removes an attempt's
  claim, then re-reads the step's marker and leaves the attempt it names (see
  :func:`_fence_attempts`; the committer checks its claim after its marker);
* data under hashed prefixes (``<root>/_dXX/<run>/step_N/<save_id>/``, object stores)
  goes with its step or attempt, found by listing every prefix (so whatever P a save
  used, with or without a manifest), and *before* the step or attempt records that
  would lead a later gc back to it; prefixed data whose step has no record at all
  (an older dcp_atomic's gc removed it) is swept once its lease has expired.

:func:`remove_step` and :func:`remove_run` are the operator's deletions (``dcp-atomic rm``, the Lightning
integration's ``remove_checkpoint``): unlike gc they delete what is asked even when ``LATEST`` names it, and
then leave ``LATEST`` and the ``COMMITS`` journal telling the truth about what remains.
"""

from __future__ import annotations

import calendar
import json
import logging
import time
from dataclasses import dataclass, field

from .catalog import most_recent
from .retention_policy import Retention, metric_reader
from .commit import SCAN_RETRY_SECONDS, commit_order, read_latest, read_marker, scan_markers, write_latest
from ..errors import CheckpointError, CheckpointNotFoundError
from ..format.layout import (ATTEMPT, COMMITS, DATA_PREFIX_PATTERN, MARKER, RunLayout, parse_step_dir,
                             step_dir_name)
from ..format.manifest import CONTROL_SCHEMA, Marker, sealed_json, unseal
from .._base.retry import Deadline

log = logging.getLogger("dcp_atomic.retention")  # the name users filter on

DEFAULT_LEASE_SECONDS = 6 * 3600.0


@dataclass
class GcPlan:
    delete_steps: list[int] = field(default_factory=list)
    delete_attempts: list[tuple[int, str]] = field(default_factory=list)  # (step, save_id)
    delete_temps: list[str] = field(default_factory=list)  # control-file temps of crashed commits
    delete_data: list[str] = field(default_factory=list)  # prefixed attempt data of steps that have no record left
    kept_steps: list[int] = field(default_factory=list)
    kept_reasons: dict[int, list[str]] = field(default_factory=dict)  # step -> why it stays (dcp-atomic gc --dry-run)
    in_flight: list[tuple[int, str]] = field(default_factory=list)  # (step, save_id): uncommitted, inside the lease
    unreadable_steps: list[tuple[int, str]] = field(default_factory=list)  # (step, reason): left whole, needs a human
    lease_seconds: float = DEFAULT_LEASE_SECONDS
    planned_at: float = field(default_factory=time.time)  # a claim written later is a save started since: left

    @property
    def empty(self) -> bool:
        return not self.delete_steps and not self.delete_attempts and not self.delete_temps and not self.delete_data


def _attempt_started(layout: RunLayout, step: int, save_id: str) -> float | None:
    try:
        return _claim_started(layout.storage.read_file(layout.attempt_file(step, save_id, ATTEMPT)))
    except Exception:
        return None  # unreadable or missing claim: judged by its save_id timestamp below


def _claim_started(claim: bytes) -> float | None:
    """When the save an ``ATTEMPT`` claim records started; None if the claim does not say."""
    try:
        return float(json.loads(claim)["started_at"])
    except Exception:  # noqa: BLE001 - a damaged claim tells no time
        return None


def _attempt_age(layout: RunLayout, step: int, save_id: str, now: float) -> float | None:
    """Seconds since an attempt started (its claim, else its save id's time); None when neither tells.  An
    attempt is a save in flight while its age is within the lease: gc keeps it, `rm` leaves it."""
    started = _attempt_started(layout, step, save_id) or _save_id_time(save_id)
    return None if started is None else now - started


def _save_id_time(save_id: str) -> float | None:
    try:
        return float(calendar.timegm(time.strptime(save_id[:16], "%Y%m%dT%H%M%SZ")))
    except ValueError:
        return None


def _data_steps(layout: RunLayout) -> dict[str, list[str]]:
    """Hashed data prefix -> this run's step directories under it (one LIST of the root, one per prefix)."""
    storage = layout.storage
    prefixes = [e for e in storage.list_dir(storage.root) if DATA_PREFIX_PATTERN.fullmatch(e)]
    return {prefix: storage.list_dir(layout.data_run_dir(prefix)) for prefix in prefixes}


def plan_gc(layout: RunLayout, policy: Retention | int | None, *, lease_seconds: float = DEFAULT_LEASE_SECONDS,
            now: float | None = None, markers: list[Marker] | None = None) -> GcPlan:
    """What gc deletes under ``policy`` (a :class:`Retention`, ``keep_last`` as an int, None: keep every commit),
    and why each kept step stays (``kept_reasons``)."""
    now = time.time() if now is None else now
    data_steps = _data_steps(layout)  # before the step listing: a save publishes its ATTEMPT before any data
    unreadable: list[tuple[int, str]] = []
    if markers is None:
        markers = scan_markers(layout, unreadable=unreadable)
    reasons = _kept_reasons(layout, markers, Retention.of(policy), protected={})
    plan = GcPlan(kept_steps=sorted(reasons), kept_reasons=reasons, lease_seconds=lease_seconds, planned_at=now)
    keep = set(reasons)
    plan.delete_steps = sorted(m.step for m in markers if m.step not in keep)
    committed = {m.step: m.save_id for m in markers}
    scanned_bad = dict(unreadable)
    storage = layout.storage

    def marker_problem(step: int) -> str | None:
        """Why a listed marker is not among the valid ones; None if it reads fine now (committed since the scan)."""
        if step in scanned_bad:
            return scanned_bad[step]
        try:  # a caller's scan skipped it (damaged) or predates it: read it here
            committed[step] = read_marker(layout, step, Deadline(SCAN_RETRY_SECONDS)).save_id
            return None
        except CheckpointError as e:
            return e.message

    def stale_temp(directory: str, entry: str) -> bool:
        """A control-file temp (".NAME.<pid>.<hex>.tmp") a crashed commit left behind."""
        if not (entry.startswith(".") and entry.endswith(".tmp")):
            return False
        stamp = storage.modified(storage.join(directory, entry))
        return stamp is not None and now - stamp > lease_seconds

    run_entries = storage.list_dir(layout.run_dir)
    plan.delete_temps = [storage.join(layout.run_dir, e) for e in run_entries if stale_temp(layout.run_dir, e)]
    for prefix, names in data_steps.items():
        for name in set(names) - set(run_entries):
            orphans = storage.join(layout.data_run_dir(prefix), name)
            plan.delete_data += [storage.join(orphans, save_id) for save_id in storage.list_dir(orphans)
                                 if now - (_save_id_time(save_id) or now) > lease_seconds]
    for name in run_entries:
        step = parse_step_dir(name)
        if step is None or step in plan.delete_steps:
            continue
        entries = storage.list_dir(layout.step_dir(step))
        if MARKER in entries and step not in committed:
            reason = marker_problem(step)
            if reason is not None:
                log.warning("gc: leaving step %d of run %r untouched: its commit marker cannot be validated (%s)",
                            step, layout.run_id, reason)
                plan.unreadable_steps.append((step, reason))
                continue
        plan.delete_temps += [storage.join(layout.step_dir(step), e) for e in entries
                              if stale_temp(layout.step_dir(step), e)]
        for save_id in layout.attempts(entries):
            if save_id == committed.get(step):
                continue
            age = _attempt_age(layout, step, save_id, now)
            if age is not None and age > lease_seconds:  # an unknown age is kept: it may be in flight
                plan.delete_attempts.append((step, save_id))
            else:
                plan.in_flight.append((step, save_id))
    return plan


def _kept_reasons(layout: RunLayout, markers: list[Marker], policy: Retention,
                  protected: dict[int | None, str]) -> dict[int, list[str]]:
    """Step -> why it stays: the policy's one rule (:func:`retained`), then ``LATEST`` (one read by exact name: a
    failed ``LATEST`` write may leave it naming an older step) and what the caller ``protected`` (step -> why)."""
    metric_of = metric_reader(layout, policy.best.metric) if policy.best is not None else None
    reasons = policy.reasons(markers, metric_of)
    for step, why in {**protected, _latest_step_named(layout): "LATEST"}.items():
        if step is not None:
            reasons.setdefault(step, []).append(why)
    return reasons


def apply_gc(layout: RunLayout, plan: GcPlan) -> None:
    storage = layout.storage
    data_steps = _data_steps(layout) if plan.delete_steps or plan.delete_attempts else {}

    def data_dirs(step: int) -> list[str]:
        return [layout.data_step_dir(prefix, step) for prefix, names in data_steps.items()
                if step_dir_name(step) in names]

    def delete_attempt(step: int, save_id: str) -> None:
        for path in data_dirs(step):
            storage.remove(storage.join(path, save_id))
        storage.remove(layout.attempt_dir(step, save_id))
        log.info("gc: deleted abandoned attempt %s of step %d", save_id, step)

    for step in plan.delete_steps:
        storage.remove(layout.marker(step))  # un-commit first
        try:
            storage.sync_dir(layout.step_dir(step))
        except FileNotFoundError:  # removed since gc planned (the saver's own retention): nothing left to delete
            log.info("gc: step %d of run %r was removed meanwhile", step, layout.run_id)
            continue
        attempts = layout.attempts(storage.list_dir(layout.step_dir(step)))
        deletable = _fence_attempts(layout, step, attempts, plan.planned_at)
        if len(deletable) < len(attempts):  # a save committed or started there since: only the others go
            for save_id in deletable:
                delete_attempt(step, save_id)
            continue
        for path in data_dirs(step):
            storage.remove(path)
        storage.remove(layout.step_dir(step))
        log.info("gc: deleted step %d of run %r", step, layout.run_id)
    for step, save_id in plan.delete_attempts:
        if not _fence_attempts(layout, step, [save_id], plan.planned_at):
            continue
        delete_attempt(step, save_id)
        if not storage.list_dir(layout.step_dir(step)):
            storage.remove(layout.step_dir(step))
    for path in plan.delete_temps:
        storage.remove(path)
        log.info("gc: deleted leftover temp file %s", path)
    for path in plan.delete_data:
        storage.remove(path)
        log.info("gc: deleted data %s, whose step has no record left", path)
    abort = getattr(storage, "abort_stale_uploads", None)
    if abort is not None:
        abort(layout.run_dir, older_than_s=plan.lease_seconds)


def _fence_attempts(layout: RunLayout, step: int, save_ids: list[str], planned_at: float) -> list[str]:
    """Of the uncommitted attempts ``save_ids`` of ``step``, the ones gc may delete now, however short its lease.

    gc planned from a listing that a save can overtake (its marker placed since).  So each attempt's ``ATTEMPT``
    claim is removed first, then the step's marker is re-read: an attempt it names committed after gc planned and
    stays (its claim put back); a committer that places its marker after the claim is gone finds it gone and
    withdraws (``commit._refuse_removed_under``), so no save reports success over deleted files.  A claim written
    after ``planned_at`` (a save started since) is left alone, and every attempt is while the marker cannot be
    read."""
    storage = layout.storage
    claims: dict[str, bytes | None] = {}
    for save_id in save_ids:
        path = layout.attempt_file(step, save_id, ATTEMPT)
        try:
            claim = storage.read_file(path)
        except FileNotFoundError:
            claim = None
        started = None if claim is None else _claim_started(claim)
        if started is not None and started > planned_at:
            log.info("gc: left attempt %s of step %d of run %r: claimed after gc planned (a save started since)",
                     save_id, step, layout.run_id)
            continue
        if claim is not None:
            storage.remove(path)
        claims[save_id] = claim
    if not claims:
        return []
    try:
        named = read_marker(layout, step, Deadline(SCAN_RETRY_SECONDS), missing_ok=True).save_id
    except FileNotFoundError:
        return list(claims)
    except CheckpointError as e:
        named, why = None, f"its marker cannot be validated ({e.message})"
    else:
        why = f"its marker, placed since gc planned, names attempt {named}"
    left = [a for a in claims if named is None or a == named]
    for save_id in left:
        if claims[save_id] is not None:
            storage.publish(layout.attempt_file(step, save_id, ATTEMPT), claims[save_id])
    if left:
        log.warning("gc: left attempt(s) %s of step %d of run %r: %s", ", ".join(left), step, layout.run_id, why)
    return [a for a in claims if a not in left]


# -- deletions an operator asks for -----------------------------------------------------------------------------


def remove_step(layout: RunLayout, step: int, *, lease_seconds: float = DEFAULT_LEASE_SECONDS) -> list[str]:
    """Delete one step, committed or not, even the one ``LATEST`` names; returns the attempts left in place.

    An uncommitted attempt inside its lease (its ``ATTEMPT`` claim younger than ``lease_seconds``) is a save in
    flight: it is left (logged), and commits or is gc's once the lease ends, so a job saving the step while it is
    removed never commits over files taken from under it.

    Order, so that a crash at any point leaves no committed step with missing files and no ``LATEST`` naming a
    step that is gone for longer than the deletion: the marker is removed first (un-commit), then ``LATEST`` is
    pointed at the most recent remaining commit (commit order, P10; deleted if none remains) and the step is
    dropped from the ``COMMITS`` journal, and only then are the step's files deleted, its hashed-prefix data
    (``_dXX/<run>/step_N/``) before the step directory that leads gc to it.  Run by one process (the CLI, global
    rank 0).
    """
    storage = layout.storage
    if not storage.is_dir(layout.step_dir(step)) and not any(
            step_dir_name(step) in names for names in _data_steps(layout).values()):
        raise CheckpointNotFoundError(f"run {layout.run_id!r} has no step {step} ({layout.step_dir(step)} does not "
                                      "exist); nothing was removed", step=step, path=layout.step_dir(step))
    try:
        committed = read_marker(layout, step, Deadline(SCAN_RETRY_SECONDS), missing_ok=True).save_id
    except (FileNotFoundError, CheckpointError):
        committed = None  # uncommitted, or a damaged marker: its attempts are judged by their leases alone
    now = time.time()
    attempts = layout.attempts(storage.list_dir(layout.step_dir(step)))
    in_flight = [a for a in attempts if a != committed  # an unknown age goes: the operator asked for the step
                 and (age := _attempt_age(layout, step, a, now)) is not None and age <= lease_seconds]
    storage.remove(layout.marker(step))  # un-commit first
    storage.sync_dir(layout.step_dir(step))
    _point_latest_at_newest(layout, exclude={step})
    journal = _read_journal(layout)
    if journal is not None:  # a missing journal stays missing: the next commit rebuilds it from a scan
        _write_journal(layout, [m for m in journal if m.step != step])
    if in_flight:
        apply_gc(layout, GcPlan(delete_attempts=[(step, a) for a in attempts if a not in in_flight],
                                lease_seconds=lease_seconds))
        log.warning("removed step %d of run %r but left %d attempt(s) of a save in flight (inside the %.0f h lease): "
                    "%s; it commits, or gc collects it once the lease ends", step, layout.run_id, len(in_flight),
                    lease_seconds / 3600, ", ".join(in_flight))
    else:
        apply_gc(layout, GcPlan(delete_steps=[step]))
        log.info("removed step %d of run %r", step, layout.run_id)
    return in_flight


def remove_run(layout: RunLayout) -> list[int]:
    """Delete a whole run: every step (committed, uncommitted, damaged), ``LATEST``, the journal, its data under
    every hashed prefix, its unfinished multipart uploads and the run directory.  Returns the committed steps it
    removed.

    Markers go first, newest commit first, then ``LATEST``: a crash half-way leaves a run whose remaining
    commits are complete (or none), never a ``LATEST`` or marker that leads to deleted files.  Only paths under
    ``<root>/<run>/`` and ``<root>/_dXX/<run>/`` are touched (with the '/' after the run: run ``exp1`` never
    reaches ``exp10``).
    """
    storage = layout.storage
    data_steps = _data_steps(layout)
    if not storage.is_dir(layout.run_dir) and not any(data_steps.values()):
        raise CheckpointNotFoundError(f"no run {layout.run_id!r} under {storage.root}; nothing was removed",
                                      path=layout.run_dir)
    committed = scan_markers(layout)
    steps = [parse_step_dir(name) for name in storage.list_dir(layout.run_dir)]
    for marker in sorted(committed, key=commit_order, reverse=True):
        storage.remove(layout.marker(marker.step))
    for step in steps:  # damaged markers too: nothing of this run may stay committed
        if step is not None:
            storage.remove(layout.marker(step))
    storage.remove(layout.latest())
    storage.remove(storage.join(layout.run_dir, COMMITS))
    for prefix, names in data_steps.items():
        if names:
            storage.remove(layout.data_run_dir(prefix))
    abort = getattr(storage, "abort_stale_uploads", None)
    if abort is not None:
        abort(layout.run_dir, older_than_s=0)
    storage.remove(layout.run_dir)
    log.info("removed run %r (%d committed step(s))", layout.run_id, len(committed))
    return sorted(m.step for m in committed)


def _point_latest_at_newest(layout: RunLayout, exclude: set[int]) -> None:
    """``LATEST`` names the most recent commit outside ``exclude``, or is deleted when there is none."""
    newest = most_recent([m for m in scan_markers(layout) if m.step not in exclude])
    if newest is None:
        layout.storage.remove(layout.latest())
    else:
        write_latest(layout, newest)


# -- per commit: O(kept steps), not O(steps) --------------------------------------------------------------

FULL_GC_EVERY = 64  # commits between full sweeps (crashed attempts of other steps, stale temps)


def retain_after_commit(layout: RunLayout, marker: Marker, policy: Retention | int | None, *,
                        lease_seconds: float = DEFAULT_LEASE_SECONDS) -> GcPlan:
    """Retention right after ``marker`` was committed (global rank 0): reads one small journal and the markers of
    only the steps it lists, instead of every step's marker.

    The journal (``<run>/COMMITS``, self-checksummed) lists the kept steps.  It is a hint for *which* markers to
    read, never for what they say: each listed step is ordered by its own marker, read by exact name (a journal
    entry re-sealed with another sequence or save id ranks as its marker does; one whose marker is gone or
    unreadable takes no ``keep_last`` slot).  A missing or damaged journal, or one that lags (the markers it
    lists hold no commit just before this one: another writer, an older dcp_atomic), is rebuilt from one full
    scan, as is every ``FULL_GC_EVERY``-th commit, which also sweeps crashed attempts.  With ``best``, only the
    manifest of a step not seen before in this process is read (:func:`.retention_policy.metric_reader`).
    """
    policy = Retention.of(policy)
    if policy.keeps_all:
        return GcPlan(lease_seconds=lease_seconds)
    plan = GcPlan(lease_seconds=lease_seconds)
    journal = _read_journal(layout)
    markers = None if journal is None else _listed_markers(layout, journal, marker, plan)
    newest_before = max(((m.sequence or 0) for m in markers or [] if m.step != marker.step), default=None)
    lagging = markers is None or (marker.sequence is not None and newest_before is not None
                                  and newest_before + 1 < marker.sequence)
    if lagging or (marker.sequence or 0) % FULL_GC_EVERY == 0:
        markers = scan_markers(layout)
        plan = plan_gc(layout, policy, lease_seconds=lease_seconds, markers=markers)
        apply_gc(layout, plan)
        _write_journal(layout, [m for m in markers if m.step not in plan.delete_steps])
        return plan
    plan.kept_reasons = _kept_reasons(layout, markers, policy, protected={marker.step: "just committed"})
    plan.kept_steps = sorted(plan.kept_reasons)
    plan.delete_steps = sorted(m.step for m in markers if m.step not in plan.kept_reasons)
    apply_gc(layout, plan)
    _write_journal(layout, [m for m in markers if m.step not in plan.delete_steps])
    return plan


def _listed_markers(layout: RunLayout, journal: list[Marker], committed: Marker, plan: GcPlan) -> list[Marker]:
    """The markers of the steps ``journal`` lists, each read by exact name (``committed`` as it was just placed):
    the journal says where to look, the markers what is there.  A listed step without a marker (removed outside
    dcp_atomic) is dropped with a warning; one whose marker cannot be validated is reported in
    ``plan.unreadable_steps`` and left whole (``dcp-atomic verify`` / ``rm``).  One read per listed step."""
    markers = [committed]
    for step in sorted({m.step for m in journal} - {committed.step}):
        try:
            markers.append(read_marker(layout, step, Deadline(SCAN_RETRY_SECONDS), missing_ok=True))
        except FileNotFoundError:
            log.warning("retention: the COMMITS journal of run %r lists step %d, which has no marker (removed "
                        "outside dcp_atomic?): the journal is repaired and the step takes no keep_last slot",
                        layout.run_id, step)
        except CheckpointError as e:  # neither kept nor deleted: reported
            plan.unreadable_steps.append((step, e.message))
    return markers


def _latest_step_named(layout: RunLayout) -> int | None:
    """The step ``LATEST`` names (one read by exact name), or None if it cannot be read."""
    try:
        return read_latest(layout, Deadline(0)).step
    except Exception:  # noqa: BLE001 - a hint: unreadable LATEST protects nothing extra
        return None


def _read_journal(layout: RunLayout) -> list[Marker] | None:
    path = layout.storage.join(layout.run_dir, COMMITS)
    try:
        raw = unseal(layout.storage.read_file(path), path, "dcp_atomic.commits")
        return [Marker.from_json(Marker(**m).to_json(), where=path) for m in raw["commits"]]
    except Exception:  # noqa: BLE001 - missing, damaged or foreign: rebuilt from a scan
        return None


def _write_journal(layout: RunLayout, markers: list[Marker]) -> None:
    body = {"kind": "dcp_atomic.commits", "schema_version": CONTROL_SCHEMA,
            "commits": [m.record() for m in sorted(markers, key=commit_order)]}
    layout.storage.replace(layout.storage.join(layout.run_dir, COMMITS), sealed_json(body))
