"""``dcp-atomic verify`` never exits 0 on a step a load refuses (P11, P12; issue: verify tells the truth).

* A partial-copy note (``<file>.partial``) is honoured only with ``--local`` (a node's local root, where only a tier
  restore writes one), only when it names the items it holds, and only if those items verify; a note in a durable
  root, or a stray note naming nothing, fails the step and names the note.  Before, any empty note anywhere turned
  damage into "OK, partial copies".
* The P11 decoders run in verify too: a non-tensor item the allow-list refuses is a FAILED step, as its load is.
"""

from __future__ import annotations

import contextlib
import io
import json
import os

import torch
import torch.distributed.checkpoint as dcp

from dcp_atomic import AtomicStorageReader, AtomicStorageWriter, UnsafeItemError
from dcp_atomic.cli import main
from tests import manifest_view

RUN = "exp"


class _UserConfig:
    def __init__(self, lr: float) -> None:
        self.lr = lr


def _verify(*argv):
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["verify", *argv])
    return code, printed.getvalue()


def _saved(root, state=None):
    state = state or {"a": torch.arange(4096.0), "b": torch.arange(4096.0) * 2, "c": torch.ones(4096)}
    dcp.save(state, storage_writer=AtomicStorageWriter(root, RUN, 1))
    step_dir = os.path.join(root, RUN, "step_0000000001")
    attempt = os.path.join(step_dir, json.load(open(os.path.join(step_dir, "COMMITTED")))["save_id"])
    view = manifest_view.load(attempt)
    entry = next(f for f in view["files"] if f["name"].endswith(".distcp"))
    return attempt, entry


def _damage(attempt, entry, item):
    with open(os.path.join(attempt, entry["name"]), "r+b") as f:
        f.seek(item["pos"])
        f.write(b"\x00" * min(64, item["length"]))


def _note(attempt, entry, items):
    body = b"" if items is None else json.dumps({"items": [[i["pos"], i["length"]] for i in items]}).encode()
    open(os.path.join(attempt, entry["name"] + ".partial"), "wb").write(body)


def test_a_partial_note_in_a_durable_root_fails_the_step(root):
    attempt, entry = _saved(root)
    _damage(attempt, entry, entry["items"][1])
    _note(attempt, entry, [entry["items"][0]])  # as a restore would write it, but not on a local root
    code, out = _verify(root, RUN, "1")
    assert code == 1 and "FAILED" in out and ".partial: a partial-copy note in a root that is not" in out, out
    code, out = _verify(root, RUN, "1", "--local")  # on a local root the same note is a restore's partial copy
    assert code == 0 and "OK, partial copies" in out, out


def test_a_stray_note_naming_nothing_is_no_excuse_for_damage(root):
    attempt, entry = _saved(root)
    _damage(attempt, entry, entry["items"][1])
    _note(attempt, entry, None)
    for extra in ((), ("--local",)):
        code, out = _verify(root, RUN, "1", *extra)
        assert code == 1 and "FAILED" in out and "checksum mismatch" in out, (extra, out)
    code, out = _verify(root, RUN, "1", "--local")
    assert "no tier restore wrote" in out, out


def test_a_local_partial_copy_whose_claimed_item_is_damaged_fails(root):
    attempt, entry = _saved(root)
    _note(attempt, entry, entry["items"][:2])
    _damage(attempt, entry, entry["items"][0])
    code, out = _verify(root, RUN, "1", "--local")
    assert code == 1 and "FAILED" in out and "checksum mismatch" in out, out


def test_verify_fails_a_non_tensor_item_the_load_refuses(root):
    _saved(root, {"w": torch.ones(8), "cfg": _UserConfig(0.5)})
    try:
        dcp.load({"w": torch.zeros(8), "cfg": None}, storage_reader=AtomicStorageReader(root, RUN, 1))
        refused = None
    except BaseException as e:  # DCP wraps the rank's error (a CheckpointException is a BaseException)
        refused = e
    assert refused is not None and "UnsafeItemError" in repr(refused) + str(refused), refused
    code, out = _verify(root, RUN, "1")
    assert code == 1 and "FAILED" in out and "UnsafeItemError" in out and "cfg" in out, out
    assert UnsafeItemError.__name__ in out
