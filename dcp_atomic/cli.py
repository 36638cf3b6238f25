"""``dcp-atomic``: look at, verify and demo checkpoints without writing Python.

Subcommands: ``ls ROOT [RUN]``, ``show ROOT RUN [STEP]``, ``verify ROOT RUN
[STEP|--all]``, ``gc ROOT RUN --keep-last N [--dry-run]``, ``export ROOT RUN STEP
OUT.pt``, ``demo``.  ``--json`` prints machine-readable output.  The CLI
is one process, so it may scan (list) the run directory; training ranks never do.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from typing import Any

from .audit import audit_step
from .catalog import most_recent, scan_markers
from .commit import read_committed
from .errors import CheckpointError
from .layout import RunLayout, parse_step_dir, validate_run_id
from .retention import apply_gc, plan_gc
from .retry import Deadline
from .storage import open_storage


class Progress:
    """A byte-count progress line on stderr (rewritten in place on a terminal)."""

    def __init__(self, total: int, label: str) -> None:
        self.total, self.label, self.done = max(total, 1), label, 0
        self._lock = threading.Lock()
        self._last = 0.0
        self._started = time.monotonic()
        self._tty = sys.stderr.isatty()

    def __call__(self, n: int) -> None:
        with self._lock:
            self.done += n
            now = time.monotonic()
            if now - self._last >= (0.1 if self._tty else 2.0) or self.done >= self.total:
                self._last = now
                rate = self.done / max(now - self._started, 1e-9) / 1e9
                line = f"{self.label}: {100 * self.done / self.total:5.1f}% of {self.total / 1e9:.2f} GB ({rate:.2f} GB/s)"
                sys.stderr.write(("\r" + line) if self._tty else (line + "\n"))
                sys.stderr.flush()

    def close(self) -> None:
        if self._tty:
            sys.stderr.write("\n")


def _layout(args) -> RunLayout:
    return RunLayout(open_storage(args.root, json.loads(args.storage_options) if args.storage_options else None), args.run)


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def _step_rows(layout: RunLayout) -> list[dict[str, Any]]:
    markers = {m.step: m for m in scan_markers(layout)}
    rows = []
    for name in layout.storage.list_dir(layout.run_dir):
        step = parse_step_dir(name)
        if step is None:
            continue
        attempts = [a for a in layout.storage.list_dir(layout.step_dir(step)) if a != "COMMITTED" and not a.startswith(".")]
        marker = markers.get(step)
        row: dict[str, Any] = {"step": step, "committed": marker is not None, "attempts": len(attempts)}
        if marker is not None:
            try:
                manifest = read_committed(layout, step, Deadline(0)).manifest
                row.update(save_id=marker.save_id, bytes=manifest.total_bytes, world_size=manifest.world_size,
                           parallelism=manifest.parallelism, committed_at=marker.committed_at)
            except CheckpointError as e:
                row.update(save_id=marker.save_id, error=str(e))
        row["partial_attempts"] = len(attempts) - (1 if marker is not None else 0)
        rows.append(row)
    return rows


def cmd_ls(args) -> int:
    storage = open_storage(args.root, json.loads(args.storage_options) if args.storage_options else None)
    if not args.run:
        runs = [r for r in storage.list_dir(storage.root) if not r.startswith(".")]
        if args.json:
            print(json.dumps({"runs": runs}))
        else:
            print("\n".join(runs) if runs else f"no runs under {args.root}")
        return 0
    layout = _layout(args)
    rows = _step_rows(layout)
    newest = most_recent(scan_markers(layout))
    if args.json:
        print(json.dumps({"run": args.run, "latest": newest.step if newest else None, "steps": rows}, indent=1))
        return 0
    if not rows:
        print(f"no steps in {layout.run_dir}")
        return 0
    now = time.time()
    print(f"{'step':>10}  {'state':<10} {'size':>10}  {'age':>6}  {'world':>5}  layout              save_id")
    for row in rows:
        state = "committed" if row["committed"] else "partial"
        size = f"{row['bytes'] / 2**20:.1f} MiB" if "bytes" in row else "-"
        age = _age(now - row["committed_at"]) if "committed_at" in row else "-"
        par = row.get("parallelism") or {}
        lay = f"tp={par.get('tp')} dp={par.get('dp')} pp={par.get('pp')}" if par else "-"
        extra = f"  (+{row['partial_attempts']} partial attempt(s))" if row["partial_attempts"] and row["committed"] else ""
        latest = "  <- latest" if newest and row["step"] == newest.step else ""
        print(f"{row['step']:>10}  {state:<10} {size:>10}  {age:>6}  {row.get('world_size', '-'):>5}  "
              f"{lay:<19} {row.get('save_id', '-')}{extra}{latest}")
    return 0


def cmd_show(args) -> int:
    layout = _layout(args)
    step = args.step
    if step is None:
        newest = most_recent(scan_markers(layout))
        if newest is None:
            print(f"no committed step in {layout.run_dir}", file=sys.stderr)
            return 1
        step = newest.step
    try:
        committed = read_committed(layout, step, Deadline(args.timeout))
    except CheckpointError as e:
        print(str(e), file=sys.stderr)
        return 1
    manifest = committed.manifest
    if args.json:
        print(manifest.to_json().decode())
        return 0
    print(f"run {manifest.run_id}  step {manifest.step}  save {manifest.save_id}")
    print(f"world size {manifest.world_size}  parallelism {manifest.parallelism or 'not declared'}")
    print(f"{len(manifest.files)} files, {manifest.total_bytes / 2**20:.1f} MiB; "
          f"torch {manifest.versions.get('torch')}, dcp_atomic {manifest.versions.get('dcp_atomic')}")
    hosts = sorted({r.get("host") for r in manifest.ranks})
    print(f"hosts: {', '.join(hosts)}")
    for s in manifest.stats:
        secs = s["write_seconds"]
        print(f"  rank {s['rank']}: {s['bytes'] / 2**20:.1f} MiB in {secs:.2f}s "
              f"({s['bytes'] / max(secs, 1e-9) / 1e9:.2f} GB/s), fsync {s['fsync_seconds']:.2f}s, {s['items']} items")
    keys: dict[str, list[int]] = {}
    for entry in manifest.files:
        for item in entry.items:
            keys.setdefault(item.key, [0, 0])
            keys[item.key][0] += 1
            keys[item.key][1] += item.length
    print(f"{len(keys)} keys:")
    for key in sorted(keys):
        chunks, size = keys[key]
        print(f"  {key:<60} {chunks:>3} chunk(s) {size:>12} bytes")
    return 0


def cmd_verify(args) -> int:
    layout = _layout(args)
    if args.all:
        steps = [m.step for m in scan_markers(layout)]
    elif args.step is not None:
        steps = [args.step]
    else:
        newest = most_recent(scan_markers(layout))
        steps = [newest.step] if newest else []
    if not steps:
        print(f"no committed step to verify in {layout.run_dir}", file=sys.stderr)
        return 1
    reports = []
    for step in steps:
        total = 0
        try:
            total = read_committed(layout, step, Deadline(args.timeout)).manifest.total_bytes
        except CheckpointError:
            pass
        progress = None if args.json else Progress(total, f"verify step {step}")
        reports.append(audit_step(layout, step, threads=args.threads, timeout=args.timeout, progress=progress))
        if progress:
            progress.close()
    bad = [r for r in reports if not r.ok]
    if args.json:
        print(json.dumps([r.__dict__ for r in reports], indent=1))
    else:
        for r in reports:
            status = "OK" if r.ok else "FAILED"
            print(f"step {r.step}: {status} ({r.files} files, {r.bytes / 2**20:.1f} MiB, save {r.save_id})")
            for problem in r.problems:
                print(f"  {problem}")
    return 1 if bad else 0


def cmd_gc(args) -> int:
    layout = _layout(args)
    plan = plan_gc(layout, args.keep_last, lease_seconds=args.lease_hours * 3600)
    if args.json:
        print(json.dumps({"dry_run": args.dry_run, "delete_steps": plan.delete_steps,
                          "delete_attempts": [list(a) for a in plan.delete_attempts],
                          "delete_temps": plan.delete_temps, "kept_steps": plan.kept_steps}))
    else:
        verb = "would delete" if args.dry_run else "deleting"
        for step in plan.delete_steps:
            print(f"{verb} committed step {step}")
        for step, save_id in plan.delete_attempts:
            print(f"{verb} abandoned attempt {save_id} of step {step}")
        for path in plan.delete_temps:
            print(f"{verb} leftover temp file {path}")
        print(f"keeping steps {plan.kept_steps}" + ("" if not plan.empty else " (nothing to collect)"))
    if not args.dry_run:
        apply_gc(layout, plan)
    return 0


def cmd_export(args) -> int:
    """One torch.save file holding the whole (unsharded) state dict of a step."""
    import warnings

    import torch
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    from .reader import AtomicStorageReader

    warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
    reader = AtomicStorageReader(args.root, args.run, args.step, timeout=args.timeout,
                                 storage_options=json.loads(args.storage_options) if args.storage_options else None)
    try:
        reader.resolve()
        state = _load_state_dict_from_keys(storage_reader=reader)
    except CheckpointError as e:
        print(str(e), file=sys.stderr)
        return 1
    torch.save(state, args.out)
    print(f"exported run {args.run} step {reader.step} (save {reader.save_id}) to {args.out}")
    return 0


def cmd_demo(args) -> int:
    from .demo import run_demo

    return run_demo(args.root, args.world_size)


def build_parser() -> argparse.ArgumentParser:
    from .demo import DEFAULT_ROOT

    parser = argparse.ArgumentParser(prog="dcp-atomic", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--storage-options", help="fsspec options as JSON, e.g. an S3 endpoint")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for visibility")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("ls", help="runs, or the steps of a run")
    p.add_argument("root")
    p.add_argument("run", nargs="?")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("show", help="manifest summary of a step (default: latest)")
    p.add_argument("root")
    p.add_argument("run")
    p.add_argument("step", nargs="?", type=int)
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("verify", help="re-read every byte and check every checksum")
    p.add_argument("root")
    p.add_argument("run")
    p.add_argument("step", nargs="?", type=int)
    p.add_argument("--all", action="store_true", help="every committed step")
    p.add_argument("--threads", type=int, default=4)
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("gc", help="delete old committed steps and abandoned attempts")
    p.add_argument("root")
    p.add_argument("run")
    p.add_argument("--keep-last", type=int, required=True)
    p.add_argument("--lease-hours", type=float, default=6.0, help="age after which an uncommitted attempt is abandoned")
    p.add_argument("--dry-run", action="store_true")
    p.set_defaults(func=cmd_gc)

    p = sub.add_parser("export", help="write one step as a single torch.save file")
    p.add_argument("root")
    p.add_argument("run")
    p.add_argument("step", type=int)
    p.add_argument("out")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("demo", help="train, crash a save, resume (the README's first command)")
    p.add_argument("--root", default=DEFAULT_ROOT)
    p.add_argument("--world-size", type=int, default=4)
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if hasattr(args, "run") and args.run is not None:
        try:
            validate_run_id(args.run)
        except ValueError as e:
            print(f"dcp-atomic: {e}", file=sys.stderr)
            return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
