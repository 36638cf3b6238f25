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
import gc
import json
import pickle
import shutil
import tempfile
import time
import tracemalloc

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from dcp_atomic import AtomicStorageWriter
from dcp_atomic.commit import read_committed
from dcp_atomic.manifest import FileEntry, ItemExtent, ManifestShard, ShardRef
from dcp_atomic.retry import Deadline
from dcp_atomic.writer import _STATS_FQN, _RankStats

PROPS = TensorProperties(dtype=torch.float32)


def _plans(world: int, items: int) -> list[SavePlan]:
    size = torch.Size([world, 16])
    return [SavePlan([WriteItem(index=MetadataIndex(f"layer{k}.w", torch.Size([r, 0])), type=WriteItemType.SHARD,
                                tensor_data=TensorWriteData(ChunkStorageMetadata(torch.Size([r, 0]), torch.Size([1, 16])),
                                                            PROPS, size))
                      for k in range(items)], planner_data={}) for r in range(world)]


def _results(plans: list[SavePlan], writer: AtomicStorageWriter) -> list[list[WriteResult]]:
    """What every rank's write_data hands the coordinator: (file, offset, length) per item and its stats."""
    out = []
    for rank, plan in enumerate(plans):
        name = f"__{rank}_0.distcp"
        results = [WriteResult(item.index, 64, _StorageInfo(name, 64 * i, 64)) for i, item in enumerate(plan.items)]
        stats = _RankStats(rank=rank, host="bench", files={name: 64 * len(plan.items)}, items=len(plan.items),
                           shard=ShardRef(rank, f"manifest.{rank}.json", 1000, "0" * 64))
        out.append(results + [WriteResult(MetadataIndex(f"{_STATS_FQN}/{rank}"), 0, stats)])
    return out


def _shard(rank: int, items: int, run: str, step: int, save_id: str) -> ManifestShard:
    name = f"__{rank}_0.distcp"
    extents = [ItemExtent(key=f"layer{k}.w", chunk_offset=[rank, 0], kind="tensor", format="raw", pos=64 * k,
                          length=64, checksums=["0123456789abcdef"], block_size=4 << 20) for k in range(items)]
    return ManifestShard(run, step, save_id, rank, [FileEntry(name, rank, 64 * items, extents)])


def cell(world: int, items: int) -> dict:
    root = tempfile.mkdtemp(prefix="dcp-atomic-scale-")
    try:
        plans = _plans(world, items)
        planner = DefaultSavePlanner()
        gc.collect()
        started = time.perf_counter()
        global_plans, metadata = planner.create_global_plan(plans)
        dcp_plan = time.perf_counter() - started

        writer = AtomicStorageWriter(root, "run", 1, thread_count=1)
        writer.set_up_storage_writer(True, rank=0)
        local = [writer.prepare_local_plan(p) for p in plans]
        for rank, plan in enumerate(local):  # distinct identities, as real ranks would send
            plan.storage_data.identity.update(rank=rank, pid=rank)
        started = time.perf_counter()
        assigned = writer.prepare_global_plan(local)
        ours_plan = time.perf_counter() - started
        writer.save_id = assigned[0].storage_data.save_id
        results = _results(plans, writer)
        started = time.perf_counter()
        writer.finish(metadata, results)
        ours_finish = time.perf_counter() - started
        started = time.perf_counter()  # stock FileSystemWriter.finish pickles the same .metadata, storage_data included
        metadata_bytes = len(pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL))
        dcp_pickle = time.perf_counter() - started
        # a loading rank: the top manifest and its own shard (written here as rank 0 would find it)
        shard_bytes = _shard(0, items, "run", 1, writer.save_id).to_json()
        layout = writer.layout
        committed = read_committed(layout, 1, Deadline(5))
        manifest_size = len(layout.storage.read_file(layout.attempt_file(1, writer.save_id, "manifest.json")))
        gc.collect()
        tracemalloc.start()
        started = time.perf_counter()
        read_committed(layout, 1, Deadline(5))
        ManifestShard.from_json(shard_bytes, where="shard")
        parse = time.perf_counter() - started
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        del committed
        # pickling .metadata (with storage_data) is DCP's own work inside finish; the rest is ours
        added = ours_plan + max(0.0, ours_finish - dcp_pickle)
        return {"world": world, "items_per_rank": items, "dcp_plan_s": dcp_plan, "dcp_pickle_s": dcp_pickle,
                "dcp_metadata_bytes": metadata_bytes, "ours_prepare_global_plan_s": ours_plan,
                "ours_finish_s": ours_finish, "ours_added_s": added,
                "added_vs_dcp": added / max(dcp_plan + dcp_pickle, 1e-9),
                "load_manifest_bytes": manifest_size, "load_shard_bytes": len(shard_bytes),
                "load_metadata_bytes": manifest_size + len(shard_bytes), "load_parse_s": parse,
                "load_peak_heap_bytes": peak}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--items", type=int, nargs="+", default=[1000])
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    rows = []
    print(f"{'world':>6} {'items':>6} {'DCP plan s':>10} {'DCP pickle s':>12} {'ours added s':>12} {'ratio':>6} "
          f"{'load MB':>8} {'parse s':>8} {'peak MB':>8}")
    for world in args.worlds:
        for items in args.items:
            r = cell(world, items)
            rows.append(r)
            print(f"{world:>6} {items:>6} {r['dcp_plan_s']:>10.2f} {r['dcp_pickle_s']:>12.2f} "
                  f"{r['ours_added_s']:>12.2f} {r['added_vs_dcp']:>6.1%} {r['load_metadata_bytes'] / 1e6:>8.2f} "
                  f"{r['load_parse_s']:>8.3f} {r['load_peak_heap_bytes'] / 1e6:>8.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
