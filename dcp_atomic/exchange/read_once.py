"""Read once, share with peers: who reads which stored item, and moving its bytes between ranks.

When several ranks need overlapping parts of one stored item (data-parallel
replicas, HSDP's ``dp_replicate``, replicated norms and objects), each of them
reading it from storage multiplies restore traffic by the replica count.  The
load coordinator sees every rank's read plan, so it assigns each such item to
one of the ranks that need it (balanced by bytes across ranks, then hosts); that
rank reads and verifies it, and sends the stored bytes, unchanged, to the others
over the process group.  Receivers verify what they got against the same block
digests before decoding it (the reader does that: this module never trusts or
interprets bytes).  Stored bytes travel, not decoded tensors: compressed items
cross the network compressed and every receiver can verify them.

Work is cut into rounds so that a rank holds at most ``budget`` bytes of fetched
plus received items at once (a single larger item is a round of its own).  Each
round ends with a status collective before any byte moves, so a rank whose
storage read failed never leaves its peers waiting for bytes that will not come;
one more status after the last round tells every rank how the exchange ended.

A peer that dies or freezes breaks the group: gloo's error names an address, or
only a timeout.  Each rank that sees the exchange break checks in on the
rendezvous store, with the peer whose connection failed if it knows one, and
waits (bounded) for the others; the error then names the ranks that peers saw
fail, else those that never checked in (:meth:`PeerLink.lost`).  That error must
reach the caller of plain ``dcp.load`` typed, although DCP's next step gathers
every rank's outcome over the same broken group.  DCP pickles that outcome
before it sends a byte, so ``read_data`` raises a :class:`PastTheGather` carrier
whose pickling raises the :class:`PeerLost` it carries: ``dcp.load`` raises the
typed error on this rank at once.  PeerLost itself pickles like every error.
"""

from __future__ import annotations

import datetime
import itertools
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Hashable, Sequence

import torch
import torch.distributed as dist

from ..errors import RankFailureError, shorten

Ident = Hashable  # a stored item's identity: (key, chunk offset)


@dataclass(frozen=True)
class Need:
    """One rank's read of (part of) one stored item: the box it reads, in the stored chunk's coordinates."""

    rank: int
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]


@dataclass
class Round:
    """One rank's share of one exchange round.

    ``fetch`` is what this rank reads from storage, in the order of its round
    buffer; ``sends`` are (receiver, first, stop, tag) slices of ``fetch`` sent
    as one message each; ``receives`` are (sender, idents, tag), one message each.
    """

    fetch: list[Ident] = field(default_factory=list)
    sends: list[tuple[int, int, int, int]] = field(default_factory=list)
    receives: list[tuple[int, list[Ident], int]] = field(default_factory=list)


@dataclass
class SharePlan:
    """One rank's whole exchange schedule (the same number of rounds on every rank)."""

    rounds: list[Round]
    hosts: list[str]  # per rank, to name a sender

    @property
    def idents(self) -> set[Ident]:
        """Every item this rank gets through the exchange (read for peers, or received)."""
        got = {i for r in self.rounds for i in r.fetch}
        got.update(i for r in self.rounds for _, idents, _ in r.receives for i in idents)
        return got


def plan_exchange(needs: dict[Ident, list[Need]], lengths: dict[Ident, int], hosts: Sequence[str],
                  budget: int) -> list[SharePlan] | None:
    """Every rank's schedule, or None when no stored item is read by more than one rank.

    An item is shared when at least two ranks read overlapping parts of it;
    ranks reading disjoint parts (a reshard along dim 0) read their own parts
    directly, which already costs storage each byte once.
    """
    world = len(hosts)
    shared: dict[Ident, list[int]] = {}
    load = [0] * world  # bytes each rank reads from storage
    for ident, reads in needs.items():
        ranks = sorted({n.rank for n in reads})
        if len(ranks) > 1 and lengths[ident] > 0 and _overlapping(reads):
            shared[ident] = ranks
        else:
            for r in ranks:
                load[r] += lengths[ident]
    if not shared:
        return None
    host_load: dict[str, int] = {}
    sender: dict[Ident, int] = {}
    for ident in sorted(shared, key=lambda i: -lengths[i]):
        best = min(shared[ident], key=lambda r: (load[r], host_load.get(hosts[r], 0), r))
        sender[ident] = best
        load[best] += lengths[ident]
        host_load[hosts[best]] = host_load.get(hosts[best], 0) + lengths[ident]
    rounds = _pack_rounds(shared, sender, lengths, world, budget)
    plans = [SharePlan([Round() for _ in rounds], list(hosts)) for _ in range(world)]
    for n, members in enumerate(rounds):
        tag = itertools.count()
        for rank in range(world):
            # Items with one receiver set lie back to back, so each receiver gets a few messages, not one per item.
            mine = sorted((i for i in members if sender[i] == rank),
                          key=lambda i: (tuple(shared[i]), repr(i)))
            plans[rank].rounds[n].fetch = mine
            for receivers, group in itertools.groupby(enumerate(mine), key=lambda p: tuple(shared[p[1]])):
                group = list(group)
                first, stop = group[0][0], group[-1][0] + 1
                for receiver in receivers:
                    if receiver == rank:
                        continue
                    t = next(tag)
                    plans[rank].rounds[n].sends.append((receiver, first, stop, t))
                    plans[receiver].rounds[n].receives.append((rank, [i for _, i in group], t))
    return plans


def _overlapping(reads: list[Need]) -> bool:
    """Whether two ranks read intersecting parts of one item (one rank reading a part twice does not count)."""
    readers: dict[tuple, set[int]] = {}
    for n in reads:
        readers.setdefault((n.offsets, n.lengths), set()).add(n.rank)
    if any(len(ranks) > 1 for ranks in readers.values()):  # replicas: the usual case, O(n)
        return True
    ordered = sorted(reads, key=lambda n: n.offsets)
    # Exact pairwise for a few readers; for many, neighbours in offset order (a box that meets only a
    # non-neighbour is then read directly: correct, just not shared).
    pairs = itertools.combinations(ordered, 2) if len(ordered) <= 64 else zip(ordered, ordered[1:])
    return any(a.rank != b.rank and all(ao < bo + bl and bo < ao + al
                                        for ao, al, bo, bl in zip(a.offsets, a.lengths, b.offsets, b.lengths))
               for a, b in pairs)


def _pack_rounds(shared: dict[Ident, list[int]], sender: dict[Ident, int], lengths: dict[Ident, int], world: int,
                 budget: int) -> list[list[Ident]]:
    """Shared items cut into rounds in which no rank holds more than ``budget`` bytes.

    Senders are interleaved (round robin over their items) so that every round
    has every sender reading: rounds run their storage reads in parallel.
    """
    queues: dict[int, list[Ident]] = {}
    for ident in sorted(shared, key=repr):
        queues.setdefault(sender[ident], []).append(ident)
    order = [i for batch in itertools.zip_longest(*queues.values()) for i in batch if i is not None]
    rounds: list[list[Ident]] = [[]]
    held = [0] * world
    for ident in order:
        size = lengths[ident]
        if rounds[-1] and any(held[r] + size > budget for r in shared[ident]):
            rounds.append([])
            held = [0] * world
        rounds[-1].append(ident)
        for r in shared[ident]:
            held[r] += size
    return rounds


class PeerError(Exception):
    """The exchange with ``peer`` (None: some peer, in a collective) failed on this rank; :meth:`PeerLink.lost`
    turns it into the RankFailureError that names who is gone."""

    def __init__(self, peer: int | None, cause: str) -> None:
        super().__init__(cause)
        self.peer, self.cause = peer, cause


class PeerLost(RankFailureError):
    """A peer died, froze or lost its connection during a shared read; names the silent ranks."""


class PastTheGather(Exception):
    """Carries a :class:`PeerLost` out of ``read_data`` (the reader raises it; nothing else does).

    DCP gathers ``read_data``'s outcome over the group the exchange just found
    broken: the gather would fail with gloo's untyped error (after waiting out the
    group timeout if a peer is frozen) and drop the typed one.  DCP pickles the
    outcome before sending anything, and this carrier's pickling raises the error
    it carries, so ``dcp.load`` raises the PeerLost on this rank, at once.
    """

    def __init__(self, error: PeerLost) -> None:
        super().__init__(str(error))
        self.error = error

    def __reduce__(self):
        raise self.error


class PeerLink:
    """Moves round buffers between the ranks of one process group.

    On NCCL the bytes travel as device tensors (one host-to-device copy of a
    sender's round buffer, one device-to-host copy per received message for
    verification on the host); on gloo they stay on the host.  ``exchange_id``
    (the same on every rank) names this exchange's keys on the rendezvous store.
    """

    def __init__(self, group: dist.ProcessGroup | None, timeout: float, exchange_id: str = "") -> None:
        self.group = group
        self.timeout = datetime.timedelta(seconds=timeout)
        self.exchange_id = exchange_id
        self.rank = dist.get_rank(group)
        backend = dist.get_backend(group)
        self.device = (torch.device("cuda", torch.cuda.current_device()) if backend == "nccl"
                       else torch.device("cpu"))

    def failed_ranks(self, failed: bool, what: str) -> list[int]:
        """Every rank says whether its share of this round failed; all learn who did."""
        flags = torch.zeros(dist.get_world_size(self.group), dtype=torch.int32, device=self.device)
        flags[self.rank] = int(failed)
        self._wait([(None, self._issue(None, lambda: dist.all_reduce(flags, group=self.group, async_op=True)))],
                   what, timeout=None)
        return [r for r, flag in enumerate(flags.tolist()) if flag]

    def post(self, buffer: torch.Tensor, sends: list[tuple[int, int, int, int]], offsets: list[int],
             receives: list[tuple[int, int, int]], what: str) -> "Transfer":
        """Start sending slices of ``buffer`` (``offsets`` are item starts in it, plus its end) and receiving
        messages of (sender, nbytes, tag); the caller works meanwhile, then calls ``Transfer.wait``."""
        device_buffer = buffer.to(self.device) if sends and self.device.type != "cpu" else buffer
        works = []
        inbox = [torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _, nbytes, _ in receives]
        for (sender, _, tag), message in zip(receives, inbox):
            works.append((sender, self._issue(sender, lambda m=message, s=sender, t=tag: dist.irecv(
                m, group=self.group, group_src=s, tag=t))))
        for receiver, first, stop, tag in sends:
            piece = device_buffer[offsets[first]:offsets[stop]]
            works.append((receiver, self._issue(receiver, lambda p=piece, r=receiver, t=tag: dist.isend(
                p, group=self.group, group_dst=r, tag=t))))
        return Transfer(self, works, inbox, what)

    @staticmethod
    def _issue(peer: int | None, start):
        """Start one operation: a connection a dead peer already closed fails here, at once, not in ``wait``."""
        try:
            return start()
        except Exception as e:
            raise PeerError(peer, f"{type(e).__name__}: {shorten(str(e).strip(), 300)}") from None

    def _wait(self, works: list, what: str, timeout: datetime.timedelta | None) -> None:
        for peer, work in works:
            try:
                work.wait() if timeout is None else work.wait(timeout)
            except Exception as e:  # a dead peer closes its connections: gloo / NCCL errors name nobody
                raise PeerError(peer, f"{type(e).__name__}: {shorten(str(e).strip(), 300)}") from None

    def lost(self, error: PeerError, what: str) -> PeerLost:
        """Check in on the rendezvous store with what this rank saw, wait (at most ``timeout``) for the other
        ranks, and name the gone ones: those whose connection a rank saw fail, else those that never checked
        in.  The store lives on global rank 0: if it does not answer, rank 0 is the one gone."""
        world = dist.get_world_size(self.group)
        prefix = f"dcp_atomic/exchange/{self.exchange_id}"
        seen: dict[int, str] = {}

        def check_in() -> None:
            store = dist.distributed_c10d._get_default_store()
            store.set(f"{prefix}/{self.rank}", "" if error.peer is None else str(error.peer))
            deadline = time.monotonic() + self.timeout.total_seconds()
            while True:
                keys = {r: f"{prefix}/{r}" for r in range(world)}
                seen.update({r: store.get(k).decode() for r, k in keys.items() if r not in seen and store.check([k])})
                suspects = {int(s) for s in seen.values() if s}
                if set(seen) | suspects >= set(range(world)) or time.monotonic() > deadline:
                    return
                time.sleep(0.05)

        worker = threading.Thread(target=check_in, name="dcp-atomic-exchange-blame", daemon=True)
        worker.start()  # a frozen rank 0 freezes its store, and store calls then never return: bounded here
        worker.join(self.timeout.total_seconds() + 2.0)
        def named(ranks) -> str:  # global ranks, whatever group the exchange runs on
            return ", ".join(str(r if self.group is None else dist.get_global_rank(self.group, r)) for r in ranks)

        suspects = sorted({int(s) for s in dict(seen).values() if s})
        if worker.is_alive() or self.rank not in seen:
            silent, how = "0", "the rendezvous store on global rank 0 does not answer: rank 0 is dead or frozen"
        elif suspects:
            silent, how = named(suspects), "peers saw their connection to it fail"
        else:
            missing = [r for r in range(world) if r not in seen]
            silent = named(missing) or "unknown"
            how = (f"it did not check in within {self.timeout.total_seconds():g}s" if missing
                   else "every rank checked in: a transient network failure?")
        whom = "a peer" if error.peer is None else f"rank {named([error.peer])}"
        return PeerLost(
            f"{what}: the exchange with {whom} failed on rank {self.rank} ({socket.gethostname()}): {error.cause}. "
            f"Silent rank(s): {silent} ({how}). A peer died, froze or lost its connection during a shared read; "
            "nothing was loaded on this rank. Restart the job and load again.",
            rank=self.rank, silent=silent,
        )


@dataclass
class Transfer:
    """One round's messages in flight."""

    link: PeerLink
    works: list
    inbox: list[torch.Tensor]
    what: str

    def wait(self) -> list[torch.Tensor]:
        """Every send and receive done; the received messages as host tensors, in the order posted."""
        self.link._wait(self.works, self.what, timeout=self.link.timeout)
        return [m if m.device.type == "cpu" else m.cpu() for m in self.inbox]


def round_layout(idents: list[Ident], lengths: dict[Ident, int]) -> list[int]:
    """Start of each item in a round buffer, plus the buffer's end."""
    return list(itertools.accumulate((lengths[i] for i in idents), initial=0))

