"""Overlapping ``gc_paused()`` blocks (async saves beside loads, one thread each) never leave cyclic GC on during a
pause, nor off after the last one: every order of two and three pauses' starts and ends, GC on or off before."""

from __future__ import annotations

import gc
import itertools
import threading

import pytest

from dcp_atomic._base.gc_pause import gc_paused

pytestmark = pytest.mark.timeout(300)


# -- gc_paused() from several threads ------------------------------------------------------------------


def _orders(n: int):
    """Every order of n pauses' starts and ends in which each pause starts before it ends."""
    events = [(i, kind) for i in range(n) for kind in ("start", "end")]
    for order in itertools.permutations(events):
        if all(order.index((i, "start")) < order.index((i, "end")) for i in range(n)):
            yield order


def _run_order(order, initially_enabled: bool) -> list[str]:
    """Drive one thread per pause through ``order``; returns every moment GC was in the wrong state."""
    (gc.enable if initially_enabled else gc.disable)()
    n = len(order) // 2
    entered = [threading.Event() for _ in range(n)]
    release = [threading.Event() for _ in range(n)]

    def pause(i: int) -> None:
        with gc_paused():
            entered[i].set()
            release[i].wait(10)

    threads = [threading.Thread(target=pause, args=(i,)) for i in range(n)]
    active: set[int] = set()
    wrong = []
    for i, kind in order:
        if kind == "start":
            threads[i].start()
            assert entered[i].wait(10)
            active.add(i)
        else:
            release[i].set()
            threads[i].join(10)
            active.discard(i)
        expected = initially_enabled and not active
        if gc.isenabled() != expected:
            wrong.append(f"after {kind} of pause {i} (active {sorted(active)}): GC "
                         f"{'on' if gc.isenabled() else 'off'}")
    return wrong


def test_overlapping_gc_pauses_in_every_order_keep_gc_off_inside_and_restore_it_after_the_last():
    was = gc.isenabled()
    try:
        checked = 0
        for n in (2, 3):
            for order in _orders(n):
                for initially in (True, False):
                    wrong = _run_order(order, initially)
                    assert not wrong, (order, initially, wrong)
                    checked += 1
        assert checked == 2 * (6 + 90)
    finally:
        (gc.enable if was else gc.disable)()
