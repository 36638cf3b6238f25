"""Read once, share with peers: the reader's half of :mod:`~dcp_atomic.exchange` (P12).

Where the coordinator's plan says so (``share_reads``), a stored item several ranks need is read and verified
by one of them and sent to the others over the reader's process group, in rounds of at most
``share_buffer_bytes``.  Every rank takes part in every round: a status collective before each exchange tells
every rank whether a peer's storage read failed (it then stops, and that peer reports its error), and a peer
lost mid-exchange is raised as :class:`~dcp_atomic.errors.RankFailureError` naming it.  Received bytes are
verified again before they are decoded, so damage on the way names the sender, never the stored checkpoint.

``AtomicStorageReader`` mixes :class:`SharedReads` in (it provides ``_read_item``, ``_open_data``,
``_storage_info``, ``_data_path``, ``_in_parallel``, ``_extents`` and the reader's settings).
"""

from __future__ import annotations

import logging
import threading
import time

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem

from .._base import failpoints
from ..format.codec import tensor_bytes
from ..errors import CorruptCheckpointError
from ..exchange.read_once import Need, SharePlan, plan_exchange, round_layout
from ..exchange.transport import PeerError, PeerLink
from ..format.manifest import ItemExtent
from .read_checks import item_id
from ..format.blocks import verify_item
from .read_sources import Window, item_runs

log = logging.getLogger("dcp_atomic.reader")


class SharedReads:
    """The shared-read path of :class:`~dcp_atomic.dcp.reader.AtomicStorageReader` (see the module docstring)."""

    def _can_share(self) -> bool:
        """Whether this rank can take part in shared reads: DCP's collectives are on and the reader's group is
        the one DCP loads on (this rank's rank in it is its DCP rank)."""
        if self.share_reads is False or not self._use_collectives or not (dist.is_available() and dist.is_initialized()):
            return False
        try:
            return dist.get_world_size(self.process_group) > 1 and dist.get_rank(self.process_group) == self.rank
        except (RuntimeError, ValueError):  # this process is not in the group
            return False

    def _plan_shares(self, plans: list[LoadPlan], views: list) -> list[SharePlan] | None:
        """Each rank's exchange schedule, or None when reads are not shared (see ``share_reads``)."""
        wanted = self.share_reads if self.share_reads is not None else (
            not all(v.posix for v in views) or len({v.host for v in views}) > 1)
        if not wanted or len(plans) < 2 or not all(v.can_share and v.group_size == len(plans) for v in views):
            return None  # e.g. dcp.load on a subgroup the reader was not given: read directly
        needs: dict[tuple, list[Need]] = {}
        lengths: dict[tuple, int] = {}
        for rank, plan in enumerate(plans):
            for item in plan.items:
                ident = item_id(item.storage_index)
                needs.setdefault(ident, []).append(Need(rank, tuple(item.storage_offsets), tuple(item.lengths)))
                lengths[ident] = self._storage_info(item).length
        return plan_exchange(needs, lengths, [v.host for v in views], self.share_buffer_bytes)

    def _read_shared(self, share: SharePlan, items: list[ReadItem], planner: LoadPlanner,
                     planner_lock: threading.Lock, exchange_id: str) -> bool:
        """This rank's part of every exchange round; False when a peer's storage read failed (its error is
        reported by that peer), True when every shared item this rank needs is installed.  A peer gone during
        the exchange raises :class:`.exchange.PeerLost` naming it, which ``dcp.load`` raises as is."""
        what = f"shared read of run {self.layout.run_id!r} step {self.committed.step}"
        link = PeerLink(self.process_group, self.timeout, exchange_id)
        try:
            return self._exchange_rounds(link, share, items, planner, planner_lock, what)
        except PeerError as e:
            raise link.lost(e, what, "nothing was loaded on this rank. Restart the job and load again.") from None

    def _exchange_rounds(self, link: PeerLink, share: SharePlan, items: list[ReadItem], planner: LoadPlanner,
                         planner_lock: threading.Lock, what: str) -> bool:
        by_ident: dict[tuple, list[ReadItem]] = {}
        for item in items:
            by_ident.setdefault(item_id(item.storage_index), []).append(item)
        lengths = {ident: extent.length for ident, (_, extent) in self._extents.items()}
        stats = self.read_stats
        error: BaseException | None = None
        for n, step_round in enumerate(share.rounds):
            stats.rounds += 1
            buffer, offsets = torch.empty(0, dtype=torch.uint8), [0]
            if error is None:
                try:
                    if n == 0:
                        failpoints.hit("read.before_data", self.rank)
                    started = time.perf_counter()
                    buffer, offsets = self._fetch(step_round.fetch, lengths, what)
                    stats.storage_seconds += time.perf_counter() - started
                except BaseException as e:  # told to the peers below, raised after
                    error = e
            self._before_exchange(n, failing=error is not None)
            started = time.perf_counter()
            failed = link.failed_ranks(error is not None, what)
            if error is not None:
                raise error
            if failed:
                log.error("%s: rank(s) %s could not read their share; rank %d stops here (their error follows)",
                          what, ", ".join(map(str, failed)), self.rank)
                return False
            outgoing = buffer
            if failpoints.hit("read.exchange_send", self.rank) == "flip" and buffer.numel():
                outgoing = buffer.clone()  # tests: a peer whose memory or link corrupts what it sends
                outgoing[buffer.numel() // 2] ^= 0x01
            receives = [(sender, sum(lengths[i] for i in idents), tag) for sender, idents, tag in step_round.receives]
            pending = link.post(outgoing, step_round.sends, offsets, receives, what)
            try:  # this rank's own share decodes while the bytes travel
                self._in_parallel([lambda ident=ident, start=start, data=buffer: self._install(
                    by_ident[ident], ident, data, start, None, planner, planner_lock)
                    for ident, start in zip(step_round.fetch, offsets)])
            except BaseException as e:  # the next round's status tells the peers, or it is raised below
                error = e
            messages = pending.wait()
            stats.exchange_seconds += time.perf_counter() - started
            stats.peer_bytes_sent += sum(offsets[stop] - offsets[first] for _, first, stop, _ in step_round.sends)
            stats.peer_bytes_received += sum(nbytes for _, nbytes, _ in receives)
            stats.shared_items += len(step_round.fetch) + sum(len(idents) for _, idents, _ in step_round.receives)
            jobs = []
            if error is not None:
                messages = []
            for (sender, idents, _), message in zip(step_round.receives, messages):
                jobs += [lambda ident=ident, sender=sender, message=message, start=start: self._install(
                    by_ident[ident], ident, message, start, sender, planner, planner_lock, share.hosts)
                    for ident, start in zip(idents, round_layout(idents, lengths))]
            try:
                self._in_parallel(jobs)
            except BaseException as e:
                error = e
            del buffer, outgoing, pending, messages, jobs  # freed before the next round's: at most one budget held
        # How the last round ended, on every rank: a peer lost during it is then seen here, typed, not in DCP's
        # gather that follows; a failure of this rank's own installs stops its peers at once.
        failed = link.failed_ranks(error is not None, what)
        if error is not None:
            raise error
        if failed:
            log.error("%s: rank(s) %s could not install their share; rank %d stops here (their error follows)",
                      what, ", ".join(map(str, failed)), self.rank)
            return False
        return True

    def _fetch(self, idents: list, lengths: dict, what: str) -> tuple[torch.Tensor, list[int]]:
        """Read (and verify) the stored bytes of ``idents`` into one round buffer, files in parallel."""
        offsets = round_layout(idents, lengths)
        buffer = torch.empty(offsets[-1], dtype=torch.uint8)
        if not idents:
            return buffer, offsets
        view = tensor_bytes(buffer)
        per_file: dict[str, list[tuple[int, ItemExtent]]] = {}
        for i, ident in enumerate(idents):
            name, extent = self._extents[ident]
            per_file.setdefault(name, []).append((i, extent))

        def fetch_file(name: str, entries: list[tuple[int, ItemExtent]]) -> None:
            with self._open_data(name) as source:
                entries.sort(key=lambda e: e[1].pos)
                for start, end, run in item_runs([(entry, entry[1]) for entry in entries]):
                    window = source if len(run) == 1 else Window(source, start, end - start)
                    for i, extent in run:
                        target = view[offsets[i]:offsets[i + 1]]
                        if window.readinto_range(extent.pos, target) != extent.length:
                            raise CorruptCheckpointError(
                                f"{source.path} item {extent.key!r}: file is truncated (item of {extent.length} "
                                f"bytes at offset {extent.pos})", path=source.path, key=extent.key)
                        if self.verify:  # before it is sent: a peer must never be blamed for bad storage
                            verify_item(extent, target, f"{source.path} item {extent.key!r}", path=source.path)

        self._in_parallel([lambda name=name, entries=entries: fetch_file(name, entries)
                           for name, entries in sorted(per_file.items())])
        return buffer, offsets

    def _install(self, items: list[ReadItem], ident: tuple, data: torch.Tensor, start: int, sender: int | None,
                 planner: LoadPlanner, planner_lock: threading.Lock, hosts: list[str] | None = None) -> None:
        """Decode one shared item from memory into this rank's destinations, verifying it on the way (the
        same checks as a read from storage); damage in bytes a peer sent names that peer."""
        name, extent = self._extents[ident]
        path = self._data_path(name)
        source = Window.held(path, extent.pos, tensor_bytes(data)[start:start + extent.length])
        try:
            for item in items:
                self._read_item(source, path, item, planner, planner_lock)
        except CorruptCheckpointError as e:
            if sender is None:
                raise
            raise CorruptCheckpointError(
                f"{e.message} [these bytes were received from rank {sender} (host {hosts[sender]}), which read and "
                "verified them from storage: they were damaged in that rank's memory or on the way; the stored "
                "checkpoint is not blamed. Load again; if it repeats, check that host]",
                **{**e.details, "sender": sender},
            ) from None

    def _before_exchange(self, round_index: int, failing: bool) -> None:
        """Hook before each round's status collective (the manager waits for its peers by heartbeat here)."""
