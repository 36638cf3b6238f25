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
load, not NCCL.  A staging round (``--staging-gb``, 16 by default) then compares bounded staging
(``CheckpointManager(staging=Staging(...)).async_save`` and ``wait_staged()``) with DCP's ``DefaultStager`` on the
same device state while matmul steps run: the call's stall (target <= 50 ms), ``wait_staged()``, the steps' time,
pinned host bytes (target <= the pool) and peak RSS, each save loaded back bit-exact.
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


def _peak_rss_reset() -> None:
    """Start a new peak-RSS window (Linux: ``/proc/self/clear_refs`` 5 resets VmHWM); harmless where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak_rss() -> int | None:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return None


def _pinned() -> dict | None:
    """The CUDA caching host allocator's pinned bytes (current, peak) since the last reset; None on CPU."""
    if not torch.cuda.is_available() or not hasattr(torch.cuda, "host_memory_stats"):
        return None
    stats = torch.cuda.host_memory_stats()
    return {"current": stats.get("allocated_bytes.current"), "peak": stats.get("allocated_bytes.peak"),
            "reserved_peak": stats.get("reserved_bytes.peak")}


def _staging_state(gb: float, device: str) -> dict:
    """``gb`` of parameters and optimizer moments in 256 MiB tensors (bf16 and fp32), as a model's state."""
    generator = torch.Generator(device=device).manual_seed(1)
    state, total, index = {}, int(gb * 1e9), 0
    while total > 0:
        dtype = torch.bfloat16 if index % 3 == 0 else torch.float32
        numel = min(total, 256 << 20) // torch.empty((), dtype=dtype).element_size()
        state[f"t{index:04d}"] = torch.randn(numel, device=device, generator=generator).to(dtype)
        total -= numel * state[f"t{index:04d}"].element_size()
        index += 1
    return state


def _train_steps(work: torch.Tensor, steps: int) -> list[float]:
    """The training step's stand-in: matmuls on the device, timed one by one (synchronised)."""
    times = []
    for _ in range(steps):
        sync()
        started = time.perf_counter()
        for _ in range(8):
            work = torch.tanh(work @ work)
        sync()
        times.append(time.perf_counter() - started)
    return times


def staging_round(args, device: str, workdir: str, threads: int) -> dict:
    """Bounded staging (P16) against DCP's ``DefaultStager`` on the same device state: how long the call blocks the
    loop, how long ``wait_staged()`` (ours) / the staging future (DCP's) then takes while matmul steps run, what the
    steps cost meanwhile, peak pinned host bytes and peak RSS.  Each save loads back onto the device bit-exact
    against the state at the call, although the state is changed in place right after staging (the optimizer)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    from dcp_atomic import CheckpointManager, Staging

    state = _staging_state(args.staging_gb, device)
    nbytes = tensor_bytes(state)
    expected = {k: v.clone() for k, v in state.items()}
    side = 2048 if device == "cuda" else 256  # a CPU dry run shares its cores with the copies
    work = torch.randn(side, side, device=device) / side**0.5
    baseline = _train_steps(work, args.steps)  # the step's time with nothing in flight
    pool = int(args.pool_gb * (1 << 30))
    results: dict = {"state_gb": round(nbytes / 1e9, 3), "pool_bytes": pool, "window_bytes": args.window_mb << 20,
                     "step_seconds_alone": round(statistics.median(baseline), 4)}
    for name in ("dcp_atomic", "dcp_default_stager"):
        path = os.path.join(workdir, f"staging-{name}")
        for key, value in state.items():  # the previous contender's optimizer step undone
            value.copy_(expected[key])
        sync()
        _peak_rss_reset()
        if hasattr(torch.cuda, "reset_peak_host_memory_stats") and torch.cuda.is_available():
            torch.cuda.reset_peak_host_memory_stats()
        started = time.perf_counter()
        if name == "dcp_atomic":
            manager = CheckpointManager(path, "staging", thread_count=threads,
                                        staging=Staging(pool_bytes=pool, window_bytes=args.window_mb << 20))
            future = manager.async_save(1, state)
            call = time.perf_counter() - started
            during = _train_steps(work, args.steps)
            started = time.perf_counter()
            manager.wait_staged()
            staged = time.perf_counter() - started
        else:
            stager = DefaultStager(StagingOptions(use_pinned_memory=device == "cuda", use_shared_memory=False,
                                                  use_async_staging=True, use_non_blocking_copy=device == "cuda"))
            response = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(path, thread_count=threads),
                                      async_stager=stager, no_dist=True)
            call = time.perf_counter() - started
            during = _train_steps(work, args.steps)
            started = time.perf_counter()
            staging = getattr(response, "staging_completion", None)
            if staging is not None:
                staging.result()
            staged = time.perf_counter() - started
            future = getattr(response, "upload_completion", response)
        pinned = _pinned()
        for value in state.values():  # the optimizer step: the save must hold the state of the call
            value.mul_(0.5)
        future.result()
        if name == "dcp_atomic":
            manager.close()
        else:
            stager.close()
        rss = _peak_rss()
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        if name == "dcp_atomic":
            dcp.load(target, storage_reader=AtomicStorageReader(path, "staging", 1, thread_count=threads))
        else:
            dcp.load(target, storage_reader=dcp.FileSystemReader(path))
        sync()
        check_equal(expected, target, f"staging {name}")
        shutil.rmtree(path, ignore_errors=True)
        results[name] = {"call_seconds": round(call, 4), "wait_staged_seconds": round(staged, 4),
                         "step_seconds_during": round(statistics.median(during), 4), "pinned": pinned,
                         "peak_rss_bytes": rss, "loaded_bit_exact": True}
        print(f"[staging] {name:<20} call {call * 1e3:8.1f} ms  wait_staged {staged:7.3f} s  step "
              f"{statistics.median(during) * 1e3:7.1f} ms (alone {statistics.median(baseline) * 1e3:.1f} ms)  "
              f"pinned {pinned}  peak RSS {rss}", file=sys.stderr, flush=True)
    ours = results["dcp_atomic"]
    results["targets"] = {
        "call_stall_le_50ms": ours["call_seconds"] <= 0.05,
        "pinned_le_pool": None if ours["pinned"] is None else (ours["pinned"]["peak"] or 0) <= pool,
    }
    return results


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
        del state
        staging = staging_round(args, device, workdir, threads) if args.staging_gb > 0 else None
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                    "torch": torch.__version__, "cuda": torch.version.cuda, "gb": nbytes / 1e9,
                    "repeats": args.repeats, "warm_up_round": True, "thread_count": threads,
                    "loadavg": [load_before[0], os.getloadavg()[0]], "results": {}, "reuse": reuse,
                    "staging": staging}
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
    parser.add_argument("--staging-gb", type=float, default=16.0,
                        help="device state of the staging round (default %(default)s; 0: no staging round)")
    parser.add_argument("--pool-gb", type=float, default=1.0, help="the staging pool (default %(default)s)")
    parser.add_argument("--window-mb", type=int, default=64, help="one staging window (default %(default)s)")
    parser.add_argument("--steps", type=int, default=10, help="matmul steps timed while staging runs")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    print(json.dumps(run(args)))


if __name__ == "__main__":
    main()
