"""``dcp-atomic``: look at, verify, export, import and demo checkpoints without writing Python.

Subcommands: ``ls ROOT [RUN]``, ``show ROOT RUN [STEP]``, ``verify ROOT RUN
[STEP|--all]``, ``gc ROOT RUN --keep-last N [--dry-run]``, ``rm ROOT RUN [STEP]
[--yes]``, ``export [--format safetensors] ROOT RUN STEP OUT``, ``import
STOCK_DCP_DIR ROOT RUN STEP``, ``demo``.  ``--json`` prints machine-readable
output, errors included; it, ``--timeout`` and ``--storage-options`` go before
or after the subcommand.  The CLI is one process, so it may scan (list) the run
directory; training ranks never do.

Operators pipe it (``| head``), script it (``--json``) and point it at roots
whose SDK or credentials are missing: every failure is one line on stderr (one
JSON object on stdout with ``--json``) and a non-zero status, never a
traceback (``DCP_ATOMIC_TRACEBACK=1`` shows one for a bug report).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
from typing import Any

from ..protocol.catalog import most_recent, scan_markers
from ..protocol.commit import read_committed, read_marker
from ..errors import CheckpointError, CheckpointNotFoundError
from ..format.layout import LATEST, SPOOL_DIR, RunLayout, parse_step_dir, validate_run_id
from ..format.manifest import Marker
from ..protocol.retention import COMMITS, apply_gc, plan_gc, remove_run, remove_step
from .._base.retry import Deadline
from ..stores.backends import open_storage
from ..stores.storage import Storage


#: version of every ``--json`` object this command prints (its ``"schema"`` key); bumped when a field changes
#: meaning or goes away, not when one is added.  See "JSON output" in the README.
JSON_SCHEMA = 1

#: the extra that brings each URL scheme's SDK
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}

#: what to do about failures that arrive as a third-party SDK's own exception type
_HINTS = {
    "NoCredentialsError": "no credentials were found: pass them in --storage-options (e.g. {\"key\": ..., "
                          "\"secret\": ...}), set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE, or "
                          "pass {\"anon\": true} for a public bucket",
    "PartialCredentialsError": "the credentials are incomplete: pass both key and secret",
    "DefaultCredentialsError": "no Google credentials were found: run `gcloud auth application-default login`, set "
                               "GOOGLE_APPLICATION_CREDENTIALS, or pass {\"token\": ...} in --storage-options",
    "EndpointConnectionError": "the endpoint cannot be reached: check endpoint_url in --storage-options",
}


def _emit(body: dict[str, Any]) -> None:
    """One ``--json`` object on stdout, versioned."""
    print(json.dumps({"schema": JSON_SCHEMA, **body}, indent=1))


class CliError(Exception):
    """A failure the command reports as one message (one JSON object with ``--json``), never a traceback."""

    def __init__(self, message: str, code: int = 1, kind: str = "Error") -> None:
        super().__init__(message)
        self.message, self.code, self.kind = message, code, kind


class _Parser(argparse.ArgumentParser):
    """Usage errors become :class:`CliError`, so that ``--json`` gets them as JSON too."""

    def error(self, message: str):
        raise CliError(f"{self.prog}: {message}", code=2, kind="UsageError")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _rename_rule(text: str) -> tuple[str, str]:
    old, sep, new = text.partition("=")
    if not sep or not old:
        raise argparse.ArgumentTypeError(f"expected OLD=NEW with a non-empty OLD, got {text!r}")
    return old, new


def _size(text: str) -> str:
    from .export import parse_size

    try:
        parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


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


STORAGE_OPTIONS_ENV = "DCP_ATOMIC_STORAGE_OPTIONS"  # JSON, or @FILE, like --storage-options


def _storage_options_text(value: str) -> str:
    """``--storage-options`` as JSON text: ``@FILE`` reads it from a file (credentials stay out of argv)."""
    if not value.startswith("@"):
        return value
    try:
        with open(os.path.expanduser(value[1:]), encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read storage options from {value[1:]}: {e.strerror}") from None


def _storage(args) -> Storage:
    """The root's storage; a root that does not exist is an error, not an empty listing."""
    options = None
    if args.storage_options:
        try:
            options = json.loads(args.storage_options)
        except ValueError as e:
            raise CliError(f"--storage-options is not valid JSON ({e})", code=2, kind="UsageError") from None
        if not isinstance(options, dict):
            raise CliError("--storage-options must be a JSON object", code=2, kind="UsageError")
    try:
        storage = open_storage(args.root, options)
    except ImportError as e:
        raise CliError(_missing_sdk(args.root, e), kind="MissingDependency") from None
    if not storage.is_dir(storage.root):
        raise CliError(f"{args.root}: no such checkpoint root (nothing there)", kind="NotFound")
    return storage


def _missing_sdk(root: str, error: ImportError) -> str:
    scheme = root.split("://", 1)[0] if "://" in root else ""
    extra = _EXTRAS.get(scheme)
    fix = (f"pip install 'dcp-atomic[{extra}]'" if extra else
           f"install the fsspec implementation of {scheme}:// (see fsspec's list of known implementations)")
    return f"{root}: the {scheme}:// backend cannot be imported ({error}); {fix}"


def _layout(args) -> RunLayout:
    layout = RunLayout(_storage(args), args.run)
    if not layout.storage.is_dir(layout.run_dir):
        raise CliError(f"no run {args.run!r} under {args.root}", kind="NotFound")
    return layout


def _require_step(layout: RunLayout, step: int) -> None:
    """An explicit step with no directory at all is reported at once, not after ``--timeout``."""
    if not layout.storage.is_dir(layout.step_dir(step)):
        raise CheckpointNotFoundError(
            f"run {layout.run_id!r} has no step {step} ({layout.step_dir(step)} does not exist)", step=step
        )


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def _scan(layout: RunLayout) -> tuple[dict[int, Marker], dict[int, str]]:
    """Valid markers by step, and the steps whose marker exists but cannot be validated, with the reason."""
    unreadable: list[tuple[int, str]] = []
    markers = {m.step: m for m in scan_markers(layout, unreadable=unreadable)}
    return markers, dict(unreadable)


def _step_rows(layout: RunLayout, markers: dict[int, Marker], damaged: dict[int, str]) -> list[dict[str, Any]]:
    rows = []
    for name in layout.storage.list_dir(layout.run_dir):
        step = parse_step_dir(name)
        if step is None:
            continue
        attempts = [a for a in layout.storage.list_dir(layout.step_dir(step)) if a != "COMMITTED" and not a.startswith(".")]
        marker = markers.get(step)
        row: dict[str, Any] = {"step": step, "committed": marker is not None, "attempts": len(attempts)}
        if step in damaged:  # a marker is there: not "partial", but nothing can be trusted until a human looks
            row["marker_error"] = damaged[step]
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


def _local_steps(args) -> dict[int, Marker]:
    """The local markers in ``--local-root`` (one node's disk: the CLI sees no other node's local tier)."""
    if not getattr(args, "local_root", None):
        return {}
    from ..tiers.local_tier import local_markers, open_local

    return {m.step: m for m in local_markers(open_local(args.local_root, args.run))}


def _local_layout(args) -> RunLayout:
    from ..tiers.local_tier import open_local

    layout = open_local(args.local_root, args.run)
    if not layout.storage.is_dir(layout.run_dir):
        raise CliError(f"no run {args.run!r} under the local root {args.local_root}", kind="NotFound")
    return layout


def _root_tier(layout: RunLayout, markers) -> str:
    """Which tier ROOT is: ``local`` when it is a node's local root (an operator may point ROOT at one), seen in
    the fields only local markers record (``lineage``, ``drain``) or the spool replicas arrive in; else
    ``durable``.  So a step that never drained is never called durable."""
    if any(m.lineage is not None or m.drain is not None for m in markers):
        return "local"
    return "local" if layout.storage.is_dir(layout.storage.join(layout.run_dir, SPOOL_DIR)) else "durable"


def _step_tiers(args, step: int, save_id: str) -> list[str]:
    """Where ``step`` (save ``save_id``) is committed: ROOT's tier (:func:`_root_tier`), and ``local`` when
    ``--local-root`` holds it."""
    root = RunLayout(_storage(args), args.run)
    try:
        marker = read_marker(root, step, Deadline(0), missing_ok=True)
    except (OSError, CheckpointError):  # not drained (yet), or no durable root here
        marker = None
    tiers = [_root_tier(root, [marker])] if marker is not None and marker.save_id == save_id else []
    local = _local_steps(args)
    if step in local and local[step].save_id == save_id and "local" not in tiers:
        tiers.append("local")
    return tiers


def _copies_by_domain(ranks: list[dict[str, Any]]) -> str:
    """``nodeA: ranks 0, 1 (replicas on nodeB); ...`` from the records a local save keeps; "" for other saves."""
    by_domain: dict[str, list[dict[str, Any]]] = {}
    for record in ranks:
        if isinstance(record.get("failure_domain"), str):
            by_domain.setdefault(record["failure_domain"], []).append(record)
    parts = []
    for domain, records in sorted(by_domain.items()):
        replicas = sorted({d for r in records for d in r.get("replicas_on") or []})
        parts.append(f"{domain}: ranks {', '.join(str(r['rank']) for r in sorted(records, key=lambda r: r['rank']))}"
                     f" (replicas on {', '.join(replicas) or 'none'})")
    return "; ".join(parts)


def _with_tiers(rows: list[dict[str, Any]], local: dict[int, Marker], root_tier: str) -> list[dict[str, Any]]:
    """Each row's ``tiers``: ROOT's tier (``root_tier``) when committed in the root, ``local`` when ``--local-root``
    holds it; steps only that local root holds get a row of their own."""
    for row in rows:
        tiers = [root_tier] if row["committed"] else []
        row["tiers"] = tiers + (["local"] if row["step"] in local and "local" not in tiers else [])
    listed = {row["step"] for row in rows}
    rows += [{"step": m.step, "committed": False, "attempts": 0, "partial_attempts": 0, "save_id": m.save_id,
              "tiers": ["local"]} for m in local.values() if m.step not in listed]
    return sorted(rows, key=lambda row: row["step"])


def _run_rows(storage: Storage) -> list[dict[str, Any]]:
    """Each run under the root: committed step count, latest step, bytes of its committed steps, age."""
    rows = []
    now = time.time()
    for name in storage.list_dir(storage.root):
        layout = RunLayout(storage, name) if _is_run_id(name) else None
        if layout is None or not _is_run_dir(layout):
            continue  # hashed data prefixes, dot-files, temps, exports: anything that is not a run
        damaged: list[tuple[int, str]] = []
        markers = scan_markers(layout, unreadable=damaged)
        newest = most_recent(markers)
        size, unreadable, seen = 0, 0, set()
        for marker in markers:
            try:
                size += _stored_bytes(layout, read_committed(layout, marker.step, Deadline(0)), seen)
            except CheckpointError:
                unreadable += 1
        rows.append({"run": name, "committed_steps": len(markers), "latest_step": newest.step if newest else None,
                     "bytes": size, "unreadable_manifests": unreadable, "damaged_markers": len(damaged),
                     "latest_committed_at": newest.committed_at if newest else None,
                     "age_seconds": now - newest.committed_at if newest else None})
    return rows


def _stored_bytes(layout: RunLayout, committed, seen: set) -> int:
    """A step's data bytes, less the files an earlier step of ``seen`` holds too: reuse (and ``import --link``)
    hard-link one file into several steps, which the run's size counts once."""
    manifest = committed.manifest
    if not layout.storage.hard_links:
        return manifest.total_bytes
    total = 0
    for entry in manifest.files:
        try:
            version = layout.storage.file_version(
                layout.data_file(committed.step, committed.save_id, entry.name, manifest.data_prefixes))
        except OSError:
            version = None
        if version is None or version not in seen:
            total += entry.size
            seen.add(version)
    return total


def _is_run_dir(layout: RunLayout) -> bool:
    """A directory that holds a step directory or a run-level control file (one listing)."""
    try:
        names = layout.storage.list_dir(layout.run_dir)
    except NotADirectoryError:  # a stray file under the root (POSIX; object stores list it as nothing)
        return False
    return any(parse_step_dir(n) is not None or n in (LATEST, COMMITS) for n in names)


def _is_run_id(name: str) -> bool:
    try:
        validate_run_id(name)
    except ValueError:
        return False
    return True


def cmd_ls(args) -> int:
    if not args.run:
        rows = _run_rows(_storage(args))
        if args.json:
            _emit({"root": args.root, "runs": rows})
        elif not rows:
            print(f"no runs under {args.root}")
        else:
            print(f"{'run':<30} {'steps':>5} {'latest':>10} {'size':>12} {'age':>6}")
            for row in rows:
                committed = row["latest_step"] is not None
                damaged = f"  ({row['unreadable_manifests']} unreadable)" if row["unreadable_manifests"] else ""
                damaged += f"  ({row['damaged_markers']} damaged marker(s))" if row["damaged_markers"] else ""
                print(f"{row['run']:<30} {row['committed_steps']:>5} {row['latest_step'] if committed else '-':>10} "
                      f"{_mib(row['bytes']) if committed else '-':>12} "
                      f"{_age(row['age_seconds']) if committed else '-':>6}{damaged}")
        return 0
    layout = _layout(args)
    markers, damaged = _scan(layout)
    root_tier = _root_tier(layout, markers.values())
    rows = _with_tiers(_step_rows(layout, markers, damaged), _local_steps(args), root_tier)
    newest = most_recent(list(markers.values()))
    if args.json:
        _emit({"run": args.run, "latest": newest.step if newest else None, "root_tier": root_tier, "steps": rows})
        return 0
    if not rows:
        print(f"no steps in {layout.run_dir}")
        return 0
    if root_tier == "local":
        print(f"{args.root} is a node's local root: its steps are this disk's copies; which of them drained shows "
              f"`dcp-atomic ls DURABLE_ROOT {args.run} --local-root {args.root}`")
    now = time.time()
    print(f"{'step':>10}  {'state':<10} {'tiers':<14} {'size':>10}  {'age':>6}  {'world':>5}  layout              save_id")
    for row in rows:
        state = ("committed" if row["committed"] else "damaged" if "marker_error" in row
                 else "local" if row["tiers"] == ["local"] else "partial")
        size = _mib(row["bytes"]) if "bytes" in row else "-"
        age = _age(now - row["committed_at"]) if "committed_at" in row else "-"
        par = row.get("parallelism") or {}
        lay = " ".join(f"{d}={par.get(d, 1)}" for d in ("tp", "dp", "pp", "cp", "ep")
                       if d in ("tp", "dp", "pp") or par.get(d, 1) != 1) if par else "-"  # cp, ep: only when used
        extra = f"  (+{row['partial_attempts']} partial attempt(s))" if row["partial_attempts"] and row["committed"] else ""
        latest = "  <- latest" if newest and row["step"] == newest.step else ""
        damage = f"  (commit marker cannot be validated: {row['marker_error']})" if "marker_error" in row else ""
        print(f"{row['step']:>10}  {state:<10} {'+'.join(row['tiers']) or '-':<14} {size:>10}  {age:>6}  {row.get('world_size', '-'):>5}  "
              f"{lay:<19} {row.get('save_id', '-')}{extra}{latest}{damage}")
    return 0


def cmd_show(args) -> int:
    durable = _layout(args) if not args.local_root else None
    layout = durable or _local_layout(args)
    step = args.step
    if step is None:
        newest = most_recent(scan_markers(layout))
        if newest is None:
            raise CheckpointNotFoundError(f"no committed step in {layout.run_dir}")
        step = newest.step
    _require_step(layout, step)
    committed = read_committed(layout, step, Deadline(args.timeout))
    committed.load_items(layout, None, Deadline(args.timeout))
    committed.load_rank_records(layout, Deadline(args.timeout))
    manifest = committed.manifest
    tiers = _step_tiers(args, step, committed.save_id)
    if args.json:  # the manifest as stored (its own "schema_version"), with what ranks.json holds
        _emit(dict(sorted({**json.loads(manifest.to_json()), "ranks": manifest.ranks, "stats": manifest.stats,
                           "tiers": tiers}.items())))
        return 0
    print(f"run {manifest.run_id}  step {manifest.step}  save {manifest.save_id}")
    print(f"tiers: {', '.join(tiers)}")
    domains = _copies_by_domain(manifest.ranks)
    if domains:
        print(f"saved through the local tier: {domains}")
    print(f"world size {manifest.world_size}  parallelism {manifest.parallelism or 'not declared'}")
    print(f"{len(manifest.files)} files, {manifest.total_bytes / 2**20:.1f} MiB; "
          f"torch {manifest.versions.get('torch')}, dcp_atomic {manifest.versions.get('dcp_atomic')}")
    if manifest.data_prefixes:
        print(f"data under {manifest.data_prefixes} hashed prefixes: "
              f"{layout.storage.join(layout.storage.root, '_dXX', layout.run_id, '...')}")
    user_metadata = getattr(manifest, "user_metadata", None)
    if user_metadata:
        print(f"user metadata: {json.dumps(user_metadata, sort_keys=True)}")
    hosts = sorted({r.get("host") for r in manifest.ranks})
    print(f"hosts: {', '.join(hosts)}")
    reused = [s for s in manifest.stats if s.get("bytes_reused")]
    if reused:
        written = sum(s.get("bytes_written", s["bytes"]) for s in manifest.stats)
        print(f"reuse: {written} bytes written, {sum(s['bytes_reused'] for s in reused)} bytes linked from an earlier "
              "step (bytes_written, bytes_reused)")
    for s in manifest.stats:
        secs = s["write_seconds"]
        link = (f", {s.get('bytes_written', s['bytes']) / 2**20:.1f} MiB written, "
                f"{s['bytes_reused'] / 2**20:.1f} MiB reused") if s.get("bytes_reused") else ""
        rate = s.get("bytes_written", s["bytes"]) / max(secs, 1e-9) / 1e9  # linked bytes cost no write time
        print(f"  rank {s['rank']}: {s['bytes'] / 2**20:.1f} MiB in {secs:.2f}s "
              f"({rate:.2f} GB/s written), fsync {s['fsync_seconds']:.2f}s, {s['items']} items"
              f"{link}")
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
    """Audit the step(s); a step whose marker exists but cannot be validated is reported as FAILED, never skipped."""
    layout = _layout(args)
    from .audit import AuditReport, audit_step  # torch: only the commands that read tensors import it

    reports: list[AuditReport] = []
    if args.step is not None:
        _require_step(layout, args.step)
        steps = [args.step]
    else:
        markers, damaged = _scan(layout)  # with a damaged marker "the latest" is unknown: report it either way
        newest = most_recent(list(markers.values()))
        steps = sorted(markers) if args.all else [newest.step] if newest else []
        reports = [AuditReport(step, None, 0, 0, [f"commit marker cannot be validated: {reason}"])
                   for step, reason in damaged.items()]
    if not steps and not reports:
        raise CheckpointNotFoundError(f"no committed step to verify in {layout.run_dir}")
    for step in steps:
        try:
            total = read_committed(layout, step, Deadline(args.timeout)).manifest.total_bytes
        except CheckpointError as e:  # not committed or damaged: reported now, not waited for a second time
            reports.append(AuditReport(step, None, 0, 0, [str(e)]))
            continue
        progress = None if args.json else Progress(total, f"verify step {step}")
        reports.append(audit_step(layout, step, threads=args.threads, timeout=args.timeout, progress=progress,
                                  local=args.local))
        if progress:
            progress.close()
    reports.sort(key=lambda r: r.step)
    bad = [r for r in reports if not r.ok]
    if args.json:  # an array (as before schemas), each report versioned
        print(json.dumps([{"schema": JSON_SCHEMA, **r.__dict__} for r in reports], indent=1))
    else:
        for r in reports:
            status = ("OK" if not r.notes else "OK, partial copies") if r.ok else "FAILED"
            status += ", with warnings" if r.warnings else ""
            print(f"step {r.step}: {status} ({r.files} files, {r.bytes / 2**20:.1f} MiB, save {r.save_id})")
            for line in r.problems + r.notes + [f"warning: {w}" for w in r.warnings]:
                print(f"  {line}")
    return 1 if bad else 0


def cmd_gc(args) -> int:
    """Print the plan, then apply it; with ``--json`` one object, holding the plan and any failure to apply it.

    ``--local-root DIR``: collect only what killed or failed saves left on that node's local root (attempts older
    than the lease with no marker, temp files, a restore's spool of a process that is gone); its committed steps
    are the manager's (``keep_local``) and are never deleted here, nor is the durable root touched."""
    if args.local_root:
        if args.keep_last is not None:
            raise CliError("gc --local-root collects only abandoned attempts; local steps are kept by the manager's "
                           "keep_local, so --keep-last does not apply", code=2, kind="UsageError")
        from ..tiers.local_tier import sweep_spool

        layout = _local_layout(args)
        swept = sweep_spool(layout)
        if swept and not args.json:
            print(f"removed {len(swept)} leftover restore file(s) from {layout.storage.describe()}")
    elif args.keep_last is None:
        raise CliError("gc needs --keep-last N (committed steps to keep), or --local-root DIR", code=2,
                       kind="UsageError")
    else:
        layout = _layout(args)
    plan = plan_gc(layout, args.keep_last, lease_seconds=args.lease_hours * 3600)
    unreadable = plan.unreadable_steps  # markers that exist but cannot be validated: never touched, never "kept"
    kept = [step for step in plan.kept_steps if step not in dict(unreadable)]
    if not args.json:
        verb = "would delete" if args.dry_run else "deleting"
        for step in plan.delete_steps:
            print(f"{verb} committed step {step}")
        for step, save_id in plan.delete_attempts:
            print(f"{verb} abandoned attempt {save_id} of step {step}")
        for path in plan.delete_temps:
            print(f"{verb} leftover temp file {path}")
        for path in plan.delete_data:
            print(f"{verb} data without a step record {path}")
        print(f"keeping committed steps {kept}" + ("" if not plan.empty else " (nothing to collect)"))
        for step, reason in unreadable:
            print(f"step {step}: its marker exists but cannot be validated, so gc left the whole step alone "
                  f"({reason}); inspect it, restore the marker, or delete the step by hand", file=sys.stderr)
        if not args.dry_run:
            apply_gc(layout, plan)  # a failure is reported by main, after the lines above
        return 1 if unreadable else 0
    report: dict[str, Any] = {"schema": JSON_SCHEMA, "dry_run": args.dry_run, "delete_steps": plan.delete_steps,
                              "delete_attempts": [list(a) for a in plan.delete_attempts],
                              "delete_temps": plan.delete_temps, "delete_data": plan.delete_data, "kept_steps": kept,
                              "unreadable_steps": [list(u) for u in unreadable]}
    if not args.dry_run:
        try:
            apply_gc(layout, plan)
        except (CheckpointError, OSError) as e:
            report["error"] = {"type": type(e).__name__, "message": getattr(e, "message", str(e))}
    print(json.dumps(report))
    return 1 if unreadable or "error" in report else 0


def cmd_rm(args) -> int:
    """Show what would go; delete it only with ``--yes`` (a step, or the whole run).  Never touches another run."""
    layout = _layout(args)
    markers, damaged = _scan(layout)
    if args.step is not None:
        _require_step(layout, args.step)
        remaining = [m for step, m in markers.items() if step != args.step]
        newest = most_recent(remaining)
        plan: dict[str, Any] = {
            "run": args.run, "step": args.step, "committed": args.step in markers,
            "attempts": [a for a in layout.storage.list_dir(layout.step_dir(args.step))
                         if a != "COMMITTED" and not a.startswith(".")],
            "latest_after": newest.step if newest else None}
        what = (f"{'committed' if plan['committed'] else 'uncommitted'} step {args.step} of run {args.run!r} "
                f"({len(plan['attempts'])} attempt(s))")
        after = f"step {newest.step}" if newest else "nothing (no commit left)"
    else:
        steps = sorted(s for s in map(parse_step_dir, layout.storage.list_dir(layout.run_dir)) if s is not None)
        plan = {"run": args.run, "step": None, "committed_steps": sorted(markers), "all_steps": steps,
                "damaged_steps": sorted(damaged)}
        what = (f"run {args.run!r}: {len(markers)} committed step(s) {sorted(markers)}, {len(steps)} step "
                f"director{'y' if len(steps) == 1 else 'ies'} in all, LATEST, and its data under {layout.run_dir}")
        after = None
    if not args.yes:
        if args.json:
            _emit({**plan, "removed": False})
        else:
            print(f"would remove {what}" + (f"; LATEST would then name {after}" if after else ""))
        print("dcp-atomic: nothing was removed: pass --yes to remove it", file=sys.stderr)
        return 2
    again = None
    if args.step is not None:
        left = remove_step(layout, args.step, lease_seconds=args.lease_hours * 3600)
        plan["left_in_flight"] = left
        again = _committed_again(layout, args.step, left)
        plan["committed_again"] = again
    else:
        plan["committed_steps"] = remove_run(layout)
    if args.json:
        _emit({**plan, "removed": True})
    elif again is not None:
        print(f"step {args.step} of run {args.run!r} is committed again: a save in flight (save {again}) committed it "
              f"while rm ran; {what} was removed before that. Run rm again to remove the new commit")
    elif plan.get("left_in_flight"):
        print(f"step {args.step} of run {args.run!r} may be committed again: {len(left)} attempt(s) of a save in "
              f"flight were left (inside the {args.lease_hours:g} h lease: {', '.join(left)}); it commits, or gc "
              f"collects it once the lease ends. Removed {what}" + (f"; LATEST now names {after}" if after else ""))
    else:
        print(f"removed {what}" + (f"; LATEST now names {after}" if after else ""))
    return 1 if again is not None else 0


def _committed_again(layout: RunLayout, step: int, in_flight: list[str]) -> str | None:
    """The save id that committed ``step`` while ``rm`` removed it (one of the attempts it left in flight, e.g. a
    drain), or None: the operator must not read "removed" over a step that is there."""
    if not in_flight:
        return None
    try:
        marker = read_marker(layout, step, Deadline(0), missing_ok=True)
    except (OSError, CheckpointError):
        return None
    return None if marker is None else marker.save_id


def cmd_export(args) -> int:
    """One step as a single torch.save file, or as Hugging Face safetensors shards (streamed, one tensor in memory)."""
    from .export import DEFAULT_SHARD_SIZE, export_safetensors, export_torch

    layout = _layout(args)
    _require_step(layout, args.step)
    options = json.loads(args.storage_options) if args.storage_options else None
    out = os.path.abspath(args.out)
    if not os.path.isdir(os.path.dirname(out)):
        raise CliError(f"cannot export to {args.out}: directory {os.path.dirname(out)} does not exist")
    if args.format == "torch":
        if args.dtype or args.keys or args.shard_size or args.renames or args.ties:
            raise CliError("--dtype, --keys, --shard-size, --strip-prefix, --rename and --tie apply to "
                           "--format safetensors", code=2, kind="UsageError")
        step, save_id = export_torch(args.root, args.run, args.step, out, timeout=args.timeout,
                                     storage_options=options, force=args.force)
        if args.json:
            _emit({"out": out, "format": "torch", "step": step, "save_id": save_id})
        else:
            print(f"exported run {args.run} step {step} (save {save_id}) to {args.out}")
        return 0
    report = export_safetensors(args.root, args.run, args.step, out, shard_size=args.shard_size or DEFAULT_SHARD_SIZE,
                                dtype=args.dtype, keys=args.keys or (), renames=args.renames or (),
                                ties=args.ties or (), force=args.force, timeout=args.timeout,
                                storage_options=options)
    if args.json:
        _emit({"out_dir": report.out_dir, "format": "safetensors", "step": report.step, "save_id": report.save_id,
               "files": report.files, "total_size": report.total_size, "skipped": report.skipped,
               "renamed": report.renamed, "tied": [list(t) for t in report.tied]})
    else:
        print(f"exported run {args.run} step {report.step} (save {report.save_id}) to {args.out}: "
              f"{len(report.files)} safetensors shard(s), {report.total_size / 2**20:.1f} MiB"
              + (f"; {len(report.renamed)} key(s) renamed" if report.renamed else "")
              + (f"; tied {', '.join(f'{a} -> {t}' for a, t in report.tied)}" if report.tied else ""))
    return 0


def cmd_import(args) -> int:
    """Adopt a stock DCP checkpoint directory as a committed step (copies or hard links; the source is not written)."""
    from .importer import import_stock

    options = json.loads(args.storage_options) if args.storage_options else None
    marker = import_stock(args.source, args.root, args.run, args.step, link=args.link, timeout=args.timeout,
                          storage_options=options)
    if args.json:
        _emit({"run": args.run, "step": marker.step, "save_id": marker.save_id})
    else:
        print(f"imported {args.source} as run {args.run} step {marker.step} (save {marker.save_id}, "
              f"{'hard-linked' if args.link else 'copied'})")
    return 0


def cmd_demo(args) -> int:
    from .demo import run_demo

    return run_demo(args.root, args.world_size)


def build_parser() -> argparse.ArgumentParser:
    from .demo import DEFAULT_ROOT

    parser = _Parser(prog="dcp-atomic", description=__doc__.splitlines()[0])
    _add_global_options(parser, after_subcommand=False)
    after = argparse.ArgumentParser(add_help=False)
    _add_global_options(after, after_subcommand=True)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("ls", parents=[after], help="runs, or the steps of a run")
    p.add_argument("root")
    p.add_argument("run", nargs="?")
    p.add_argument("--local-root", help="this node's local_root (two tiers): also list the steps it holds; other "
                   "nodes' local roots are not visible from here")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("show", parents=[after], help="manifest summary of a step (default: latest)")
    p.add_argument("root")
    p.add_argument("run")
    p.add_argument("step", nargs="?", type=int)
    p.add_argument("--local-root", help="this node's local_root (two tiers): show the step as this root holds it, "
                   "and whether the root (durable) holds it too")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("verify", parents=[after], help="re-read every byte and check every checksum")
    p.add_argument("root")
    p.add_argument("run")
    p.add_argument("step", nargs="?", type=int)
    p.add_argument("--all", action="store_true", help="every committed step")
    p.add_argument("--threads", type=_positive_int, default=4)
    p.add_argument("--local", action="store_true", help="ROOT is a node's local_root (two tiers): partial copies "
                   "a tier restore kept there are reported as such (anywhere else a partial-copy note fails the step)")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("gc", parents=[after], help="delete old committed steps and abandoned attempts")
    p.add_argument("root")
    p.add_argument("run")
    p.add_argument("--keep-last", type=_positive_int, help="committed steps to keep (>= 1; required without "
                   "--local-root)")
    p.add_argument("--lease-hours", type=float, default=6.0, help="age after which an uncommitted attempt is abandoned")
    p.add_argument("--local-root", help="this node's local_root (two tiers): collect only the abandoned attempts "
                   "and leftovers killed jobs left there; its committed steps and the durable root are not touched")
    p.add_argument("--dry-run", action="store_true")
    p.set_defaults(func=cmd_gc)

    p = sub.add_parser("rm", parents=[after], help="delete one step (committed or not) or a whole run; needs --yes")
    p.add_argument("root")
    p.add_argument("run")
    p.add_argument("step", nargs="?", type=int, help="the step to delete (default: the whole run)")
    p.add_argument("--yes", action="store_true", help="really delete (without it: show what would go, exit 2)")
    p.add_argument("--lease-hours", type=float, default=6.0,
                   help="a step's uncommitted attempt younger than this is a save in flight and is left (0: none)")
    p.set_defaults(func=cmd_rm)

    p = sub.add_parser("export", parents=[after],
                       help="write one step as one torch.save file, or as safetensors shards")
    p.add_argument("root")
    p.add_argument("run")
    p.add_argument("step", type=int)
    p.add_argument("out", help="the .pt file (torch), or the directory of shards (safetensors)")
    p.add_argument("--format", choices=("torch", "safetensors"), default="torch")
    p.add_argument("--shard-size", type=_size, help="bytes per safetensors shard, e.g. 5GB (default), 500MiB")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), help="cast floating tensors (safetensors)")
    p.add_argument("--keys", action="append", metavar="GLOB",
                   help="export only keys matching GLOB, e.g. 'model.*' (repeatable; safetensors)")
    p.add_argument("--strip-prefix", dest="renames", action="append", type=lambda prefix: (prefix, ""),
                   metavar="PREFIX", help="drop PREFIX from the names that start with it, e.g. 'model.' for a state "
                   "dict saved as {'model': model.state_dict()} (repeatable, in order with --rename; safetensors)")
    p.add_argument("--rename", dest="renames", action="append", type=_rename_rule, metavar="OLD=NEW",
                   help="replace a leading OLD with NEW in the exported names (repeatable; safetensors)")
    p.add_argument("--tie", dest="ties", action="append", type=_rename_rule, metavar="ALIAS=TARGET",
                   help="ALIAS is tied to TARGET (exported names, e.g. lm_head.weight=model.embed_tokens.weight): "
                   "checked bit-identical, written once under TARGET (repeatable; safetensors)")
    p.add_argument("--force", action="store_true", help="replace an existing export at OUT")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("import", parents=[after], help="adopt a stock DCP checkpoint directory as a committed step")
    p.add_argument("source", help="directory written by torch's FileSystemWriter (holds .metadata)")
    p.add_argument("root")
    p.add_argument("run")
    p.add_argument("step", type=int)
    p.add_argument("--link", action="store_true",
                   help="hard-link the data files instead of copying (same filesystem; never write the source again)")
    p.set_defaults(func=cmd_import)

    p = sub.add_parser("demo", parents=[after], help="train, crash a save, resume (the README's first command)")
    p.add_argument("--root", default=DEFAULT_ROOT)
    p.add_argument("--world-size", type=int, default=4)
    p.set_defaults(func=cmd_demo)
    return parser


def _add_global_options(parser: argparse.ArgumentParser, *, after_subcommand: bool) -> None:
    """Options accepted before the subcommand and after it; one not given after it keeps its value from before."""

    def default(value: Any) -> Any:
        return argparse.SUPPRESS if after_subcommand else value

    parser.add_argument("--json", action="store_true", default=default(False),
                        help="machine-readable output, errors included")
    parser.add_argument("--storage-options", type=_storage_options_text,
                        default=default(os.environ.get(STORAGE_OPTIONS_ENV) or None),
                        help=f"fsspec options as JSON, e.g. an S3 endpoint, or @FILE holding that JSON (keeps secrets "
                             f"out of shell history); default: ${STORAGE_OPTIONS_ENV}")
    parser.add_argument("--timeout", type=float, default=default(10.0), help="seconds to wait for visibility")


def main(argv: list[str] | None = None) -> int:
    """Run one command; every failure becomes one line (or one JSON object) and an exit status."""
    argv = sys.argv[1:] if argv is None else argv
    handler = _one_line_logging()
    try:
        code = _run(argv)
        sys.stdout.flush()  # inside the try: `| head` closing the pipe surfaces here at the latest
        return code
    except BrokenPipeError:  # the reader went away (`show | head -1`): end quietly, as Unix tools do
        _silence_stdout()
        return 141
    except KeyboardInterrupt:
        print("dcp-atomic: interrupted", file=sys.stderr)
        return 130
    finally:
        if handler is not None:
            logging.getLogger().removeHandler(handler)


class _OneLineFormatter(logging.Formatter):
    """Warnings as one line each: SDKs log their retries with ``logger.exception`` (gcsfs), a traceback here."""

    def format(self, record: logging.LogRecord) -> str:
        return f"dcp-atomic: {record.levelname.lower()}: {record.getMessage()}".replace("\n", " ")


def _one_line_logging() -> logging.Handler | None:
    """Give an unconfigured process (the console script) a one-line stderr handler; leave a configured one alone."""
    if logging.getLogger().handlers or os.environ.get("DCP_ATOMIC_TRACEBACK"):
        return None
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(_OneLineFormatter())
    logging.getLogger().addHandler(handler)
    return handler


def _run(argv: list[str]) -> int:
    as_json = "--json" in argv  # known before parsing, so that usage errors are JSON too
    root = None
    try:
        args = build_parser().parse_args(argv)
        root = getattr(args, "root", None)
        if getattr(args, "run", None) is not None:
            try:
                validate_run_id(args.run)
            except ValueError as e:
                raise CliError(str(e), code=2, kind="UsageError") from None
        return args.func(args)
    except CliError as e:
        return _report(as_json, e.kind, e.message, e.code)
    except CheckpointError as e:
        return _report(as_json, type(e).__name__, e.message, 1)
    except BrokenPipeError:
        raise
    except (OSError, ValueError) as e:  # storage and configuration failures: a message, not a traceback
        text = str(e)
        return _report(as_json, type(e).__name__, text if not root or root in text else f"{root}: {text}", 1)
    except ImportError as e:
        return _report(as_json, "MissingDependency", _missing_sdk(root or "", e), 1)
    except Exception as e:  # noqa: BLE001 - an SDK's own type (credentials, endpoints) or a bug: still one line
        if os.environ.get("DCP_ATOMIC_TRACEBACK"):
            raise
        hint = _HINTS.get(type(e).__name__)
        where = f"{root}: " if root else ""
        message = f"{where}{e}" + (f"; {hint}" if hint else
                                   " (unexpected: set DCP_ATOMIC_TRACEBACK=1 and rerun for a traceback to report)")
        return _report(as_json, type(e).__name__, message, 1)


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's own flush at exit cannot raise BrokenPipeError again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # not a real file (captured by a test harness)
        pass


def _report(as_json: bool, kind: str, message: str, code: int) -> int:
    if as_json:
        print(json.dumps({"schema": JSON_SCHEMA, "error": {"type": kind, "message": message}}))
    else:
        print(f"dcp-atomic: {kind}: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
