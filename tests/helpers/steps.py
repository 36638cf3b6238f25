"""Committed steps made and edited the way the CLI and decoding tests need: a plain ``dcp.save`` of one step, its
paths, and a re-sealed manifest (what someone with write access can do)."""

from __future__ import annotations

import hashlib
import json
import os

import torch
import torch.distributed.checkpoint as dcp

from dcp_atomic import AtomicStorageWriter
from tests import manifest_view

RUN = "exp"


def _save(root, step, state=None, run=RUN, **writer_args):
    state = {"w": torch.randn(32, 32), "meta": {"step": step}} if state is None else state
    dcp.save(state, storage_writer=AtomicStorageWriter(root, run, step, **writer_args))


def _step_paths(root, step, run=RUN):
    step_dir = os.path.join(root, run, f"step_{step:010d}")
    marker = json.load(open(os.path.join(step_dir, "COMMITTED")))
    return step_dir, os.path.join(step_dir, marker["save_id"]), marker


def _reseal(root, step, edit_manifest):
    """Edit a committed manifest (items included) and recompute every digest that names it — shard, manifest,
    marker (what someone with write access can do)."""
    step_dir, attempt, marker = _step_paths(root, step)
    manifest = manifest_view.load(attempt)
    edit_manifest(manifest, attempt)
    data = manifest_view.dump(attempt, manifest)
    marker["manifest_sha256"] = hashlib.sha256(data).hexdigest()
    body = {k: v for k, v in marker.items() if k != "checksum"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    sealed = json.dumps({**body, "checksum": hashlib.sha256(canonical).hexdigest()}, indent=1).encode()
    open(os.path.join(step_dir, "COMMITTED"), "wb").write(sealed)
