"""``dcp-atomic verify`` never exits 0 on a step a load refuses (P11, P12: verify tells the truth).

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
from dcp_atomic.tools.cli import main
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


def _note_cases(entry: dict) -> list[tuple[str, bytes]]:
    """One-field changes of a restore's note ``{"items": [[pos, length], ...]}`` (it claims item 0 of the file),
    and garbled notes: every kind of value each field could take."""
    first, hole = entry["items"][0], entry["items"][1]
    good = [first["pos"], first["length"]]
    odd = [None, True, False, -1, 0, 1, 2**63, 1e300, 0.5, "0", "x", [], {}, [[]], [None], float("inf"),
           float("nan"), -float("inf")]
    bodies = [{"items": value} for value in odd]
    bodies += [{"items": [value]} for value in odd]
    bodies += [{"items": [[value, good[1]]]} for value in odd] + [{"items": [[good[0], value]]} for value in odd]
    bodies += [{"items": [good + [1]]}, {"items": [good[:1]]}, {"items": [good, good]}, {"items": [good[::-1]]},
               {"items": [[hole["pos"], hole["length"]]]}, {"items": [good, [hole["pos"], hole["length"]]]},
               {"items": [[first["pos"], first["length"] + 1]]}, {"items": [[first["pos"] + 1, first["length"]]]},
               {"items": [[entry["size"] + 4096, 8]]}, {}, {"item": [good]}, {"items": [good], "more": 1}, [good],
               "items", 7]
    cases = [(f"note {json.dumps(body)[:80]}", json.dumps(body).encode()) for body in bodies]
    return cases + [("empty note", b""), ("not JSON", b"{items"), ("not UTF-8", b"\xff\xfe\x00"),
                    ("deep", b"[" * 100_000 + b"]" * 100_000), ("huge number", b'{"items": [[1' + b"0" * 5000 + b', 8]]}')]


def test_one_field_mutations_of_a_partial_note_never_make_verify_lie_or_crash(root):
    """A local root where a restore kept item 0 of a data file and left a hole at item 1: whatever the note beside
    it says, ``verify --local`` exits 0 only when the note names items of that file and every one it names
    verifies (so not the hole), else 1 naming the note or the damage; never a traceback.  A load of the step reads
    the hole and is refused either way (the note is never a load's business)."""
    attempt, entry = _saved(root)
    _damage(attempt, entry, entry["items"][1])
    first, hole = entry["items"][0], entry["items"][1]
    outcomes = {"ok": 0, "failed": 0}
    for what, body in _note_cases(entry):
        open(os.path.join(attempt, entry["name"] + ".partial"), "wb").write(body)
        try:
            code, out = _verify(root, RUN, "1", "--local")
        except BaseException as e:  # noqa: BLE001 - a crash is the finding
            raise AssertionError(f"{what}: verify crashed with {type(e).__name__}: {e}") from None
        try:
            note = json.loads(body)
        except (ValueError, RecursionError):
            note = None
        honest = (isinstance(note, dict) and set(note) == {"items"} and isinstance(note["items"], list)
                  and note["items"] and all(type(c) is list and len(c) == 2 and all(type(v) is int for v in c)
                                            for c in note["items"]))
        claims = {tuple(c) for c in note["items"]} if honest else set()
        expect_ok = honest and claims <= {(first["pos"], first["length"])}
        assert code == (0 if expect_ok else 1), f"{what}: exit {code}\n{out}"
        assert ("OK, partial copies" in out) if expect_ok else ("FAILED" in out), f"{what}: {out}"
        outcomes["ok" if code == 0 else "failed"] += 1
    assert outcomes["ok"] >= 2 and outcomes["failed"] >= 40, outcomes
    with open(os.path.join(attempt, entry["name"] + ".partial"), "wb") as f:
        f.write(json.dumps({"items": [[first["pos"], first["length"]]]}).encode())
    try:
        dcp.load({"a": torch.zeros(4096), "b": torch.zeros(4096), "c": torch.zeros(4096)},
                 storage_reader=AtomicStorageReader(root, RUN, 1, timeout=0.05))
    except BaseException as e:  # DCP wraps it
        assert "CorruptCheckpointError" in repr(e) + str(e), e
    else:
        raise AssertionError(f"the hole at {hole['pos']} loaded")
