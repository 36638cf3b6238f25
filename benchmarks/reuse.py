"""Store a byte once (P15): a LoRA-shaped fine-tune saved with reuse on, with reuse off, and by stock DCP.

What it measures
    Per world (``--world-sizes``, default 1,2,4) each rank holds its share of a frozen base (``--base-mb`` in all,
    bf16, keys of its own) and an adapter with its two Adam moments (``--adapter-fraction`` of the base's bytes in
    all, fp32).  ``--saves`` saves (default 10) at steps 1, 2, ..., the adapter and its moments changed before each
    (a training step), the base never:

    reuse   ``CheckpointManager(root, run, keep_last=3, reuse=True).save(step, state)``
    full    the same with ``reuse=False`` (the default)
    stock   ``dcp.save`` into a ``FileSystemWriter`` directory per step, the fourth newest removed after each save

    then ``--async-saves`` more saves through ``async_save`` (the call's blocking time, then the time to committed),
    and a load of the newest step (the older ones retired, checked bit-exact).  Then a full fine-tune, where every
    tensor changes before every save: reuse against full (reuse must cost nothing there).  Before each operation
    rank 0 runs ``sync``, so no dirty pages of the last operation are flushed inside the next.

What the numbers mean
    seconds = the slowest rank's wall time, medians over saves 3..N: save 1 has no base, and save 2 is the first to
    find its unchanged items (by their digests) and links save 1's plain files that hold mostly unchanged bytes
    under stable names; "written" = bytes of the new step's files whose inode no other step of the run holds
    (hard-linked files are not written again), all ranks; "storage" = bytes of the distinct inodes under the run
    after the last save; x = full's value over the row's.  Targets (docs/benchmarks.md): written per save <= 5% of
    a full save's, save time <= 0.3x of a full save's, storage of the kept steps <= 1.2x one full step, the newest
    step loads as fast as a full one (<= 1.1x), and a full fine-tune with reuse within 2% of reuse off.  One changed
    element (issue 44): three reused saves, one element of one frozen tensor changed in the third: storage after
    them <= 1.2x one step, and the first reused save after a plain one (save 2) writes <= 10% of one step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time

from benchmarks import report
from benchmarks.common import GB, Media, MiB, assert_bit_exact, clear, quiet_warnings, say, zeroed_like
from benchmarks.world import gather, launch, measured

RUN = "finetune"
KEEP = 3
TARGETS = {"written": 0.05, "save_seconds": 0.3, "storage_vs_one_step": 1.2, "load_seconds": 1.1,
           "full_finetune_save_seconds": 1.02, "s3_read_vs_base": 0.01, "s3_save_seconds": 0.5,
           "one_element_storage": 1.2, "first_reused_written": 0.10}
# stable-file caps compared in the one-changed-element case: the library's (dcp.reuse.STABLE_FILE_BYTES) and others
GROUP_CAPS = (1 << 30, 256 << 20, 64 << 20, 16 << 20)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-sizes", default=None, help="comma-separated (default 1,2,4; 1,2 with --smoke)")
    parser.add_argument("--base-mb", type=float, default=1000, help="frozen base of all ranks, MB (default %(default)s)")
    parser.add_argument("--adapter-fraction", type=float, default=0.01,
                        help="adapter + its two Adam moments, as a fraction of the base's bytes (default %(default)s)")
    parser.add_argument("--tensor-mb", type=float, default=32, help="size of one base tensor (default %(default)s MB)")
    parser.add_argument("--saves", type=int, default=10, help="synchronous saves per contender, at least 3 "
                        "(default %(default)s)")
    parser.add_argument("--async-saves", type=int, default=3, help="async saves after them (default %(default)s)")
    parser.add_argument("--disk-root", default=None, help="directory on a disk (default /var/tmp)")
    parser.add_argument("--json", default="bench-results/reuse.json", help="results file (default %(default)s)")
    parser.add_argument("--op-timeout", type=float, default=600, help="seconds one operation may take")
    parser.add_argument("--smoke", action="store_true", help="seconds: 24 MB, 4 + 1 saves (worlds 1,2 unless given)")
    parser.add_argument("--s3", default=None, metavar="SERVER",
                        help="also on S3: seaweedfs or moto (started here) or an endpoint URL; reuse and full through a "
                             "recording proxy that counts the bytes each save uploads")
    parser.add_argument("--s3-only", action="store_true", help="the S3 part alone (with --s3)")
    parser.add_argument("--s3-saves", type=int, default=5, help="saves per S3 contender, at least 3 (default "
                        "%(default)s)")


def finish_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.smoke:
        args.base_mb, args.tensor_mb, args.saves, args.async_saves = 24, 4, 4, 1
    args.world_sizes = [int(w) for w in (args.world_sizes or ("1,2" if args.smoke else "1,2,4")).split(",")]
    if min(args.world_sizes) < 1 or args.saves < 3 or args.async_saves < 0 or args.base_mb <= 0:
        parser.error("world sizes positive, --saves >= 3 (saves 1 and 2 link nothing), --async-saves >= 0, "
                     "--base-mb > 0")
    if not 0 < args.adapter_fraction < 1:
        parser.error("--adapter-fraction must lie in (0, 1)")
    if args.smoke:
        args.s3_saves = 3
    if args.s3_only and not args.s3:
        parser.error("--s3-only needs --s3 SERVER")
    if args.s3_saves < 3:
        parser.error("--s3-saves >= 3 (saves 1 and 2 copy nothing)")


def finetune_state(rank: int, world: int, base_mb: float, tensor_mb: float, adapter_fraction: float) -> dict:
    """This rank's share: frozen bf16 base tensors, an fp32 adapter and its two Adam moments (1/3 of the adapter
    fraction each), all under keys of this rank (plain tensors; DCP would keep one rank's copy of a shared key)."""
    import torch

    generator = torch.Generator().manual_seed(100 + rank)
    share = base_mb * 1e6 / world
    per_tensor = min(tensor_mb * 1e6, share)
    count = max(1, round(share / per_tensor))
    side = max(1, int((share / count / 2) ** 0.5))  # bf16: 2 bytes an element
    base = {f"base.r{rank}.layer{i}": torch.randn(side, side, generator=generator).to(torch.bfloat16)
            for i in range(count)}
    adapter_elements = max(1, int(share * adapter_fraction / 3 / 4))  # fp32, three tensors' worth
    rows = max(1, adapter_elements // 64)
    adapter = {f"adapter.r{rank}.lora": torch.randn(rows, 64, generator=generator)}
    moments = {f"optim.r{rank}.exp_avg": torch.zeros(rows, 64), f"optim.r{rank}.exp_avg_sq": torch.zeros(rows, 64)}
    return {"model": {**base, **adapter}, "optim": moments}


def train_step(state: dict, step: int, everything: bool) -> None:
    """What an optimizer step changes: the adapter and its moments; with ``everything`` the base too."""
    for key, tensor in state["model"].items():
        if everything or not key.startswith("base."):
            tensor.add_(1e-3 * step)
    for tensor in state["optim"].values():
        tensor.add_(1e-4 * step)


def _sync() -> None:
    subprocess.run(["sync"], check=False)


def _inodes(path: str) -> dict[tuple[int, int], int]:
    """(device, inode) -> size of every regular file under ``path``."""
    out = {}
    for folder, _, files in os.walk(path):
        for name in files:
            st = os.lstat(os.path.join(folder, name))
            out[(st.st_dev, st.st_ino)] = st.st_size
    return out


def _written(run_dir: str, new_step_dir: str) -> int:
    """Bytes of ``new_step_dir``'s files that no other step of the run shares (what this save wrote)."""
    new = _inodes(new_step_dir)
    others: set = set()
    for name in os.listdir(run_dir):
        path = os.path.join(run_dir, name)
        if os.path.isdir(path) and os.path.abspath(path) != os.path.abspath(new_step_dir):
            others |= _inodes(path).keys()
    return sum(size for inode, size in new.items() if inode not in others)


class _Contender:
    """One contender's saves and loads of ``state`` under ``where``, on one rank."""

    def __init__(self, name: str, where: str, storage_options: dict | None = None) -> None:
        self.name, self.where = name, where
        self.manager = None
        if name != "stock":
            from dcp_atomic import CheckpointManager

            self.manager = CheckpointManager(where, RUN, keep_last=KEEP, reuse=name == "reuse",
                                             storage_options=storage_options)

    def step_dir(self, step: int) -> str:
        if self.manager is None:
            return os.path.join(self.where, RUN, f"stock_{step:010d}")
        return os.path.join(self.where, RUN, f"step_{step:010d}")

    def save(self, state: dict, step: int, asynchronous: bool = False) -> dict:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        if self.manager is not None:
            if not asynchronous:
                self.manager.save(step, state)
                return {}
            started = time.perf_counter()
            future = self.manager.async_save(step, state)
            blocked = time.perf_counter() - started
            future.result()
            return {"blocked_seconds": blocked}
        writer = dcp.FileSystemWriter(self.step_dir(step))
        if asynchronous:
            started = time.perf_counter()
            future = dcp.async_save(state, storage_writer=writer)
            blocked = time.perf_counter() - started
            future.result()
            extra = {"blocked_seconds": blocked}
        else:
            dcp.save(state, storage_writer=writer)
            extra = {}
        dist.barrier()
        if dist.get_rank() == 0:
            import shutil

            shutil.rmtree(self.step_dir(step - KEEP), ignore_errors=True)  # keep_last=3, as the managers
        return extra

    def load(self, target: dict, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        if self.manager is not None:
            self.manager.load(target, step)
        else:
            dcp.load(target, storage_reader=dcp.FileSystemReader(self.step_dir(step)))

    def close(self) -> None:
        if self.manager is not None:
            self.manager.close()


def _series(ctx, plan: dict, name: str, where: str, everything: bool) -> dict | None:
    """One contender's whole run on every rank: saves, async saves, the newest step's load."""
    import torch.distributed as dist

    rank, world = ctx.rank, ctx.world_size
    state = finetune_state(rank, world, plan["base_mb"], plan["tensor_mb"], plan["adapter_fraction"])
    contender = _Contender(name, where)
    saves, asyncs = [], []
    step = 0
    for number in range(plan["saves"] + plan["async_saves"]):
        step += 1
        train_step(state, step, everything)
        asynchronous = number >= plan["saves"]
        if rank == 0:
            _sync()
        record = gather(measured(lambda: contender.save(state, step, asynchronous)))
        written = _written(os.path.join(where, RUN), contender.step_dir(step)) if rank == 0 else 0
        (asyncs if asynchronous else saves).append({"ranks": record, "written": written})
    storage = sum(_inodes(os.path.join(where, RUN)).values()) if rank == 0 else 0
    target = zeroed_like(state)
    clear(target)
    if rank == 0:
        _sync()
    load = gather(measured(lambda: contender.load(target, step)))
    assert_bit_exact(state, target, f"{name}, step {step}, rank {rank}")
    contender.close()
    dist.barrier()
    if rank != 0:
        return None
    slowest = [max(r["seconds"] for r in s["ranks"]) for s in saves]
    return {
        "save_seconds": statistics.median(slowest[2:]), "first_save_seconds": slowest[0],
        "second_save_seconds": slowest[1],
        "written": statistics.median(s["written"] for s in saves[2:]), "first_written": saves[0]["written"],
        "async_blocked_seconds": statistics.median(max(r["blocked_seconds"] for r in a["ranks"]) for a in asyncs)
        if asyncs else None,
        "async_seconds": statistics.median(max(r["seconds"] for r in a["ranks"]) for a in asyncs) if asyncs else None,
        "storage": storage, "load_seconds": max(r["seconds"] for r in load), "loaded_bit_exact": True,
        "all_save_seconds": slowest, "all_written": [s["written"] for s in saves],
    }


def _one_element(ctx, plan: dict, cap: int) -> dict | None:
    """Three reused saves of the LoRA-shaped state, the third with one element of one frozen tensor changed (rank 0),
    stable files cut at ``cap`` bytes: the run's storage after them, against one step's bytes (issue 44, item 1)."""
    import torch.distributed as dist

    from dcp_atomic.dcp import reuse

    reuse.STABLE_FILE_BYTES = cap
    rank, world = ctx.rank, ctx.world_size
    state = finetune_state(rank, world, plan["base_mb"], plan["tensor_mb"], plan["adapter_fraction"])
    where = os.path.join(plan["dir"], f"w{world}-one-element-{cap}")
    contender = _Contender("reuse", where)
    written = []
    for step in (1, 2, 3):
        train_step(state, step, False)
        if step == 3 and rank == 0:
            next(t for k, t in state["model"].items() if k.startswith("base.")).view(-1)[0] += 1
        contender.save(state, step)
        written.append(_written(os.path.join(where, RUN), contender.step_dir(step)) if rank == 0 else 0)
    storage = sum(_inodes(os.path.join(where, RUN)).values()) if rank == 0 else 0
    contender.close()
    dist.barrier()
    if rank != 0:
        return None
    import shutil

    shutil.rmtree(where, ignore_errors=True)
    return {"cap": cap, "one_step": written[0], "written": written, "storage": storage}


def _rank(ctx, plan: dict) -> dict | None:
    quiet_warnings()
    out: dict = {}
    for cap in plan["group_caps"]:
        result = _one_element(ctx, plan, cap)
        if ctx.rank == 0:
            out.setdefault("one_element", []).append(result)
    for case, everything, names in (("lora", False, ("reuse", "full", "stock")),
                                    ("full_finetune", True, ("full", "reuse"))):
        for name in names:
            where = os.path.join(plan["dir"], f"w{ctx.world_size}-{case}-{name}")
            result = _series(ctx, plan, name, where, everything)
            if ctx.rank == 0:
                out.setdefault(case, {})[name] = result
                say(f"w{ctx.world_size} {case:<13} {name:<5} save {result['save_seconds']:6.3f}s (first "
                    f"{result['first_save_seconds']:.3f}s) written {result['written'] / MiB:8.1f} MiB storage "
                    f"{result['storage'] / MiB:8.1f} MiB load {result['load_seconds']:.3f}s (bit-exact)")
                import shutil

                shutil.rmtree(where, ignore_errors=True)
    return out if ctx.rank == 0 else None


def _s3_series(ctx, plan: dict, name: str) -> dict | None:
    """One contender's saves on S3 on every rank (the bytes each uploads are counted by the proxy, in the parent),
    then the newest step's load, checked bit-exact."""
    import torch.distributed as dist

    rank, world = ctx.rank, ctx.world_size
    state = finetune_state(rank, world, plan["base_mb"], plan["tensor_mb"], plan["adapter_fraction"])
    contender = _Contender(name, f"{plan['s3_root']}/w{world}-{name}", plan["storage_options"])
    saves = []
    for step in range(1, plan["s3_saves"] + 1):
        train_step(state, step, False)
        saves.append(gather(measured(lambda: contender.save(state, step))))
    target = zeroed_like(state)
    clear(target)
    load = gather(measured(lambda: contender.load(target, plan["s3_saves"])))
    assert_bit_exact(state, target, f"{name} on S3, rank {rank}")
    contender.close()
    dist.barrier()
    if rank != 0:
        return None
    return {"save_seconds": [max(r["seconds"] for r in s) for s in saves],
            "load_seconds": max(r["seconds"] for r in load)}


def _s3_rank(ctx, plan: dict) -> dict | None:
    quiet_warnings()
    out = {name: _s3_series(ctx, plan, name) for name in ("reuse", "full")}
    return out if ctx.rank == 0 else None


def _s3_bytes(proxy, prefix: str, saves: int, ops: tuple[str, ...], field: str) -> list[int]:
    """Per step of the run under ``prefix``: body bytes of the requests ``ops`` on its data objects (``field``:
    ``request_bytes`` what the client sent, ``reply_bytes`` what it read)."""
    import re

    moved = [0] * (saves + 1)
    for record in proxy.requests():
        match = re.search(rf"{re.escape(prefix)}/(?:_d[0-9a-f]{{2}}/)?{RUN}/step_(\d{{10}})/.*\.distcp$", record.key)
        if match and record.op in ops:
            moved[int(match.group(1))] += getattr(record, field)
    return moved[1:]


def run_s3(args: argparse.Namespace, plan: dict) -> tuple[dict, list[dict]]:
    """Reuse on / off on S3 per world: bytes uploaded per save (saves 3..N; from save 2 on each copies what the one
    before it holds), save seconds, the newest step's load; the proxy in this process counts what the ranks send."""
    import secrets

    import boto3

    from benchmarks.s3 import server
    from testbed.s3_proxy import S3Proxy

    results: dict = {}
    checks: list[dict] = []
    with server(args.s3, None) as endpoint:
        key = os.environ.get("AWS_ACCESS_KEY_ID", "bench")
        secret = os.environ.get("AWS_SECRET_ACCESS_KEY", "bench")
        bucket = f"dcp-reuse-{secrets.token_hex(4)}"
        boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=key, aws_secret_access_key=secret,
                     region_name="us-east-1").create_bucket(Bucket=bucket)
        proxy = S3Proxy(endpoint)
        try:
            plan = {**plan, "s3_root": f"s3://{bucket}/reuse", "s3_saves": args.s3_saves,
                    "storage_options": {"endpoint_url": proxy.url, "key": key, "secret": secret,
                                        "client_kwargs": {"region_name": "us-east-1"}}}
            for world in args.world_sizes:
                with tempfile.TemporaryDirectory(prefix="dcp-reuse-s3-") as scratch:  # the world's root: unused
                    rows = launch(_s3_rank, world, scratch, args=(plan,), op_timeout=args.op_timeout,
                                  ops=4 * (args.s3_saves + 1))
                for name, row in rows.items():
                    prefix = f"reuse/w{world}-{name}"
                    row["uploaded"] = _s3_bytes(proxy, prefix, args.s3_saves, ("PUT", "UPLOAD_PART"), "request_bytes")
                    # a save's reads of its own new objects: verifying copies (the last step's are its load's too)
                    row["downloaded"] = _s3_bytes(proxy, prefix, args.s3_saves, ("GET",), "reply_bytes")
                results[str(world)] = rows
        finally:
            proxy.close()
    print("\n== store a byte once on S3 (medians over saves 3..N; x = full / row) ==")
    print(f"{'world':<6}{'contender':<10}{'save s':>9}{'x':>7}{'uploaded MiB':>14}{'of full':>9}"
          f"{'read MiB':>10}{'load s':>9}")
    for world, rows in results.items():
        medians = {name: (statistics.median(row["save_seconds"][2:]), statistics.median(row["uploaded"][2:]),
                          # reads count by the step of the object read: a save reads its base (the step before it),
                          # the load reads the last step; so saves 3..N's reads are steps 2..N-1's
                          statistics.median(row["downloaded"][1:-1]))
                   for name, row in rows.items()}
        for name, row in rows.items():
            seconds, uploaded, downloaded = medians[name]
            print(f"{world:<6}{name:<10}{seconds:>9.3f}{report.fmt(_ratio(medians['full'][0], seconds), '.2f'):>7}"
                  f"{uploaded / MiB:>14.1f}{report.fmt(_ratio(uploaded, medians['full'][1]), '.1%'):>9}"
                  f"{report.fmt(None if downloaded is None else downloaded / MiB, '.1f'):>10}"
                  f"{row['load_seconds']:>9.3f}")
        checks.append(report.check(f"S3: reuse uploaded <= {TARGETS['written']}x full",
                                   _ratio(medians["reuse"][1], medians["full"][1]), TARGETS["written"], False,
                                   world=world, medium="s3", contender="reuse"))
        checks.append(report.check(f"S3: reuse reads <= {TARGETS['s3_read_vs_base']:.0%} of base",
                                   _ratio(medians["reuse"][2], plan["base_mb"] * 1e6), TARGETS["s3_read_vs_base"], False,
                                   world=world, medium="s3", contender="reuse"))
        checks.append(report.check(f"S3: reuse save time <= {TARGETS['s3_save_seconds']}x full",
                                   _ratio(medians["reuse"][0], medians["full"][0]), TARGETS["s3_save_seconds"], False,
                                   world=world, medium="s3", contender="reuse"))
    return results, checks


def _ratio(a, b):
    return None if a is None or not b else a / b


def run(args: argparse.Namespace) -> dict:
    began = time.monotonic()
    base_bytes = args.base_mb * 1e6
    say(f"store a byte once: frozen base {args.base_mb:g} MB + adapter/moments {args.adapter_fraction:.1%}; worlds "
        f"{args.world_sizes}; {args.saves} saves + {args.async_saves} async, keep_last={KEEP}")
    load_before = os.getloadavg()
    results: dict = {}
    checks: list[dict] = []
    with Media(["disk"], base_bytes * (KEEP + 2) * 2, args.disk_root) as media:
        plan = {"dir": media.dirs["disk"], "base_mb": args.base_mb, "tensor_mb": args.tensor_mb,
                "adapter_fraction": args.adapter_fraction, "saves": args.saves, "async_saves": args.async_saves,
                "group_caps": GROUP_CAPS}
        ops = 5 * (args.saves + args.async_saves + 1)
        for world in [] if args.s3_only else args.world_sizes:
            results[str(world)] = launch(_rank, world, media.dirs["disk"], args=(plan,), op_timeout=args.op_timeout,
                                         ops=ops)
    if results:
        print("\n== store a byte once: LoRA-shaped fine-tune (medians over saves 3..N; x = full / row) ==")
        print(f"{'world':<6}{'case':<14}{'contender':<10}{'save s':>9}{'x':>7}{'written MiB':>13}{'of full':>9}"
              f"{'storage MiB':>13}{'/ step':>8}{'async block s':>15}{'load s':>9}")
    for world, cases in results.items():
        print(f"\n== w{world}: one element of one frozen tensor changed in save 3 (stable files cut at most at ...) ==")
        print(f"{'cap MiB':>8}{'step MiB':>10}{'save 2 wrote MiB':>18}{'/ step':>8}{'save 3 wrote MiB':>18}"
              f"{'storage MiB':>13}{'/ step':>8}")
        from dcp_atomic.dcp.reuse import STABLE_FILE_BYTES

        for row in cases.get("one_element", []):
            ratio = _ratio(row["storage"], row["one_step"])
            first = _ratio(row["written"][1], row["one_step"])  # the first reused save after a plain one
            print(f"{row['cap'] / MiB:>8.0f}{row['one_step'] / MiB:>10.1f}{row['written'][1] / MiB:>18.1f}"
                  f"{report.fmt(first, '.1%'):>8}{row['written'][2] / MiB:>18.1f}{row['storage'] / MiB:>13.1f}"
                  f"{report.fmt(ratio, '.2f'):>8}")
            if row["cap"] == STABLE_FILE_BYTES:
                checks.append(report.check(f"one changed element: storage <= {TARGETS['one_element_storage']}x step",
                                           ratio, TARGETS["one_element_storage"], False, world=world, medium="disk",
                                           contender="reuse"))
                checks.append(report.check(f"first reused save: written <= "
                                           f"{TARGETS['first_reused_written']:.0%} of step", first,
                                           TARGETS["first_reused_written"], False, world=world, medium="disk",
                                           contender="reuse"))
        print()
        for case, rows in cases.items():
            if case == "one_element":
                continue
            full = rows["full"]
            one_step = full["first_written"]  # a full save: every byte of one step
            for name, row in rows.items():
                print(f"{world:<6}{case:<14}{name:<10}{row['save_seconds']:>9.3f}"
                      f"{report.fmt(_ratio(full['save_seconds'], row['save_seconds']), '.2f'):>7}"
                      f"{row['written'] / MiB:>13.1f}{report.fmt(_ratio(row['written'], full['written']), '.1%'):>9}"
                      f"{row['storage'] / MiB:>13.1f}{report.fmt(_ratio(row['storage'], one_step), '.2f'):>8}"
                      f"{report.fmt(row['async_blocked_seconds'], '.3f'):>15}{row['load_seconds']:>9.3f}")
            reuse = rows["reuse"]
            if case == "lora":
                for target, value in (("written", _ratio(reuse["written"], full["written"])),
                                      ("save_seconds", _ratio(reuse["save_seconds"], full["save_seconds"])),
                                      ("storage_vs_one_step", _ratio(reuse["storage"], one_step)),
                                      ("load_seconds", _ratio(reuse["load_seconds"], full["load_seconds"]))):
                    checks.append(report.check(f"reuse {target.replace('_', ' ')} <= {TARGETS[target]}x full", value,
                                               TARGETS[target], False, world=world, medium="disk", contender="reuse"))
                stock = rows["stock"]
                checks.append(report.check("reuse save seconds <= stock's", _ratio(reuse["save_seconds"],
                                                                                   stock["save_seconds"]),
                                           1.0, False, world=world, medium="disk", contender="reuse"))
            else:
                checks.append(report.check(f"full fine-tune: reuse save <= {TARGETS['full_finetune_save_seconds']}x "
                                           "reuse off", _ratio(reuse["save_seconds"], full["save_seconds"]),
                                           TARGETS["full_finetune_save_seconds"], False, world=world, medium="disk",
                                           contender="reuse"))
    s3_results = None
    if args.s3:
        s3_results, s3_checks = run_s3(args, plan)
        checks += s3_checks
    report.print_targets(checks)
    wall = report.print_wall(began, load_before)
    return {
        "config": {"world_sizes": args.world_sizes, "base_mb": args.base_mb, "adapter_fraction": args.adapter_fraction,
                   "tensor_mb": args.tensor_mb, "saves": args.saves, "async_saves": args.async_saves,
                   "keep_last": KEEP, "media_dirs": media.notes, "smoke": args.smoke, "base_gb": base_bytes / GB},
        "environment": {**report.environment(), "loadavg_before": load_before},
        "wall_seconds": wall,
        "results": results,
        "s3_results": s3_results,
        "targets": checks,
    }
