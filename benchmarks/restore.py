"""Replicated restore: every rank loads the same state (data-parallel replicas), shared reads on vs off vs stock DCP.

What it measures
    Each rank of a world (``--world-sizes``, default 2,4) holds the same ``--gb`` GB of plain tensors (bf16
    weights, fp32 Adam moments: replicas, saved once by rank 0).  One dcp_atomic save and one stock
    ``FileSystemWriter`` save, then ``--repeats`` rounds in alternating order (ABBA) of three loads:
    ``AtomicStorageReader(share_reads=True)`` (read once, share over gloo), ``share_reads=False`` (each
    rank reads its own copy) and stock ``FileSystemReader``; each warm (page cache full) and, as root on a
    disk, cold (``drop_caches`` before the load).  A first round checks every load bit-exact.

What the numbers mean
    seconds = wall time of the slowest rank's ``dcp.load`` (median); GB/s = bytes delivered to all ranks
    (world x state) / seconds; "read" = bytes all ranks read from storage divided by the unique stored
    bytes: the reader's own count for dcp_atomic, ``rchar`` of /proc/self/io for stock (bytes returned by
    read calls); "disk" = ``read_bytes`` of /proc/self/io summed over ranks, the bytes the kernel fetched
    from the device (cold loads only); x = ratio to sharing off (above 1: faster).

    ``--store s3`` runs the same loads against a local S3 server (SeaweedFS by default, see
    ``bench.py s3 --help`` for ``--server``); stock is then ``FsspecReader``, and there are no cold loads.
    On one host a local disk's page cache already reads each byte from the device once, whatever the
    replica count: shared reads pay off where every rank's read is a request (object stores) or crosses
    the network (NFS from several hosts).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import time

import fsspec

from benchmarks import report
from benchmarks.common import (GB, RUN_ID, MiB, Media, assert_bit_exact, can_drop_caches, clear, drop_caches,
                               quiet_warnings, say, tensor_bytes, transformer_state, zeroed_like)
from benchmarks.world import Progress, gather, launch, measured

LOADS = ("share-on", "share-off", "stock")
TARGETS = {"cold": 1.5}  # shared vs unshared cold restore at world 4 (issue 13); warm: no slower


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-sizes", default="2,4", help="comma-separated (default %(default)s)")
    parser.add_argument("--gb", type=float, default=0.5, help="replicated state per rank, GB (default %(default)s)")
    parser.add_argument("--hidden", type=int, default=1024, help="model width of the generated state")
    parser.add_argument("--repeats", type=int, default=3, help="counted rounds (default %(default)s)")
    parser.add_argument("--store", default="disk", choices=("disk", "s3"), help="where the checkpoints live")
    parser.add_argument("--server", default="seaweedfs", help="--store s3: seaweedfs, moto or an endpoint URL")
    parser.add_argument("--disk-root", default=None, help="directory on a disk (default /var/tmp)")
    parser.add_argument("--no-cold", action="store_true", help="skip cold loads")
    parser.add_argument("--share-buffer-mib", type=int, default=None,
                        help="AtomicStorageReader(share_buffer_bytes=) in MiB (default: the library's, 256)")
    parser.add_argument("--json", default="bench-results/restore.json", help="results file (default %(default)s)")
    parser.add_argument("--op-timeout", type=float, default=600, help="seconds one operation may take")
    parser.add_argument("--smoke", action="store_true", help="seconds: world 2, 8 MB, 1 repeat, warm only")


def finish_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.smoke:
        args.world_sizes, args.gb, args.hidden, args.repeats, args.no_cold = "2", 0.008, 128, 1, True
        args.server = "moto"
    args.world_sizes = [int(w) for w in args.world_sizes.split(",")]
    if args.repeats < 1 or args.gb <= 0 or min(args.world_sizes) < 2:
        parser.error("--repeats and --gb must be positive, world sizes at least 2")


def _io() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


def _save(state: dict, plan: dict) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    from dcp_atomic import AtomicSavePlanner, AtomicStorageWriter

    options = plan["options"]
    dcp.save(state, storage_writer=AtomicStorageWriter(plan["root"], RUN_ID, 1, storage_options=options),
             planner=AtomicSavePlanner())
    stock = plan["root"] + "/stock"
    dcp.save(state, storage_writer=FsspecWriter(stock, **options) if options else dcp.FileSystemWriter(stock))


def _load(target: dict, name: str, plan: dict) -> dict:
    """One load by ``name``; what this rank read (the reader's count, rchar, device bytes)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    from dcp_atomic import AtomicLoadPlanner, AtomicStorageReader

    buffer = {} if plan.get("share_buffer_mib") is None else {"share_buffer_bytes": plan["share_buffer_mib"] << 20}
    before = _io()
    stats = None
    options = plan["options"]
    if name == "stock":
        stock = plan["root"] + "/stock"
        dcp.load(target, storage_reader=FsspecReader(stock, **options) if options else dcp.FileSystemReader(stock))
    else:
        reader = AtomicStorageReader(plan["root"], RUN_ID, 1, share_reads=name == "share-on", storage_options=options,
                                     **buffer)
        dcp.load(target, storage_reader=reader, planner=AtomicLoadPlanner())
        stats = reader.read_stats.to_dict()
    after = _io()
    return {"rchar": after["rchar"] - before["rchar"], "device_bytes": after["read_bytes"] - before["read_bytes"],
            "reader": stats}


def _rank(ctx, plan: dict, progress: Progress) -> dict | None:
    quiet_warnings()
    rank, world = ctx.rank, ctx.world_size
    state = transformer_state(plan["gb"] * GB, plan["hidden"])  # the same on every rank: replicas
    target = zeroed_like(state)
    _save(state, plan)
    results: dict = {name: {"warm": [], "cold": []} for name in LOADS}
    rounds = [("warm-up", LOADS)] + [(f"{r + 1}/{plan['repeats']}", LOADS[::-1] if r % 2 else LOADS)
                                     for r in range(plan["repeats"])]
    for round_label, names in rounds:
        for name in names:
            for kind in ("warm", "cold") if plan["cold"] else ("warm",):
                if kind == "cold" and rank == 0:
                    drop_caches()
                if round_label == "warm-up":
                    clear(target)
                record = gather(measured(lambda: _load(target, name, plan)))
                if round_label == "warm-up":
                    assert_bit_exact(state, target, f"rank {rank} {name}")
                progress.done += 1
                if rank != 0:
                    continue
                seconds = max(r["seconds"] for r in record)
                say(f"{progress.stamp()} w{world} {round_label:<7} {name:<9} {kind} {seconds:6.2f}s")
                if round_label != "warm-up":
                    results[name][kind].append(record)
    return results if rank == 0 else None


def _unique_bytes(root: str, options: dict | None) -> int:
    """Stored bytes of dcp_atomic's data files (wherever its layout puts them under ``root``; stock's data lies
    under ``root/stock``): what one read of each item costs."""
    fs = fsspec.filesystem("s3", **options) if options else fsspec.filesystem("file")
    stock = fs._strip_protocol(f"{root}/stock") + "/"
    return sum(info["size"] for path, info in fs.find(root, detail=True).items()
               if path.endswith(".distcp") and not path.startswith(stock))


def _summary(per_load: dict, world: int, state_bytes: int, unique: int, s3: bool) -> dict:
    out = {}
    for name, kinds in per_load.items():
        row = {}
        for kind, records in kinds.items():
            if not records:
                continue
            seconds = report.med([max(r["seconds"] for r in rec) for rec in records])
            read = report.med([sum((r["reader"] or {}).get("storage_bytes", r["rchar"]) for r in rec)
                               for rec in records])
            device = report.med([sum(r["device_bytes"] for r in rec) for rec in records])
            rss = report.med([max(r["rss_extra"] for r in rec) for rec in records])
            row[kind] = {"seconds": seconds, "gbps": world * state_bytes / GB / seconds, "peak_rss_extra": rss,
                         # rchar misses socket reads: stock's bytes from S3 are not counted
                         "read_vs_unique": read / unique if read or not s3 else None,
                         "device_vs_unique": None if s3 else device / unique}
        out[name] = row
    for name, row in out.items():
        for kind, cell in row.items():
            base = out["share-off"].get(kind)
            cell["x_vs_share_off"] = base["seconds"] / cell["seconds"] if base else None
    return out


def run(args: argparse.Namespace) -> dict:
    began = time.monotonic()
    state_bytes = tensor_bytes(transformer_state(args.gb * GB, args.hidden))
    if args.store == "s3":
        cold_ok, cold_note = False, "S3: no cold loads (the server's cache is not the client's)"
    else:
        cold_ok, cold_note = (False, "cold loads skipped (--no-cold)") if args.no_cold else can_drop_caches()
    say(f"replicated restore: {state_bytes / GB:.2f} GB per rank on {args.store}, worlds {args.world_sizes}, "
        f"{args.repeats} repeat(s); {cold_note}")
    ops = len(LOADS) * (args.repeats + 1) * (2 if cold_ok else 1)
    progress = Progress(total=len(args.world_sizes) * ops, started=time.monotonic())
    raw, summary, checks = {}, {}, []
    with contextlib.ExitStack() as stack:
        media = stack.enter_context(Media(["disk"], 3 * state_bytes, args.disk_root))
        if args.store == "s3":
            from benchmarks.s3 import server

            endpoint = stack.enter_context(server(args.server, None))
            options = {"endpoint_url": endpoint, "key": "bench", "secret": "bench",
                       "client_kwargs": {"region_name": "us-east-1"}}
            bucket = f"dcp-restore-{secrets.token_hex(4)}"
            fsspec.filesystem("s3", **options).mkdir(bucket)
        for world in args.world_sizes:
            root = (f"s3://{bucket}/w{world}" if args.store == "s3" else os.path.join(media.dirs["disk"], f"w{world}"))
            plan = {"gb": args.gb, "hidden": args.hidden, "root": root, "cold": cold_ok, "repeats": args.repeats,
                    "share_buffer_mib": args.share_buffer_mib,
                    "options": options if args.store == "s3" else None}
            raw[str(world)] = launch(_rank, world, media.dirs["disk"], args=(plan, progress),
                                     op_timeout=args.op_timeout, ops=ops + 2)
            unique = _unique_bytes(root, plan["options"])
            summary[str(world)] = _summary(raw[str(world)], world, state_bytes, unique, args.store == "s3")
            progress.done = ops * (args.world_sizes.index(world) + 1)
            on = summary[str(world)]["share-on"]
            checks.append(report.check("storage bytes read <= 1.05x unique (shared)", on["warm"]["read_vs_unique"],
                                       1.05, False, world=str(world), medium=args.store, contender="share-on"))
            checks.append(report.check("warm restore no slower than unshared", on["warm"]["x_vs_share_off"], 1.0,
                                       True, world=str(world), medium=args.store, contender="share-on"))
            if world >= 4 and ("cold" in on or args.store == "s3"):
                cell = on["cold"] if "cold" in on else on["warm"]
                checks.append(report.check(f"{'cold' if 'cold' in on else 's3'} restore >= {TARGETS['cold']}x unshared",
                                           cell["x_vs_share_off"], TARGETS["cold"], True, world=str(world),
                                           medium=args.store, contender="share-on"))
    print(f"\nreplicated restore on {args.store}, {state_bytes / GB:.2f} GB per rank, median of {args.repeats}; "
          f"x = vs sharing off; RSS+ = peak resident-set growth of the largest rank during a warm load (VmHWM); "
          f"share_buffer_bytes {args.share_buffer_mib or 256} MiB")
    print("| world | load | warm s | warm GB/s | x | read / unique | RSS+ MiB | cold s | cold GB/s | x | disk / unique |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for world, rows in summary.items():
        for name, row in rows.items():
            warm, cold = row.get("warm", {}), row.get("cold", {})
            print(f"| {world} | {name} | {report.fmt(warm.get('seconds'), '.2f')} | {report.fmt(warm.get('gbps'), '.2f')}"
                  f" | {report.fmt(warm.get('x_vs_share_off'), '.2f')}x | {report.fmt(warm.get('read_vs_unique'), '.2f')}"
                  f" | {report.fmt(warm['peak_rss_extra'] / MiB if warm else None, '.0f')}"
                  f" | {report.fmt(cold.get('seconds'), '.2f')} | {report.fmt(cold.get('gbps'), '.2f')}"
                  f" | {report.fmt(cold.get('x_vs_share_off'), '.2f')}x | {report.fmt(cold.get('device_vs_unique'), '.2f')} |")
    report.print_targets(checks)
    wall = time.monotonic() - began
    print(f"\nwall time {wall:.0f} s; load average {os.getloadavg()[0]:.2f} at the end")
    return {"config": {"world_sizes": args.world_sizes, "store": args.store, "state_bytes_per_rank": state_bytes,
                       "repeats": args.repeats, "share_buffer_mib": args.share_buffer_mib,
                       "cold_loads": cold_note, "media_dirs": media.notes, "smoke": args.smoke},
            "environment": report.environment(), "wall_seconds": wall, "raw": raw, "summary": summary,
            "targets": checks}
