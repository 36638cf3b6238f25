"""Many small tensors: 10k and 50k plain tensors per rank (1-64 KiB, mixed dtypes), dcp_atomic against stock DCP.

What it measures
    Each rank holds ``--keys`` plain tensors of its own (optimizer states, MoE experts, per-layer
    norms: 10^3-10^5 keys per rank in real jobs), sizes drawn log-uniformly between ``--min-kib`` and
    ``--max-kib`` (mean about 15 KiB at 1-64 KiB), dtypes cycling through fp32, bf16, fp16, int64, int32
    and uint8.  Per world size (``--world-sizes``, default 1,2,4) and key count, a first round runs each
    contender once (not counted) and checks every loaded tensor bit-exact; then ``--repeats`` rounds in
    alternating order (ABBA): save, then warm load (``--cold`` adds a load after ``drop_caches``, as root).
    Contenders default to dcp_atomic's default writer and stock ``FileSystemWriter`` /
    ``FileSystemReader``; any of benchmarks/contenders.py can be named.  Thread counts are each rank's own:
    dcp_atomic's library default computed in the rank (CPUs per local rank: 1 at worlds 2 and 4 on 2 cores),
    and stock's writer with the same count (``--stock-threads same``, the default; ``1`` for torch's default).
    Stock's reader has no thread option (one thread); ours uses its default.

What the numbers mean
    GB/s = tensor bytes of all ranks / wall time of the slowest rank's ``dcp.save`` / ``dcp.load``;
    items/s = tensors of all ranks / the same time; medians; x = ratio to stock (above 1: faster).
    "metadata" = every file but the ``.distcp`` data files (manifest, ``.metadata``, marker...).
"""

from __future__ import annotations

import argparse
import math
import os
import time

from benchmarks import report
from benchmarks.common import GB, Media, can_drop_caches, quiet_warnings, say, zeroed_like
from benchmarks.contenders import Contenders, is_known, label
from benchmarks.world import Progress, gather, launch, save_and_load

DTYPES = ("float32", "bfloat16", "float16", "int64", "int32", "uint8")
TARGETS = {"save": 1.3, "warm_load": 1.5}  # vs stock, at 10k keys, worlds 1-2 (issue 11) and 2-4 (issue 21)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-sizes", default="1,2,4", help="comma-separated (default %(default)s)")
    parser.add_argument("--keys", default="10000,50000", help="tensors per rank, comma-separated (default %(default)s)")
    parser.add_argument("--min-kib", type=float, default=1, help="smallest tensor (default %(default)s KiB)")
    parser.add_argument("--max-kib", type=float, default=64, help="largest tensor (default %(default)s KiB)")
    parser.add_argument("--media", default="disk", help="comma-separated subset of disk,tmpfs (default %(default)s)")
    parser.add_argument("--disk-root", default=None, help="directory on a disk (default /var/tmp)")
    parser.add_argument("--tmpfs-root", default=None, help="directory on a tmpfs (default /dev/shm)")
    parser.add_argument("--repeats", type=int, default=3, help="counted rounds (default %(default)s)")
    parser.add_argument("--contenders", default="atomic-default,stock", help="comma-separated (default %(default)s)")
    parser.add_argument("--atomic-threads", type=int, default=None,
                        help="dcp_atomic thread_count (default: the library's default, computed in each rank)")
    parser.add_argument("--stock-threads", default="same",
                        help="stock FileSystemWriter thread_count: 'same' as dcp_atomic's in each rank (default), "
                             "or a number (1 = torch's default)")
    parser.add_argument("--cold", action="store_true", help="also load after dropping the page cache (root, disk)")
    parser.add_argument("--json", default="bench-results/small.json", help="results file (default %(default)s)")
    parser.add_argument("--op-timeout", type=float, default=600, help="seconds one operation may take")
    parser.add_argument("--smoke", action="store_true", help="seconds: worlds 1,2, 200 keys, tmpfs, 1 repeat")


def finish_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.smoke:
        args.world_sizes, args.keys, args.media, args.repeats = "1,2", "200", "tmpfs", 1
    args.world_sizes = [int(w) for w in args.world_sizes.split(",")]
    args.keys = [int(k) for k in args.keys.split(",")]
    args.media = [m.strip() for m in args.media.split(",") if m.strip()]
    args.contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    if any(not is_known(c) for c in args.contenders) or "stock" not in args.contenders:
        parser.error(f"--contenders {args.contenders}: names from benchmarks/contenders.py, including stock")
    if any(m not in ("disk", "tmpfs") for m in args.media):
        parser.error(f"unknown medium in {args.media}: use disk, tmpfs")
    if args.stock_threads != "same" and not args.stock_threads.isdigit():
        parser.error(f"--stock-threads {args.stock_threads!r}: 'same' or a number")
    if args.repeats < 1 or min(args.keys + args.world_sizes) < 1 or not 0 < args.min_kib <= args.max_kib:
        parser.error("--repeats, --keys, world sizes and tensor sizes must be positive")


def shapes(keys: int, min_kib: float, max_kib: float) -> list[tuple[str, int]]:
    """(dtype name, elements) of each tensor: log-uniform byte sizes, dtypes in turn; the same on every rank."""
    import torch

    generator = torch.Generator().manual_seed(0)
    sizes = torch.empty(keys).uniform_(math.log(min_kib * 1024), math.log(max_kib * 1024), generator=generator)
    out = []
    for i, size in enumerate(sizes.exp().tolist()):
        dtype = DTYPES[i % len(DTYPES)]
        out.append((dtype, max(1, int(size) // getattr(torch, dtype).itemsize)))
    return out


def bytes_per_rank(keys: int, min_kib: float, max_kib: float) -> int:
    import torch

    return sum(numel * getattr(torch, dtype).itemsize for dtype, numel in shapes(keys, min_kib, max_kib))


def small_tensors(keys: int, rank: int, min_kib: float, max_kib: float) -> dict:
    """This rank's ``keys`` 1-D tensors, under names of its own, values seeded by rank."""
    import torch

    generator = torch.Generator().manual_seed(1000 + rank)
    state = {}
    for i, (dtype_name, numel) in enumerate(shapes(keys, min_kib, max_kib)):
        dtype = getattr(torch, dtype_name)
        if dtype.is_floating_point:
            tensor = torch.randn(numel, generator=generator).to(dtype)
        else:
            tensor = torch.randint(0, 100, (numel,), generator=generator, dtype=dtype)
        state[f"rank{rank}.layers.{i // 8}.param{i % 8}"] = tensor
    return state


def _rank(ctx, plan: dict, progress: Progress) -> dict | None:
    """Every key count and medium of one world, on every rank; rank 0 returns ``{keys: {medium: entries}}``."""
    from dcp_atomic import Parallelism

    quiet_warnings()
    rank, world = ctx.rank, ctx.world_size
    results: dict = {}
    for keys in plan["keys"]:
        state = small_tensors(keys, rank, plan["min_kib"], plan["max_kib"])
        contenders = Contenders(rank, state, zeroed_like(state), Parallelism(dp=world), plan["atomic_threads"],
                                plan["stock_threads"])
        threads = gather(contenders.threads())
        if rank == 0:
            results["threads"] = threads[0] if all(t == threads[0] for t in threads) else threads
        data_bytes, items = plan["data_bytes"][str(keys)] * world, keys * world
        number = 0
        for medium in plan["media"]:
            base, cold = plan["dirs"][medium], plan["cold"] and medium == "disk"
            rounds = [("warm-up", plan["contenders"])] + [
                (f"{r + 1}/{plan['repeats']}", plan["contenders"][::-1] if r % 2 else plan["contenders"])
                for r in range(plan["repeats"])]
            for round_label, names in rounds:
                for name in names:
                    number += 1
                    record = save_and_load(rank, contenders, name, os.path.join(base, f"{keys}", name), number,
                                           verify=round_label == "warm-up", cold=cold, progress=progress)
                    if rank != 0:
                        continue
                    s = max(r["seconds"] for r in record["save"])
                    wl = max(r["seconds"] for r in record["warm"])
                    say(f"{progress.stamp()} w{world} {keys} keys {medium:<5} {round_label:<7} {name:<15} save "
                        f"{s:6.2f}s {data_bytes / GB / s:5.2f} GB/s {items / s:7.0f} items/s | warm load {wl:6.2f}s "
                        f"{data_bytes / GB / wl:5.2f} GB/s {items / wl:7.0f} items/s"
                        + ("  (verified bit-exact)" if record["verified"] else ""))
                    if round_label != "warm-up":
                        report.record(results.setdefault(str(keys), {}).setdefault(medium, {}).setdefault(name, {}),
                                      record)
        del state, contenders
    return results if rank == 0 else None


def run(args: argparse.Namespace) -> dict:
    began = time.monotonic()
    atomic_threads, stock_threads = args.atomic_threads, args.stock_threads
    cold_ok, cold_note = can_drop_caches() if args.cold and "disk" in args.media else (False, "no cold loads")
    data_bytes = {str(k): bytes_per_rank(k, args.min_kib, args.max_kib) for k in args.keys}
    need = 2.5 * max(data_bytes.values()) * max(args.world_sizes)
    say(f"many small tensors: {args.keys} keys per rank, {args.min_kib:g}-{args.max_kib:g} KiB ({', '.join(DTYPES)}); "
        f"worlds {args.world_sizes}; media {args.media}; {args.repeats} repeat(s); contenders "
        f"{', '.join(args.contenders)}; dcp_atomic thread_count {atomic_threads or 'default (in each rank)'}, stock "
        f"FileSystemWriter thread_count {stock_threads}; {cold_note}")
    load_before = os.getloadavg()
    ops_per_world = len(args.keys) * len(args.media) * len(args.contenders) * (args.repeats + 1) * (3 if cold_ok else 2)
    progress = Progress(total=len(args.world_sizes) * ops_per_world, started=time.monotonic())
    results: dict = {}
    with Media(args.media, need, args.disk_root, args.tmpfs_root) as media:
        plan = {"keys": args.keys, "min_kib": args.min_kib, "max_kib": args.max_kib, "data_bytes": data_bytes,
                "atomic_threads": atomic_threads, "stock_threads": stock_threads, "media": args.media, "dirs": media.dirs, "cold": cold_ok,
                "contenders": args.contenders, "repeats": args.repeats}
        for world in args.world_sizes:
            results[str(world)] = launch(_rank, world, media.dirs[args.media[0]], args=(plan, progress),
                                         op_timeout=args.op_timeout, ops=ops_per_world)
            progress.done += ops_per_world
    threads = {world: per_keys.pop("threads") for world, per_keys in results.items()}
    summary: dict = {}
    checks: list[dict] = []
    for world, per_keys in results.items():
        for keys, per_medium in per_keys.items():
            for medium, entries in per_medium.items():
                where = f"{medium}, {keys} keys/rank"
                block = report.summarize(entries, data_bytes[keys] * int(world), args.contenders,
                                         items=int(keys) * int(world))
                summary.setdefault(world, {})[where] = block
                for name, row in block["contenders"].items():
                    if name == "stock":
                        continue
                    for metric, need_ratio in TARGETS.items():
                        checks.append(report.check(
                            f"{metric.replace('_', ' ')} >= {need_ratio}x stock", row[f"{metric}_gbps_vs_stock"],
                            need_ratio, True, world=world, medium=where, contender=name,
                            best=row[f"{metric}_gbps_vs_stock_best"],
                            note="" if keys == "10000" and int(world) <= 4 else "target set at 10k keys, worlds 1-4"))
    report.print_contender_tables(
        summary, f"median of {args.repeats}; x = ratio to torch FSW; GB/s and items/s over all ranks; thread counts "
        f"per rank (dcp_atomic / stock writer; stock's reader has one): "
        + ", ".join(f"world {w}: {t['atomic']} / {t['stock']}" if isinstance(t, dict) else f"world {w}: {t}"
                    for w, t in threads.items()), items=True)
    report.print_targets(checks)
    wall = report.print_wall(began, load_before)
    return {
        "config": {"world_sizes": args.world_sizes, "keys_per_rank": args.keys, "min_kib": args.min_kib,
                   "max_kib": args.max_kib, "dtypes": DTYPES, "tensor_bytes_per_rank": data_bytes,
                   "media": args.media, "media_dirs": media.notes, "repeats": args.repeats,
                   "contenders": args.contenders, "labels": {c: label(c) for c in args.contenders},
                   "dcp_atomic_thread_count": atomic_threads, "stock_writer_thread_count": stock_threads,
                   "threads_per_world": threads, "cold_loads": cold_note, "smoke": args.smoke},
        "environment": {**report.environment(), "loadavg_before": load_before},
        "wall_seconds": wall,
        "raw": results,
        "summary": summary,
        "targets": checks,
    }
