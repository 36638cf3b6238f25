"""One stall clock and one verdict for background work that every rank shares (P8, the drain of P13).

The drain runs on every rank: each uploads its share and then waits in a collective for the others, and global
rank 0 commits at the end.  A stall deadline that each rank measures on its own I/O alone is kept only by the ranks
doing I/O: a rank waiting in a collective for a peer whose store hangs waits for the group's timeout (hours), and a
rank 0 whose commit is slow gives up and calls the step "not durable" while its peers, told the outcome later, say
"ok".  So both the clock and the verdict are shared, through the rendezvous store (a channel that works while
collectives hang; :mod:`.liveness` keeps the heartbeat there):

* **Progress is one counter.**  Every rank's progress (a piece uploaded, a phase of the round passed, the commit
  started) is counted locally and added to one key by the heartbeat thread, once per beat when it moved; a waiter
  reads that one key (O(1) per poll, whatever the world).  Every rank thus measures the same thing: when the whole
  drain last moved, by its own monotonic clock (hosts' clocks are never compared).
* **The verdict is claimed once.**  A waiter whose clock runs out claims ``stalled`` with one compare-and-set; global
  rank 0 claims ``commit`` the same way just before it creates a durable marker, and clears it after.  Whoever is
  first wins.  After ``stalled``, this job writes no marker of the step (rank 0 sees the claim and abandons it), so
  every rank can say "not durable" and mean it.  After ``commit``, the marker is being written: waiters give it one
  more stall period, then say "unknown" (``dcp-atomic ls`` tells).  A store that does not answer (global rank 0 dead
  or frozen) is "unknown" too.

A world of one (or a manager without a store) keeps the same rules in process memory.
"""

from __future__ import annotations

import threading
import time

from .liveness import Heartbeat, _StoreSilent

STALLED, COMMIT, UNKNOWN, SILENT = "stalled", "commit", "unknown", "silent"


class _LocalBoard:
    """The counter and the verdict cell of one process (a world of one)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total = 0
        self._verdict = ""

    def add(self, n: int) -> None:
        with self._lock:
            self._total += n

    def total(self) -> int | None:
        return self._total

    def compare_set(self, expected: str, desired: str) -> str | None:
        with self._lock:
            if self._verdict == expected:
                self._verdict = desired
            return self._verdict


class _StoreBoard:
    """The counter and the verdict cell on the rendezvous store; every call bounded (a frozen rank 0 freezes it)."""

    def __init__(self, heartbeat: Heartbeat, name: str) -> None:
        self.heartbeat = heartbeat
        self.counter = f"{heartbeat.prefix}/{name}/progress"
        self.verdict = f"{heartbeat.prefix}/{name}/verdict"

    def add(self, n: int) -> None:  # on the heartbeat thread: a failure is the waiters' to notice
        self.heartbeat.store.add(self.counter, n)

    def total(self) -> int | None:
        try:
            return int(self.heartbeat.bounded(lambda: self.heartbeat.store.add(self.counter, 0)))
        except _StoreSilent:
            return None

    def compare_set(self, expected: str, desired: str) -> str | None:
        store = self.heartbeat.store
        try:
            value = self.heartbeat.bounded(lambda: store.compare_set(self.verdict, expected, desired))
        except _StoreSilent:
            return None
        return value.decode() if isinstance(value, bytes) else str(value)


class StallClock:
    """The stall deadline of one background activity, measured alike on every rank (module doc).

    ``tick()`` wherever this rank makes progress; ``check()`` from the waiter, every poll, outside any lock that the
    working thread takes (it may wait up to the store's bound); ``claim_commit()`` / ``commit_done()`` around the one
    irrevocable write."""

    def __init__(self, stall: float | None, heartbeat: Heartbeat | None = None, name: str = "drain") -> None:
        self.stall = stall
        self._board = _StoreBoard(heartbeat, name) if heartbeat is not None else _LocalBoard()
        self._mine = 0  # this rank's ticks, and how many of them the board has
        self._published = 0
        self._own_at = time.monotonic()  # this rank's last tick
        self._seen_total: int | None = None
        self._seen_at = self._own_at  # when this rank last saw the shared counter move (or began to look)
        self._commit_since: float | None = None  # when this waiter found rank 0 writing the marker
        if heartbeat is not None:
            heartbeat.on_beat(self._publish)

    def tick(self) -> None:
        """This rank made progress (any thread; cheap: the heartbeat publishes it)."""
        self._mine += 1
        self._own_at = time.monotonic()

    def _publish(self) -> None:
        mine = self._mine
        if mine != self._published:
            self._board.add(mine - self._published)
            self._published = mine

    def start_waiting(self) -> None:
        """A waiter begins: its clock starts now at the latest (a drain that was idle has not stalled)."""
        self._seen_at = max(self._seen_at, time.monotonic())
        self._commit_since = None

    def quiet(self) -> float:
        """Seconds since any rank's progress, as this rank knows it (reads the shared counter)."""
        total = self._board.total()
        now = time.monotonic()
        if total is not None and total != self._seen_total:
            self._seen_total, self._seen_at = total, now
        if isinstance(self._board, _LocalBoard):
            self._publish()
        return now - max(self._own_at, self._seen_at)

    def check(self) -> str | None:
        """The waiter's verdict, or None to go on waiting: :data:`STALLED` (claimed: no marker follows),
        :data:`UNKNOWN` (rank 0 was writing the marker and did not finish within one more stall period) or
        :data:`SILENT` (the store, hosted by global rank 0, does not answer)."""
        if self.stall is None:
            return None
        if self.quiet() < self.stall:
            return None
        if self._commit_since is not None:
            claimed = self._board.compare_set("", "")  # reads the cell
            if claimed is None:
                return SILENT
            if claimed != COMMIT:  # rank 0 finished writing the marker: the outcome is on its way
                self._commit_since = None
                self._seen_at = time.monotonic()
                return None
            return UNKNOWN if time.monotonic() - self._commit_since >= self.stall else None
        claimed = self._board.compare_set("", STALLED)
        if claimed is None:
            return SILENT
        if claimed == COMMIT:
            self._commit_since = time.monotonic()
            return None
        return STALLED

    def claim_commit(self) -> bool:
        """Global rank 0, before the irrevocable write: False when a waiter already declared the drain stalled."""
        claimed = self._board.compare_set("", COMMIT)
        return claimed is None or claimed == COMMIT  # a silent store: no waiter could have claimed either

    def commit_done(self) -> None:
        """Global rank 0, after the write (done or failed): waiters go back to the clock."""
        self._board.compare_set(COMMIT, "")

    def declared_stalled(self) -> bool:
        """Whether a waiter claimed the verdict ``stalled`` (then no new round may start: drains stopped)."""
        return self._board.compare_set("", "") == STALLED
