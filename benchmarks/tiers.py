"""Two tiers (P13): node-local saves with replicas against direct durable saves, world 4 as 2 simulated nodes.

What it measures
    One world of 4 gloo ranks plays 2 nodes (``DCP_ATOMIC_FAILURE_DOMAIN`` nodeA / nodeB, ``LOCAL_WORLD_SIZE=2``);
    each node's ``local_root`` is its own tmpfs mount (``/dev/shm`` subdirectories where mounting is refused: the
    output says which).  The state (``--size-mb`` in all, bf16 weights + two fp32 Adam moments as DTensors sharded
    over the 4 ranks) is saved through ``CheckpointManager`` in every case, so every contender runs the same code,
    the library's default thread count in each rank and the same fsync/commit rules; only the tier differs.
    Durable roots: a directory on a disk (``--disk-root``) and a bucket on a local S3 server (SeaweedFS by
    default, ``--server``).  For each durable root, each round runs two blocks, in alternating order:

    tiered   ``CheckpointManager(root, local=LocalTierOptions(node's tmpfs, replicas=1, keep_local=1))``:
             ``save(durable=False)`` (stall = time to local-committed), ``async_save(durable=False)`` (stall = the
             call, then time to local-committed = the future), ``save(durable=True)`` + ``wait()`` (the drain's
             own seconds from ``on_drained``'s DrainStats); then node B's local root is emptied (a replaced node)
             and a fresh manager restores the newest step from node A's replicas; then a manager without a local
             tier restores the drained step from the durable root;
    direct   ``CheckpointManager(root)`` (no local tier): ``save``, then ``async_save`` (stall and time to
             committed).

    A warm-up round (not counted) checks both restores bit-exact and that the first was served by the local tier.
    Before each operation rank 0 runs ``sync`` (no dirty pages of the previous operation are flushed inside the
    next); as root, restores start after ``drop_caches`` (a restarted job reads durable files cold; tmpfs pages
    cannot be dropped, as a node's local NVMe would be read from the device).

What the numbers mean
    seconds = the slowest rank's wall time (medians over rounds; the local save and the replica restore pool the
    samples of both durable roots: they do not touch it); GB/s = the state's tensor bytes / seconds; x = the
    direct save's (or restore's) seconds over the row's.  Peak RSS = the largest rank's VmHWM during the
    operation (the kernel's high-water mark of resident memory, reset before each operation), the state and its
    load target (one copy each) included; "+" = its growth over the RSS before the operation.  tmpfs pages are
    not in any process's RSS: the local tier's files cost each node their size in RAM besides.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import secrets
import shutil
import subprocess
import tempfile
import time

from benchmarks import report
from benchmarks.common import (GB, MiB, BenchError, PeakRss, assert_bit_exact, clear, drop_caches, fs_type,
                               quiet_warnings, say, tensor_bytes, transformer_state, zeroed_like)
from benchmarks.world import Progress, gather

WORLD, NODES = 4, 2
STORES = ("s3", "disk")
TARGETS = {"local_vs_s3_save": 5.0, "replicas_vs_s3_restore": 2.0, "drain_vs_direct": 1.0}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size-mb", type=float, default=1000, help="state of all 4 ranks, MB = 1e6 bytes "
                        "(default %(default)s)")
    parser.add_argument("--hidden", type=int, default=1024, help="model width of the generated state")
    parser.add_argument("--repeats", type=int, default=3, help="counted rounds (default %(default)s)")
    parser.add_argument("--server", default="seaweedfs", help="S3 server: seaweedfs (default), moto or an endpoint "
                        "URL (credentials from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)")
    parser.add_argument("--disk-root", default=None, help="durable directory on a disk (default /var/tmp)")
    parser.add_argument("--no-warmup", action="store_true", help="verify in the first counted round instead")
    parser.add_argument("--no-cold", action="store_true", help="do not drop the page cache before restores")
    parser.add_argument("--op-timeout", type=float, default=600, help="seconds one operation may take")
    parser.add_argument("--json", default="bench-results/tiers.json", help="results file (default %(default)s)")
    parser.add_argument("--smoke", action="store_true", help="seconds: moto, 4 MB, 1 round, no warm-up")


def finish_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.smoke:
        args.size_mb, args.hidden, args.repeats, args.server, args.no_warmup = 4, 64, 1, "moto", True
        args.no_cold, args.op_timeout = True, 60
    if args.repeats < 1 or args.size_mb <= 0:
        parser.error("--repeats and --size-mb must be positive")


# -- the nodes' local roots ---------------------------------------------------------------------------------


@contextlib.contextmanager
def node_roots(size_bytes: int):
    """One local root per simulated node: its own tmpfs mount (unmounted after), else a /dev/shm subdirectory."""
    made: list[str] = []
    mounted: list[str] = []
    how = "tmpfs mounts"
    try:
        for node in range(NODES):
            point = tempfile.mkdtemp(prefix=f"dcp-tiers-node{'AB'[node]}-")
            made.append(point)
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=0755", "tmpfs", point],
                                  capture_output=True, text=True)
            if done.returncode == 0:
                mounted.append(point)
                continue
            how = f"/dev/shm subdirectories (mount refused: {done.stderr.strip() or done.returncode})"
            break
        if len(mounted) < NODES:
            for point in mounted:
                subprocess.run(["umount", point], check=False)
            for point in made:
                os.rmdir(point)
            mounted, made = [], [tempfile.mkdtemp(prefix=f"dcp-tiers-node{'AB'[n]}-", dir="/dev/shm")
                                 for n in range(NODES)]
        yield made, how
    finally:
        for point in made:
            if point in mounted:
                if subprocess.run(["umount", point], capture_output=True).returncode != 0:
                    subprocess.run(["umount", "-l", point], capture_output=True)
                with contextlib.suppress(OSError):
                    os.rmdir(point)
            else:
                shutil.rmtree(point, ignore_errors=True)


def node_env(rank: int) -> dict[str, str]:
    """torchrun's per-node variables for rank ``rank`` of 2 nodes of 2 ranks, and its failure domain."""
    node = rank // (WORLD // NODES)
    return {"DCP_ATOMIC_FAILURE_DOMAIN": f"node{'AB'[node]}", "LOCAL_RANK": str(rank % (WORLD // NODES)),
            "LOCAL_WORLD_SIZE": str(WORLD // NODES), "GROUP_RANK": str(node)}


# -- one rank ----------------------------------------------------------------------------------------------


def _timed(fn) -> dict:
    """This rank's wall seconds, peak RSS (VmHWM) and its growth during ``fn``, between two barriers."""
    import torch.distributed as dist

    dist.barrier()
    with PeakRss() as rss:
        started = time.perf_counter()
        extra = fn()
        seconds = time.perf_counter() - started
    dist.barrier()
    return {"seconds": seconds, "rss_peak": rss.baseline + rss.extra, "rss_extra": rss.extra,
            **(extra if isinstance(extra, dict) else {})}


class _Rank:
    """What one rank measures; rank 0 keeps every rank's records in ``samples``."""

    def __init__(self, ctx, plan: dict, progress: Progress) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        from dcp_atomic import Parallelism

        self.rank, self.plan, self.progress = ctx.rank, plan, progress
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
        self.parallelism = Parallelism(dp=WORLD)
        self.state = transformer_state(plan["size_bytes"], plan["hidden"], ctx.rank, WORLD, mesh)
        self.target = zeroed_like(self.state)
        self.local_root = plan["nodes"][ctx.rank // (WORLD // NODES)]
        self.samples: dict[str, list[dict]] = {}
        self.runs = itertools.count()

    def manager(self, store: str, run: str, tiered: bool, **kwargs):
        from dcp_atomic import CheckpointManager, LocalTierOptions

        options = self.plan["s3_options"] if store == "s3" else None
        local = LocalTierOptions(self.local_root, replicas=1, keep_local=1) if tiered else None
        return CheckpointManager(self.plan["roots"][store], run, parallelism=self.parallelism, local=local,
                                 storage_options=options, timeout=self.plan["op_timeout"], **kwargs)

    def settle(self, cold: bool = False) -> None:
        """Rank 0 flushes dirty pages (and, for a cold restore, drops the page cache) outside the timed window."""
        import torch.distributed as dist

        if self.rank == 0 and self.plan["settle"]:
            drop_caches() if cold and self.plan["cold"] else os.sync()
        dist.barrier()

    def op(self, name: str, fn, counted: bool, label: str, cold: bool = False) -> list[dict]:
        self.settle(cold)
        records = gather(_timed(fn))
        self.progress.done += 1
        if self.rank == 0:
            seconds = max(r["seconds"] for r in records)
            stall = max((r["stall"] for r in records if "stall" in r), default=None)
            say(f"{self.progress.stamp()} {label:<7} {name:<24} {seconds:7.2f}s"
                + (f" (stall {stall:.3f}s)" if stall is not None else "")
                + f"  peak RSS {max(r['rss_peak'] for r in records) / MiB:.0f} MiB"
                + ("" if counted else "  (not counted)"))
            if counted:
                self.samples.setdefault(name, []).append({"records": records})
        return records

    def split(self, saved: list[dict], name: str, counted: bool) -> None:
        """Rank 0: how much of the local save was the local commit (replication, decision, markers: SaveStats'
        ``local_commit_seconds``) rather than DCP's write into the node's own root."""
        if self.rank != 0 or not saved:
            return
        commit = saved[-1].get("local_commit_seconds")
        if commit is not None:
            say(f"{'':>8}{name}: local commit (replication + markers) {commit:.2f}s of {saved[-1]['seconds']:.2f}s")
            if counted:
                self.samples[name][-1]["local_commit_seconds"] = commit

    def restored(self, where: str, served, step: int, tier: str | None, verify: bool) -> None:
        if verify:
            assert_bit_exact(self.state, self.target, f"rank {self.rank} after {where}")
        if served is not None and (served.get("tier"), served.get("step")) != (tier, step):
            raise BenchError(f"rank {self.rank}: {where} was served by {served}, expected the {tier} tier's step "
                             f"{step}; the benchmark would time the wrong thing")

    def tiered(self, store: str, counted: bool, label: str, verify: bool) -> None:
        from dcp_atomic import Callbacks

        run = f"tiers-{next(self.runs)}"
        drained: list[dict] = []
        saved: list[dict] = []
        callbacks = Callbacks(on_drained=drained.append, on_saved=saved.append)
        with self.manager(store, run, True, callbacks=callbacks) as manager:
            self.op("local save", lambda: manager.save(1, self.state, durable=False), counted, label)
            self.split(saved, "local save", counted)

            def asynchronous() -> dict:
                started = time.perf_counter()
                future = manager.async_save(2, self.state, durable=False)
                stall = time.perf_counter() - started
                future.result()
                return {"stall": stall}

            self.op("local async_save", asynchronous, counted, label)
            self.split(saved, "local async_save", counted)

            def save_and_drain() -> None:
                manager.save(3, self.state, durable=True)
                manager.wait()

            self.op(f"local save + drain {store}", save_and_drain, counted, label)
        if self.rank == 0:
            if [d["step"] for d in drained] != [3]:
                raise BenchError(f"drain to {store}: on_drained reported {drained}, expected step 3 once")
            if counted:
                self.samples[f"local save + drain {store}"][-1]["drain"] = drained[0]
            say(f"{'':>8}drain {store}: {drained[0]['seconds']:.2f}s, {drained[0]['bytes'] / MiB:.0f} MiB, "
                f"queued {drained[0]['queued_seconds']:.3f}s, attempt {drained[0]['attempts']}")
        self.lose_node_b(run)
        if verify:
            clear(self.target)
        with self.manager(store, run, True) as fresh:  # a restarted job's manager, built outside the timing
            def from_replicas() -> dict:
                step = fresh.load(self.target)
                return {"step": step, "ranks_fetched": (fresh.restored_from or {}).get("ranks_fetched")}

            self.op("restore from replicas", from_replicas, counted, label, cold=True)
            self.restored("the restore after losing node B", fresh.restored_from, 3, "local", verify)
        if verify:
            clear(self.target)
        with self.manager(store, run, False) as durable:
            records = self.op(f"restore from {store}", lambda: {"step": durable.load(self.target)}, counted, label,
                              cold=True)
            self.restored(f"the restore from {store}", {"tier": "durable", "step": records[self.rank]["step"]}, 3,
                          "durable", verify)
        self.clean(store, run)

    def lose_node_b(self, run: str) -> None:
        """Node B is replaced: its local root comes back empty (done by node B's first rank)."""
        import torch.distributed as dist

        dist.barrier()
        if self.rank == WORLD // NODES:
            shutil.rmtree(os.path.join(self.plan["nodes"][1], run))
        dist.barrier()

    def direct(self, store: str, counted: bool, label: str) -> None:
        run = f"direct-{next(self.runs)}"
        with self.manager(store, run, False) as manager:
            self.op(f"direct save {store}", lambda: manager.save(1, self.state), counted, label)

            def asynchronous() -> dict:
                started = time.perf_counter()
                future = manager.async_save(2, self.state)
                stall = time.perf_counter() - started
                future.result()
                return {"stall": stall}

            self.op(f"direct async_save {store}", asynchronous, counted, label)
        self.clean(store, run)

    def clean(self, store: str, run: str) -> None:
        """Rank 0 removes the run from the durable root and from both nodes' local roots, outside any timing."""
        import torch.distributed as dist

        dist.barrier()
        if self.rank == 0:
            for node in self.plan["nodes"]:
                shutil.rmtree(os.path.join(node, run), ignore_errors=True)
            if store == "disk":
                shutil.rmtree(os.path.join(self.plan["roots"]["disk"], run), ignore_errors=True)
            else:
                import fsspec

                fs = fsspec.filesystem("s3", skip_instance_cache=True, use_listings_cache=False,
                                       **self.plan["s3_options"])
                bucket = self.plan["roots"]["s3"].removeprefix("s3://").split("/")[0]
                doomed = [path for path in fs.find(bucket) if f"/{run}/" in path]  # data prefixes: _dXX/<run>/
                if doomed:
                    fs.rm(doomed)
        dist.barrier()


def _rank(ctx, plan: dict, progress: Progress) -> dict | None:
    import resource

    quiet_warnings()
    me = _Rank(ctx, plan, progress)
    from dcp_atomic.dcp.identity import default_thread_count

    threads = gather(default_thread_count())
    rounds = ([] if plan["no_warmup"] else [("warm-up", False)]) + \
        [(f"{r + 1}/{plan['repeats']}", True) for r in range(plan["repeats"])]
    for index, (label, counted) in enumerate(rounds):
        verify = index == 0
        stores = STORES if index % 2 == 0 else STORES[::-1]
        for s_index, store in enumerate(stores):
            tiered_first = (index + s_index) % 2 == 0  # ABBA over rounds and stores
            blocks = [lambda: me.tiered(store, counted, label, verify), lambda: me.direct(store, counted, label)]
            for block in blocks if tiered_first else blocks[::-1]:
                block()
    maxrss = gather(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    if ctx.rank != 0:
        return None
    return {"samples": me.samples, "threads": threads, "ru_maxrss": maxrss}


# -- the parent --------------------------------------------------------------------------------------------


def _seconds(samples: list[dict]) -> list[float]:
    return [max(r["seconds"] for r in s["records"]) for s in samples]


def _summary(samples: dict, data_bytes: int) -> dict:
    """Per measurement: median seconds, GB/s, the stall (async), peak RSS; drains: DrainStats' own seconds."""
    gb = data_bytes / GB
    rows: dict[str, dict] = {}

    def row(name: str, seconds: list[float], entries: list[dict]) -> None:
        median = report.med(seconds)
        stalls = [max(r["stall"] for r in s["records"]) for s in entries if "stall" in s["records"][0]]
        rows[name] = {"seconds": median, "runs": seconds, "gbps": gb / median,
                      "stall_seconds": report.med(stalls), "stall_runs": stalls or None,
                      "peak_rss_mib": max(r["rss_peak"] for s in entries for r in s["records"]) / MiB,
                      "peak_rss_extra_mib": max(r["rss_extra"] for s in entries for r in s["records"]) / MiB}

    for name, entries in samples.items():
        row(name, _seconds(entries), entries)
        commits = [s["local_commit_seconds"] for s in entries if "local_commit_seconds" in s]
        if commits:
            rows[name]["local_commit_seconds"] = report.med(commits)
        if name.startswith("local save + drain"):
            store = name.rsplit(" ", 1)[1]
            row(f"drain {store}", [s["drain"]["seconds"] for s in entries], entries)
            rows[f"drain {store}"]["queued_seconds"] = report.med([s["drain"]["queued_seconds"] for s in entries])
    return rows


def _ratio(rows: dict, slower: str, faster: str, key: str = "seconds") -> float | None:
    a, b = rows.get(slower), rows.get(faster)
    return a[key] / b[key] if a and b and a.get(key) and b.get(key) else None


ROWS = [  # (row, what it is, the direct row it is compared with)
    ("direct save s3", "direct save to S3 (sync): stall = committed", None),
    ("direct async_save s3", "direct async_save to S3: time to committed", None),
    ("direct save disk", "direct save to disk (sync): stall = committed", None),
    ("direct async_save disk", "direct async_save to disk: time to committed", None),
    ("local save", "local save (sync): stall = time to local-committed", "direct save s3"),
    ("local async_save", "local async_save: time to local-committed", "direct save s3"),
    ("drain s3", "drain to S3 (DrainStats seconds)", "direct save s3"),
    ("drain disk", "drain to disk (DrainStats seconds)", "direct save disk"),
    ("restore from replicas", "restore after losing node B (replicas)", "restore from s3"),
    ("restore from s3", "restore from durable S3", None),
    ("restore from disk", "restore from durable disk", None),
]


def _print_table(rows: dict, intro: str) -> None:
    print(f"\n{intro}")
    print("| measurement | seconds | GB/s | stall s (async) | x vs | peak RSS MiB (+) |")
    print("|---|---|---|---|---|---|")
    for name, what, versus in ROWS:
        r = rows.get(name)
        if r is None:
            continue
        x = _ratio(rows, versus, name) if versus else None
        print(f"| {what} | {r['seconds']:.2f} | {r['gbps']:.2f} | {report.fmt(r['stall_seconds'], '.3f')} | "
              + (f"{x:.2f}x {versus}" if x is not None else "") +
              f" | {r['peak_rss_mib']:.0f} (+{r['peak_rss_extra_mib']:.0f}) |")


def _targets(rows: dict) -> list[dict]:
    checks = [
        report.check("time to local-committed >= 5x faster than a direct S3 save",
                     _ratio(rows, "direct save s3", "local save"), TARGETS["local_vs_s3_save"], True,
                     world=str(WORLD), medium="s3", note="local save (sync) vs direct save (sync)"),
        report.check("restore from replicas >= 2x faster than from S3",
                     _ratio(rows, "restore from s3", "restore from replicas"), TARGETS["replicas_vs_s3_restore"], True,
                     world=str(WORLD), medium="s3"),
    ]
    for store in STORES:
        checks.append(report.check(f"drain no slower than a direct {store} save",
                                   _ratio(rows, f"direct save {store}", f"drain {store}"), TARGETS["drain_vs_direct"],
                                   True, world=str(WORLD), medium=store, note="direct save seconds / drain seconds"))
    return checks


def run(args: argparse.Namespace) -> dict:
    from benchmarks.common import can_drop_caches
    from benchmarks.s3 import server

    began = time.monotonic()
    size_bytes = int(args.size_mb * 1e6)
    data_bytes = tensor_bytes(transformer_state(size_bytes, args.hidden))
    if args.no_cold:
        cold, cold_note = False, "page cache kept before restores (--no-cold)"
    else:
        cold, cold_note = can_drop_caches()
        cold_note = cold_note.replace("cold loads", "cold restores")
    per_node = int(2.2 * data_bytes) + 64 * MiB  # keep_local=1: the newest step and the one being written
    load_before = os.getloadavg()
    with contextlib.ExitStack() as stack:
        nodes, how = stack.enter_context(node_roots(per_node))
        disk_parent = args.disk_root or "/var/tmp"
        if fs_type(disk_parent) in ("tmpfs", "ramfs"):
            raise SystemExit(f"--disk-root {disk_parent} is on {fs_type(disk_parent)}, not a disk")
        disk = stack.enter_context(tempfile.TemporaryDirectory(prefix="dcp-tiers-durable-", dir=disk_parent))
        endpoint = stack.enter_context(server(args.server, None))
        key = os.environ.get("AWS_ACCESS_KEY_ID", "bench")  # a --server URL may need real credentials
        secret = os.environ.get("AWS_SECRET_ACCESS_KEY", "bench")
        options = {"endpoint_url": endpoint, "key": key, "secret": secret,
                   "client_kwargs": {"region_name": "us-east-1"}}
        import boto3

        bucket = f"dcp-tiers-{secrets.token_hex(4)}"
        boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=key, aws_secret_access_key=secret,
                     region_name="us-east-1").create_bucket(Bucket=bucket)
        say(f"two tiers: {data_bytes / GB:.3f} GB of tensors over {WORLD} ranks as {NODES} nodes; local roots: {how}"
            f" ({', '.join(f'{n} ({fs_type(n)})' for n in nodes)}); durable: {disk} ({fs_type(disk)}) and "
            f"s3://{bucket} on {args.server} at {endpoint}; {cold_note}")
        plan = {"size_bytes": size_bytes, "hidden": args.hidden, "repeats": args.repeats, "nodes": nodes,
                "roots": {"disk": disk, "s3": f"s3://{bucket}/durable"}, "s3_options": options, "cold": cold,
                "no_warmup": args.no_warmup, "op_timeout": args.op_timeout,
                "settle": not args.smoke}  # the smoke proves it runs: no machine-wide sync per operation
        rounds = args.repeats + (0 if args.no_warmup else 1)
        ops = rounds * len(STORES) * 7
        progress = Progress(total=ops, started=time.monotonic())
        from testbed.worlds import run_world

        outcomes = run_world(_rank, WORLD, disk, args=(plan, progress), rank_env=node_env,
                             timeout=args.op_timeout * (ops + 10) + 60, pg_timeout=args.op_timeout)
        failed = [o for o in outcomes if not o.ok]
        if failed:
            raise BenchError("\n".join(f"rank {o.rank}: {o.error_type} (exit {o.exitcode}): {o.error}" for o in failed))
        raw = outcomes[0].value
    rows = _summary(raw["samples"], data_bytes)
    checks = _targets(rows)
    threads = raw["threads"]
    intro = (f"two tiers, world {WORLD} as {NODES} nodes, {data_bytes / GB:.3f} GB of tensors, median of "
             f"{args.repeats}; local roots on {how.split(' (')[0]}, durable on disk and S3 ({args.server}); "
             f"thread_count {threads[0] if len(set(threads)) == 1 else threads} per rank (library default); "
             f"load average {load_before[0]:.2f} at the start, {os.getloadavg()[0]:.2f} at the end; {cold_note}")
    _print_table(rows, intro)
    for name in ("local save", "local async_save"):
        commit = rows.get(name, {}).get("local_commit_seconds")
        if commit is not None:
            print(f"{name}: of its {rows[name]['seconds']:.2f}s, the local commit (replicas sent, verified and "
                  f"written; rank 0's decision; markers) took {commit:.2f}s (rank 0's SaveStats, median)")
    report.print_verdicts(checks, 62, "x")
    print("peak RSS over the whole run (ru_maxrss, per rank): "
          + ", ".join(f"{m / MiB:.0f}" for m in raw["ru_maxrss"]) + " MiB")
    wall = time.monotonic() - began
    print(f"wall time {wall:.0f} s")
    return {"config": {"world": WORLD, "nodes": NODES, "size_mb": args.size_mb, "data_bytes": data_bytes,
                       "hidden": args.hidden, "repeats": args.repeats, "server": args.server,
                       "local_roots": how, "cold_restores": cold_note, "thread_count": threads,
                       "warmup": not args.no_warmup, "smoke": args.smoke},
            "environment": {**report.environment(), "loadavg_before": load_before}, "wall_seconds": wall,
            "summary": rows, "targets": checks, "ru_maxrss": raw["ru_maxrss"], "raw": raw["samples"]}

