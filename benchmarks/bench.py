"""Save/load throughput of dcp_atomic against stock torch.distributed.checkpoint (DCP).

What it measures
    One transformer-like state dict (bf16 weight matrices plus their fp32 Adam
    moments, tensors of 8-64 MiB, plus a few small non-tensor objects) is saved
    and loaded, in a single process, by two contenders:

    * dcp_atomic: ``AtomicStorageWriter`` / ``AtomicStorageReader`` with their
      defaults (block checksums written and verified, fsync, commit protocol);
      each save goes to a fresh step.
    * stock:      ``FileSystemWriter`` / ``FileSystemReader`` with default
      arguments (one file, one thread, fsync), each save into a fresh directory.

    A warm-up round (not counted) runs each contender once, loading into a
    zeroed state dict that is then checked bit-exact against the original;
    first saves pay for imports and fresh page-cache / allocator growth.  Then
    contenders alternate within each repeat (ABBA order across repeats, so a
    drifting machine does not favour either).  Each save is followed at once by
    its load, so loads read from a warm page cache: they measure the library's
    CPU path (read, checksum, decode, copy), not the disk.  Each checkpoint is
    deleted after its load.

How to run (from the repo root)
    python benchmarks/bench.py                     # ~1 GB, 3 repeats, in /tmp
    python benchmarks/bench.py --quick             # 0.25 GB, 2 repeats
    python benchmarks/bench.py --root /dev/shm     # tmpfs: no disk in the way
    python benchmarks/bench.py --threads 4 --json results.json

What the numbers mean
    GB/s = logical tensor bytes (1 GB = 1e9 bytes; non-tensor objects and file
    headers not counted) divided by the wall time of the whole ``dcp.save`` /
    ``dcp.load`` call (planning, writing, fsync, commit / metadata, reading,
    verification, copy into the destination).  The median over repeats is
    reported.  Ratios are dcp_atomic / stock: above 1 means dcp_atomic is faster.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp

import dcp_atomic
from dcp_atomic import AtomicStorageReader, AtomicStorageWriter

# Single process, no process group: DCP says so on every call, dcp_atomic on every load (no Parallelism given).
warnings.filterwarnings("ignore", message=r".*assuming the intent is to (save|load) in a single process")
logging.getLogger("dcp_atomic.reshard").addFilter(lambda record: "layout check skipped" not in record.getMessage())

GB = 1e9
HIDDEN = 2048
RUN_ID = "bench"


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


def weight_slots(hidden: int):
    """(layer, name, shape) of every weight matrix of an endless stack of layers."""
    for layer in itertools.count():
        for name, shape in layer_weight_shapes(hidden).items():
            yield layer, name, shape


def make_state_dict(target_bytes: float, seed: int = 0) -> dict:
    """Layers of bf16 weights, each with two fp32 Adam moments, up to the total nearest ``target_bytes``."""
    generator = torch.Generator().manual_seed(seed)
    model: dict[str, torch.Tensor] = {}
    moments: dict[str, dict[str, torch.Tensor]] = {}
    total = layers = 0
    for layer, name, shape in weight_slots(HIDDEN):
        group_bytes = math.prod(shape) * (2 + 4 + 4)  # bf16 weight + two fp32 moments
        if model and total + group_bytes / 2 > target_bytes:
            break
        model.setdefault(f"layers.{layer}.norm.weight", torch.ones(HIDDEN, dtype=torch.bfloat16))
        fqn = f"layers.{layer}.{name}"
        model[fqn] = torch.randn(shape, generator=generator).to(torch.bfloat16)
        moments[fqn] = {
            "exp_avg": torch.randn(shape, generator=generator) * 1e-3,
            "exp_avg_sq": torch.rand(shape, generator=generator) * 1e-6,
        }
        total += group_bytes
        layers = layer + 1
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


def tensors_of(tree) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for value in tree.values() for t in tensors_of(value)]
    return []


def zeroed_like(tree):
    """Same structure, tensors zero-filled, non-tensors replaced (the load must restore them)."""
    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree)
    if isinstance(tree, dict):
        return {key: zeroed_like(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [zeroed_like(value) for value in tree]
    return None


def assert_bit_exact(expected, actual, where: str = "") -> None:
    if isinstance(expected, torch.Tensor):
        if not (isinstance(actual, torch.Tensor) and actual.dtype == expected.dtype and torch.equal(actual, expected)):
            raise AssertionError(f"loaded value differs from the saved one at {where or '<root>'}")
    elif isinstance(expected, dict):
        if not isinstance(actual, dict) or actual.keys() != expected.keys():
            raise AssertionError(f"loaded keys differ from the saved ones at {where or '<root>'}")
        for key in expected:
            assert_bit_exact(expected[key], actual[key], f"{where}.{key}" if where else str(key))
    elif actual != expected:
        raise AssertionError(f"loaded {actual!r} != saved {expected!r} at {where or '<root>'}")


# -- contenders ------------------------------------------------------------------------


@dataclass
class Contender:
    """``save(state_dict, workdir, number)`` writes checkpoint ``number`` and returns the path to delete;
    ``load(state_dict, workdir, number)`` reads it back into ``state_dict``."""

    name: str
    save: Callable[[dict, str, int], str]
    load: Callable[[dict, str, int], None]
    save_seconds: list[float] = field(default_factory=list)
    load_seconds: list[float] = field(default_factory=list)


def atomic_contender(thread_count: int | None) -> Contender:
    def save(state_dict: dict, workdir: str, index: int) -> str:
        writer = AtomicStorageWriter(workdir, run_id=RUN_ID, step=index, thread_count=thread_count)
        dcp.save(state_dict, storage_writer=writer)
        return writer.checkpoint_id  # the step directory

    def load(state_dict: dict, workdir: str, index: int) -> None:
        reader = AtomicStorageReader(workdir, run_id=RUN_ID, step=index, thread_count=thread_count)
        dcp.load(state_dict, storage_reader=reader)

    return Contender("dcp_atomic", save, load)


def stock_contender() -> Contender:
    def path_for(workdir: str, index: int) -> str:
        return os.path.join(workdir, f"stock_{index:04d}")

    def save(state_dict: dict, workdir: str, index: int) -> str:
        path = path_for(workdir, index)
        dcp.save(state_dict, storage_writer=dcp.FileSystemWriter(path))
        return path

    def load(state_dict: dict, workdir: str, index: int) -> None:
        dcp.load(state_dict, storage_reader=dcp.FileSystemReader(path_for(workdir, index)))

    return Contender("stock", save, load)


def say(line: str) -> None:
    print(line, flush=True)


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


# -- driver ----------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=1.0, help="logical tensor data, GB = 1e9 bytes (default 1.0)")
    parser.add_argument("--repeats", type=int, default=3, help="save+load rounds per contender (default 3)")
    parser.add_argument("--root", default=tempfile.gettempdir(), help="directory to write into, e.g. /dev/shm")
    parser.add_argument("--threads", type=int, default=None, help="dcp_atomic thread_count (default: library's)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--quick", action="store_true", help="0.25 GB, 2 repeats")
    args = parser.parse_args(argv)
    if args.quick:
        args.size_gb, args.repeats = 0.25, 2
    if args.repeats < 1 or args.size_gb <= 0:
        parser.error("--repeats and --size-gb must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    state_dict = make_state_dict(args.size_gb * GB)
    tensors = tensors_of(state_dict)
    data_bytes = sum(t.nbytes for t in tensors)
    matrix_mib = sorted(t.nbytes / 2**20 for t in tensors if t.dim() == 2)
    contenders = [atomic_contender(args.threads), stock_contender()]
    workdir = tempfile.mkdtemp(prefix="dcp-bench-", dir=args.root)
    atomic_threads = AtomicStorageWriter(workdir, run_id=RUN_ID, step=0, thread_count=args.threads).thread_count
    checkpoint_numbers = itertools.count()

    def save_then_load(contender: Contender, target: dict) -> tuple[float, float]:
        number = next(checkpoint_numbers)  # a fresh step / directory for every save
        save_seconds, path = timed(lambda: contender.save(state_dict, workdir, number))
        load_seconds, _ = timed(lambda: contender.load(target, workdir, number))
        shutil.rmtree(path)
        return save_seconds, load_seconds

    def report(label: str, contender: Contender, save_seconds: float, load_seconds: float, note: str = "") -> None:
        say(f"[{label}] {contender.name:<10} save {save_seconds:6.2f} s {data_bytes / GB / save_seconds:6.2f} GB/s"
            f" | load {load_seconds:6.2f} s {data_bytes / GB / load_seconds:6.2f} GB/s{note}")

    say(f"state dict: {len(tensors)} tensors, {data_bytes / GB:.3f} GB ({len(matrix_mib)} matrices of "
        f"{matrix_mib[0]:.0f}-{matrix_mib[-1]:.0f} MiB: bf16 weights + fp32 Adam moments) + non-tensor objects")
    say(f"writing into {workdir}; dcp_atomic thread_count={atomic_threads}, stock FileSystemWriter/Reader defaults; "
        f"each load follows its save at once (warm page cache)")
    try:
        for contender in contenders:
            target = zeroed_like(state_dict)
            seconds = save_then_load(contender, target)
            assert_bit_exact(state_dict, target)
            report("warm-up", contender, *seconds, "  (not counted; loaded values verified bit-exact)")
        for repeat in range(args.repeats):
            for contender in contenders if repeat % 2 == 0 else contenders[::-1]:
                save_seconds, load_seconds = save_then_load(contender, target)  # into the verified target
                contender.save_seconds.append(save_seconds)
                contender.load_seconds.append(load_seconds)
                report(f"{repeat + 1}/{args.repeats}", contender, save_seconds, load_seconds)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    rates = {
        c.name: {
            "save_gbps": data_bytes / GB / statistics.median(c.save_seconds),
            "load_gbps": data_bytes / GB / statistics.median(c.load_seconds),
        }
        for c in contenders
    }
    ratios = {kind: rates["dcp_atomic"][kind] / rates["stock"][kind] for kind in ("save_gbps", "load_gbps")}

    say("")
    say(f"median of {args.repeats}, {data_bytes / GB:.3f} GB in {args.root} (load = warm page cache)")
    say(f"{'contender':<12}{'save GB/s':>11}{'load GB/s':>11}")
    for name, rate in rates.items():
        say(f"{name:<12}{rate['save_gbps']:>11.2f}{rate['load_gbps']:>11.2f}")
    say(f"{'atomic/stock':<12}{ratios['save_gbps']:>10.2f}x{ratios['load_gbps']:>10.2f}x")

    if args.json:
        result = {
            "config": {"size_gb": args.size_gb, "repeats": args.repeats, "root": args.root,
                       "dcp_atomic_thread_count": atomic_threads, "data_bytes": data_bytes,
                       "tensors": len(tensors), "load_cache": "warm"},
            "environment": {"python": platform.python_version(), "torch": torch.__version__,
                            "dcp_atomic": dcp_atomic.__version__, "cpu_count": os.cpu_count(),
                            "machine": platform.machine()},
            "runs": {c.name: {"save_seconds": c.save_seconds, "load_seconds": c.load_seconds} for c in contenders},
            "median": rates,
            "ratio_atomic_over_stock": {"save": ratios["save_gbps"], "load": ratios["load_gbps"]},
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        say(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
