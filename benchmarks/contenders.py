"""The save/load contenders, run on each rank of a world: dcp_atomic formats, stock DCP variants, torch.save.

``atomic-*`` go through ``AtomicSavePlanner`` / ``AtomicLoadPlanner`` as the README recommends; stock
writers fsync too (``sync_files=True``, their default, as ours always do on a file system).

Thread counts are resolved *in the rank*: ``atomic_threads=None`` is the library's own default there
(``default_thread_count()``: this host's CPUs over ``LOCAL_WORLD_SIZE``), not a number computed once in the
parent and handed to every rank.  ``stock_threads`` is stock ``FileSystemWriter``'s ``thread_count``: 1 (its
default) or ``"same"`` (the count dcp_atomic uses in that rank), so a ratio can compare equal thread counts.
Stock's ``FileSystemReader`` has no thread option: stock loads always read with one thread.  A contender's checkpoint ``number`` lives under
``where``; :func:`checkpoint_path` names the directory to measure and delete afterwards.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from benchmarks.common import RUN_ID, flat_items, local_of
from dcp_atomic import AtomicLoadPlanner, AtomicSavePlanner, AtomicStorageReader, AtomicStorageWriter

LABELS = {
    "atomic-default": "dcp_atomic (default, raw)",
    "atomic-stock": "dcp_atomic stock_readable",
    "atomic-zstd": "dcp_atomic zstd",
    "stock": "torch FSW (default)",
    "stock-zstd": "torch FSW + ZStandard",
    "torch-save": "torch.save per rank",
}
ATOMIC_OPTIONS = {"atomic-default": {}, "atomic-stock": {"stock_readable": True},
                  "atomic-zstd": {"compression": "zstd"}}


def label(name: str) -> str:
    if name.startswith("stock-t"):
        return f"torch FSW thread_count={name[7:]}"
    return LABELS.get(name, name)


def is_known(name: str) -> bool:
    return name in LABELS or (name.startswith("stock-t") and name[7:].isdigit())


def is_stock_uncompressed(name: str) -> bool:
    return name == "stock" or name.startswith("stock-t")


def checkpoint_path(name: str, where: str, number: int) -> str:
    """The directory one save of ``name`` creates."""
    if name in ATOMIC_OPTIONS:
        return os.path.join(where, RUN_ID, f"step_{number:010d}")
    return os.path.join(where, f"ckpt_{number:04d}")


def _timed_stock_writer_class():
    from torch.distributed.checkpoint import FileSystemWriter

    class TimedFileSystemWriter(FileSystemWriter):
        """FileSystemWriter whose finish() (metadata write + fsync + rename, coordinator only) is timed."""

        commit_seconds: float | None = None

        def finish(self, metadata, results) -> None:
            started = time.perf_counter()
            super().finish(metadata, results)
            self.commit_seconds = time.perf_counter() - started

    return TimedFileSystemWriter


class Contenders:
    """Save ``state`` / load into ``target`` (same structure) the way each contender does, on one rank."""

    def __init__(self, rank: int, state: dict, target: dict, parallelism, atomic_threads: int | None,
                 stock_threads: int | str = 1) -> None:
        from dcp_atomic.dcp.identity import default_thread_count

        self.rank, self.state, self.target = rank, state, target
        self.parallelism = parallelism
        self.atomic_threads = atomic_threads or default_thread_count()  # this rank's library default
        self.stock_threads = self.atomic_threads if stock_threads == "same" else int(stock_threads)
        self.stock_writer = _timed_stock_writer_class()
        self.target_slots = _slots(target)  # computed once, outside the timed loads

    def save(self, name: str, where: str, number: int) -> dict:
        """Returns ``{"commit_seconds": ...}`` (the coordinator's ``finish()``; None elsewhere)."""
        if name in ATOMIC_OPTIONS:
            writer = AtomicStorageWriter(where, RUN_ID, number, parallelism=self.parallelism,
                                         thread_count=self.atomic_threads, **ATOMIC_OPTIONS[name])
            dcp.save(self.state, storage_writer=writer, planner=AtomicSavePlanner())
            stats = writer.last_stats if self.rank == 0 else None
            return {"commit_seconds": stats["commit_seconds"] if stats else None}
        path = checkpoint_path(name, where, number)
        if name.startswith("stock"):
            from torch.distributed.checkpoint._extension import ZStandard

            if name == "stock-zstd":  # same thread_count as dcp_atomic, for fairness
                writer = self.stock_writer(path, thread_count=self.atomic_threads, _extensions=[ZStandard()])
            else:
                writer = self.stock_writer(path, thread_count=self.stock_threads_of(name))
            dcp.save(self.state, storage_writer=writer)
            return {"commit_seconds": writer.commit_seconds if self.rank == 0 else None}
        if name == "torch-save":
            os.makedirs(path, exist_ok=True)
            with open(os.path.join(path, f"rank{self.rank}.pt"), "wb") as f:
                torch.save(self._local_flat(), f)
                f.flush()
                os.fsync(f.fileno())
            return {"commit_seconds": None}
        raise ValueError(f"unknown contender {name!r}")

    def stock_threads_of(self, name: str) -> int:
        return int(name[7:]) if name.startswith("stock-t") else self.stock_threads

    def threads(self) -> dict[str, int]:
        """The thread counts this rank uses: dcp_atomic's and stock ``FileSystemWriter``'s."""
        return {"atomic": self.atomic_threads, "stock": self.stock_threads}

    def load(self, name: str, where: str, number: int) -> None:
        if name in ATOMIC_OPTIONS:
            reader = AtomicStorageReader(where, RUN_ID, number, parallelism=self.parallelism,
                                         thread_count=self.atomic_threads)
            dcp.load(self.target, storage_reader=reader, planner=AtomicLoadPlanner())
        elif name.startswith("stock"):
            dcp.load(self.target, storage_reader=dcp.FileSystemReader(checkpoint_path(name, where, number)))
        elif name == "torch-save":
            path = os.path.join(checkpoint_path(name, where, number), f"rank{self.rank}.pt")
            loaded = torch.load(path, map_location="cpu", weights_only=True)
            for key, (container, slot, value) in self.target_slots.items():
                if isinstance(value, torch.Tensor):
                    local_of(value).copy_(loaded[key])
                else:
                    container[slot] = loaded[key]
        else:
            raise ValueError(f"unknown contender {name!r}")

    def _local_flat(self) -> dict:
        return {key: (local_of(v) if isinstance(v, torch.Tensor) else v) for key, v in flat_items(self.state)}


def _slots(tree) -> dict[str, tuple[Any, Any, Any]]:
    """dotted path -> (container, key, value) of every leaf, to write torch.load results back in place."""
    out: dict[str, tuple[Any, Any, Any]] = {}

    def walk(node, prefix: str) -> None:
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            path = f"{prefix}{key}"
            if isinstance(value, dict) or (isinstance(value, list) and
                                           any(isinstance(v, (dict, list, torch.Tensor)) for v in value)):
                walk(value, path + ".")
            else:
                out[path] = (node, key, value)

    walk(tree, "")
    return out
