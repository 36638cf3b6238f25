"""The memory tier's kill campaign (P16) from the command line: ``python benchmarks/memory_campaign.py --rounds 100
--seed 1``.  Each round a world of 4 ranks on 2 simulated nodes restores what the previous round left, checks it
against the witness files, then snapshots every step until a rank or a node is SIGKILLed (by a failpoint at a memory
phase or by a timer); some rounds then wipe one node's memory directory, or both.  What is checked and why:
``testbed/memory_campaign.py``.  Prints one line per round and a summary; exits 1 if any round failed.

The nodes' memory directories are under ``/dev/shm`` (``--shm``), the durable root and the witness files under
``--disk-root``; both are removed at the end (``--keep`` leaves them for a look).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or ".") == HERE:
    sys.path[0] = os.path.dirname(HERE)  # import benchmarks.* and testbed.* as packages, never as loose files


def main(argv: list[str] | None = None) -> int:
    from testbed.memory_campaign import NODES, run_campaign, summary

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=100, help="kill rounds (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seeds every round's choices (default %(default)s)")
    parser.add_argument("--timeout", type=float, default=5.0, help="the managers' timeout, seconds")
    parser.add_argument("--shm", default="/dev/shm", help="where the nodes' memory directories go")
    parser.add_argument("--disk-root", default="/var/tmp", help="where the durable root and witness files go")
    parser.add_argument("--keep", action="store_true", help="leave the directories for a look")
    args = parser.parse_args(argv)
    shm = tempfile.mkdtemp(prefix="dcp-atomic-campaign-", dir=args.shm)
    disk = tempfile.mkdtemp(prefix="dcp-atomic-campaign-", dir=args.disk_root)
    nodes = [os.path.join(shm, f"node{'AB'[n]}") for n in range(NODES)]
    for node in nodes:
        os.makedirs(node)
    started, load = time.monotonic(), os.getloadavg()
    try:
        verdicts = run_campaign(args.rounds, args.seed, disk, nodes, say=lambda line: print(line, flush=True),
                                timeout=args.timeout)
    finally:
        if args.keep:
            print(f"kept: {shm} {disk}")
        else:
            shutil.rmtree(shm, ignore_errors=True)
            shutil.rmtree(disk, ignore_errors=True)
    print(f"-- python benchmarks/memory_campaign.py --rounds {args.rounds} --seed {args.seed}: "
          f"{time.monotonic() - started:.0f} s, load average {load[0]:.1f} at the start, "
          f"{os.getloadavg()[0]:.1f} at the end, {os.cpu_count()} cores")
    for line in summary(verdicts, args.seed):
        print(line)
    return 1 if any(v.problems for v in verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
