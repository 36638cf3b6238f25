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
  rank 0 claims ``commit`` the same way just before it creates a durable marker, and once the marker is written
  leaves the step's name in the cell (``committed:<key>``), never an empty cell: a waiter that looked before the
  marker and claims after it finds the cell changed, and its claim fails.  Whoever is first wins.  After ``stalled``, this job writes
  no marker of the step (rank 0 sees the claim and abandons it), so every rank can say "not durable" and mean it.
  After ``commit``, the marker is being written: waiters give it one more stall period, then say "unknown"
  (``dcp-atomic ls`` tells); a cell naming the step a waiter waits for says it is durable, and the waiter gives rank
  0 one more period to hand out the outcome, then says "durable".  A store that does not answer (global rank 0 dead
  or frozen) is "unknown" too, said as soon as one read of the counter went unanswered for the store's bound (the
  manager's timeout, which is the stall deadline): never a second wait for the store.

A world of one (or a manager without a store) keeps the same rules in process memory.
"""

from __future__ import annotations

import threading
import time

from .liveness import Heartbeat, _StoreSilent

STALLED, COMMIT, UNKNOWN, SILENT, DURABLE = "stalled", "commit", "unknown", "silent", "durable"


def committed(key: str) -> str:
    """The verdict cell once rank 0 committed the job ``key`` names (``StallClock.commit_done``)."""
    return f"committed:{key}"


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
        self._silent = False  # the counter's last read went unanswered
        self._commit_since: float | None = None  # when this waiter found rank 0 writing (or done writing) the marker
        self._cell = ""  # global rank 0: what it last left in the verdict cell (only it writes anything but STALLED)
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
        self._silent = total is None
        if total is not None and total != self._seen_total:
            self._seen_total, self._seen_at = total, now
        if isinstance(self._board, _LocalBoard):
            self._publish()
        return now - max(self._own_at, self._seen_at)

    def check(self, waiting_for: str | None = None) -> str | None:
        """The waiter's verdict, or None to go on waiting: :data:`STALLED` (claimed: no marker follows),
        :data:`UNKNOWN` (rank 0 was writing the marker and did not finish within one more stall period),
        :data:`DURABLE` (rank 0 committed ``waiting_for``, the key of the job this rank waits for, and did not hand
        out the outcome within one more period) or :data:`SILENT` (the store, hosted by global rank 0, does not
        answer)."""
        if self.stall is None:
            return None
        quiet = self.quiet()
        if self._silent:  # unanswered for the store's whole bound (the manager's timeout, this deadline): no 2nd wait
            return SILENT
        if quiet < self.stall:
            return None
        cell = self._board.compare_set("", "")  # reads the cell
        if cell is None:
            return SILENT
        done = waiting_for is not None and cell == committed(waiting_for)
        if cell == COMMIT or done:
            if self._commit_since is None:
                self._commit_since = time.monotonic()
                return None
            if time.monotonic() - self._commit_since < self.stall:
                return None
            return DURABLE if done else UNKNOWN
        if self._commit_since is not None:  # rank 0's commit failed: the outcome is on its way
            self._commit_since = None
            self._seen_at = time.monotonic()
            return None
        claimed = self._board.compare_set(cell, STALLED)  # fails if rank 0 claimed, or committed, since the read
        if claimed is None:
            return SILENT
        if claimed == STALLED:
            return STALLED
        self._commit_since = time.monotonic()  # rank 0 is writing a marker, or just wrote one: one more period
        return None

    def claim_commit(self) -> bool:
        """Global rank 0, before the irrevocable write: False when a waiter already declared the drain stalled."""
        claimed = self._board.compare_set(self._cell, COMMIT)
        return claimed is None or claimed == COMMIT  # a silent store: no waiter could have claimed either

    def commit_done(self, key: str | None) -> None:
        """Global rank 0, after the write: ``key`` names the job committed (None: it failed).  Waiters that find
        their job named know it is durable; the others go back to the clock."""
        if key is not None:
            self._cell = committed(key)
        self._board.compare_set(COMMIT, self._cell)

    def declared_stalled(self) -> bool:
        """Whether a waiter claimed the verdict ``stalled`` (then no new round may start: drains stopped)."""
        return self._board.compare_set("", "") == STALLED
