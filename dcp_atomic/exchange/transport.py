"""The one rank-to-rank transport: bytes between ranks of a process group, and a typed error naming who is gone.

Read once (:mod:`.read_once`: one rank reads a shared item and sends its stored bytes to the others) and file
streams (:mod:`.file_transfer`: the local tier's replicas and restores) both move bytes with :class:`PeerLink`:
every send and receive of a round is posted before any is waited for, on NCCL through device tensors, and a
failure of any of them is a :class:`PeerError` naming the peer whose connection failed.  Neither trusts what
arrives: the receiver verifies it against the sender's block digests before it is used or kept.

A peer that dies or freezes breaks the group: gloo's error names an address, or only a timeout.  Each rank that
sees the exchange break checks in on the rendezvous store, with the peer whose connection failed if it knows one,
and waits (bounded) for the others; :meth:`PeerLink.lost` then names the ranks that peers saw fail, else those
that never checked in, in a :class:`PeerLost`.  A caller that gets it must not run another collective on the
group (it would wait out the group's timeout and end in gloo's untyped error): it raises the PeerLost.  Inside
``dcp.load`` that is not in the caller's hands, because DCP gathers ``read_data``'s outcome over the broken group;
:class:`PastTheGather` carries the error past that gather.
"""

from __future__ import annotations

import datetime
import socket
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..errors import RankFailureError, shorten
from .._base import internals


class PeerError(Exception):
    """The exchange with ``peer`` (None: some peer, in a collective) failed on this rank; :meth:`PeerLink.lost`
    turns it into the RankFailureError that names who is gone."""

    def __init__(self, peer: int | None, cause: str) -> None:
        super().__init__(cause)
        self.peer, self.cause = peer, cause


class PeerLost(RankFailureError):
    """A peer died, froze or lost its connection while bytes moved between ranks; names the silent ranks."""


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
        messages of (sender, nbytes, tag); the caller works meanwhile, then calls ``Transfer.wait``, which returns
        the messages as host tensors."""
        device_buffer = buffer.to(self.device) if sends and self.device.type != "cpu" else buffer
        inbox = [torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _, nbytes, _ in receives]
        return self.start([(receiver, device_buffer[offsets[first]:offsets[stop]], tag)
                           for receiver, first, stop, tag in sends],
                          [(sender, message, tag) for (sender, _, tag), message in zip(receives, inbox)], what)

    def start(self, sends: list[tuple[int, torch.Tensor, int]], receives: list[tuple[int, torch.Tensor, int]],
              what: str) -> "Transfer":
        """Post every (peer, tensor, tag) receive, then every send, before any is waited for (gloo pairs a pair's
        ``k``-th send with its ``k``-th receive of a tag: no order of waits can deadlock).  Host tensors on an NCCL
        group travel through device copies; ``Transfer.wait`` copies what arrived back into them."""
        works, inbox, copy_back = [], [], []
        for sender, tensor, tag in receives:
            target = tensor
            if tensor.device != self.device:
                target = torch.empty_like(tensor, device=self.device)
                copy_back.append((tensor, target))
            inbox.append(target)
            works.append((sender, self._issue(sender, lambda m=target, s=sender, t=tag: dist.irecv(
                m, group=self.group, group_src=s, tag=t))))
        for receiver, tensor, tag in sends:
            piece = tensor if tensor.device == self.device else tensor.to(self.device)
            works.append((receiver, self._issue(receiver, lambda p=piece, r=receiver, t=tag: dist.isend(
                p, group=self.group, group_dst=r, tag=t))))
        return Transfer(self, works, inbox, what, copy_back)

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

    def lost(self, error: PeerError, what: str, consequence: str) -> PeerLost:
        """Check in on the rendezvous store with what this rank saw, wait (at most ``timeout``) for the other
        ranks, and name the gone ones: those whose connection a rank saw fail, else those that never checked
        in.  The store lives on global rank 0: if it does not answer, rank 0 is the one gone."""
        world = dist.get_world_size(self.group)
        prefix = f"dcp_atomic/exchange/{self.exchange_id}"
        seen: dict[int, str] = {}

        def check_in() -> None:
            store = internals.default_store()
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

        checked_in = dict(seen)  # a copy: the worker may still be running (a frozen store)
        suspects = sorted({int(s) for s in checked_in.values() if s})
        # A rank that checked in is alive: its failed connection may only be a symptom (a rank waiting on a frozen
        # peer stops sending to the next one), so suspects that never checked in are named first.
        gone = [r for r in suspects if r not in checked_in]
        if worker.is_alive() or self.rank not in checked_in:
            silent, how = "0", "the rendezvous store on global rank 0 does not answer: rank 0 is dead or frozen"
        elif gone:
            silent, how = named(gone), "peers saw their connection to it fail, and it did not check in"
        elif suspects:
            silent, how = named(suspects), "peers saw their connection to it fail, though it checked in"
        else:
            missing = [r for r in range(world) if r not in checked_in]
            silent = named(missing) or "unknown"
            how = (f"it did not check in within {self.timeout.total_seconds():g}s" if missing
                   else "every rank checked in: a transient network failure?")
        whom = "a peer" if error.peer is None else f"rank {named([error.peer])}"
        return PeerLost(
            f"{what}: the exchange with {whom} failed on rank {self.rank} ({socket.gethostname()}): {error.cause}. "
            f"Silent rank(s): {silent} ({how}). A peer died, froze or lost its connection; {consequence}",
            rank=self.rank, silent=silent,
        )


@dataclass
class Transfer:
    """One round's messages in flight."""

    link: PeerLink
    works: list
    inbox: list[torch.Tensor]
    what: str
    copy_back: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (host tensor, device copy)

    def wait(self) -> list[torch.Tensor]:
        """Every send and receive done (a failure is a :class:`PeerError`); the received messages as host
        tensors, in the order posted."""
        self.link._wait(self.works, self.what, timeout=self.link.timeout)
        for host, device in self.copy_back:
            host.copy_(device)
        return [m if m.device.type == "cpu" else m.cpu() for m in self.inbox]
