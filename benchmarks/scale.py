"""Coordinator and metadata cost at 256-4,096 ranks, without processes or data (issue 11, P12).

Drives the writer's coordinator path (``prepare_global_plan`` + ``finish``: identity and divergence checks,
manifest, commit into a tmp dir) with generated per-rank SavePlans and WriteResults, next to DCP's own
``create_global_plan`` + ``.metadata`` pickling at the same scale; and a loading rank's share: the bytes of
our metadata it reads and parses beyond ``.metadata`` (top manifest + its own shard), the parse time and its
peak heap (tracemalloc).  Each key is an FSDP-style row shard: rank r holds rows [r, r+1) of every key.

    .venv/bin/python -m benchmarks.scale                      # 256 and 1,024 ranks x 1k items
    .venv/bin/python -m benchmarks.scale --worlds 4096 --items 1000 --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import pickle
import shutil
import statistics
import tempfile
import time
import tracemalloc

import torch
from torch.distributed.checkpoint import filesystem as torch_filesystem
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemWriter, _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from dcp_atomic import AtomicStorageWriter
from dcp_atomic.dcp import writer as writer_module
from dcp_atomic.dcp import plan_cache
from dcp_atomic.protocol.commit import read_committed
from dcp_atomic.format.manifest import FileEntry, ItemExtent, ManifestShard, ShardRef
from dcp_atomic._base.retry import Deadline
from dcp_atomic.dcp.rank_write import RankStats
from dcp_atomic.dcp.writer import rank_stats_result

PROPS = TensorProperties(dtype=torch.float32)


def _plans(world: int, items: int) -> list[SavePlan]:
    size = torch.Size([world, 16])
    return [SavePlan([WriteItem(index=MetadataIndex(f"layer{k}.w", torch.Size([r, 0])), type=WriteItemType.SHARD,
                                tensor_data=TensorWriteData(ChunkStorageMetadata(torch.Size([r, 0]), torch.Size([1, 16])),
                                                            PROPS, size))
                      for k in range(items)], planner_data={}) for r in range(world)]


def _shard(rank: int, items: int, run: str, step: int, save_id: str) -> ManifestShard:
    name = f"__{rank}_0.distcp"
    extents = [ItemExtent(key=f"layer{k}.w", chunk_offset=[rank, 0], kind="tensor", format="raw", pos=64 * k,
                          length=64, checksums=["0123456789abcdef"], block_size=4 << 20) for k in range(items)]
    return ManifestShard(run, step, save_id, rank, [FileEntry(name, rank, 64 * items, extents)])


def _stock_results(plans: list[SavePlan]) -> list[list[WriteResult]]:
    """What stock FileSystemWriter's write_data hands its coordinator: (file, offset, length) per item."""
    return [[WriteResult(item.index, 64, _StorageInfo(f"__{rank}_0.distcp", 64 * i, 64))
             for i, item in enumerate(plan.items)] for rank, plan in enumerate(plans)]


def _ours_results(stock: list[list[WriteResult]], save_id: str, step: int) -> list[list[WriteResult]]:
    """Ours: the same, plus each rank's statistics (its files, its shard's digest, the attempt it wrote)."""
    out = []
    for rank, results in enumerate(stock):
        name = f"__{rank}_0.distcp"
        stats = RankStats(rank=rank, host="bench", files={name: 64 * len(results)}, items=len(results),
                          shard=ShardRef(rank, f"manifest.{rank}.json", 1000, "0" * 64), step=step, save_id=save_id)
        out.append(results + [rank_stats_result(rank, stats)])
    return out


def _local_plans(writer: AtomicStorageWriter, plans: list[SavePlan]) -> list[SavePlan]:
    """What every rank's writer sends the coordinator: identities as torchrun's ranks would send, 8 per host."""
    local = [writer.prepare_local_plan(p) for p in plans]
    world = len(plans)
    for rank, plan in enumerate(local):
        env = {"RANK": str(rank), "LOCAL_RANK": str(rank % 8), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": "8",
               "GROUP_RANK": str(rank // 8)}
        plan.storage_data.identity.update(rank=rank, pid=100000 + rank, global_rank=rank, global_world_size=world,
                                          host=f"node{rank // 8:04d}.cluster.example.com", env=env)
    return local


def _timed(fn):
    gc.collect()
    started = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - started


def _clear_dcp_plan_cache() -> None:
    for cache in (SavePlanner._cached_save_plan, SavePlanner._cached_final_save_plan, SavePlanner._cached_all_plans,
                  SavePlanner._cached_global_plan, SavePlanner._cached_metadata):
        cache.clear()


class _PickleClock:
    """Times the ``.metadata`` pickle inside a writer's ``finish`` (a module's ``pickle``, replaced for the run),
    so that DCP's own format cost is shown apart from the rest."""

    HIGHEST_PROTOCOL = pickle.HIGHEST_PROTOCOL

    def __init__(self) -> None:
        self.seconds = 0.0

    def _time(self, fn, *args, **kwargs):
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - started

    def dumps(self, *args, **kwargs):
        return self._time(pickle.dumps, *args, **kwargs)

    def dump(self, *args, **kwargs):
        return self._time(pickle.dump, *args, **kwargs)


def _finish(writer_or_stock, module, metadata, results) -> tuple[float, float]:
    """(finish seconds, of which pickling .metadata)."""
    clock, original = _PickleClock(), module.pickle
    module.pickle = clock
    try:
        _, seconds = _timed(lambda: writer_or_stock.finish(metadata, results))
    finally:
        module.pickle = original
    return seconds, clock.seconds


def cell(world: int, items: int, *, caching: bool = False, repeats: int = 3) -> dict:
    """One save's coordinator phases, ours next to stock FileSystemWriter's on the same plans and results
    (medians of ``repeats``).

    With ``caching`` the measured save follows the first of a series: DCP answers every rank with its cached
    plan (DefaultSavePlanner(enable_plan_caching=True), nothing changed), as in a training loop.
    """
    root = tempfile.mkdtemp(prefix="dcp-atomic-scale-")
    try:
        _clear_dcp_plan_cache()
        plans = _plans(world, items)
        planner = DefaultSavePlanner(enable_plan_caching=caching)
        writer = AtomicStorageWriter(root, "run", 1, thread_count=1)
        writer.set_up_storage_writer(True, rank=0)
        local = _local_plans(writer, plans)
        (global_plans, metadata), dcp_plan = _timed(lambda: planner.create_global_plan(local))
        dcp_cached_plan = None
        if caching:  # the first save of the series, as rank 0 runs it (its data writes left out)
            assigned = writer.prepare_global_plan(global_plans)
            plan_cache.advance(assigned[0].storage_data.save_id, assigned[0].storage_data.number, True)
            plan_cache.remember(planner, writer._series)
            cached = [writer.prepare_local_plan(SavePlan([], usable=False)) for _ in plans]
        stock_results = _stock_results(plans)
        runs = []
        for k in range(repeats):
            if caching:
                (global_plans, metadata), dcp_cached_plan = _timed(lambda: planner.create_global_plan(cached))
            writer = AtomicStorageWriter(root, "run", 2 + k, thread_count=1)
            writer.set_up_storage_writer(True, rank=0)
            stock = FileSystemWriter(os.path.join(root, f"stock{k}"), thread_count=1)
            stock.set_up_storage_writer(True, rank=0)
            bare = [dataclasses.replace(p, storage_data=None) for p in global_plans]
            _, stock_plan = _timed(lambda: stock.prepare_global_plan(bare))
            _, ours_plan = _timed(lambda: writer.prepare_global_plan(global_plans))
            ours_results = _ours_results(stock_results, writer._planned_save_id, writer.step)
            if caching:
                plan_cache.advance(assigned[0].storage_data.save_id, assigned[0].storage_data.number, True)  # as rank 0's write_data does
            os.makedirs(stock.path)
            stock_finish, stock_pickle = _finish(stock, torch_filesystem, metadata, stock_results)
            ours_finish, ours_pickle = _finish(writer, writer_module, metadata, ours_results)
            runs.append({"stock_prepare_global_plan_s": stock_plan, "stock_finish_s": stock_finish,
                         "stock_pickle_s": stock_pickle, "ours_prepare_global_plan_s": ours_plan,
                         "ours_finish_s": ours_finish, "ours_pickle_s": ours_pickle,
                         # what we add: everything but the pickle of DCP's own .metadata, beyond what stock does
                         "ours_added_s": ours_plan - stock_plan + (ours_finish - ours_pickle)
                         - (stock_finish - stock_pickle)})
        row = {"world": world, "items_per_rank": items, "plan_caching": caching, "repeats": repeats,
               "dcp_plan_s": dcp_plan, "dcp_cached_plan_s": dcp_cached_plan,
               "dcp_metadata_bytes": len(pickle.dumps(metadata)),
               **{key: statistics.median(run[key] for run in runs) for key in runs[0]}}
        row["added_vs_dcp_plan"] = row["ours_added_s"] / dcp_plan
        return {**row, **_loading_rank(writer, items)}
    finally:
        _clear_dcp_plan_cache()
        plan_cache.forget_all()
        shutil.rmtree(root, ignore_errors=True)


def _loading_rank(writer: AtomicStorageWriter, items: int) -> dict:
    """A loading rank's share: the top manifest and its own shard (written here as rank 0 would find it)."""
    layout, step, save_id = writer.layout, writer.step, writer._planned_save_id
    shard_bytes = _shard(0, items, layout.run_id, step, save_id).to_json()
    manifest_size = len(layout.storage.read_file(layout.attempt_file(step, save_id, "manifest.json")))
    read_committed(layout, step, Deadline(5))  # warm: imports, caches
    gc.collect()
    tracemalloc.start()
    started = time.perf_counter()
    read_committed(layout, step, Deadline(5))
    ManifestShard.from_json(shard_bytes, where="shard")
    parse = time.perf_counter() - started
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"load_manifest_bytes": manifest_size, "load_shard_bytes": len(shard_bytes),
            "load_metadata_bytes": manifest_size + len(shard_bytes), "load_parse_s": parse, "load_peak_heap_bytes": peak}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--items", type=int, nargs="+", default=[1000])
    parser.add_argument("--caching", choices=("off", "on", "both"), default="both",
                        help="DCP plan caching for the measured save (on: the second save of a series)")
    parser.add_argument("--repeats", type=int, default=3, help="saves measured per cell (medians)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.caching]
    rows = []
    print(f"{'world':>6} {'items':>6} {'cache':>5} {'DCP plan s':>10} {'pickle s':>8} {'ours pickle':>11} "
          f"{'stock fin s':>11} {'ours plan s':>11} {'ours fin s':>10} {'added s':>8} {'/plan':>6} "
          f"{'load MB':>8} {'parse s':>8} {'peak MB':>8}")
    for world in args.worlds:
        for items in args.items:
            for caching in modes:
                r = cell(world, items, caching=caching, repeats=args.repeats)
                rows.append(r)
                plan = r["dcp_cached_plan_s"] if caching else r["dcp_plan_s"]
                print(f"{world:>6} {items:>6} {'on' if caching else 'off':>5} {plan:>10.2f} "
                      f"{r['stock_pickle_s']:>8.2f} {r['ours_pickle_s']:>11.2f} {r['stock_finish_s']:>11.2f} "
                      f"{r['ours_prepare_global_plan_s']:>11.3f} {r['ours_finish_s']:>10.2f} "
                      f"{r['ours_added_s']:>8.3f} {r['added_vs_dcp_plan']:>6.1%} "
                      f"{r['load_metadata_bytes'] / 1e6:>8.2f} {r['load_parse_s']:>8.3f} "
                      f"{r['load_peak_heap_bytes'] / 1e6:>8.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
