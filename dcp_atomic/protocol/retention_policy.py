"""Which committed steps a run keeps: the retention policy, and the one rule every deleter applies.

Users of Orbax keep a step every N and the best k by a metric beside the last few; torchtitan keeps the latest k;
Lightning the top k by a monitored value.  :class:`Retention` holds those wishes, and :func:`retained` (through
:meth:`Retention.reasons`) is the only place that decides: gc after each durable commit
(``retention.retain_after_commit``), after each drain, ``dcp-atomic gc`` and the local tier's ``keep_local``
all call it, so no two of them can disagree about a step.

A step is kept when *any* part of the policy keeps it (Orbax's ``AnyPreservationPolicy``), and the newest commit is
kept whatever the policy says: the step a resume would take is never the one retention removes.  Only commits of
the live branch count (P14: after a rollback, steps above the resume point committed before it are the abandoned
branch's); those go once they are older than every step ``keep_last`` keeps.  What protects a step outside the
policy (``LATEST``, a save or drain in flight, the durable-pending step) is added by the caller that knows it.

``best`` needs each step's metric, held in its manifest's ``user_metadata``: a committed manifest never changes
under its save id, so each is read at most once per process (:func:`metric_reader`), and a commit reads only its
own: the per-commit cost stays O(kept steps).
"""

from __future__ import annotations

import logging
import math
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .commit import SCAN_RETRY_SECONDS, commit_order, read_manifest
from ..errors import CheckpointError
from ..format.layout import RunLayout
from ..format.manifest import Marker
from .._base import arguments
from .._base.retry import Deadline

log = logging.getLogger("dcp_atomic.retention")  # the name users filter on

_METRIC_NAME = re.compile(r"\S.*", re.DOTALL)
MetricOf = Callable[[Marker], Any]  # a committed step's recorded metric (any JSON value; None when absent)


@dataclass(frozen=True)
class Best:
    """Keep the ``k`` best committed steps by ``metric``, a number saved with the step
    (``save(step, sd, metadata={"val_loss": 0.31})``); ``mode``: ``"min"`` (a loss) or ``"max"`` (an accuracy)."""

    metric: str
    k: int = 1
    mode: str = "min"

    def __post_init__(self) -> None:
        arguments.text("Best(metric=...)", self.metric, _METRIC_NAME, "a non-empty metric name (a str)")
        arguments.count("Best(k=...)", self.k, optional=False)
        arguments.choice("Best(mode=...)", self.mode, ("min", "max"))


@dataclass(frozen=True)
class Retention:
    """What a run's durable root keeps (None everywhere: every commit).  Each part keeps its own steps, the policy
    their union; the newest commit is always kept.

    keep_last: the N most recent commits (of the live branch).
    keep_every: every committed step that is a multiple of K (a pretraining run's step every 1,000, forever).
    keep_period: one commit per period of wall time, in seconds: the first commit of each window
        ``committed_at // keep_period``.  ``committed_at`` is global rank 0's wall clock at the commit (P10: an
        informative clock, never the commit order), so a clock step moves windows, never which commit is newest.
    best: :class:`Best`, the k best commits by a metric recorded with the step.
    """

    keep_last: int | None = None
    keep_every: int | None = None
    keep_period: float | None = None
    best: Best | None = None

    def __post_init__(self) -> None:
        arguments.count("Retention(keep_last=...)", self.keep_last)
        arguments.count("Retention(keep_every=...)", self.keep_every)
        if self.keep_period is not None:
            arguments.seconds("Retention(keep_period=...)", self.keep_period)
        arguments.instance("Retention(best=...)", self.best, Best, 'a dcp_atomic.Best("metric", k=..., mode=...)')

    @classmethod
    def of(cls, policy: "Retention | int | None") -> "Retention":
        """A policy from what callers pass: a :class:`Retention`, ``keep_last`` as an int, or None (keep all)."""
        return policy if isinstance(policy, Retention) else cls(keep_last=policy)

    @property
    def keeps_all(self) -> bool:
        return self == Retention()

    def describe(self) -> str:
        """The policy as its options read (logs, ``dcp-atomic gc``)."""
        parts = [f"{name}={value}" for name, value in (("keep_last", self.keep_last), ("keep_every", self.keep_every),
                                                        ("keep_period", self.keep_period)) if value is not None]
        if self.best is not None:
            parts.append(f"best={self.best.metric}:{self.best.k}:{self.best.mode}")
        return ", ".join(parts) or "keep all"

    def reasons(self, markers: list[Marker], metric_of: MetricOf | None = None) -> dict[int, list[str]]:
        """Step -> why this policy keeps it, for each commit it keeps; the steps absent go.  ``metric_of`` is
        needed with ``best`` (:func:`metric_reader`)."""
        newest_first = sorted(markers, key=commit_order, reverse=True)
        if not newest_first:
            return {}
        if self.keeps_all:
            return {m.step: ["keep all"] for m in newest_first}
        why: dict[int, list[str]] = defaultdict(list)
        why[newest_first[0].step].append("newest")
        live = live_branch(newest_first)
        last = live[:self.keep_last or 1]
        for marker in last if self.keep_last else []:
            why[marker.step].append("keep_last")
        oldest = commit_order(last[-1])
        on_live = {id(m) for m in live}
        for marker in newest_first:  # a rollback's superseding saves replace these; until then they hold the place
            if id(marker) not in on_live and commit_order(marker) >= oldest:
                why[marker.step].append("abandoned branch, newer than keep_last's oldest")
        if self.keep_every:
            for marker in live:
                if marker.step % self.keep_every == 0:
                    why[marker.step].append(f"keep_every {self.keep_every}")
        if self.keep_period:
            windows: dict[int, Marker] = {}
            for marker in reversed(live):  # oldest first: the first commit of each window stays
                windows.setdefault(int(marker.committed_at // self.keep_period), marker)
            for marker in windows.values():
                why[marker.step].append(f"keep_period {self.keep_period:g}s")
        if self.best is not None:
            ranked, unreadable = self._ranked(live, metric_of)
            for rank, (marker, value) in enumerate(ranked, start=1):
                why[marker.step].append(f"best {self.best.metric}={value:g} (#{rank})")
            for marker in unreadable:
                why[marker.step].append(f"best: its {self.best.metric} cannot be read yet")
        return dict(why)

    def _ranked(self, live: list[Marker], metric_of: MetricOf | None
                ) -> tuple[list[tuple[Marker, float]], list[Marker]]:
        """The ``best.k`` best of ``live`` (newest first) with their values, equal values ranking the newer first;
        and the steps whose manifest cannot be read now (kept: one of them may be among the best).  Steps without a
        finite number under the metric never rank; each is reported once per process."""
        best = self.best
        if metric_of is None:
            raise ValueError("Retention.reasons: a policy with best= needs metric_of (retention_policy.metric_reader)")
        scored, unscored, unreadable = [], [], []
        for age, marker in enumerate(live):
            value = metric_of(marker)
            if value is UNREADABLE:
                unreadable.append(marker)
            elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                unscored.append((marker, value))
            else:
                scored.append((value if best.mode == "min" else -value, age, marker, value))
        _report_unscored(best.metric, unscored)
        return [(marker, value) for _, _, marker, value in sorted(scored)[:best.k]], unreadable


def live_branch(newest_first: list[Marker]) -> list[Marker]:
    """The live branch, newest first: each older commit belongs to it only if its step is below every step of the
    live branch after it (P14: a resumed job re-saves steps above where it resumed)."""
    live, lowest = [], None
    for marker in newest_first:
        if lowest is None or marker.step < lowest:
            live.append(marker)
            lowest = marker.step
    return live


def retained(markers: list[Marker], policy: Retention | int | None,
             metric_of: MetricOf | None = None) -> list[Marker]:
    """The commits ``policy`` keeps, newest first (``policy``: see :meth:`Retention.of`)."""
    kept = Retention.of(policy).reasons(markers, metric_of)
    return [m for m in sorted(markers, key=commit_order, reverse=True) if m.step in kept]


# -- the metric of a committed step: its manifest's user_metadata, read once per process -------------------------

_METADATA_CACHE_SIZE = 65536
_metadata: dict[tuple[str, str, int, str], dict | None] = {}  # (root, run, step, save_id) -> user_metadata
_reported: set[tuple[str, str, int, str]] = set()  # (metric, run, step, save_id) already warned about
UNREADABLE = object()  # what metric_of gives for a step whose manifest cannot be read now


def metric_reader(layout: RunLayout, metric: str) -> MetricOf:
    """``metric`` of a committed step, from its manifest's ``user_metadata``: read by exact name at most once per
    process for each (step, save id), since a committed manifest never changes.  A manifest that cannot be read
    gives :data:`UNREADABLE`, never cached: the step is kept (it may be among the best; a damaged one is left whole,
    as gc leaves a damaged marker) and read again at the next commit."""
    root = layout.storage.describe()

    def metric_of(marker: Marker) -> Any:
        key = (root, layout.run_id, marker.step, marker.save_id)
        if key not in _metadata:
            try:
                manifest, _ = read_manifest(layout, marker, Deadline(SCAN_RETRY_SECONDS))
            except (CheckpointError, OSError) as e:
                log.warning("retention: cannot read the manifest of step %d of run %r for its %r (%s): the step is "
                            "kept until it can be read, or removed with `dcp-atomic rm`", marker.step,
                            layout.run_id, metric, e)
                return UNREADABLE
            if len(_metadata) >= _METADATA_CACHE_SIZE:
                _metadata.pop(next(iter(_metadata)))
            _metadata[key] = manifest.user_metadata
        return (_metadata[key] or {}).get(metric)

    return metric_of


def _report_unscored(metric: str, unscored: list[tuple[Marker, Any]]) -> None:
    """One WARNING naming ``metric`` for the steps not reported before that hold no number under it."""
    new = [(m, v) for m, v in unscored if (metric, m.run_id, m.step, m.save_id) not in _reported]
    if not new:
        return
    _reported.update((metric, m.run_id, m.step, m.save_id) for m, _ in new)
    log.warning("retention: step(s) %s of run %r hold no number under %r in their metadata (save(..., "
                "metadata={%r: <number>})), so they never count among the best; other parts of the policy may keep "
                "them", ", ".join(f"{m.step} ({'missing' if v is None else repr(v)})" for m, v in new),
                new[0][0].run_id, metric, metric)

