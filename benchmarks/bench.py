"""dcp_atomic benchmarks against stock torch.distributed.checkpoint: one command per scenario.

    python benchmarks/bench.py [large] [options]   large tensors, worlds 1-4, disk + tmpfs (the default;
                                                   bash scripts/bench.sh runs this after set-up)
    python benchmarks/bench.py small [options]     many small tensors: 10k / 50k keys per rank, worlds 1-4
    python benchmarks/bench.py compression         zstd on the real MiniLM weights
    python benchmarks/bench.py s3 [options]        S3 through a local server (SeaweedFS or moto)
    python benchmarks/bench.py restore [options]   replicated restore: shared reads on / off / stock, worlds 2-4
    python benchmarks/bench.py tiers [options]     two tiers: local saves + replicas vs direct disk / S3, world 4
    python benchmarks/bench.py reuse [options]     store a byte once: a LoRA-shaped fine-tune, reuse on / off / stock
    python benchmarks/bench.py staging [options]   bounded staging: async_save's host memory with / without Staging
    python benchmarks/bench.py memory [options]    the memory tier: snapshots and restores vs the local tier, world 4
    python benchmarks/bench.py SCENARIO --help     what it measures, its options
    python benchmarks/bench.py SCENARIO --smoke    seconds: proves it still runs (tests/guards/test_benchmarks.py)

Each writes its tables to stdout, progress to stderr and its results to bench-results/<scenario>.json
(the large scenario: bench-results/bench.json and bench.png).  The layout is in benchmarks/__init__.py.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or ".") == HERE:
    sys.path[0] = os.path.dirname(HERE)  # import benchmarks.* and testbed.* as packages, never as loose files
os.environ.setdefault("OMP_NUM_THREADS", "1")  # one intra-op thread per rank, as in a job whose ranks share cores

SCENARIOS = ("large", "small", "compression", "s3", "restore", "tiers", "reuse", "staging", "memory", "steps")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    name = argv.pop(0) if argv and argv[0] in SCENARIOS else "large"
    scenario = importlib.import_module(f"benchmarks.{name}")
    from benchmarks import report

    parser = argparse.ArgumentParser(prog=f"bench.py {name}", description=scenario.__doc__, epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    scenario.add_arguments(parser)
    args = parser.parse_args(argv)
    if hasattr(scenario, "finish_arguments"):
        scenario.finish_arguments(parser, args)
    report.SMOKE = bool(getattr(args, "smoke", False))
    report.write_json({"scenario": name, **scenario.run(args)}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
