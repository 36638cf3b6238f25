"""Where a save and a load of many small tensors spend their time, phase by phase, dcp_atomic against stock DCP.

    .venv/bin/python -m benchmarks.profile --world 2 --keys 10000 --repeats 3

Runs one world of ``--world`` gloo ranks (the benchmarks' launcher), each holding ``--keys`` small tensors
(benchmarks/small.py's state), and times dcp_atomic (``AtomicSavePlanner`` / ``AtomicLoadPlanner``, the
library's default thread count in each rank) and stock ``FileSystemWriter`` / ``FileSystemReader`` (writer
with the same thread count), alternating, after a warm-up round.  Every DCP planner hook, storage hook and
object collective is wrapped with a wall-clock timer, and the cyclic GC's collections (full and young apart) are
timed through ``gc.callbacks`` (no cProfile: its per-call overhead doubles the time of
exactly the per-key Python this is about), so a phase is the time spent inside that call on that rank,
waits for other ranks included.  Prints the median per phase on rank 0, the other ranks' collections, and the
ratios to stock.
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib
import os
import shutil
import statistics
import sys
import tempfile
import time

#: (module, class or None, function): the phases timed
PHASES = [
    ("torch.distributed.checkpoint.state_dict_saver", None, "_stateful_to_state_dict"),
    ("torch.distributed.checkpoint.default_planner", "DefaultSavePlanner", "create_local_plan"),
    ("torch.distributed.checkpoint.default_planner", "DefaultSavePlanner", "create_global_plan"),
    ("torch.distributed.checkpoint.default_planner", "DefaultLoadPlanner", "create_local_plan"),
    ("torch.distributed.checkpoint.default_planner", "DefaultLoadPlanner", "create_global_plan"),
    ("dcp_atomic.dcp.reshard", None, "summarize_state_dict"),
    ("dcp_atomic.dcp.writer", None, "check_save"),
    ("dcp_atomic.dcp.writer", "AtomicStorageWriter", "prepare_local_plan"),
    ("dcp_atomic.dcp.writer", "AtomicStorageWriter", "prepare_global_plan"),
    ("dcp_atomic.dcp.writer", "AtomicStorageWriter", "write_data"),
    ("dcp_atomic.dcp.writer", "AtomicStorageWriter", "_publish_shard"),
    ("dcp_atomic.dcp.writer", "AtomicStorageWriter", "finish"),
    ("dcp_atomic.dcp.planners", "AtomicLoadPlanner", "create_local_plan"),
    ("dcp_atomic.dcp.reader", "AtomicStorageReader", "read_metadata"),
    ("dcp_atomic.dcp.reader", "AtomicStorageReader", "prepare_local_plan"),
    ("dcp_atomic.dcp.reader", "AtomicStorageReader", "prepare_global_plan"),
    ("dcp_atomic.dcp.reader", "AtomicStorageReader", "read_data"),
    ("torch.distributed.checkpoint.filesystem", "_FileSystemWriter", "write_data"),
    ("torch.distributed.checkpoint.filesystem", "_FileSystemWriter", "finish"),
    ("torch.distributed.checkpoint.filesystem", "FileSystemReader", "read_metadata"),
    ("torch.distributed.checkpoint.filesystem", "FileSystemReader", "read_data"),
    ("torch.distributed.distributed_c10d", None, "_object_to_tensor"),  # pickling, in every object collective
    ("torch.distributed.distributed_c10d", None, "_tensor_to_object"),  # unpickling
]
_spent: dict[str, float] = {}


def _install() -> None:
    for module_name, class_name, name in PHASES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        owner = getattr(module, class_name, None) if class_name else module
        if owner is None or name not in vars(owner):
            continue
        original = vars(owner)[name]
        label = f"{class_name}.{name}" if class_name else name

        def timed(*args, __original=original, __label=label, **kwargs):
            started = time.perf_counter()
            try:
                return __original(*args, **kwargs)
            finally:
                _spent[__label] = _spent.get(__label, 0.0) + time.perf_counter() - started

        setattr(owner, name, functools.wraps(original)(timed))
        if class_name is None:  # the modules that imported the function by name call it through their own global
            for user in ("torch.distributed", "torch.distributed.distributed_c10d", "dcp_atomic.dcp.writer",
                         "dcp_atomic.dcp.planners"):
                module_of_user = sys.modules.get(user)
                if module_of_user is not None and getattr(module_of_user, name, None) is original:
                    setattr(module_of_user, name, getattr(owner, name))


_collection_started = [0.0]


def _time_collections(phase: str, info: dict) -> None:
    """The cyclic GC's collections count as phases, full (generation 2) and young (0 and 1) apart: DCP's pickled
    collectives set them off, and a pause that only raised the full collections' threshold would still pay
    the young ones."""
    if phase == "start":
        _collection_started[0] = time.perf_counter()
        return
    label = "gc: full collections" if info.get("generation") == 2 else "gc: young collections"
    _spent[label] = _spent.get(label, 0.0) + time.perf_counter() - _collection_started[0]
    _spent[f"{label} (count)"] = _spent.get(f"{label} (count)", 0.0) + 1


def _rank(ctx, keys: int, repeats: int) -> dict:
    import torch.distributed as dist

    from benchmarks.common import quiet_warnings, zeroed_like
    from benchmarks.contenders import Contenders
    from benchmarks.small import small_tensors
    from dcp_atomic import Parallelism

    _install()
    gc.callbacks.append(_time_collections)
    quiet_warnings()
    state = small_tensors(keys, ctx.rank, 1, 64)
    try:
        contenders = Contenders(ctx.rank, state, zeroed_like(state), Parallelism(dp=ctx.world_size), None, "same")
    except TypeError:  # an older benchmarks/contenders.py (profiling an earlier commit): stock writer at 1 thread
        contenders = Contenders(ctx.rank, state, zeroed_like(state), Parallelism(dp=ctx.world_size), None)
    base = os.path.join(ctx.root, "profile")
    names = ["atomic-default", "stock"]
    out: dict[str, list] = {}
    number = 0
    for repeat in range(repeats + 1):
        for name in names if repeat % 2 else names[::-1]:
            number += 1
            for op in ("save", "load"):
                dist.barrier()
                _spent.clear()
                started = time.perf_counter()
                getattr(contenders, op)(name, os.path.join(base, name), number)
                seconds = time.perf_counter() - started
                phases = dict(_spent)
                dist.barrier()
                if repeat:  # the first round warms up
                    out.setdefault(f"{name} {op}", []).append((seconds, phases))
            dist.barrier()
            if ctx.rank == 0:
                shutil.rmtree(os.path.join(base, name), ignore_errors=True)
            dist.barrier()
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="ranks (default %(default)s)")
    parser.add_argument("--keys", type=int, default=10000, help="tensors per rank (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="counted rounds after a warm-up (default %(default)s)")
    parser.add_argument("--root", default=None, help="directory to write under (default: a fresh one in /var/tmp)")
    args = parser.parse_args(argv)
    from testbed.worlds import run_world

    root = tempfile.mkdtemp(prefix="dcp-profile-", dir=args.root or "/var/tmp")
    load_before = os.getloadavg()[0]
    try:
        outcomes = run_world(_rank, args.world, root, args=(args.keys, args.repeats),
                             env={"LOCAL_WORLD_SIZE": str(args.world)}, timeout=600 * (args.repeats + 1),
                             pg_timeout=600)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    failed = [o for o in outcomes if not o.ok]
    if failed:
        raise SystemExit("\n".join(f"rank {o.rank}: {o.error_type}: {o.error}" for o in failed))
    print(f"world {args.world}, {args.keys} keys per rank, median of {args.repeats}; load average {load_before:.2f} "
          f"at the start, {os.getloadavg()[0]:.2f} at the end; seconds on rank 0 (slowest rank for the totals)")
    totals = {}
    for label, runs in sorted(outcomes[0].value.items()):
        totals[label] = max(statistics.median(s for s, _ in o.value[label]) for o in outcomes)
        print(f"{label:<22} {totals[label]:7.3f} s   rounds: {' '.join(f'{s:.2f}' for s, _ in runs)}")
        for phase in sorted({p for _, phases in runs for p in phases}):
            median = statistics.median(phases.get(phase, 0.0) for _, phases in runs)
            if median >= 0.005:
                print(f"    {phase:<44} {median:7.3f}" + ("" if "(count)" in phase else " s"))
    for outcome in outcomes[1:]:  # the other ranks' collectors: their unpickling of the plan and .metadata
        for label, runs in sorted(outcome.value.items()):
            cells = [f"{name} {statistics.median(phases.get(f'gc: {name} collections', 0.0) for _, phases in runs):.3f} s "
                     f"({statistics.median(phases.get(f'gc: {name} collections (count)', 0.0) for _, phases in runs):g})"
                     for name in ("full", "young")]
            print(f"rank {outcome.rank} {label:<22} gc: {', '.join(cells)}")
    for op in ("save", "load"):
        print(f"{op}: stock / dcp_atomic = {totals[f'stock {op}'] / totals[f'atomic-default {op}']:.2f}x")
    return totals


if __name__ == "__main__":
    main()
