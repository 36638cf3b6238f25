"""Slow is not dead (P8): liveness by heartbeat, work by its own limit.

DCP follows each rank's share of the work (planning, writing, reading) with a
collective whose only deadline is the group timeout, so a rank slower than its
peers by more than that would fail the save although it is alive.  Instead, each
share ends at a barrier on the rendezvous store (hosted by global rank 0), and
DCP's collective starts only once every rank is there, completing at once.

While waiting there, peers are judged by their heartbeat: every rank publishes
(operation, inside-a-manager-call, counter) every ``timeout / 4`` for the
manager's lifetime.  A peer whose counter stops moving for ``timeout`` (by the
waiter's own monotonic clock; hosts' clocks are never compared) is dead or
frozen.  A peer idle outside the manager that has not started this operation
after ``timeout`` called the manager in another order or too late: every rank
must enter each manager call within ``timeout`` of the others (a rank arriving
after its peers gave up is told that it was the late one).  A peer whose call failed
posts that, and is named at once.  Any other peer is working: it is waited for
until ``work_timeout``.

Store calls are bounded from outside: a frozen rank 0 freezes the store, and
its calls then never return.  Keys are unique per manager and operation; each
rank deletes its own once an operation succeeded (after a failure a peer may
still read them: those few bytes die with the job's store).
"""

from __future__ import annotations

import atexit
import socket
import threading
import time
import weakref
from typing import Any, Callable

from ..errors import RankFailureError

BEATS_PER_TIMEOUT = 4
STORE_SILENT = "0 (the rendezvous store on global rank 0 does not answer: rank 0 is dead or frozen)"


class _StoreSilent(Exception):
    """The store (global rank 0) failed or stopped answering."""


def _stop_at_exit(heartbeat: "weakref.ref[Heartbeat]") -> None:
    """atexit: a manager never closed leaves its heartbeat running; stop it before the interpreter finalizes."""
    alive = heartbeat()
    if alive is not None:
        alive.stop()


class Heartbeat:
    """This process's heartbeat (one per manager), and bounded access to the store."""

    def __init__(self, store: Any, prefix: str, rank: int, ranks: list[int], timeout: float) -> None:
        self.store, self.prefix, self.rank, self.ranks, self.timeout = store, prefix, rank, ranks, timeout
        # One poll reads O(world) keys: poll less often in big worlds so the store's load stays flat.
        self.poll = min(timeout / 8, 0.05 + len(ranks) / 1000)
        self._store_down = False
        self._op, self._busy = 0, False  # the latest operation this rank started; inside a manager call?
        self._stop = threading.Event()
        self._nudge = threading.Event()
        self._publishers: list[Callable[[], None]] = []  # called on every beat (:meth:`on_beat`)
        self._thread = threading.Thread(target=self._beat, name="dcp-atomic-heartbeat", daemon=True)
        self._thread.start()
        # atexit runs after the manager's exit wait (internals.before_thread_pools_stop): a save or drain waited for
        # at exit still beats, and the thread is stopped before the interpreter finalizes.
        atexit.register(_stop_at_exit, weakref.ref(self))

    def _key(self, rank: int) -> str:
        return f"{self.prefix}/heartbeat/{rank}"

    def started(self, op: int) -> None:
        """This rank started operation ``op`` (beat at once, so waiting peers see it)."""
        self._op, self._busy = op, True
        self._nudge.set()

    def idle(self) -> None:
        """This rank's manager call returned (or raised)."""
        self._busy = False
        self._nudge.set()

    def gave_up(self, op: int) -> None:
        """Operation ``op`` failed on this rank: peers waiting for it at a barrier stop waiting."""
        self.bounded(lambda: self.store.add(f"{self.prefix}/op{op}/ended", 1), quiet=True)

    def on_beat(self, publish: Callable[[], None]) -> None:
        """Call ``publish()`` on the heartbeat thread at every beat (a shared progress counter, :mod:`.stall`): store
        writes of the hot path then cost nothing there, and at most one per beat reaches the store."""
        self._publishers.append(publish)

    def _beat(self) -> None:
        count = 0
        while not self._stop.is_set():
            count += 1
            try:
                self.store.set(self._key(self.rank), f"{self._op} {int(self._busy)} {count}")
                for publish in self._publishers:
                    publish()
            except Exception:  # the store's host is gone: the barriers say so
                pass
            self._nudge.wait(self.timeout / BEATS_PER_TIMEOUT)
            self._nudge.clear()

    def stop(self) -> None:
        """Stop beating and wait for the thread (at most ``timeout``): a daemon thread still inside a store call
        when the interpreter finalizes is ended there by force, through the C++ frame that releases the GIL, and
        the process aborts ("terminate called without an active exception") after a save that succeeded."""
        self._stop.set()
        self._nudge.set()
        if self._thread is not threading.current_thread():
            self._thread.join(self.timeout)

    def close(self) -> None:
        self.stop()
        self.bounded(lambda: self.store.delete_key(self._key(self.rank)), quiet=True)

    def bounded(self, call: Callable[[], Any], quiet: bool = False) -> Any:
        """``call()`` on a helper thread; raises _StoreSilent if it fails or takes over ``timeout``.
        ``quiet`` calls (cleanup, notices) return None instead, at once once the store has failed."""
        if quiet and self._store_down:
            return None
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = call()
            except Exception as e:  # noqa: BLE001 - any store failure means its host is unreachable
                box["error"] = e

        worker = threading.Thread(target=run, name="dcp-atomic-store-call", daemon=True)
        worker.start()
        worker.join(self.timeout)
        if "value" in box:
            return box["value"]
        self._store_down = True
        if quiet:
            return None
        raise _StoreSilent(box.get("error", f"no answer within {self.timeout:g}s"))

    def silent_peers(self) -> list[int] | None:
        """The liveness verdict after a collective failed: the ranks whose beat count does not move within
        ``timeout`` (dead or frozen; returns as soon as every peer has beaten), [] when every rank is alive, None
        when the store itself does not answer (global rank 0 is gone)."""
        try:
            first = self.bounded(self.beats)
        except _StoreSilent:
            return None
        deadline = time.monotonic() + self.timeout
        moved = {self.rank}
        while True:
            try:
                now = self.bounded(self.beats)
            except _StoreSilent:
                return None
            moved |= {rank for rank, before, after in zip(self.ranks, first, now)
                      if after is not None and after != before}
            if len(moved) == len(self.ranks) or time.monotonic() > deadline:
                return [rank for rank in self.ranks if rank not in moved]
            time.sleep(self.poll)

    def beats(self) -> list[tuple[int, int, int] | None]:
        """Every rank's latest (operation, busy, beat count); None: it has not beaten yet."""
        keys = [self._key(r) for r in self.ranks]
        if self.store.check(keys):  # multi_get would block on a missing key
            values = self.store.multi_get(keys)
        else:
            values = [self.store.get(k) if self.store.check([k]) else None for k in keys]
        return [tuple(map(int, v.split())) if v is not None else None for v in values]


class OpWatch:
    """One save's or load's barriers: ``run(phase, work)`` does this rank's share, then waits for all.

    ``verdict`` keeps the RankFailureError of a barrier: DCP's next collective
    then fails too, with a gloo error that names nobody, and the manager raises
    this instead.  Without a heartbeat (one process) ``run`` just does the work.
    """

    def __init__(self, heartbeat: Heartbeat | None, op: int, work_timeout: float, what: str) -> None:
        self.heartbeat, self.op, self.what, self.work_timeout = heartbeat, op, what, work_timeout
        self.prefix = f"{heartbeat.prefix}/op{op}" if heartbeat else ""
        self.deadline = time.monotonic() + work_timeout
        self.verdict: RankFailureError | None = None
        self._phases: list[str] = []

    def run(self, phase: str, work: Callable[[], Any]) -> Any:
        try:
            result = work()
        except BaseException:
            self.wait_all(phase, quiet=True)  # peers must not wait for this rank until work_timeout
            raise
        self.wait_all(phase)
        return result

    def wait_all(self, phase: str, quiet: bool = False) -> None:
        """Arrive at ``phase`` and wait for every rank; on a dead, frozen or overdue peer record the
        verdict and raise it (unless ``quiet``: this rank is already failing with its own error)."""
        hb = self.heartbeat
        if hb is None or phase in self._phases:
            return
        self._phases.append(phase)
        try:
            self._wait(phase)
        except RankFailureError as e:
            self.verdict = self.verdict or e
            if not quiet:
                raise

    def finish(self) -> None:
        """The operation succeeded: DCP's collectives after the barriers are done, so every rank is past
        them and this rank's keys can go (after a failure they stay: a peer may still be reading them)."""
        hb = self.heartbeat
        if hb is None:
            return
        keys = [f"{self.prefix}/{p}/{hb.rank}" for p in self._phases]
        if hb.rank == hb.ranks[0]:
            keys += [f"{self.prefix}/{p}/count" for p in self._phases]
        hb.bounded(lambda: [hb.store.delete_key(k) for k in keys], quiet=True)

    def _wait(self, phase: str) -> None:
        hb = self.heartbeat
        base = f"{self.prefix}/{phase}"
        world = len(hb.ranks)
        abandoned = f"{base}/abandoned"

        def arrive() -> str | None:
            hb.store.set(f"{base}/{hb.rank}", "1")
            hb.store.add(f"{base}/count", 1)
            return hb.store.get(abandoned).decode() if hb.store.check([abandoned]) else None

        try:
            gave_up = hb.bounded(arrive)
            if gave_up:
                raise self._failure(
                    f"none (rank {hb.rank} itself arrived late)",
                    f"rank {hb.rank} reached the {phase} phase after rank(s) {gave_up} had stopped waiting for it: "
                    f"it entered this call more than timeout={hb.timeout:g}s after them, or its work outlasted "
                    "work_timeout (every rank must enter each manager call within timeout of the others)")
            started = time.monotonic()
            last: dict[int, tuple[tuple[int, int, int] | None, float]] = {r: (None, started) for r in hb.ranks}
            # since when each peer has been seen idle outside this operation, without a break: a rank between
            # two calls (its save returned, its load not yet begun) is idle for an instant, never for timeout
            idle_since: dict[int, float] = {}
            while True:  # "ended" is only checked: adding 0 would create one key per operation, forever
                arrived, ended, beats = hb.bounded(
                    lambda: (hb.store.add(f"{base}/count", 0), hb.store.check([f"{self.prefix}/ended"]), hb.beats()))
                if arrived >= world:
                    return
                now = time.monotonic()
                for r, beat in zip(hb.ranks, beats):
                    if beat != last[r][0]:
                        last[r] = (beat, now)
                    if r != hb.rank and self._idle_before(beat):
                        idle_since.setdefault(r, now)
                    else:
                        idle_since.pop(r, None)
                silent = [r for r in hb.ranks if r != hb.rank and now - last[r][1] > hb.timeout]
                if silent:
                    names = _names(silent)
                    self._give_up(abandoned)
                    raise self._failure(names, f"no heartbeat from rank(s) {names} for {hb.timeout:g}s "
                                               "(dead or frozen)")
                elsewhere = [r for r, since in sorted(idle_since.items()) if now - since > hb.timeout]
                if elsewhere:
                    names = _names(elsewhere)
                    self._give_up(abandoned)
                    raise self._failure(
                        f"{names} (alive, but it did not start this operation within {hb.timeout:g}s)",
                        f"rank(s) {names} did not start this operation (every rank must enter each manager call "
                        "within timeout of the others, in the same order)")
                missing = self._missing(base) if ended or now > self.deadline else ""
                if missing and ended:
                    raise self._failure(f"{missing} (it left the operation before the {phase} phase ended)",
                                        f"rank(s) {missing} gave up during the {phase} phase")
                if missing:
                    self._give_up(abandoned)
                    raise self._failure(
                        f"{missing} (alive, but its {phase} work did not finish within work_timeout="
                        f"{self.work_timeout:g}s)",
                        f"rank(s) {missing} still busy after work_timeout={self.work_timeout:g}s "
                        "(a hung filesystem? raise work_timeout if the storage is just slow)")
                time.sleep(hb.poll)
        except _StoreSilent as e:
            raise self._failure(STORE_SILENT, f"the rendezvous store did not answer ({e})") from None

    def _give_up(self, abandoned: str) -> None:
        """Leave word that this rank stopped waiting, so a rank that arrives later knows it was the late one
        (the peer it would otherwise blame has left the collective that follows)."""
        hb = self.heartbeat
        hb.bounded(lambda: hb.store.set(abandoned, str(hb.rank)), quiet=True)

    def _idle_before(self, beat: tuple[int, int, int] | None) -> bool:
        """Outside any manager call, and this operation not started (a call still running, say rank 0's
        retention after the previous save, is work: it is waited for)."""
        op, busy, _ = beat or (0, 0, 0)
        return op < self.op and not busy

    def _missing(self, base: str) -> str:
        hb = self.heartbeat
        here = hb.bounded(lambda: [r for r in hb.ranks if hb.store.check([f"{base}/{r}"])])
        return _names(r for r in hb.ranks if r not in here)

    def _failure(self, silent: str, cause: str) -> RankFailureError:
        return RankFailureError(
            f"{self.what}: {cause}; seen by rank {self.heartbeat.rank} on {socket.gethostname()}; silent rank(s): "
            f"{silent}. Nothing new is committed unless the step's marker names this save; restart the job and "
            "resume from the latest committed step.",
            rank=self.heartbeat.rank,
            silent=silent,
        )


def _names(ranks) -> str:
    return ", ".join(map(str, ranks))
