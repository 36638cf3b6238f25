"""The memory tier (P16): snapshots into RAM with verified replicas against today's local-tier save, a direct disk
save and the transport's floor, world 4 as 2 simulated nodes.

What it measures
    One world of 4 gloo ranks plays 2 nodes (failure domains nodeA / nodeB, 2 ranks each, as ``bench.py tiers``);
    each node's memory path and local root are on its own tmpfs mount (``/dev/shm`` subdirectories where mounting
    is refused: the output says which); the durable root is a directory on a disk (``--disk-root``).  The state
    (``--mib-per-rank`` per rank: bf16 weights and two fp32 Adam moments as DTensors sharded over the 4 ranks) is
    the same in every block; each round runs them in turn:

    memory   ``CheckpointManager(disk, memory=MemoryTier(node's tmpfs, every=1, replicas=1, slots=2))``: snapshots
             of steps 1 and 2 fill both slots (not timed), then step 3's snapshot rewrites the oldest slot in place:
             the call's block (``stall``) and the time until the future resolves, memory-committed on every rank
             (replica verified by its holder, records written); then a fresh manager restores step 3 from every
             rank's own slots; then node B's memory path is emptied (a replaced node) and a fresh manager restores
             from the replicas node A holds;
    local    ``CheckpointManager(disk, local=LocalTierOptions(node's tmpfs, replicas=1, keep_local=1))``:
             ``save(durable=False)`` (time to local-committed), then node B's local root is emptied and a fresh
             manager restores from node A's replicas (today's replica restore);
    direct   ``CheckpointManager(disk)``: ``save`` (time to committed);
    floor    a raw gloo exchange of one share between the ranks a snapshot pairs across the nodes (r <-> r+2): what
             the transport alone takes to move the bytes one replica needs;
    in-place floor  the least a verified one-replica snapshot can cost on this machine, the same bytes between the
             same ranks: copy the state into a preallocated tmpfs file (mapped) hashing every 4 MiB block, send it
             from the mapping and receive the peer's straight into a second preallocated file, hash that (no
             records, no agreement, no sequence).  A snapshot within 1.5x of it spends little beyond its bytes.

    A warm-up round (not counted) checks every restore bit-exact and served by the tier it is timed for.  Before
    each operation rank 0 runs ``sync`` (the direct save's dirty pages are not flushed inside the next one).

What the numbers mean
    seconds = the slowest rank's wall time (median over rounds); GB/s = the whole state's tensor bytes / seconds;
    x = the compared row's seconds over this row's.  Memory, per node after step 3's snapshot: the bytes the run's
    slots take on the node's tmpfs and the largest RSS growth (VmHWM) of the node's ranks during the snapshot, summed
    over its ranks, against ``slots x (1 + replicas) x share`` of its ranks (the budget ``MemoryTier`` checks); and
    per rank the largest growth of anonymous memory (``RssAnon``: buffers, copies) apart from the slots' mapped
    tmpfs pages (``RssShmem``), sampled during the snapshot: the target bounds the first.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import shutil
import tempfile
import time

from benchmarks import report
from benchmarks.common import (GB, MiB, BenchError, PeakRssKinds, assert_bit_exact, clear, flat_items, fs_type,
                               local_of, quiet_warnings, say, tensor_bytes, transformer_state, zeroed_like)
from benchmarks.tiers import NODES, WORLD, node_env, node_roots
from benchmarks.world import Progress, gather, launch, measured

SLOTS, REPLICAS = 2, 1
RANKS_PER_NODE = WORLD // NODES
TARGETS = {"snapshot_vs_local_save": 3.0, "snapshot_vs_in_place_floor": 1.5, "replica_restore_vs_local": 2.0,
           "own_restore_vs_local": 3.0}
ALLOWANCE = 32 * MiB  # per node, beyond the slots: records, the spool, the interpreter's own growth


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mib-per-rank", type=float, default=256, help="state per rank, MiB (default %(default)s)")
    parser.add_argument("--hidden", type=int, default=1024, help="model width of the generated state")
    parser.add_argument("--repeats", type=int, default=3, help="counted rounds (default %(default)s)")
    parser.add_argument("--disk-root", default=None, help="durable directory on a disk (default /var/tmp)")
    parser.add_argument("--no-warmup", action="store_true", help="verify in the first counted round instead")
    parser.add_argument("--op-timeout", type=float, default=600, help="seconds one operation may take")
    parser.add_argument("--json", default="bench-results/memory.json", help="results file (default %(default)s)")
    parser.add_argument("--smoke", action="store_true", help="seconds: 2 MiB per rank, 1 round, no warm-up")


def finish_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.smoke:
        args.mib_per_rank, args.hidden, args.repeats, args.no_warmup, args.op_timeout = 2, 64, 1, True, 60
    if args.repeats < 1 or args.mib_per_rank <= 0:
        parser.error("--repeats and --mib-per-rank must be positive")


# -- one rank ----------------------------------------------------------------------------------------------


class _Rank:
    """What one rank measures; rank 0 keeps every rank's records in ``samples``."""

    def __init__(self, ctx, plan: dict, progress: Progress) -> None:
        import torch
        from torch.distributed.device_mesh import init_device_mesh

        self.rank, self.plan, self.progress = ctx.rank, plan, progress
        self.node = ctx.rank // RANKS_PER_NODE
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
        self.state = transformer_state(plan["size_bytes"], plan["hidden"], ctx.rank, WORLD, mesh)
        self.target = zeroed_like(self.state)
        self.samples: dict[str, list[dict]] = {}
        self.footprints: list[list[dict]] = []
        self.runs = itertools.count()

    def path(self, node: int, tier: str) -> str:
        return os.path.join(self.plan["nodes"][node], tier)

    def manager(self, run: str, *, memory: bool = False, local: bool = False):
        from dcp_atomic import CheckpointManager, LocalTierOptions, MemoryTier

        tiers = {}
        if memory:
            tiers["memory"] = MemoryTier(self.path(self.node, "mem"), every=1, replicas=REPLICAS, slots=SLOTS)
        if local:
            tiers["local"] = LocalTierOptions(self.path(self.node, "local"), replicas=REPLICAS, keep_local=1)
        return CheckpointManager(self.plan["disk"], run, timeout=self.plan["op_timeout"], **tiers)

    def op(self, name: str, fn, counted: bool, label: str) -> list[dict]:
        import torch.distributed as dist

        if self.rank == 0 and self.plan["settle"]:
            os.sync()
        dist.barrier()
        records = gather(measured(fn))
        self.progress.done += 1
        if self.rank == 0:
            stall = max((r["stall"] for r in records if "stall" in r), default=None)
            say(f"{self.progress.stamp()} {label:<7} {name:<28} {max(r['seconds'] for r in records):7.3f}s"
                + (f" (call {stall:.3f}s)" if stall is not None else "") + ("" if counted else "  (not counted)"))
            if counted:
                self.samples.setdefault(name, []).append({"records": records})
        return records

    def restore(self, run: str, name: str, tier: str, step: int, counted: bool, label: str, verify: bool,
                **tiers) -> None:
        if verify:
            clear(self.target)
        with self.manager(run, **tiers) as fresh:  # a restarted job's manager, built outside the timing
            self.op(name, lambda: {"step": fresh.load(self.target)}, counted, label)
            served = fresh.restored_from or {}
        if (served.get("tier"), served.get("step")) != (tier, step):
            raise BenchError(f"rank {self.rank}: {name} was served by {served}, expected the {tier} tier's step "
                             f"{step}; the benchmark would time the wrong thing")
        if verify:
            assert_bit_exact(self.state, self.target, f"rank {self.rank} after {name}")

    def memory(self, counted: bool, label: str, verify: bool) -> None:
        from dcp_atomic.memory import SlotDir

        run = f"memory-{next(self.runs)}"
        with self.manager(run, memory=True) as manager:
            for step in (1, 2):
                manager.snapshot(step, self.state).result()

            def snapshot() -> dict:
                with PeakRssKinds() as kinds:
                    started = time.perf_counter()
                    future = manager.snapshot(3, self.state)
                    stall = time.perf_counter() - started
                    if future.result() != 3:
                        raise BenchError(f"rank {self.rank}: the snapshot of step 3 was skipped")
                return {"stall": stall, "rss_anon": kinds.anon_extra, "rss_shmem": kinds.shmem_extra}

            records = self.op("snapshot (memory-committed)", snapshot, counted, label)
            skipped = manager.snapshots_skipped
        if self.rank == 0 and counted:
            self.footprints.append([{
                "node": "AB"[node], "tmpfs_bytes": SlotDir(self.path(node, "mem"), run).held_bytes(),
                "rss_extra_bytes": sum(records[r]["rss_extra"] for r in self.ranks_of(node)),
                "budget_bytes": SLOTS * (1 + REPLICAS) * self.plan["share_bytes"] * RANKS_PER_NODE,
                "snapshots_skipped": skipped} for node in range(NODES)])
        self.restore(run, "restore from own slots", "memory", 3, counted, label, verify, memory=True)
        self.lose_node_b(run, "mem")
        self.restore(run, "restore from replica slots", "memory-replica", 3, counted, label, verify, memory=True)
        self.clean(run)

    def local(self, counted: bool, label: str, verify: bool) -> None:
        run = f"local-{next(self.runs)}"
        with self.manager(run, local=True) as manager:
            self.op("local-tier save", lambda: {"step": manager.save(1, self.state, durable=False)},
                    counted, label)
        self.lose_node_b(run, "local")
        self.restore(run, "local-tier restore from replicas", "local", 1, counted, label, verify, local=True)
        self.clean(run)

    def direct(self, counted: bool, label: str) -> None:
        run = f"direct-{next(self.runs)}"
        with self.manager(run) as manager:
            self.op("direct save to disk", lambda: {"step": manager.save(1, self.state)}, counted, label)
        self.clean(run)

    def floor(self, counted: bool, label: str) -> None:
        import torch
        import torch.distributed as dist

        peer = (self.rank + RANKS_PER_NODE) % WORLD
        share = torch.ones(tensor_bytes(self.state), dtype=torch.uint8)  # touched: no page faults in the timing
        received = torch.ones_like(share)

        def exchange() -> None:
            sent, got = dist.isend(share, peer), dist.irecv(received, peer)
            sent.wait()
            got.wait()

        self.op("gloo send of one share (floor)", exchange, counted, label)
        del share, received

    def floor_in_place(self, counted: bool, label: str) -> None:
        """The in-place floor (module doc): copy + hash into a mapped tmpfs file, send from it, receive into another,
        hash that; both files preallocated and touched before the timing, as a tier's slots are after two
        snapshots."""
        import mmap

        import torch
        import torch.distributed as dist

        from dcp_atomic.format.integrity import BlockHasher

        peer = (self.rank + RANKS_PER_NODE) % WORLD
        tensors = [local_of(v) for _, v in flat_items(self.state) if isinstance(v, torch.Tensor)]
        length = sum(t.numel() * t.element_size() for t in tensors)
        folder = os.path.join(self.path(self.node, "mem"), "floor")
        os.makedirs(folder, exist_ok=True)
        maps = []
        for name in ("own", "replica"):
            fd = os.open(os.path.join(folder, f"r{self.rank}.{name}"), os.O_RDWR | os.O_CREAT, 0o600)
            os.ftruncate(fd, length)
            os.posix_fallocate(fd, 0, length)
            maps.append(mmap.mmap(fd, length))
            os.close(fd)
        own, replica = (torch.frombuffer(m, dtype=torch.uint8) for m in maps)
        own.fill_(1)
        replica.fill_(1)

        def copy_send_receive_hash() -> None:
            hasher, at = BlockHasher(), 0
            for t in tensors:
                nbytes = t.numel() * t.element_size()
                own[at:at + nbytes].copy_(t.reshape(-1).view(torch.uint8))
                hasher.update(memoryview(maps[0])[at:at + nbytes])
                at += nbytes
            sent, got = dist.isend(own, peer), dist.irecv(replica, peer)
            sent.wait()
            got.wait()
            received = BlockHasher()
            received.update(memoryview(maps[1]))

        self.op("in-place floor", copy_send_receive_hash, counted, label)
        del own, replica
        for m in maps:
            m.close()
        dist.barrier()
        if self.rank % RANKS_PER_NODE == 0:
            shutil.rmtree(folder, ignore_errors=True)

    def ranks_of(self, node: int) -> range:
        return range(node * RANKS_PER_NODE, (node + 1) * RANKS_PER_NODE)

    def lose_node_b(self, run: str, tier: str) -> None:
        """Node B is replaced: its tier's directory comes back empty (done by node B's first rank)."""
        import torch.distributed as dist

        dist.barrier()
        if self.rank == RANKS_PER_NODE:
            shutil.rmtree(os.path.join(self.path(1, tier), run))
        dist.barrier()

    def clean(self, run: str) -> None:
        import torch.distributed as dist

        dist.barrier()
        if self.rank == 0:
            for node in range(NODES):
                for tier in ("mem", "local"):
                    shutil.rmtree(os.path.join(self.path(node, tier), run), ignore_errors=True)
            shutil.rmtree(os.path.join(self.plan["disk"], run), ignore_errors=True)
        dist.barrier()


def _rank(ctx, plan: dict, progress: Progress) -> dict | None:
    quiet_warnings()
    if ctx.rank % RANKS_PER_NODE == 0:
        for tier in ("mem", "local"):
            os.makedirs(os.path.join(plan["nodes"][ctx.rank // RANKS_PER_NODE], tier), exist_ok=True)
    me = _Rank(ctx, plan, progress)
    rounds = ([] if plan["no_warmup"] else [("warm-up", False)]) + \
        [(f"{r + 1}/{plan['repeats']}", True) for r in range(plan["repeats"])]
    for index, (label, counted) in enumerate(rounds):
        blocks = [lambda: me.memory(counted, label, index == 0), lambda: me.local(counted, label, index == 0),
                  lambda: me.direct(counted, label), lambda: me.floor(counted, label),
                  lambda: me.floor_in_place(counted, label)]
        for block in blocks if index % 2 == 0 else blocks[::-1]:  # ABBA over rounds
            block()
    if ctx.rank != 0:
        return None
    return {"samples": me.samples, "footprints": me.footprints}


# -- the parent --------------------------------------------------------------------------------------------


ROWS = [  # (row, what it is, the row it is compared with)
    ("snapshot (memory-committed)", "snapshot: time to memory-committed", "local-tier save"),
    ("in-place floor", "in-place floor: copy + hash into a slot, send, receive in place, hash", None),
    ("local-tier save", "local-tier save to tmpfs (sync): time to local-committed", None),
    ("direct save to disk", "direct save to disk (sync)", None),
    ("gloo send of one share (floor)", "transport floor: one share over gloo, each pair both ways", None),
    ("restore from own slots", "restore from own slots (memory)", "local-tier restore from replicas"),
    ("restore from replica slots", "restore after node B's tmpfs is wiped (memory replicas)",
     "local-tier restore from replicas"),
    ("local-tier restore from replicas", "local-tier restore after node B is wiped (today's replica restore)", None),
]


def _summary(samples: dict, data_bytes: int) -> dict:
    rows = {}
    for name, entries in samples.items():
        seconds = [max(r["seconds"] for r in s["records"]) for s in entries]
        stalls = [max(r["stall"] for r in s["records"]) for s in entries if "stall" in s["records"][0]]
        rows[name] = {"seconds": report.med(seconds), "runs": seconds, "gbps": data_bytes / GB / report.med(seconds),
                      "call_seconds": report.med(stalls), "call_runs": stalls or None,
                      "rss_extra_mib": max(r["rss_extra"] for s in entries for r in s["records"]) / MiB,
                      "rss_anon_mib": max((r.get("rss_anon", 0) for s in entries for r in s["records"]),
                                          default=0) / MiB,
                      "rss_shmem_mib": max((r.get("rss_shmem", 0) for s in entries for r in s["records"]),
                                           default=0) / MiB}
    return rows


def _ratio(rows: dict, slower: str, faster: str) -> float | None:
    a, b = rows.get(slower), rows.get(faster)
    return a["seconds"] / b["seconds"] if a and b and b["seconds"] else None


def _memory(footprints: list[list[dict]]) -> list[dict]:
    """Per node, the largest footprint over the rounds, against its budget."""
    nodes = []
    for per_node in zip(*footprints):
        worst = max(per_node, key=lambda f: f["tmpfs_bytes"] + f["rss_extra_bytes"])
        nodes.append({**worst, "ratio": (worst["tmpfs_bytes"] + worst["rss_extra_bytes"]) / worst["budget_bytes"]})
    return nodes


def _targets(rows: dict, nodes: list[dict]) -> list[dict]:
    over = max((n["tmpfs_bytes"] + n["rss_extra_bytes"] - n["budget_bytes"] for n in nodes), default=None)
    snapshot = rows.get("snapshot (memory-committed)") or {}
    return [
        report.check("snapshot to memory-committed >= 3x faster than the local-tier save",
                     _ratio(rows, "local-tier save", "snapshot (memory-committed)"),
                     TARGETS["snapshot_vs_local_save"], True, world=str(WORLD), medium="tmpfs"),
        report.check("snapshot to memory-committed within 1.5x of the in-place floor (x of the floor)",
                     _ratio(rows, "snapshot (memory-committed)", "in-place floor"),
                     TARGETS["snapshot_vs_in_place_floor"], False, world=str(WORLD), medium="tmpfs"),
        report.check("restore from replica slots >= 2x faster than the local tier's",
                     _ratio(rows, "local-tier restore from replicas", "restore from replica slots"),
                     TARGETS["replica_restore_vs_local"], True, world=str(WORLD), medium="tmpfs"),
        report.check("restore from own slots >= 3x faster than the local tier's replica restore",
                     _ratio(rows, "local-tier restore from replicas", "restore from own slots"),
                     TARGETS["own_restore_vs_local"], True, world=str(WORLD), medium="tmpfs"),
        report.check("anonymous RSS growth per rank during a snapshot <= 32 MiB (MiB; slots' tmpfs pages apart)",
                     snapshot.get("rss_anon_mib"), ALLOWANCE / MiB, False, world=str(WORLD), medium="tmpfs",
                     note=f"mapped tmpfs pages (RssShmem) grew {snapshot.get('rss_shmem_mib', 0):.0f} MiB"),
        report.check("tmpfs + RSS growth per node <= slots x (1+replicas) x share + 32 MiB (MiB over the budget)",
                     None if over is None else over / MiB, ALLOWANCE / MiB, False, world=str(WORLD), medium="tmpfs",
                     note="largest node; negative: under the budget"),
    ]


def run(args: argparse.Namespace) -> dict:
    began = time.monotonic()
    size_bytes = int(args.mib_per_rank * MiB * WORLD)
    data_bytes = tensor_bytes(transformer_state(size_bytes, args.hidden))
    share_bytes = data_bytes // WORLD
    # per node: the memory tier's slots (own and replicas) and the local tier's newest step, own and replicas
    per_node = RANKS_PER_NODE * share_bytes * (SLOTS * (1 + REPLICAS) + 2 * (1 + REPLICAS)) + 256 * MiB
    load_before = os.getloadavg()
    with contextlib.ExitStack() as stack:
        nodes, how = stack.enter_context(node_roots(per_node))
        disk_parent = args.disk_root or "/var/tmp"
        if fs_type(disk_parent) in ("tmpfs", "ramfs"):
            raise SystemExit(f"--disk-root {disk_parent} is on {fs_type(disk_parent)}, not a disk")
        disk = stack.enter_context(tempfile.TemporaryDirectory(prefix="dcp-memory-durable-", dir=disk_parent))
        say(f"memory tier: {data_bytes / GB:.3f} GB of tensors over {WORLD} ranks as {NODES} nodes; tmpfs: {how} "
            f"({', '.join(f'{n} ({fs_type(n)})' for n in nodes)}); durable: {disk} ({fs_type(disk)})")
        plan = {"size_bytes": size_bytes, "hidden": args.hidden, "repeats": args.repeats, "nodes": nodes,
                "disk": disk, "share_bytes": share_bytes, "no_warmup": args.no_warmup, "op_timeout": args.op_timeout,
                "settle": not args.smoke}
        rounds = args.repeats + (0 if args.no_warmup else 1)
        ops = rounds * len(ROWS)
        progress = Progress(total=ops, started=time.monotonic())
        raw = launch(_rank, WORLD, disk, args=(plan, progress), op_timeout=args.op_timeout, ops=ops + 10,
                     rank_env=node_env)
    rows = _summary(raw["samples"], data_bytes)
    nodes_memory = _memory(raw["footprints"])
    checks = _targets(rows, nodes_memory)
    print(f"\nmemory tier, world {WORLD} as {NODES} nodes, {data_bytes / GB:.3f} GB of tensors ({share_bytes / MiB:.0f} "
          f"MiB per rank), median of {args.repeats}; tmpfs on {how.split(' (')[0]}, durable on disk; "
          f"MemoryTier(slots={SLOTS}, replicas={REPLICAS}); load average {load_before[0]:.2f} at the start, "
          f"{os.getloadavg()[0]:.2f} at the end")
    print("| measurement | seconds | GB/s | call s | x vs |")
    print("|---|---|---|---|---|")
    for name, what, versus in ROWS:
        r = rows.get(name)
        if r is None:
            continue
        x = _ratio(rows, versus, name) if versus else None
        print(f"| {what} | {r['seconds']:.3f} | {r['gbps']:.2f} | {report.fmt(r['call_seconds'], '.3f')} | "
              + (f"{x:.2f}x {versus}" if x is not None else "") + " |")
    print("\n| node | tmpfs MiB | RSS growth MiB | budget MiB (slots x (1+replicas) x share x ranks) | ratio |")
    print("|---|---|---|---|---|")
    for n in nodes_memory:
        print(f"| {n['node']} | {n['tmpfs_bytes'] / MiB:.0f} | {n['rss_extra_bytes'] / MiB:.0f} | "
              f"{n['budget_bytes'] / MiB:.0f} | {n['ratio']:.2f} |")
    snap = rows.get("snapshot (memory-committed)")
    if snap is not None:
        print(f"\nper rank during the snapshot: anonymous RSS growth (RssAnon) {snap['rss_anon_mib']:.1f} MiB, mapped "
              f"tmpfs pages (RssShmem) {snap['rss_shmem_mib']:.1f} MiB")
    report.print_verdicts(checks, 96)
    wall = time.monotonic() - began
    print(f"wall time {wall:.0f} s")
    return {"config": {"world": WORLD, "nodes": NODES, "mib_per_rank": args.mib_per_rank, "data_bytes": data_bytes,
                       "share_bytes": share_bytes, "hidden": args.hidden, "repeats": args.repeats, "slots": SLOTS,
                       "replicas": REPLICAS, "tmpfs": how, "warmup": not args.no_warmup, "smoke": args.smoke},
            "environment": {**report.environment(), "loadavg_before": load_before}, "wall_seconds": wall,
            "summary": rows, "memory": nodes_memory, "targets": checks, "raw": raw["samples"]}
