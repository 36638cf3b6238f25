"""Where the local tier's replicas go: which ranks hold a copy of each rank's files.

A node-local save survives the loss of a node only if each rank's files also lie on other nodes.  Nodes fail
together with their power, switch or rack, so a copy on another node of the same failure domain protects
nothing: each rank's ``replicas`` copies go to ranks of *other* domains, never two to one domain (P13, "losing
fewer failure domains than there are copies never loses a local-committed step").

The copies are also spread: a rank that holds more copies than the others writes more bytes, on a disk that is
also its node's, and the slowest holder sets the time to local-committed.  Ranks are lined up domain by domain
(domains in order of their first rank) and copy ``k`` of the rank at position ``i`` goes to position
``i + k*m`` (mod the world size), ``m`` being the largest domain's size.  A domain is a run of at most ``m``
positions, so when ``(replicas + 1) * m <= world size`` the ``replicas + 1`` positions ``i, i+m, ...`` fall into
distinct domains, and each shift is a permutation: *every rank holds exactly ``replicas`` copies*, whatever the
domains' sizes.  Otherwise (a domain holding too many of the ranks, say 3+2+1 ranks with two replicas) no even
placement exists: the ranks outside the widest domain would hold at least ``replicas*m + (replicas-1)*(n-m)``
copies, more than their even share.  Each copy then goes, greedily and the widest domain's ranks first, to the
least-loaded rank of a domain the rank may still use (the nearest domain in a fixed cyclic order on ties): inside
every domain the copies held differ by at most one, and the busiest rank holds the least possible number in all
but 2 of the 594 layouts of up to 9 ranks (checked against a max-flow; one copy more in those two).
Either way the placement is a pure function of every rank's domain, so every rank computes the same one without
a collective beyond learning the domains.

Fewer domains than ``replicas + 1`` cannot keep the promise and is refused when the manager starts.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from .._base import arguments
from ..errors import ConfigurationError

FAILURE_DOMAIN_ENV = "DCP_ATOMIC_FAILURE_DOMAIN"


def failure_domain(explicit: str | None = None) -> str:
    """This process's failure domain: ``explicit``, else ``$DCP_ATOMIC_FAILURE_DOMAIN``, else the host name."""
    domain = explicit or os.environ.get(FAILURE_DOMAIN_ENV) or socket.gethostname()
    if not isinstance(domain, str) or not domain.strip():
        raise ConfigurationError(f"failure_domain must be a non-empty string, got {domain!r}")
    return domain


@dataclass(frozen=True)
class Placement:
    """``domains[r]``: rank r's failure domain; ``holders[r]``: the ranks that keep a copy of rank r's files."""

    domains: tuple[str, ...]
    holders: tuple[tuple[int, ...], ...]

    def held_by(self, rank: int) -> list[int]:
        """The ranks whose files ``rank`` keeps a copy of."""
        return [source for source, holders in enumerate(self.holders) if rank in holders]


def place_replicas(domains: list[str], replicas: int) -> Placement:
    """Each rank's ``replicas`` holders, on distinct domains other than its own, spread evenly (see module doc)."""
    arguments.count("replicas", replicas, minimum=0, optional=False)
    order: list[str] = []  # domains in order of their first rank: the same on every rank
    members: dict[str, list[int]] = {}
    for rank, domain in enumerate(domains):
        if domain not in members:
            order.append(domain)
            members[domain] = []
        members[domain].append(rank)
    if len(order) < replicas + 1:
        listed = ", ".join(f"{d!r} (ranks {_ranks(members[d])})" for d in order)
        raise ConfigurationError(
            f"replicas={replicas} needs at least {replicas + 1} failure domains (one for each rank's own files and "
            f"one per copy), but the {len(domains)} rank(s) span {len(order)}: {listed}. Set failure_domain= (or "
            f"$DCP_ATOMIC_FAILURE_DOMAIN) to each node's real domain, or lower replicas.",
            replicas=replicas, domains=order)
    lined_up = [rank for domain in order for rank in members[domain]]
    widest = max((len(ranks) for ranks in members.values()), default=0)
    if (replicas + 1) * widest <= len(domains):
        position = {rank: i for i, rank in enumerate(lined_up)}
        holders = [tuple(lined_up[(position[rank] + k * widest) % len(domains)] for k in range(1, replicas + 1))
                   for rank in range(len(domains))]
    else:
        holders = _least_loaded(domains, order, members, lined_up, replicas)
    return Placement(domains=tuple(domains), holders=tuple(holders))


def _least_loaded(domains: list[str], order: list[str], members: dict[str, list[int]], lined_up: list[int],
                  replicas: int) -> list[tuple[int, ...]]:
    """Each copy, in line order, to the least-loaded rank of a domain the rank may use (the nearest domain after
    its own on ties): used when no even placement exists."""
    load = [0] * len(domains)
    index = {domain: i for i, domain in enumerate(order)}
    holders: list[tuple[int, ...]] = [()] * len(domains)
    for rank in sorted(lined_up, key=lambda r: -len(members[domains[r]])):  # the most constrained first
        own = index[domains[rank]]
        used = {own}
        chosen = []
        for _ in range(replicas):
            holder = min((r for d in range(len(order)) if d not in used for r in members[order[d]]),
                         key=lambda r: (load[r], (index[domains[r]] - own) % len(order), r))
            load[holder] += 1
            used.add(index[domains[holder]])
            chosen.append(holder)
        holders[rank] = tuple(chosen)
    return holders


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (f", ... ({len(ranks)})" if len(ranks) > 8 else "")
