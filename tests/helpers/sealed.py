"""Re-sealing: change a control file of a saved checkpoint and recompute every digest above it (the manifest's sha256
in the marker, the marker's self-checksum), as someone with write access could; and the check that an error is one
of ours."""

from __future__ import annotations

import hashlib
import json
import os
import pickle

from tests import manifest_view


RUN = "exp"


def seal(body: dict) -> bytes:
    body = {k: v for k, v in body.items() if k != "checksum"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return json.dumps({**body, "checksum": hashlib.sha256(canonical).hexdigest()}, indent=1).encode()


class Sealed:
    """One committed step's control files, rewritten consistently: .metadata -> manifest -> marker."""

    def __init__(self, root: str, step: int) -> None:
        self.step_dir = os.path.join(root, RUN, f"step_{step:010d}")
        self.marker_path = os.path.join(self.step_dir, "COMMITTED")
        self.marker = json.load(open(self.marker_path))
        self.attempt = os.path.join(self.step_dir, self.marker["save_id"])
        self.manifest_path = os.path.join(self.attempt, "manifest.json")
        self.manifest_bytes = open(self.manifest_path, "rb").read()
        self.manifest = manifest_view.load(self.attempt)  # every item, whether in manifest.json or its shards
        self.control = {name: open(os.path.join(self.attempt, name), "rb").read() for name in os.listdir(self.attempt)
                        if name.startswith("manifest")}
        self.marker_bytes = open(self.marker_path, "rb").read()
        self.metadata_path = os.path.join(self.attempt, ".metadata")

    def metadata(self):
        return pickle.loads(open(self.metadata_path, "rb").read())  # our own, untampered file

    def write_metadata(self, metadata) -> None:
        data = pickle.dumps(metadata)
        with open(self.metadata_path, "wb") as f:
            f.write(data)
        self.manifest["dcp_metadata"].update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
        self.write_manifest()

    def write_manifest(self, data: bytes | None = None) -> bytes:
        if data is None:
            data = manifest_view.dump(self.attempt, self.manifest)
        else:
            with open(self.manifest_path, "wb") as f:
                f.write(data)
        self.marker["manifest_sha256"] = hashlib.sha256(data).hexdigest()
        with open(self.marker_path, "wb") as f:
            f.write(seal(self.marker))
        return data

    def restore(self) -> None:
        """Put back the control files as they were when this object was made."""
        for name, data in self.control.items():
            with open(os.path.join(self.attempt, name), "wb") as f:
                f.write(data)
        with open(self.marker_path, "wb") as f:
            f.write(self.marker_bytes)

    def items(self):
        return [(entry, item) for entry in self.manifest["files"] for item in entry["items"]]


def typed(exc: BaseException) -> bool:
    """One of our errors, raised directly or wrapped by DCP (CheckpointException, or torch 2.13's
    AssertionError around a read_metadata failure, whose text carries our error's name)."""
    from dcp_atomic import CheckpointError

    seen, stack = set(), [exc]
    while stack:
        e = stack.pop()
        if isinstance(e, tuple):
            e = e[0]
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, CheckpointError):
            return True
        if isinstance(e, AssertionError) and "read failed: " in str(e) and "Error: " in str(e):
            return True
        stack += list((getattr(e, "failures", None) or {}).values()) + [e.__cause__, e.__context__]
    return False
