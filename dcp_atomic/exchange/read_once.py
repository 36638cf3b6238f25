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

The bytes move over the one transport (:class:`.transport.PeerLink`); a peer lost during the exchange is its
typed :class:`.transport.PeerLost`, which ``dcp.load`` raises as is (:class:`.transport.PastTheGather`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Hashable, Sequence

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


def round_layout(idents: list[Ident], lengths: dict[Ident, int]) -> list[int]:
    """Start of each item in a round buffer, plus the buffer's end."""
    return list(itertools.accumulate((lengths[i] for i in idents), initial=0))

