"""Large tensors: a transformer's state saved and loaded by dcp_atomic and stock DCP, worlds 1-4, disk and tmpfs.

What it measures
    A transformer-like state dict (bf16 weight matrices and their two fp32 Adam moments, 8-64 MiB
    matrices at ``--hidden 2048``, plus small non-tensor objects; ``--size-gb`` of tensor data in
    total, 1.0 GB by default) is held as DTensors sharded ``Shard(0)`` over a 1-D CPU mesh of
    ``world_size`` gloo ranks (``OMP_NUM_THREADS=1``).  Contenders (``--contenders``):

    ===================  ======================================================================
    atomic-default       dcp_atomic (default): ``AtomicStorageWriter()`` = raw blocks, no compression
    atomic-stock         dcp_atomic ``stock_readable=True``: a torch.save container per item
    atomic-zstd          dcp_atomic ``compression="zstd"`` (raw blocks, byte planes, fast profile)
    stock                torch ``FileSystemWriter()`` / ``FileSystemReader()`` with defaults
    stock-tN             ``FileSystemWriter(thread_count=N)``, N in ``--stock-threads`` (2,4); the
                         reader has no thread option.  "best thread_count" = the stock variant with
                         the fastest median save in that world/medium, compared on every metric
    stock-zstd           ``FileSystemWriter(_extensions=[ZStandard()])`` (torch's own zstd extension,
                         same thread_count as dcp_atomic for fairness)
    torch-save           ``torch.save`` of each rank's local shards to one file (+ fsync), then
                         ``torch.load`` and copy into the model: a reference point, not DCP
    ===================  ======================================================================

    Per world size and medium (``disk``: a directory under /var/tmp or ``--disk-root``; ``tmpfs``:
    /dev/shm, or a tmpfs mounted when root), a first round runs every contender once (not counted)
    and, on the first medium, checks every loaded value bit-exact.  Then ``--repeats`` rounds,
    contenders in a rotated, alternating order: save, warm load, and on disk (as root) a cold load
    after ``drop_caches``.  Every checkpoint is deleted once measured.  Finally one
    ``CheckpointManager.async_save`` per world size measures what an async save holds in memory.
    Unless ``--no-compression-study``, the compression scenario runs first (benchmarks/compression.py).

What the numbers mean
    GB/s = logical tensor bytes of the whole state (1 GB = 1e9 bytes) / wall time of the slowest
    rank's ``dcp.save`` / ``dcp.load`` call; medians over repeats; ratios are contender / stock.
    "commit" is the coordinator's ``finish()``; "peak RSS" the largest growth of any rank's resident
    set during the operation; "CPU s/GB" all ranks' CPU seconds per GB (steadier than wall time on a
    shared machine); "metadata" every file but the ``.distcp`` data files.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import time

from benchmarks import compression, report
from benchmarks.common import (GB, MiB, RUN_ID, Media, PeakRss, bytes_on_disk, can_drop_caches, quiet_warnings,
                               say, transformer_bytes, transformer_state, zeroed_like)
from benchmarks.contenders import ATOMIC_OPTIONS, Contenders, is_known, label
from benchmarks.world import Progress, gather, launch, save_and_load

DEFAULT_CONTENDERS = "atomic-default,atomic-stock,atomic-zstd,stock,{STOCK_T}stock-zstd,torch-save"
QUICK_CONTENDERS = "atomic-default,atomic-stock,atomic-zstd,stock,stock-t2,stock-zstd,torch-save"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-sizes", default=None, help="comma-separated (default 1,2,4; --quick: 1,2)")
    parser.add_argument("--media", default="disk,tmpfs", help="comma-separated subset of disk,tmpfs")
    parser.add_argument("--disk-root", default=None, help="directory on a disk (default /var/tmp)")
    parser.add_argument("--tmpfs-root", default=None, help="directory on a tmpfs (default /dev/shm; mounted if absent)")
    parser.add_argument("--size-gb", type=float, default=None, help="logical tensor data, 1e9 bytes (default 1.0)")
    parser.add_argument("--hidden", type=int, default=2048, help="model width (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=None, help="counted rounds (default 3; --quick: 2)")
    parser.add_argument("--contenders", default=None,
                        help="comma-separated subset of " + DEFAULT_CONTENDERS.format(STOCK_T="stock-t2,stock-t4,")
                             + " (stock-tN for any N)")
    parser.add_argument("--stock-threads", default="2,4",
                        help="thread counts N of the stock-tN contenders in the default set ('' for none)")
    parser.add_argument("--atomic-threads", type=int, default=None,
                        help="dcp_atomic thread_count (default: the library's default, computed in each rank)")
    parser.add_argument("--no-warmup", action="store_true", help="skip the uncounted first round (verification "
                        "still runs once per contender per world)")
    parser.add_argument("--no-async", dest="async_rss", action="store_false", help="skip the async_save RSS probe")
    parser.add_argument("--no-compression-study", dest="compression", action="store_false")
    parser.add_argument("--json", default="bench-results/bench.json", help="results file (default %(default)s)")
    parser.add_argument("--png", default="bench-results/bench.png", help="chart (default %(default)s; '' to skip)")
    parser.add_argument("--op-timeout", type=float, default=600, help="seconds one operation may take")
    parser.add_argument("--quick", action="store_true",
                        help="0.25 GB, worlds 1,2, 2 repeats, stock-t2 the only stock thread_count variant")
    parser.add_argument("--smoke", action="store_true", help="seconds: 4 MB, world 1, tmpfs, 1 repeat, 2 contenders")


def finish_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    stock_t = "".join(f"stock-t{int(n)}," for n in args.stock_threads.split(",") if n.strip())
    if args.smoke:
        args.size_gb, args.hidden, args.repeats = args.size_gb or 0.004, 64, args.repeats or 1
        args.world_sizes, args.media = args.world_sizes or "1", "tmpfs"
        args.contenders = args.contenders or "atomic-default,stock"
        args.compression, args.async_rss = False, False
    if args.quick:
        args.size_gb, args.repeats = args.size_gb or 0.25, args.repeats or 2
        args.world_sizes = args.world_sizes or "1,2"
        args.contenders = args.contenders or QUICK_CONTENDERS
    args.size_gb = args.size_gb or 1.0
    args.repeats = args.repeats or 3
    args.world_sizes = [int(w) for w in (args.world_sizes or "1,2,4").split(",")]
    args.media = [m.strip() for m in args.media.split(",") if m.strip()]
    args.contenders = [c.strip() for c in (args.contenders or DEFAULT_CONTENDERS).format(STOCK_T=stock_t).split(",")
                       if c.strip()]
    for c in args.contenders:
        if not is_known(c):
            parser.error(f"unknown contender {c!r}")
    if len(set(args.contenders)) != len(args.contenders):
        parser.error("a contender is listed twice")
    if any(m not in ("disk", "tmpfs") for m in args.media):
        parser.error(f"unknown medium in {args.media}: use disk, tmpfs")
    if args.repeats < 1 or args.size_gb <= 0 or any(w < 1 for w in args.world_sizes):
        parser.error("--repeats, --size-gb and world sizes must be positive")


def _rank(ctx, plan: dict, progress: Progress) -> dict | None:
    """All of one world's measurements, run on every rank; rank 0 returns ``{medium: {contender: entry}}``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from dcp_atomic import Parallelism

    quiet_warnings()
    rank, world = ctx.rank, ctx.world_size
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    parallelism = Parallelism(dp=world)
    state = transformer_state(plan["size_gb"] * GB, plan["hidden"], rank, world, mesh)
    contenders = Contenders(rank, state, zeroed_like(state), parallelism, plan["atomic_threads"])
    threads = gather(contenders.threads())
    data_bytes = plan["data_bytes"]
    numbers = itertools.count(1)
    verified: set[str] = set()
    results: dict = {}
    for m_index, medium in enumerate(plan["media"]):
        base, cold = plan["dirs"][medium], plan["cold_ok"] and medium == "disk"

        def one(name: str, counted: bool, round_label: str) -> None:
            record = save_and_load(rank, contenders, name, os.path.join(base, name), next(numbers),
                                   verify=name not in verified, cold=cold, progress=progress)
            verified.add(name)
            if rank != 0:
                return
            s = max(r["seconds"] for r in record["save"])
            wl = max(r["seconds"] for r in record["warm"])
            line = (f"{progress.stamp()} w{world} {medium:<5} {round_label:<7} {name:<15} "
                    f"save {data_bytes / GB / s:5.2f} GB/s ({s:5.2f}s)  warm load {data_bytes / GB / wl:5.2f} GB/s")
            if record["cold"]:
                line += f"  cold load {data_bytes / GB / max(r['seconds'] for r in record['cold']):5.2f} GB/s"
            if record["save"][0].get("commit_seconds") is not None:
                line += f"  commit {record['save'][0]['commit_seconds'] * 1e3:.0f} ms"
            line += (f"  RSS+ save {max(r['rss_extra'] for r in record['save']) / MiB:.0f} / load "
                     f"{max(r['rss_extra'] for r in record['warm']) / MiB:.0f} MiB")
            say(line + ("  (verified bit-exact)" if record["verified"] else ""))
            if counted:
                report.record(results.setdefault(medium, {}).setdefault(name, {}), record)

        if plan["warmup"] and m_index == 0:
            for name in plan["contenders"]:
                one(name, counted=False, round_label="warm-up")
        names = plan["contenders"]
        for repeat in range(plan["repeats"]):
            shift = (repeat + m_index) % len(names)
            order = names[shift:] + names[:shift]
            for name in order if repeat % 2 == 0 else order[::-1]:
                one(name, counted=True, round_label=f"{repeat + 1}/{plan['repeats']}")
    if plan["async_rss"]:
        results["async_save"] = _async_save(rank, world, state, parallelism, plan, progress)
    dist.barrier()
    results["threads"] = threads[0] if all(t == threads[0] for t in threads) else threads
    return results if rank == 0 else None


def _async_save(rank: int, world: int, state: dict, parallelism, plan: dict, progress: Progress) -> dict | None:
    """What ``CheckpointManager.async_save`` holds in memory: it stages one copy of the state by design."""
    import torch.distributed as dist

    from dcp_atomic import CheckpointManager

    medium = plan["media"][0]
    where = os.path.join(plan["dirs"][medium], f"async-w{world}")  # one directory per world: a fresh step 1
    manager = CheckpointManager(where, RUN_ID, parallelism=parallelism, thread_count=plan["atomic_threads"])
    try:
        dist.barrier()
        with PeakRss() as rss:
            started = time.perf_counter()
            future = manager.async_save(1, state)
            staged = time.perf_counter() - started
            future.result()
            seconds = time.perf_counter() - started
        dist.barrier()
    finally:
        manager.close()
    replies = gather({"seconds": seconds, "stage_seconds": staged, "rss_extra": rss.extra})
    progress.done += 1
    if rank != 0:
        return None
    stored = bytes_on_disk(where)
    shutil.rmtree(where, ignore_errors=True)
    rss_list = ", ".join(f"{r['rss_extra'] / MiB:.0f}" for r in replies)
    say(f"{progress.stamp()} w{world} {medium:<5} async   CheckpointManager.async_save: staged in "
        f"{max(r['stage_seconds'] for r in replies):.2f}s, committed after "
        f"{max(r['seconds'] for r in replies):.2f}s, peak RSS+ per rank {rss_list} MiB")
    return {"medium": medium, "contender": "atomic-default (CheckpointManager.async_save)",
            "seconds": max(r["seconds"] for r in replies), "stage_seconds": max(r["stage_seconds"] for r in replies),
            "rss_extra_per_rank": [r["rss_extra"] for r in replies], "bytes_on_disk": stored}


def targets(summary: dict, compressed: dict, size_gb: float) -> list[dict]:
    """The large-tensor targets, judged against torch FileSystemWriter with defaults ("met") and against its
    best measured thread_count ("met_vs_best")."""
    checks: list[dict] = []
    for world, per_medium in summary.items():
        for medium, block in per_medium.items():
            rows = block["contenders"]
            where = {"world": world, "medium": medium}
            for name in ("atomic-default", "atomic-stock"):
                row = rows.get(name)
                if not row:
                    continue
                need = 1.3 if medium == "tmpfs" else 1.0
                checks.append(report.check(f"save >= {need}x stock", row["save_gbps_vs_stock"], need, True,
                                           contender=name, best=row["save_gbps_vs_stock_best"], **where))
                checks.append(report.check("warm load >= 1.5x stock", row["warm_load_gbps_vs_stock"], 1.5, True,
                                           contender=name, best=row["warm_load_gbps_vs_stock_best"], **where))
                if medium == "disk":
                    checks.append(report.check(
                        "cold load >= 1.0x stock", row["cold_load_gbps_vs_stock"], 1.0, True, contender=name,
                        best=row["cold_load_gbps_vs_stock_best"], **where,
                        note="" if row["cold_load_gbps"] else "no cold numbers (not root?)"))
            z = rows.get("atomic-zstd")
            if z and medium == "disk":
                checks.append(report.check("zstd save >= 0.9x stock uncompressed (disk)", z["save_gbps_vs_stock"],
                                           0.9, True, contender="atomic-zstd", best=z["save_gbps_vs_stock_best"],
                                           note="logical bytes per second", **where))
            for name, row in rows.items():
                if name not in ATOMIC_OPTIONS:
                    continue
                checks.append(report.check("sync save peak RSS <= state + 256 MiB", row["peak_rss_extra_save_mib"],
                                           256, False, contender=name, **where,
                                           note="MiB above the rank's RSS before the save (state resident)"))
                if world == "2" and row["commit_pct_of_save"] is not None:
                    at_size = size_gb >= 1.0
                    checks.append(report.check(
                        "commit < 5% of save time (world 2, 1 GiB)", row["commit_pct_of_save"] if at_size else None,
                        5, False, contender=name, **where,
                        note="" if at_size else f"{row['commit_pct_of_save']:.1f}% at {size_gb:g} GB: not the "
                                                "target's size, not judged"))
    return checks + compression.targets(compressed)


def run(args: argparse.Namespace) -> dict:
    began = time.monotonic()
    data_bytes = transformer_bytes(args.size_gb * GB, args.hidden)
    cold_ok, cold_note = can_drop_caches() if "disk" in args.media else (False, "no disk medium")
    atomic_threads = args.atomic_threads  # None: the library's default, resolved in each rank
    say(f"large tensors: state {data_bytes / GB:.3f} GB (hidden {args.hidden}, bf16 weights + fp32 Adam moments, "
        f"DTensor Shard(0)); worlds {args.world_sizes}; media {args.media}; {args.repeats} repeat(s); contenders "
        f"{', '.join(args.contenders)}; dcp_atomic thread_count {atomic_threads or 'default (in each rank)'}; "
        f"cold loads: {cold_note}")
    load_before = os.getloadavg()
    say(f"load average {load_before[0]:.2f} before starting (the machine may be shared: numbers are noisy)")
    ops_per_round = sum(3 if m == "disk" and cold_ok else 2 for m in args.media) * len(args.contenders)
    warmup_ops = 0 if args.no_warmup else (3 if args.media[0] == "disk" and cold_ok else 2) * len(args.contenders)
    ops_per_world = ops_per_round * args.repeats + warmup_ops + (1 if args.async_rss else 0)
    progress = Progress(total=len(args.world_sizes) * ops_per_world, started=time.monotonic())
    results: dict = {}
    compressed: dict = {}
    with Media(args.media, 2.5 * args.size_gb * GB, args.disk_root, args.tmpfs_root) as media:
        for medium, note in media.notes.items():
            say(f"{medium}: {note}")
        if args.compression:
            compressed = compression.study(media.dirs[args.media[-1]])
        plan = {"size_gb": args.size_gb, "hidden": args.hidden, "data_bytes": data_bytes,
                "atomic_threads": atomic_threads, "media": args.media, "dirs": media.dirs, "cold_ok": cold_ok,
                "contenders": args.contenders, "repeats": args.repeats, "warmup": not args.no_warmup,
                "async_rss": args.async_rss}
        for world in args.world_sizes:
            say(f"{progress.stamp()} world {world}: starting {world} rank(s) ({data_bytes / world / GB:.3f} GB each)")
            results[str(world)] = launch(_rank, world, media.dirs[args.media[0]], args=(plan, progress),
                                         op_timeout=args.op_timeout, ops=ops_per_world)
            progress.done += ops_per_world
    threads = {world: per_medium.pop("threads") for world, per_medium in results.items()}
    order = args.contenders
    summary = {world: {medium: report.summarize(per, data_bytes, order)
                       for medium, per in per_medium.items() if medium != "async_save"}
               for world, per_medium in results.items()}
    checks = targets(summary, compressed, args.size_gb)
    report.print_contender_tables(
        summary, f"median of {args.repeats} repeat(s); {data_bytes / GB:.3f} GB logical per checkpoint (all ranks); "
                 "GB/s = 1e9 bytes/s; x = ratio to torch FSW (default) / to the best torch FSW thread_count; "
                 "CPU s/GB = CPU seconds of all ranks (all threads) per GB; dcp_atomic thread_count per rank: "
                 + ", ".join(f"world {w}: {t['atomic']}" if isinstance(t, dict) else f"world {w}: {t}"
                             for w, t in threads.items()) + " (stock FSW: 1, or N for stock-tN)")
    for world, per_medium in results.items():
        a = per_medium.get("async_save")
        if a:
            rss = ", ".join(f"{x / MiB:.0f}" for x in a["rss_extra_per_rank"])
            print(f"world {world} CheckpointManager.async_save (dcp_atomic default, {a['medium']}): staged in "
                  f"{a['stage_seconds']:.2f} s, committed after {a['seconds']:.2f} s, peak RSS+ per rank {rss} MiB "
                  f"(state per rank {data_bytes / int(world) / MiB:.0f} MiB: async saves stage a copy)")
    compression.print_table(compressed)
    report.print_targets(checks)
    wall = report.print_wall(began, load_before)
    report.draw_png(summary, args.png, f"dcp_atomic vs torch DCP: {data_bytes / GB:.2f} GB state, median of "
                                       f"{args.repeats} (whiskers: min-max), {os.cpu_count()} cpus")
    return {
        "config": {"size_gb": args.size_gb, "data_bytes": data_bytes, "hidden": args.hidden,
                   "world_sizes": args.world_sizes, "media": args.media, "media_dirs": media.notes,
                   "repeats": args.repeats, "warmup_round": not args.no_warmup, "contenders": args.contenders,
                   "labels": {c: label(c) for c in args.contenders}, "dcp_atomic_thread_count": atomic_threads,
                   "threads_per_world": threads, "cold_loads": cold_note, "quick": args.quick, "smoke": args.smoke},
        "environment": {**report.environment(), "loadavg_before": load_before},
        "wall_seconds": wall,
        "compression_minilm": compressed,
        "raw": results,
        "summary": summary,
        "targets": checks,
    }
