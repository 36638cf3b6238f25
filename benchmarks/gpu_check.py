"""Device check: CUDA tensors through every format, bit-exact, timed against stock DCP.

The test suite runs on CPU only; this script is what runs on a lent GPU machine
(``python benchmarks/gpu_check.py --gb 2``).  It saves a state dict of CUDA
tensors (bf16 weights, fp32 moments, an empty shard, a non-contiguous view, a
byte item) with dcp_atomic in the raw, ``stock_readable`` and zstd formats and
with stock ``FileSystemWriter``, loads each back into CUDA destinations,
checks every tensor bit-exact, and prints save/load GB/s and ratios to stock in
one JSON line, with the torch version and device it ran on.  A warm-up round
(not counted) runs every contender once; then the contenders alternate, the
order rotating and reversing each round, so no contender always runs first or
last (page cache, allocator and GPU clocks warm up for all alike).  Every
writer uses the same ``thread_count`` (dcp_atomic's default in this process,
or ``--threads``); stock's reader has no thread option.  Single process, no process group: it exercises the
device-to-host staging path (pinned block buffers) and device destinations on
load, not NCCL.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or ".") == HERE:  # benchmarks/profile.py would shadow the stdlib's
    sys.path[0] = os.path.dirname(HERE)

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from dcp_atomic import AtomicStorageReader, AtomicStorageWriter  # noqa: E402
from dcp_atomic.dcp.identity import default_thread_count  # noqa: E402


def make_state(gb: float, device: str) -> dict:
    generator = torch.Generator(device=device).manual_seed(0)
    rows = max(1, int(gb * 1e9 / 3 / 4096 / 2))  # a third each: bf16 weights, fp32 exp_avg (2x bytes)
    weight = torch.randn(rows, 4096, device=device, generator=generator).to(torch.bfloat16)
    moment = torch.randn(rows, 4096, device=device, generator=generator)
    return {
        "weight": weight,
        "exp_avg": moment,
        "bias": torch.randn(4096, device=device, generator=generator),
        "empty_shard": torch.empty(0, 4096, device=device),
        "transposed": torch.randn(64, 128, device=device, generator=generator).t(),  # non-contiguous
        "step": {"epoch": 3, "lr": 1e-4},
    }


def zeros_like(state: dict) -> dict:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {field: None for field in v}
            for k, v in state.items()}


def tensor_bytes(state: dict) -> int:
    return sum(v.nbytes for v in state.values() if isinstance(v, torch.Tensor))


def check_equal(expected: dict, got: dict, label: str) -> None:
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            other = got[key]
            assert other.device == value.device, f"{label} {key}: loaded onto {other.device}, not {value.device}"
            assert torch.equal(other.cpu(), value.cpu()), f"{label} {key}: values differ after the round trip"
        else:
            assert got[key] == value, f"{label} {key}: {got[key]!r} != {value!r}"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def reuse_round(state: dict, workdir: str, threads: int) -> dict:
    """Reuse (P15) with device tensors: three saves of an unchanged state with ``reuse=True`` (no base; the stable
    files written; linked), the third loaded back onto the device bit-exact.  Each item is digested through the
    device-to-host staging path before it is compared, so this times that path, not a write."""
    seconds, stats = [], []
    for step in (1, 2, 3):
        writer = AtomicStorageWriter(workdir, "reuse", step, thread_count=threads, reuse=True)
        sync()
        started = time.perf_counter()
        dcp.save(state, storage_writer=writer)
        sync()
        seconds.append(round(time.perf_counter() - started, 3))
        stats.append({k: writer.last_stats[k] for k in ("bytes_written", "bytes_reused")})
    target = zeros_like(state)
    dcp.load(target, storage_reader=AtomicStorageReader(workdir, "reuse", 3, thread_count=threads))
    sync()
    check_equal(state, target, "reuse")
    print(f"[reuse] save seconds {seconds} (no base, stable files written, linked); {stats[-1]}", file=sys.stderr,
          flush=True)
    return {"save_seconds": seconds, "stats": stats, "loaded_bit_exact": True}


def run(args) -> dict:
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    state = make_state(args.gb, device)
    nbytes = tensor_bytes(state)
    workdir = tempfile.mkdtemp(prefix="dcp-atomic-gpu-", dir=args.dir)
    threads = args.threads or default_thread_count()
    load_before = os.getloadavg()
    contenders = {
        "atomic-raw": {},
        "atomic-stock_readable": {"stock_readable": True},
        "atomic-zstd": {"compression": "zstd"},
        "stock": None,
    }
    times: dict[str, dict[str, list[float]]] = {name: {"save": [], "load": []} for name in contenders}
    names = list(contenders)
    rounds = [("warm-up", names)]
    for repeat in range(args.repeats):
        order = names[repeat % len(names):] + names[:repeat % len(names)]
        rounds.append((f"{repeat + 1}/{args.repeats}", order[::-1] if repeat % 2 else order))
    number = 0
    try:
        for round_label, order in rounds:
            for name in order:
                options = contenders[name]
                number += 1
                path = os.path.join(workdir, f"{name}-{number}")
                sync()
                started = time.perf_counter()
                if options is None:
                    dcp.save(state, storage_writer=dcp.FileSystemWriter(path, thread_count=threads))
                else:
                    dcp.save(state, storage_writer=AtomicStorageWriter(path, "gpu", number, thread_count=threads,
                                                                       **options))
                sync()
                saved = time.perf_counter() - started
                target = zeros_like(state)
                sync()
                started = time.perf_counter()
                if options is None:
                    dcp.load(target, storage_reader=dcp.FileSystemReader(path))
                else:
                    dcp.load(target, storage_reader=AtomicStorageReader(path, "gpu", number, thread_count=threads))
                sync()
                loaded = time.perf_counter() - started
                check_equal(state, target, name)
                shutil.rmtree(path)
                if round_label != "warm-up":
                    times[name]["save"].append(saved)
                    times[name]["load"].append(loaded)
                print(f"[{round_label}] {name:<22} save {nbytes / saved / 1e9:6.2f} GB/s  load "
                      f"{nbytes / loaded / 1e9:6.2f} GB/s", file=sys.stderr, flush=True)
        reuse = reuse_round(state, workdir, threads)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                    "torch": torch.__version__, "cuda": torch.version.cuda, "gb": nbytes / 1e9,
                    "repeats": args.repeats, "warm_up_round": True, "thread_count": threads,
                    "loadavg": [load_before[0], os.getloadavg()[0]], "results": {}, "reuse": reuse}
    stock = {op: statistics.median(times["stock"][op]) for op in ("save", "load")}
    for name, measured in times.items():
        row = {}
        for op in ("save", "load"):
            median = statistics.median(measured[op])
            row[f"{op}_gb_s"] = round(nbytes / median / 1e9, 3)
            row[f"{op}_vs_stock"] = round(stock[op] / median, 2)
        report["results"][name] = row
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0, help="tensor bytes in the state dict")
    parser.add_argument("--repeats", type=int, default=3, help="counted rounds after the warm-up (default 3)")
    parser.add_argument("--threads", type=int, default=None,
                        help="thread_count of every writer (default: dcp_atomic's default in this process)")
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: the temp dir)")
    parser.add_argument("--cpu", action="store_true", help="run on CPU (a dry run of the script)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    print(json.dumps(run(args)))


if __name__ == "__main__":
    main()
