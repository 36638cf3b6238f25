"""What ``ls`` and ``show`` report about a root: its runs, a run's steps (committed, partial, damaged), the tiers
that hold each, and the failure domains a local save's copies sit in.

The CLI is one process, so it may scan (list) the run directory to build these rows; training ranks never do.
"""

from __future__ import annotations

import time
from typing import Any

from ..._base.retry import Deadline
from ...errors import CheckpointError
from ...format.layout import DCP_METADATA, SPOOL_DIR, RunLayout, parse_step_dir, validate_run_id
from ...format.manifest import Marker
from ...protocol.catalog import most_recent, scan_markers
from ...protocol.commit import read_committed, read_marker
from ...stores.storage import Storage
from .roots import local_steps, open_root


def scan_steps(layout: RunLayout) -> tuple[dict[int, Marker], dict[int, str]]:
    """Valid markers by step, and the steps whose marker exists but cannot be validated, with the reason."""
    unreadable: list[tuple[int, str]] = []
    markers = {m.step: m for m in scan_markers(layout, unreadable=unreadable)}
    return markers, dict(unreadable)


def step_rows(layout: RunLayout, markers: dict[int, Marker], damaged: dict[int, str]) -> list[dict[str, Any]]:
    """One row per step directory of the run: committed or not, its attempts, and what its manifest says."""
    rows = []
    for name in layout.storage.list_dir(layout.run_dir):
        step = parse_step_dir(name)
        if step is None:
            continue
        attempts = layout.attempts(layout.storage.list_dir(layout.step_dir(step)))
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


def stock_dcp_hint(storage: Storage, directory: str, shown: str) -> str | None:
    """What to run when ``directory`` (``shown`` as the operator typed it) is a stock DCP checkpoint, the
    ``.metadata`` torch's FileSystemWriter writes beside its data: ``ls`` finds no runs or steps in one."""
    if DCP_METADATA not in storage.list_dir(directory):
        return None
    return (f"{shown} is a stock DCP checkpoint (it holds {DCP_METADATA}), not a dcp_atomic root: adopt it as a "
            f"committed step with `dcp-atomic import {shown} ROOT RUN STEP`")


def tier_of_root(layout: RunLayout, markers) -> str:
    """Which tier ROOT is: ``local`` when it is a node's local root (an operator may point ROOT at one), seen in
    the fields only local markers record (``lineage``, ``drain``) or the spool replicas arrive in; else
    ``durable``.  So a step that never drained is never called durable."""
    if any(m.lineage is not None or m.drain is not None for m in markers):
        return "local"
    return "local" if layout.storage.is_dir(layout.storage.join(layout.run_dir, SPOOL_DIR)) else "durable"


def step_tiers(args, step: int, save_id: str) -> list[str]:
    """Where ``step`` (save ``save_id``) is committed: ROOT's tier (:func:`tier_of_root`), and ``local`` when
    ``--local-root`` holds it."""
    root = RunLayout(open_root(args), args.run)
    try:
        marker = read_marker(root, step, Deadline(0), missing_ok=True)
    except (OSError, CheckpointError):  # not drained (yet), or no durable root here
        marker = None
    tiers = [tier_of_root(root, [marker])] if marker is not None and marker.save_id == save_id else []
    local = local_steps(args)
    if step in local and local[step].save_id == save_id and "local" not in tiers:
        tiers.append("local")
    return tiers


def copies_by_domain(ranks: list[dict[str, Any]]) -> str:
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


def with_tiers(rows: list[dict[str, Any]], local: dict[int, Marker], root_tier: str) -> list[dict[str, Any]]:
    """Each row's ``tiers``: ROOT's tier (``root_tier``) when committed in the root, ``local`` when ``--local-root``
    holds it; steps only that local root holds get a row of their own."""
    for row in rows:
        tiers = [root_tier] if row["committed"] else []
        row["tiers"] = tiers + (["local"] if row["step"] in local and "local" not in tiers else [])
    listed = {row["step"] for row in rows}
    rows += [{"step": m.step, "committed": False, "attempts": 0, "partial_attempts": 0, "save_id": m.save_id,
              "tiers": ["local"]} for m in local.values() if m.step not in listed]
    return sorted(rows, key=lambda row: row["step"])


def run_rows(storage: Storage) -> list[dict[str, Any]]:
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
    return layout.holds_run(names)


def _is_run_id(name: str) -> bool:
    try:
        validate_run_id(name)
    except ValueError:
        return False
    return True
