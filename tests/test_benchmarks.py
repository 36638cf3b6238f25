"""Every benchmark scenario still runs: its ``--smoke`` mode (seconds, worlds 1-2) writes the JSON it documents.

These check that the benchmarks work end to end (bit-exact round trips included), not how fast anything is.
"""

from __future__ import annotations

import json
import os

from benchmarks import bench


def _run(root: str, *argv: str) -> dict:
    path = os.path.join(root, "out.json")
    assert bench.main([*argv, "--smoke", "--json", path]) == 0
    with open(path) as f:
        return json.load(f)


def _assert_contender_row(row: dict, items: bool = False) -> None:
    for metric in ("save", "warm_load"):
        assert row[f"{metric}_gbps"] > 0
        assert row[f"{metric}_gbps_vs_stock"] > 0
        if items:
            assert row[f"{metric}_items_per_s"] > 0
    assert row["repeats"] == 1
    assert row["bytes_on_disk"] > row["control_bytes"] > 0


def test_large_tensors_smoke(root):
    document = _run(root, "--png", "", "--no-warmup")
    assert document["scenario"] == "large"
    rows = document["summary"]["1"]["tmpfs"]["contenders"]
    assert set(rows) == {"atomic-default", "stock"}
    for row in rows.values():
        _assert_contender_row(row)
    assert rows["stock"]["save_gbps_vs_stock"] == 1.0
    assert rows["atomic-default"]["commit_s"] > 0
    assert {c["target"] for c in document["targets"]} >= {"save >= 1.3x stock", "warm load >= 1.5x stock"}


def test_many_small_tensors_smoke(root):
    document = _run(root, "small")
    assert document["scenario"] == "small"
    assert document["config"]["keys_per_rank"] == [200]
    for world in ("1", "2"):
        block = document["summary"][world]["tmpfs, 200 keys/rank"]
        assert set(block["contenders"]) == {"atomic-default", "stock"}
        for row in block["contenders"].values():
            _assert_contender_row(row, items=True)
    per_rank = document["config"]["tensor_bytes_per_rank"]["200"]
    assert 200 * 1024 <= per_rank <= 200 * 64 * 1024
    assert {(c["world"], c["target"]) for c in document["targets"]} == {
        (w, t) for w in ("1", "2") for t in ("save >= 1.3x stock", "warm load >= 1.5x stock")}
    # "default" is each rank's own library default (CPUs over its LOCAL_WORLD_SIZE), and stock's writer runs
    # with the same thread count: a ratio never compares 2 threads against 1
    cpus = len(os.sched_getaffinity(0))
    for world, threads in document["config"]["threads_per_world"].items():
        assert threads == {"atomic": max(1, min(4, cpus // int(world))), "stock": threads["atomic"]}


def test_compression_smoke(root):
    document = _run(root, "compression")
    assert document["scenario"] == "compression"
    for dtype in ("bfloat16", "float32"):
        c = document["compression"][dtype]
        assert c["raw_bytes"] > 0
        assert 0 < c["dcp_atomic_zstd_ratio"] < 1.05 and 0 < c["torch_zstandard_ratio"] < 1.05
    assert [c["met"] is not None for c in document["targets"]] == [True, True]


def test_s3_smoke(root, monkeypatch):
    from torch.distributed.checkpoint import _fsspec_filesystem

    built = []
    original = _fsspec_filesystem.FsspecWriter.__init__

    def spy(self, path, *args, **kwargs):
        built.append((kwargs.get("sync_files", True), kwargs.get("thread_count", 1)))
        original(self, path, *args, **kwargs)

    monkeypatch.setattr(_fsspec_filesystem.FsspecWriter, "__init__", spy)
    document = _run(root, "s3")
    assert document["scenario"] == "s3"
    assert set(document["median"]) == {"dcp_atomic", "stock"}
    for rates in document["median"].values():
        assert rates["save_gbps"] > 0 and rates["load_gbps"] > 0
    assert document["ratio_atomic_over_stock"]["save"] > 0
    assert len(document["runs"]["dcp_atomic"]["save_seconds"]) == 1
    # stock as a careful user configures it on an object store: no machine-wide os.sync() per file
    assert document["config"]["stock_sync_files"] == "False"
    assert built and set(built) == {(False, document["config"]["thread_count"])}


def test_replicated_restore_smoke(root):
    document = _run(root, "restore")
    assert document["scenario"] == "restore"
    rows = document["summary"]["2"]
    assert set(rows) == {"share-on", "share-off", "stock"}
    assert rows["share-on"]["warm"]["read_vs_unique"] <= 1.05  # read once...
    assert rows["share-off"]["warm"]["read_vs_unique"] >= 1.9  # ...where each replica reads its own copy
    assert all(row["warm"]["seconds"] > 0 for row in rows.values())


def test_two_tiers_smoke(root):
    document = _run(root, "tiers")
    assert document["scenario"] == "tiers"
    assert document["config"]["world"] == 4 and document["config"]["nodes"] == 2
    assert document["config"]["local_roots"] == "tmpfs mounts"  # root here: each node its own mount
    rows = document["summary"]
    assert set(rows) == {
        "local save", "local async_save", "local save + drain s3", "local save + drain disk", "drain s3", "drain disk",
        "restore from replicas", "restore from s3", "restore from disk",
        "direct save s3", "direct async_save s3", "direct save disk", "direct async_save disk"}
    for name, row in rows.items():
        assert row["seconds"] > 0 and row["peak_rss_mib"] > 0, name
    for name in ("local async_save", "direct async_save s3", "direct async_save disk"):
        assert 0 < rows[name]["stall_seconds"] <= rows[name]["seconds"], name
    # each round: both durable roots (2 samples of the local rows), the drain committed step 3 once per root
    assert len(rows["local save"]["runs"]) == 2 and len(rows["drain s3"]["runs"]) == 1
    drained = document["raw"]["local save + drain s3"][0]["drain"]
    assert drained["step"] == 3 and drained["bytes"] > 0 and drained["attempts"] == 1
    # after node B's root was emptied, node B's ranks (2, 3) each received what they read from node A
    restore = document["raw"]["restore from replicas"][0]["records"]
    assert [r["ranks_fetched"] >= 1 for r in restore] == [False, False, True, True], restore
    assert {r["step"] for r in restore} == {3}
    assert [(c["target"], c["value"] is not None) for c in document["targets"]] == [
        ("time to local-committed >= 5x faster than a direct S3 save", True),
        ("restore from replicas >= 2x faster than from S3", True),
        ("drain no slower than a direct s3 save", True),
        ("drain no slower than a direct disk save", True)]
