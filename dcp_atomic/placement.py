"""Where the local tier's replicas go: which ranks hold a copy of each rank's files.

A node-local save survives the loss of a node only if each rank's files also lie on other nodes.  Nodes fail
together with their power, switch or rack, so a copy on another node of the same failure domain protects
nothing: each rank's ``replicas`` copies go to ranks of *other* domains, never two to one domain (P13, "losing
fewer failure domains than there are copies never loses a local-committed step").  Copy ``k`` of a rank in
domain ``d`` goes to the ``k``-th domain after ``d`` in a fixed cyclic order, and inside that domain to the rank
holding the fewest copies so far, so the bytes each rank receives stay even.  The placement is a pure function of
every rank's domain, so every rank computes the same one without a collective beyond learning the domains.

Fewer domains than ``replicas + 1`` cannot keep the promise and is refused when the manager starts.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from .errors import ConfigurationError

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
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
        raise ConfigurationError(f"replicas must be a non-negative int, got {replicas!r}")
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
    load = {rank: 0 for rank in range(len(domains))}
    holders: list[tuple[int, ...]] = []
    for rank, domain in enumerate(domains):
        position = order.index(domain)
        chosen = []
        for k in range(1, replicas + 1):
            target = members[order[(position + k) % len(order)]]
            holder = min(target, key=lambda r: (load[r], r))
            load[holder] += 1
            chosen.append(holder)
        holders.append(tuple(chosen))
    return Placement(domains=tuple(domains), holders=tuple(holders))


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (f", ... ({len(ranks)})" if len(ranks) > 8 else "")
