"""Which root and run a command's arguments name, opened once and checked to exist.

A root that does not exist, or a run or step that is not there, is an error at once (never an empty listing, never
a wait of ``--timeout``); a backend whose SDK is missing is reported with the pip extra that brings it
(:func:`~dcp_atomic.stores.backends.missing_backend_message`).
"""

from __future__ import annotations

import json

from ..._base.extras import MISSING_EXTRA_EXIT
from ..._base.retry import Deadline
from ...errors import CheckpointNotFoundError
from ...format.layout import RunLayout
from ...format.manifest import Marker
from ...protocol.commit import read_marker
from ...stores.backends import missing_backend_message, open_storage
from ...stores.storage import Storage
from .output import CliError


def open_root(args) -> Storage:
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
        raise CliError(missing_backend_message(args.root, e), code=MISSING_EXTRA_EXIT,
                       kind="MissingDependency") from None
    if not storage.is_dir(storage.root):
        raise CliError(f"{args.root}: no such checkpoint root (nothing there)", kind="NotFound")
    return storage


def run_layout(args) -> RunLayout:
    layout = RunLayout(open_root(args), args.run)
    if not layout.storage.is_dir(layout.run_dir):
        raise CliError(f"no run {args.run!r} under {args.root}", kind="NotFound")
    return layout


def local_run_layout(args) -> RunLayout:
    from ...tiers.local_tier import open_local

    layout = open_local(args.local_root, args.run)
    if not layout.storage.is_dir(layout.run_dir):
        raise CliError(f"no run {args.run!r} under the local root {args.local_root}", kind="NotFound")
    return layout


def require_step(layout: RunLayout, step: int) -> None:
    """An explicit step with no directory at all is reported at once, not after ``--timeout``."""
    if not layout.storage.is_dir(layout.step_dir(step)):
        raise CheckpointNotFoundError(
            f"run {layout.run_id!r} has no step {step} ({layout.step_dir(step)} does not exist)", step=step
        )


def require_committed(layout: RunLayout, step: int) -> None:
    """An explicit step without a commit marker is reported at once: a partial step (a save in flight, or one that
    died) is what it is, and waiting ``--timeout`` for its marker tells the operator nothing more."""
    require_step(layout, step)
    try:
        read_marker(layout, step, Deadline(0), missing_ok=True)
    except FileNotFoundError:
        attempts = layout.attempts(layout.storage.list_dir(layout.step_dir(step)))
        raise CheckpointNotFoundError(
            f"step {step} of run {layout.run_id!r} is not committed: {layout.step_dir(step)} holds "
            f"{len(attempts)} attempt(s) and no commit marker (a save in flight, or one that died; `dcp-atomic gc` "
            "collects abandoned attempts, `dcp-atomic ls` lists the committed steps)", step=step,
            path=layout.marker(step)) from None


def local_steps(args) -> dict[int, Marker]:
    """The local markers in ``--local-root`` (one node's disk: the CLI sees no other node's local tier)."""
    if not getattr(args, "local_root", None):
        return {}
    from ...tiers.local_tier import local_markers, open_local

    return {m.step: m for m in local_markers(open_local(args.local_root, args.run))}
