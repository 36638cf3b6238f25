"""Which durable run a node's local steps belong to (P13, DESIGN "Two tiers": a local root belongs to one lineage).

Node-local disks outlive jobs.  A new experiment that reuses a run id with another (or a fresh, empty) durable root
must not continue from the weights an earlier experiment left on the nodes.  So the first two-tier manager of a run
writes ``<root>/<run_id>/LINEAGE`` (a random id, with the root and run it names), created exclusively, before any
save; every local marker records that id, and a restore takes only local steps of its own lineage.  It exists from
the job's first save, so a job whose every step so far was local-only still restores its own steps.
"""

from __future__ import annotations

import json
import re
import uuid

from ..errors import CorruptCheckpointError
from ..format.layout import RunLayout

LINEAGE = "LINEAGE"
_ID = re.compile(r"[0-9a-f]{32}")


def describe(lineage: str | None) -> str:
    """A lineage as errors and warnings name it (a marker without one says why it has none)."""
    if lineage is None:
        return "no lineage (saved before lineages existed, or by a job that could not reach its run's LINEAGE)"
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


def ensure_lineage(layout: RunLayout) -> str:
    """Global rank 0, once per manager: the run's lineage id, created (exclusively) by the run's first manager."""
    try:
        return read_lineage(layout)
    except FileNotFoundError:
        pass
    layout.storage.makedirs(layout.run_dir)
    record = {"kind": "dcp_atomic.lineage", "lineage": uuid.uuid4().hex, "root": layout.storage.describe(),
              "run_id": layout.run_id}
    if layout.storage.create_exclusive(lineage_path(layout), json.dumps(record, indent=1).encode() + b"\n"):
        return record["lineage"]
    return read_lineage(layout)  # another job's manager created it first
