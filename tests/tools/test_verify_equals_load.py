"""``dcp-atomic verify`` and a load give one verdict on every step: verify exits 0 exactly when the load is exact.

Both decide through the same checks (:mod:`dcp_atomic.dcp.read_checks`), so this fuzz changes one control field of a
saved step at a time, re-seals every digest above it (as anyone with write access can), and runs ``verify`` (the CLI,
by its exit status) and a real load (one process: the reader's checks are the same) on it.  Every field of the
marker, of ``manifest.json`` (its records of ``.metadata``, ``ranks.json`` and the shards, every file and item), of
every manifest shard, of ``ranks.json``, and ``.metadata``'s dtypes; three formats.  A disagreement either way is a
failure: verify passing a step the load refuses, or failing one that loads exactly.  ``ranks.json`` is never read by
a load: damage there is a warning of ``verify``, not a failure (see docs/guarantees.md).

``pytest -s tests/tools/test_verify_equals_load.py -k fuzz`` prints the counts docs/guarantees.md quotes.
"""

from __future__ import annotations

import pytest

import contextlib
import copy
import io
import json
import os
import random
import time

import torch
import torch.distributed.checkpoint as dcp

from dcp_atomic import AtomicStorageReader, AtomicStorageWriter
from dcp_atomic.tools import cli
from tests.helpers.sealed import RUN, Sealed, seal
from tests.format.test_resealed_mutations import (FORMATS, _every_path, _file_cases, _load, _mutate, _paths, _save,
                                           _SealedFiles)


def _verify(root: str, step: int, *extra: str) -> tuple[int, str]:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(io.StringIO()):
        code = cli.main(["--timeout", "0.05", "verify", root, RUN, str(step), *extra])
    return code, printed.getvalue()


def _judge(root: str, step: int, what: str) -> dict:
    load, detail = _load(root, step)
    code, out = _verify(root, step)
    return {"mutation": what, "load": load, "detail": detail, "verify": code, "out": out,
            "agree": (code == 0) == (load == "exact")}


def _cases(root: str, step: int, seed: str):
    """(description, apply) for one-field changes of every control file of ``step``; ``apply`` writes the change
    re-sealed.  The caller restores the step after each."""
    view = Sealed(root, step).manifest
    for i, path in enumerate(_paths(view)):
        def apply(path=path, i=i):
            ck = Sealed(root, step)
            what = _mutate(random.Random(f"{seed}/manifest/{i}"), ck.manifest, path)
            ck.write_manifest()
            return f"manifest.json: {what}"
        yield apply
    sealed = _SealedFiles(root, step)
    for what, name, data in list(_file_cases(random.Random(f"{seed}/files"), sealed)):
        def apply(what=what, name=name, data=data):
            _SealedFiles(root, step).write(name, data)
            return what
        yield apply
    marker_path = Sealed(root, step).marker_path
    marker = json.load(open(marker_path))
    for i, path in enumerate(p for p in _every_path(marker) if p != ("checksum",)):
        def apply(path=path, i=i):
            mutated = copy.deepcopy(marker)
            what = _mutate(random.Random(f"{seed}/marker/{i}"), mutated, path)
            with open(marker_path, "wb") as f:
                f.write(seal(mutated))
            return f"COMMITTED: {what}"
        yield apply


@pytest.mark.slow
def test_fuzz_verify_and_load_agree_on_every_one_field_change_of_every_control_file(root):
    started = time.monotonic()
    results = []
    for step, (fmt, options) in enumerate(FORMATS.items()):
        _save(root, step, options)
        pristine = _SealedFiles(root, step)
        assert _judge(root, step, "none")["load"] == "exact" and _verify(root, step)[0] == 0, fmt
        for apply in list(_cases(root, step, f"20261210/{fmt}")):
            try:
                what = apply()
                results.append({"format": fmt, **_judge(root, step, what)})
            finally:
                pristine.restore()
        assert _load(root, step)[0] == "exact" and _verify(root, step)[0] == 0, f"{fmt}: pristine again"
    wrong = [r for r in results if r["load"] in ("silent", "untyped")]
    passes_refused = [r for r in results if not r["agree"] and r["verify"] == 0]
    fails_exact = [r for r in results if not r["agree"] and r["verify"] != 0]

    def show(rows):
        return "\n".join(f"  {r['format']}: {r['mutation']} -> load {r['load']} {r['detail'][-200:]}\n"
                         f"    verify {r['verify']}: {r['out'][-400:]}" for r in rows[:8])

    assert not wrong, f"{len(wrong)} loads silent or untyped:\n{show(wrong)}"
    assert not passes_refused, f"verify passed {len(passes_refused)} step(s) the load refuses:\n{show(passes_refused)}"
    assert not fails_exact, f"verify failed {len(fails_exact)} step(s) that load exactly:\n{show(fails_exact)}"
    refused = sum(r["load"] == "refused" for r in results)
    assert len(results) >= 800 and refused >= len(results) // 2, (len(results), refused)
    print(f"\nverify versus load: {len(results)} mutations, {refused} refused by both, {len(results) - refused} "
          f"exact and verified, 0 disagreements, {time.monotonic() - started:.1f}s")


# -- the cases the issue named, one by one -------------------------------------------------------------------------


def test_a_wrong_size_in_the_manifests_record_of_metadata_fails_verify_as_it_fails_the_load(root):
    """The load refuses a ``.metadata`` whose size is not the manifest's record of it; verify checked only the
    sha256 and passed the step."""
    _save(root, 1, {})
    ck = Sealed(root, 1)
    ck.manifest["dcp_metadata"]["size"] += 1
    ck.write_manifest()
    load, detail = _load(root, 1)
    assert load == "refused" and "DCP metadata does not match the manifest" in detail, detail
    code, out = _verify(root, 1)
    assert code == 1 and "FAILED" in out and "DCP metadata does not match the manifest (size" in out, out


def test_damaged_ranks_json_warns_and_the_step_it_does_not_stop_loading_verifies(root):
    """``ranks.json`` (who saved, how fast) is never read by a load: a step whose copy of it is damaged loads
    exactly, so verify passes it, with a warning naming the file; before, verify FAILED it."""
    _save(root, 1, {})
    sealed = _SealedFiles(root, 1)
    body = json.loads(sealed.saved["ranks.json"])
    body["ranks"][0]["host"] = 7  # a field of the wrong kind, re-sealed
    sealed.write("ranks.json", json.dumps(body).encode())
    assert _load(root, 1)[0] == "exact"
    code, out = _verify(root, 1)
    assert code == 0 and "step 1: OK, with warnings" in out and "warning: " in out and "ranks.json" in out, out
    assert "no load reads this file" in out, out
    code, out = _verify(root, 1, "--json")
    (report,) = json.loads(out)
    assert code == 0 and report["problems"] == [] and "ranks.json" in report["warnings"][0], report
    with open(os.path.join(sealed.ck.attempt, "ranks.json"), "ab") as f:  # damaged under its seal: the same
        f.write(b" ")
    code, out = _verify(root, 1)
    assert code == 0 and "does not match the manifest" in out and "warning: " in out, out


def test_the_record_of_an_empty_chunk_verifies_as_it_loads(root):
    """DCP plans no read for a chunk without elements, so no record of one can make a load refuse or load a wrong
    value: verify judges it as the load does (before, a garbled dtype or format of the record FAILED the step)."""
    _save(root, 1, {})
    for field, value in (("dtype", "torch.int32"), ("format", "torch_save"), ("checksums", ["0" * 16])):
        ck = Sealed(root, 1)
        (item,) = [item for _, item in ck.items() if item["key"] == "empty"]
        item[field] = value
        ck.write_manifest()
        try:
            assert _load(root, 1)[0] == "exact", field
            code, out = _verify(root, 1)
            assert code == 0 and "step 1: OK" in out, (field, out)
        finally:
            ck.restore()


def test_hard_linked_steps_are_blamed_only_for_damaged_bytes_not_for_another_steps_records(root):
    """Steps 2, 3 and 4 link step 1's plain file (reuse: step 2 under a stable name, 3 and 4 step 2's).  A re-sealed
    change to step 3's record of one of its blocks fails step 3 (its load refuses too) but the bytes are intact: no
    other step is said to hold damaged bytes, and steps 1, 2 and 4 verify.  A flipped byte of the file is then named
    in every step that links it, under either name."""
    from tests.helpers.reuse_state import frozen
    from tests.dcp.test_reuse import _inode, _load_one, _save_one, _stable

    base = frozen()
    for step in (1, 2, 3, 4):
        _save_one(root, step, base)
    plain = os.path.join(os.path.dirname(_stable(root, 1, 0)), "__0_0.distcp")
    assert _inode(plain) == _inode(_stable(root, 2, 0)) == _inode(_stable(root, 3, 0)) == _inode(_stable(root, 4, 0))
    ck = Sealed(root, 3)
    stable = os.path.basename(_stable(root, 3, 0))
    (entry,) = [entry for entry in ck.manifest["files"] if entry["name"] == stable]
    entry["items"][0]["checksums"][0] = "0" * 16
    ck.write_manifest()
    try:
        _load_one(root, 3)
        raise AssertionError("step 3 loaded with a block record that does not match its bytes")
    except BaseException as e:  # noqa: BLE001 - DCP wraps our error
        assert "checksum mismatch" in str(e) or "CorruptCheckpointError" in repr(e), e
    code, out = _verify(root, 3)
    assert code == 1 and "step 3: FAILED" in out and "checksum mismatch" in out, out
    assert "hold the same damaged bytes" not in out, out
    for step in (1, 2, 4):
        assert _verify(root, step)[0] == 0, step
    ck.restore()
    with open(_stable(root, 3, 0), "r+b") as f:
        f.seek(4096)
        byte = f.read(1)
        f.seek(4096)
        f.write(bytes([byte[0] ^ 0x01]))
    code, out = _verify(root, 3)
    assert code == 1 and "is in step(s) 1, 2, 4, which hold the same damaged bytes" in out, out
