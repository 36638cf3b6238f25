"""The ``dcp-atomic`` subcommands, one ``cmd_*`` each: what it reads or deletes and what it prints.

Each takes the parsed arguments and returns the exit status; a failure is raised (:class:`CliError` or the library's
own :class:`~dcp_atomic.errors.CheckpointError`) for the package's ``main`` to report as one line.  What needs torch
(verify, export, import, demo) is imported inside its command, so ``--help``, ``ls`` and ``show`` start without it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from ..._base.extras import MISSING_EXTRA_EXIT
from ..._base.progress import format_size
from ..._base.retry import Deadline
from ...errors import CheckpointError, CheckpointNotFoundError
from ...format.layout import RunLayout, parse_step_dir
from ...protocol.catalog import most_recent, scan_markers
from ...protocol.commit import read_committed, read_marker
from ...protocol.retention import apply_gc, plan_gc, remove_run, remove_step
from ...protocol.retention_policy import Retention
from .output import JSON_SCHEMA, CliError, CopyProgress, emit, format_age, format_mib
from .roots import local_run_layout, local_steps, open_root, require_committed, require_step, run_layout
from .rows import (copies_by_domain, run_rows, scan_steps, step_rows, step_tiers, stock_dcp_hint, tier_of_root,
                   with_tiers)


def cmd_ls(args) -> int:
    if not args.run:
        storage = open_root(args)
        rows = run_rows(storage)
        hint = None if rows else stock_dcp_hint(storage, storage.root, args.root)
        if args.json:
            emit({"root": args.root, "runs": rows, **({"hint": hint} if hint else {})})
        elif not rows:
            print(f"no runs under {args.root}" + (f": {hint}" if hint else ""))
        else:
            print(f"{'run':<30} {'steps':>5} {'latest':>10} {'size':>12} {'age':>6}")
            for row in rows:
                committed = row["latest_step"] is not None
                damaged = f"  ({row['unreadable_manifests']} unreadable)" if row["unreadable_manifests"] else ""
                damaged += f"  ({row['damaged_markers']} damaged marker(s))" if row["damaged_markers"] else ""
                print(f"{row['run']:<30} {row['committed_steps']:>5} {row['latest_step'] if committed else '-':>10} "
                      f"{format_mib(row['bytes']) if committed else '-':>12} "
                      f"{format_age(row['age_seconds']) if committed else '-':>6}{damaged}")
        return 0
    layout = run_layout(args)
    markers, damaged = scan_steps(layout)
    root_tier = tier_of_root(layout, markers.values())
    rows = with_tiers(step_rows(layout, markers, damaged), local_steps(args), root_tier)
    newest = most_recent(list(markers.values()))
    hint = None if rows else stock_dcp_hint(layout.storage, layout.run_dir, layout.run_dir)
    if args.json:
        emit({"run": args.run, "latest": newest.step if newest else None, "root_tier": root_tier, "steps": rows,
              **({"hint": hint} if hint else {})})
        return 0
    if not rows:
        print(f"no steps in {layout.run_dir}" + (f": {hint}" if hint else ""))
        return 0
    if root_tier == "local":
        print(f"{args.root} is a node's local root: its steps are this disk's copies; which of them drained shows "
              f"`dcp-atomic ls DURABLE_ROOT {args.run} --local-root {args.root}`")
    now = time.time()
    print(f"{'step':>10}  {'state':<10} {'tiers':<14} {'size':>10}  {'age':>6}  {'world':>5}  layout              save_id")
    for row in rows:
        state = ("committed" if row["committed"] else "damaged" if "marker_error" in row
                 else "local" if row["tiers"] == ["local"] else "partial")
        size = format_mib(row["bytes"]) if "bytes" in row else "-"
        age = format_age(now - row["committed_at"]) if "committed_at" in row else "-"
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
    durable = run_layout(args) if not args.local_root else None
    layout = durable or local_run_layout(args)
    step = args.step
    if step is None:
        newest = most_recent(scan_markers(layout))
        if newest is None:
            raise CheckpointNotFoundError(f"no committed step in {layout.run_dir}")
        step = newest.step
    require_committed(layout, step)
    committed = read_committed(layout, step, Deadline(args.timeout))
    committed.load_items(layout, None, Deadline(args.timeout))
    committed.load_rank_records(layout, Deadline(args.timeout))
    manifest = committed.manifest
    tiers = step_tiers(args, step, committed.save_id)
    if args.json:  # the manifest as stored (its own "schema_version"), with what ranks.json holds
        emit(dict(sorted({**json.loads(manifest.to_json()), "ranks": manifest.ranks, "stats": manifest.stats,
                           "tiers": tiers}.items())))
        return 0
    print(f"run {manifest.run_id}  step {manifest.step}  save {manifest.save_id}")
    print(f"tiers: {', '.join(tiers)}")
    domains = copies_by_domain(manifest.ranks)
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
    layout = run_layout(args)
    damaged: dict[int, str] = {}
    if args.step is not None:
        require_step(layout, args.step)
        steps = [args.step]
    else:
        markers, damaged = scan_steps(layout)  # with a damaged marker "the latest" is unknown: report it either way
        newest = most_recent(list(markers.values()))
        steps = sorted(markers) if args.all else [newest.step] if newest else []
    if not steps and not damaged:
        raise CheckpointNotFoundError(f"no committed step to verify in {layout.run_dir}")
    # torch (the .metadata's classes, the codecs) only now: an unreachable or empty root has answered without it
    from ..audit import AuditReport, audit_step

    reports = [AuditReport(step, None, 0, 0, [f"commit marker cannot be validated: {reason}"])
               for step, reason in damaged.items()]
    for step in steps:
        try:
            require_committed(layout, step)
            total = read_committed(layout, step, Deadline(args.timeout)).manifest.total_bytes
        except CheckpointError as e:  # not committed or damaged: reported now, not waited for a second time
            reports.append(AuditReport(step, None, 0, 0, [str(e)]))
            continue
        progress = None if args.json else CopyProgress(total, f"verify step {step}")
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
            read = ("nothing read: no committed save" if r.save_id is None
                    else f"{r.files} files, {r.bytes / 2**20:.1f} MiB, save {r.save_id}")
            print(f"step {r.step}: {status} ({read})")
            for line in r.problems + r.notes + [f"warning: {w}" for w in r.warnings]:
                print(f"  {line}")
    return 1 if bad else 0


def cmd_diff(args) -> int:
    """Keys added, removed, changed and unchanged between two committed steps; changed tensors by max-abs
    difference, largest first, ``--limit`` of them listed."""
    from ..diff import diff_steps  # torch: only the commands that read tensors import it

    layout = run_layout(args)
    for step in (args.a, args.b):
        require_committed(layout, step)
    options = json.loads(args.storage_options) if args.storage_options else None
    result = diff_steps(args.root, args.run, args.a, args.b, timeout=args.timeout, storage_options=options,
                        tolerance=args.tolerance, check_both=args.verify)
    if args.json:
        emit(result.to_dict())
        return 0
    counts = result.to_dict()["counts"]
    print(f"run {args.run}: step {result.step_a} -> step {result.step_b}: {counts['changed']} changed, "
          f"{counts['added']} added, {counts['removed']} removed, {counts['unchanged']} unchanged "
          f"({result.unchanged_by_digest} by digest, none of their bytes read); read {format_size(result.bytes_read)} of data"
          + ("; both steps verified whole first" if result.verified else ""))
    if result.changed:
        print(f"  {'changed':<50} {'max-abs':>10} {'relative':>10}  note")
        for change in result.changed[:args.limit]:
            print(f"  {change.key:<50} {_number(change.max_abs):>10} {_number(change.relative):>10}  "
                  f"{_change_note(change)}")
        if len(result.changed) > args.limit:
            print(f"  ... {len(result.changed) - args.limit} more (--limit, or --json for all)")
    for label, keys in (("added", result.added), ("removed", result.removed)):
        if keys:
            shown = ", ".join(keys[:args.limit]) + (f", ... {len(keys) - args.limit} more" if len(keys) > args.limit
                                                     else "")
            print(f"  {label}: {shown}")
    return 0


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _change_note(change) -> str:
    if change.kind == "object":
        return "not a tensor: values differ"
    notes = [f"dtype {change.dtype[0]} -> {change.dtype[1]}"] if change.dtype else []
    notes += [f"shape {change.shape[0]} -> {change.shape[1]}"] if change.shape else []
    return ", ".join(notes)


def cmd_stats(args) -> int:
    """A table per committed step of what its save recorded (``--plot FILE.png``: the same over steps)."""
    from ..run_stats import FIGURES, plot, plotting, step_statistics

    if args.plot:
        _check_plot_path(args.plot)
        try:
            plotting()
        except ImportError as e:
            raise CliError(str(e), code=MISSING_EXTRA_EXIT, kind="MissingDependency") from None
    layout = run_layout(args)
    markers, damaged = scan_steps(layout)
    rows = step_statistics(layout, list(markers.values()), tier_of_root(layout, markers.values()), args.timeout)
    if args.plot:
        plot(rows, args.plot, f"run {args.run} under {args.root}")
    if args.json:
        emit({"run": args.run, "steps": rows, "damaged_markers": damaged, **({"plot": args.plot} if args.plot else {})})
        return 0
    if not rows:
        print(f"no committed steps in {layout.run_dir}")
    else:
        print(f"{'step':>10}  {'tier':<8} " + " ".join(f"{heading:>10}" for _, heading, _ in FIGURES))
    for row in rows:
        cells = [_figure(row[name], unit) for name, _, unit in FIGURES]
        tier = (row["tier"] or "-") + ("*" if row.get("drained") else "")
        print(f"{row['step']:>10}  {tier:<8} " + " ".join(f"{cell:>10}" for cell in cells)
              + (f"  ({row['error']})" if "error" in row else ""))
    if any(row.get("drained") for row in rows):
        print("*: saved on the local tier, then drained here; drain: its background copy, from start to commit")
    for step, reason in sorted(damaged.items()):
        print(f"step {step}: its commit marker cannot be validated ({reason}); not listed", file=sys.stderr)
    if args.plot:
        print(f"wrote {args.plot}")
    return 0


def _check_plot_path(path: str) -> None:
    """``--plot``'s file, before anything is read: a PNG (the one format drawn), in a folder that exists and can be
    written; a usage error naming it otherwise."""
    folder = os.path.dirname(os.path.abspath(path))
    if not path.lower().endswith(".png"):
        raise CliError(f"--plot {path}: the chart is a PNG; name a file ending in .png", code=2, kind="UsageError")
    if not os.path.isdir(folder):
        raise CliError(f"--plot {path}: its folder {folder} does not exist; create it first", code=2,
                       kind="UsageError")
    if not os.access(folder, os.W_OK):
        raise CliError(f"--plot {path}: its folder {folder} cannot be written", code=2, kind="UsageError")


def _figure(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}s" if unit == "s" else format_size(value)


def cmd_gc(args) -> int:
    """Print the plan (each kept step with what keeps it), then apply it; with ``--json`` one object, holding the
    plan and any failure to apply it.

    ``--local-root DIR``: collect only what killed or failed saves left on that node's local root (attempts older
    than the lease with no marker, temp files, a restore's spool of a process that is gone); its committed steps
    are the manager's (``keep_local``) and are never deleted here, nor is the durable root touched."""
    policy = Retention(keep_last=args.keep_last, keep_every=args.keep_every, keep_period=args.keep_period,
                       best=args.best)
    if args.local_root:
        if not policy.keeps_all:
            raise CliError("gc --local-root collects only abandoned attempts; local steps are kept by the manager's "
                           "keep_local, so --keep-last, --keep-every, --keep-period and --best do not apply", code=2,
                           kind="UsageError")
        from ...tiers.local_tier import sweep_spool

        layout = local_run_layout(args)
        swept = sweep_spool(layout)
        if swept and not args.json:
            print(f"removed {len(swept)} leftover restore file(s) from {layout.storage.describe()}")
    elif policy.keeps_all:
        raise CliError("gc needs a retention policy (--keep-last N, --keep-every K, --keep-period SECONDS, --best "
                       "METRIC:K:min|max), or --local-root DIR", code=2, kind="UsageError")
    else:
        layout = run_layout(args)
    plan = plan_gc(layout, policy, lease_seconds=args.lease_hours * 3600)
    unreadable = plan.unreadable_steps  # markers that exist but cannot be validated: never touched, never "kept"
    kept = {step: why for step, why in plan.kept_reasons.items() if step not in dict(unreadable)}
    if args.local_root:  # the manager's keep_local keeps these, not a policy given here
        kept = {step: ["local step (keep_local)"] for step in kept}
    if not args.json:
        verb = "would delete" if args.dry_run else "deleting"
        if not args.local_root:
            print(f"policy: {policy.describe()}")
        for step in sorted({*kept, *plan.delete_steps}):
            print(f"step {step}: " + (f"kept ({', '.join(kept[step])})" if step in kept else
                                      f"{verb} (no part of the policy keeps it)"))
        for step, save_id in plan.in_flight:
            print(f"step {step}: kept attempt {save_id} (in flight: uncommitted, inside the "
                  f"{plan.lease_seconds / 3600:g} h lease)")
        for step, save_id in plan.delete_attempts:
            print(f"{verb} abandoned attempt {save_id} of step {step}")
        for path in plan.delete_temps:
            print(f"{verb} leftover temp file {path}")
        for path in plan.delete_data:
            print(f"{verb} data without a step record {path}")
        print(f"keeping committed steps {sorted(kept)}" + ("" if not plan.empty else " (nothing to collect)"))
        for step, reason in unreadable:
            print(f"step {step}: its marker exists but cannot be validated, so gc left the whole step alone "
                  f"({reason}); inspect it, restore the marker, or delete the step by hand", file=sys.stderr)
        if not args.dry_run:
            apply_gc(layout, plan)  # a failure is reported by main, after the lines above
        return 1 if unreadable else 0
    report: dict[str, Any] = {"schema": JSON_SCHEMA, "dry_run": args.dry_run, "delete_steps": plan.delete_steps,
                              "delete_attempts": [list(a) for a in plan.delete_attempts],
                              "delete_temps": plan.delete_temps, "delete_data": plan.delete_data,
                              "kept_steps": sorted(kept), "kept_reasons": {str(s): kept[s] for s in sorted(kept)},
                              "in_flight_attempts": [list(a) for a in plan.in_flight],
                              "unreadable_steps": [list(u) for u in unreadable]}
    if not args.local_root:
        report["policy"] = policy.describe()
    if not args.dry_run:
        try:
            apply_gc(layout, plan)
        except (CheckpointError, OSError) as e:
            report["error"] = {"type": type(e).__name__, "message": getattr(e, "message", str(e))}
    print(json.dumps(report))
    return 1 if unreadable or "error" in report else 0


def cmd_rm(args) -> int:
    """Show what would go; delete it only with ``--yes`` (a step, or the whole run).  Never touches another run."""
    layout = run_layout(args)
    markers, damaged = scan_steps(layout)
    if args.step is not None:
        require_step(layout, args.step)
        remaining = [m for step, m in markers.items() if step != args.step]
        newest = most_recent(remaining)
        plan: dict[str, Any] = {
            "run": args.run, "step": args.step, "committed": args.step in markers,
            "attempts": layout.attempts(layout.storage.list_dir(layout.step_dir(args.step))),
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
            emit({**plan, "removed": False})
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
        emit({**plan, "removed": True})
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
    """One step as a single torch.save file, or as Hugging Face safetensors shards (streamed, one tensor in memory),
    with a progress line on stderr once it takes a while."""
    layout = run_layout(args)
    require_committed(layout, args.step)
    options = json.loads(args.storage_options) if args.storage_options else None
    out = os.path.abspath(args.out)
    if not os.path.isdir(os.path.dirname(out)):
        raise CliError(f"cannot export to {args.out}: directory {os.path.dirname(out)} does not exist; create it, or "
                       "choose another OUT", kind="NotFound")
    shown: list[CopyProgress] = []

    def progress(total: int) -> CopyProgress:  # a line on stderr once the export takes a while (not with --json)
        shown.append(CopyProgress(total, f"export step {args.step}"))
        return shown[-1]

    progress = None if args.json else progress
    try:
        return _export(args, out, options, progress)
    finally:
        for line in shown:
            line.close()


def _export(args, out: str, options: dict | None, progress) -> int:
    from ..export import DEFAULT_SHARD_SIZE, export_safetensors, export_torch

    if args.format == "torch":
        if args.dtype or args.keys or args.shard_size or args.renames or args.ties:
            raise CliError("--dtype, --keys, --shard-size, --strip-prefix, --rename and --tie apply to "
                           "--format safetensors", code=2, kind="UsageError")
        step, save_id = export_torch(args.root, args.run, args.step, out, timeout=args.timeout,
                                     storage_options=options, force=args.force, progress=progress)
        if args.json:
            emit({"out": out, "format": "torch", "step": step, "save_id": save_id})
        else:
            print(f"exported run {args.run} step {step} (save {save_id}) to {args.out}")
        return 0
    report = export_safetensors(args.root, args.run, args.step, out, shard_size=args.shard_size or DEFAULT_SHARD_SIZE,
                                dtype=args.dtype, keys=args.keys or (), renames=args.renames or (),
                                ties=args.ties or (), force=args.force, timeout=args.timeout,
                                storage_options=options, progress=progress)
    if args.json:
        emit({"out_dir": report.out_dir, "format": "safetensors", "step": report.step, "save_id": report.save_id,
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
    from ..importer import import_stock

    options = json.loads(args.storage_options) if args.storage_options else None
    marker = import_stock(args.source, args.root, args.run, args.step, link=args.link, timeout=args.timeout,
                          storage_options=options)
    if args.json:
        emit({"run": args.run, "step": marker.step, "save_id": marker.save_id})
    else:
        print(f"imported {args.source} as run {args.run} step {marker.step} (save {marker.save_id}, "
              f"{'hard-linked' if args.link else 'copied'})")
    return 0


def cmd_demo(args) -> int:
    from ..demo import run_demo

    return run_demo(args.root, args.world_size)
