"""Saves under DCP's plan caching: series of saves that replay one cached plan.

With ``DefaultSavePlanner(enable_plan_caching=True)`` DCP sends the coordinator an empty plan from a rank whose
plan did not change, and hands every rank the global plan it cached for the first save of the series, storage
data included.  The writer's plan messages (the save_id a rank writes under, what a rank reported) would then
be stale; this module keeps what makes each save of a series its own:

* every rank counts the saves of each series it caches (:func:`advance`), in lockstep, and derives the save's
  id from the series' first id and that number (:func:`save_id_of`): no message needed;
* the coordinator remembers, per DCP cache key, the series whose plans every rank has cached
  (:func:`remember`), so that a replay finds the reports it stands in for (:func:`replayed`).

Why a module of its own: the rules are about DCP's cache, not about writing bytes, and they are the part of the
writer a new torch release changes (the private names it reads are in :mod:`dcp_atomic._base.internals`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Iterable

from .._base import internals
from ..errors import ConfigurationError
from ..format.integrity import sha256_hex
from .reshard import SaveReport

_MAX_SERIES = 64  # a series ends when every rank's plan changes; a process has one live series per planner class


@dataclass
class Series:
    """Saves sharing one DCP-cached plan, as the coordinator knows them: a cached plan (``usable=False``)
    reaches it without items, and without what the rank's writer added unless the planner passes it on
    (AtomicSavePlanner does), so each rank's last full report stands in."""

    first_save_id: str
    plans: list[Any]  # per rank, the writer's last full report (writer._LocalPlanData)
    keys: dict[str, dict[str, Any]]
    named: bool = False  # its planner names its DCP cache in every report (AtomicSavePlanner), so replays find it


_lock = threading.Lock()
_counts: dict[str, int] = {}  # series (first save_id) -> number of the last save of it this process wrote
# Coordinator: per DCP plan-cache key, the series whose plans every rank has cached.  DCP keys its caches by the
# planner's class name, so two planner classes (full and model-only saves) replay two series, and two state dicts
# saved through one class share one (DCP re-plans when the structure changes).  Set from write_data only: a save
# gets there after every rank's DCP cache advanced (finish_plan), never after a refusal.
_cached: dict[str, Series] = {}


def save_id_of(first: str, number: int) -> str:
    """The save_id of save ``number`` of the series that ``first`` began: every rank derives the same one.
    Its time part stays the series' start (the ATTEMPT claim records when each save started)."""
    if number == 1:
        return first
    return first[:17] + sha256_hex(f"{first}/{number}".encode())[:8]


def next_number(series: Series) -> int:
    """Coordinator: the number of the save about to continue ``series``."""
    with _lock:
        return _counts.get(series.first_save_id, 0) + 1


def advance(first: str, number: int, caching: bool) -> int:
    """The number of this save in its series.  A plan fresh from the coordinator names it; a cached plan that
    DCP replays names an earlier one, so every rank counts the saves of each series it caches, in lockstep
    (every rank runs ``write_data`` once per save that got past planning)."""
    if not caching:
        return number
    with _lock:
        number = max(number, _counts.pop(first, 0) + 1)
        _counts[first] = number  # most recent last
        while len(_counts) > _MAX_SERIES:
            del _counts[next(iter(_counts))]
    return number


def named_cache(reports: Iterable[SaveReport | None]) -> str | None:
    """The DCP cache key the ranks' reports name (AtomicSavePlanner's); DCP's own planners name none."""
    return next((report.plan_cache for report in reports if report is not None and report.plan_cache is not None),
                None)


def replayed(named: str | None) -> Series | None:
    """The series that ranks replaying their cached plans continue: the one of the cache their planner names, or
    else the one series of a planner that names none (several such cannot be told apart)."""
    with _lock:
        if named is not None:
            return _cached.get(named)
        unnamed = sorted(key for key, series in _cached.items() if not series.named)
        if len(unnamed) <= 1:
            return _cached[unnamed[0]] if unnamed else None
    raise ConfigurationError(
        f"ranks replay a DCP plan cached by one of the planners {', '.join(unnamed)}, and nothing in it says which: "
        "with enable_plan_caching=True in several planner classes of one process, make each an AtomicSavePlanner "
        "(or a subclass), whose reports name the cache they replay, or turn caching off in all but one. Nothing "
        "was written.",
        planners=unnamed,
    )


def remember(planner: Any, series: Series) -> None:
    """Coordinator, once every rank has cached the plans of ``series``: replays through this planner's cache
    continue it."""
    with _lock:
        _cached[internals.plan_cache_key(planner)] = series


def forget_all() -> None:
    """Drop every series this process knows (a benchmark's fresh start)."""
    with _lock:
        _counts.clear()
        _cached.clear()
