"""Which durable run a node's local steps belong to (P13, DESIGN "Two tiers": a local root belongs to one lineage).

Node-local disks outlive jobs.  A new experiment that reuses a run id with another (or a fresh, empty) durable root
must not continue from the weights an earlier experiment left on the nodes.  So the first two-tier manager of a run
writes ``<root>/<run_id>/LINEAGE`` (a random id, with the root and run it names), created exclusively, before any
save; every local marker records that id, and a restore takes only local steps of its own lineage.  It exists from
the job's first save, so a job whose every step so far was local-only still restores its own steps.

A durable root that refuses writes from a job's first moment (full, read-only) must not orphan that job's local
steps: the job's lineage is then *provisional*, each local marker records it with the durable root it is for
(``Marker.provisional_for``), global rank 0 creates ``LINEAGE`` with that same id once a drain reaches the root, and
a later job of that root and run that finds no ``LINEAGE`` adopts the newest such id instead of inventing one.
"""

from __future__ import annotations

import json
import re
import uuid

from ..errors import ConfigurationError, CorruptCheckpointError, StorageError
from ..format.layout import RunLayout

LINEAGE = "LINEAGE"
_ID = re.compile(r"[0-9a-f]{32}")


def describe(lineage: str | None) -> str:
    """A lineage as errors and warnings name it (a marker without one says why it has none)."""
    if lineage is None:
        return ("no lineage (saved by a version before lineages existed, or by one that recorded none while the run's "
                "LINEAGE could not be created)")
    return f"lineage {lineage}"


def lineage_path(layout: RunLayout) -> str:
    return layout.storage.join(layout.run_dir, LINEAGE)


def read_lineage(layout: RunLayout) -> str:
    """The run's lineage id (``FileNotFoundError`` when the run has none yet); a damaged file is a typed error."""
    path = lineage_path(layout)
    data = layout.storage.read_file(path)
    try:
        record = json.loads(data)
        lineage = record["lineage"]
        if record.get("kind") != "dcp_atomic.lineage" or not isinstance(lineage, str) or not _ID.fullmatch(lineage):
            raise ValueError("not a lineage record")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(f"{path}: malformed lineage file ({e}); it names which local steps belong to "
                                     "this run: restore it, or remove it to start a new lineage (the nodes' local "
                                     "steps of the old one are then not restored)", path=path) from None
    return lineage


def new_lineage() -> str:
    return uuid.uuid4().hex


def create_lineage(layout: RunLayout, lineage: str) -> str:
    """Create the run's ``LINEAGE`` naming ``lineage``, exclusively; the id it names (another job's if it was first)."""
    layout.storage.makedirs(layout.run_dir)
    record = {"kind": "dcp_atomic.lineage", "lineage": lineage, "root": layout.storage.describe(),
              "run_id": layout.run_id}
    if layout.storage.create_exclusive(lineage_path(layout), json.dumps(record, indent=1).encode() + b"\n"):
        return lineage
    return read_lineage(layout)  # another job's manager created it first


def ensure_lineage(layout: RunLayout, lineage: str) -> str:
    """The run's lineage id: the one ``LINEAGE`` names, else ``lineage``, with which it is then created."""
    try:
        return read_lineage(layout)
    except FileNotFoundError:
        return create_lineage(layout, lineage)


def refuses_writes(error: BaseException) -> bool:
    """Whether ``error`` says the durable root cannot be written now (full, read-only, throttled, unreachable) rather
    than that it is set up wrong: a lineage then stays provisional, and local saves go on.  One rule for every store:
    POSIX's ``OSError``, an object store's ``StorageError``, and an S3 probe refused for want of write permission (a
    read-only bucket, as a read-only mount).  Bad credentials, a store without conditional writes, a damaged
    ``LINEAGE`` are not: they refuse the manager, as they would refuse every drain."""
    if isinstance(error, ConfigurationError):
        return error.details.get("cause") == "permissions"
    return isinstance(error, (OSError, StorageError))
