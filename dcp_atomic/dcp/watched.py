"""DCP's planner, writer and reader with each rank's share of the work ending at a liveness barrier.

DCP's collectives start as soon as the first rank arrives and give up at the process group's timeout, which
is a *liveness* deadline: a rank that is slow but alive (100+ GB on busy storage, rank 0's retention after the
previous save) must not fail the operation (P8).  These subclasses run each share under an
:class:`~dcp_atomic.exchange.liveness.OpWatch`, so the collective that follows starts only once every rank is there,
peers are judged by heartbeat meanwhile, and a dead or frozen one is named.  ``CheckpointManager`` uses them.
"""

from __future__ import annotations

from typing import Any

from ..exchange.liveness import OpWatch
from .planners import AtomicSavePlanner
from .reader import AtomicStorageReader
from .writer import AtomicStorageWriter


class WatchedSavePlanner(AtomicSavePlanner):
    """Ends the planning share at a liveness barrier: staging an async save, or rank 0's retention
    after the previous save, may keep one rank longer than the group timeout."""

    def __init__(self, watch: OpWatch, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.watch = watch

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        try:
            super().set_up_planner(state_dict, storage_meta, is_coordinator)
        except BaseException:
            self.watch.wait_all("plan", quiet=True)
            raise

    def create_local_plan(self):
        return self.watch.run("plan", super().create_local_plan)


class WatchedWriter(AtomicStorageWriter):
    """Ends each rank's writes at a liveness barrier, so DCP's following gather starts together."""

    def __init__(self, *args: Any, watch: OpWatch, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.watch = watch

    def write_data(self, plan, planner):
        write = super().write_data
        return self.watch.run("write", lambda: write(plan, planner))


class WatchedReader(AtomicStorageReader):
    """Ends each rank's reads at a liveness barrier, so DCP's following all_gather starts together."""

    def __init__(self, *args: Any, watch: OpWatch, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.watch = watch

    bytes_read = files_read = 0

    def read_data(self, plan, planner):
        """Also sums the stored length of each distinct item this rank loads (for ``on_loaded``)."""
        read = super().read_data

        def counted_read():
            stored = {item.storage_index: self._storage_info(item) for item in plan.items}
            self.bytes_read = sum(info.length for info in stored.values())
            self.files_read = len({info.relative_path for info in stored.values()})
            return read(plan, planner)

        return self.watch.run("read", counted_read)

    def _before_exchange(self, round_index: int, failing: bool) -> None:
        """Peers reading their share are waited for by heartbeat (slow storage is not a dead rank), so the
        round's status collective only starts once every rank is there."""
        self.watch.wait_all(f"share{round_index}", quiet=failing)
