"""A memory slot's commit record has one strict parser (``dcp_atomic.format.slot_record``), and ``verify --memory``
judges a slot exactly as a restore does.

One process, no replicas: steps 1 and 2 snapshotted, then step 2's record changed in one field at a time and sealed
again properly (only a check of its content can catch it), or an object item's bytes replaced by a hostile pickle
with its digest recomputed.  For each case the restore must load step 2 exactly (the change is harmless), serve
around it and load step 1 exactly (the change is named), or refuse by name (a record that no longer fits the state
dict); ``verify`` must call the slot FAILED exactly when the restore serves around it.  Nothing silent, untyped or
hanging.  (A record re-sealed with another step number, the same in every copy, is out of reach of a self-checksum:
with replicas, one copy that disagrees is caught, ``tests/memory/test_memory_tier.py``.)
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil

import pytest
import torch

from dcp_atomic.format import sealed_json
from dcp_atomic.format.integrity import BLOCK_SIZE, BlockHasher

RUN = "records"


def _state(step: int) -> dict:
    return {"w": torch.arange(1024.0).reshape(4, 256) + step, "h": torch.full((3,), float(step), dtype=torch.bfloat16),
            "epoch": step, "nested": {"notes": {"step": step}, "empty": torch.zeros(0)}}


def _blank() -> dict:
    return {"w": torch.zeros(4, 256), "h": torch.zeros(3, dtype=torch.bfloat16), "epoch": -1,
            "nested": {"notes": {"step": -1}, "empty": torch.zeros(0)}}


def _same(got: dict, want: dict) -> bool:
    return (torch.equal(got["w"], want["w"]) and torch.equal(got["h"], want["h"]) and got["epoch"] == want["epoch"]
            and got["nested"]["notes"] == want["nested"]["notes"])


def _reseal(raw: dict) -> bytes:
    body = {k: v for k, v in raw.items() if k != "checksum"}
    return sealed_json(body)


class _Hostile:
    def __reduce__(self):
        return (os.system, ("true",))


def _hostile_bytes() -> bytes:
    stream = io.BytesIO()
    torch.save({"x": _Hostile()}, stream, pickle_module=pickle)
    return stream.getvalue()


def _item(raw, key):
    return next(i for i in raw["items"] if i["key"] == key)


def _item_field(key, field, value):
    def change(raw):
        _item(raw, key)[field] = value
    return change


def _record_field(field, value):
    def change(raw):
        if value is _DROP:
            del raw[field]
        else:
            raw[field] = value(raw[field]) if callable(value) else value
    return change


_DROP = object()


def _drop_item(key, fix_length):
    def change(raw):
        item = _item(raw, key)
        raw["items"].remove(item)
        if fix_length:
            raw["length"] -= item["nbytes"]
    return change


def _swap_keys(raw):
    raw["items"][0]["key"], raw["items"][1]["key"] = raw["items"][1]["key"], raw["items"][0]["key"]


MUTATIONS = {
    "shape -1": _item_field("w", "shape", [-1, 256]),
    "shape other size": _item_field("w", "shape", [2, 256]),
    "shape same size": _item_field("w", "shape", [256, 4]),
    "shape not a list": _item_field("w", "shape", "4x256"),
    "dtype bogus": _item_field("w", "dtype", "bogus"),
    "dtype wider": _item_field("w", "dtype", "float64"),
    "dtype same width": _item_field("w", "dtype", "int32"),
    "kind bogus": _item_field("w", "kind", "bogus"),
    "kind object": _item_field("w", "kind", "object"),
    "kind dtensor": _item_field("w", "kind", "dtensor"),
    "key not a string": _item_field("w", "key", 5),
    "key renamed": _item_field("w", "key", "w2"),
    "key repeated": _item_field("h", "key", "w"),
    "keys swapped": _swap_keys,
    "nbytes + 1": _item_field("w", "nbytes", 4097),
    "offset + 1": _item_field("h", "offset", 4097),
    "checksums empty": _item_field("w", "checksums", []),
    "checksum changed": _item_field("w", "checksums", ["0" * 16]),
    "place outside": _item_field("w", "place", {"global_shape": [4, 256], "global_offset": [1, 0]}),
    "place short": _item_field("w", "place", {"global_shape": [1024], "global_offset": [0]}),
    "object with a dtype": _item_field("epoch", "dtype", "float32"),
    "item dropped": _drop_item("h", fix_length=False),
    "item dropped, length fixed": _drop_item("h", fix_length=True),
    "last item dropped, length fixed": lambda raw: _drop_item(raw["items"][-1]["key"], fix_length=True)(raw),
    "items not a list": _record_field("items", {"w": 1}),
    "length + 4": _record_field("length", lambda n: n + 4),
    "rank 1 of 1": _record_field("rank", 1),
    "world size 0": _record_field("world_size", 0),
    "world size 2": _record_field("world_size", 2),
    "step -1": _record_field("step", -1),
    "sequence a string": _record_field("sequence", "7"),
    "sequence + 50": _record_field("sequence", lambda n: n + 50),
    "holder is the owner": _record_field("holder", 0),
    "lineage empty": _record_field("lineage", ""),
    "lineage other": _record_field("lineage", "f" * 32),
    "run other": _record_field("run_id", "another-run"),
    "record kind": _record_field("kind", "bogus"),
    "schema 3": _record_field("schema_version", 3),
    "requires a feature": _record_field("requires", ["zero_copy_v9"]),
    "layout a list": _record_field("layout", [1, 2]),
    "slot dropped": _record_field("slot", _DROP),
}


# sound records that no longer fit the state dict (its keys, dtypes or shapes): refused by name, nothing loaded; no
# check of the slot alone can see these.  Every other change is served around (step 1) or harmless (step 2).
DOES_NOT_FIT = {"dtype same width", "key renamed", "keys swapped", "last item dropped, length fixed"}


@pytest.fixture(scope="module")
def snapshotted(tmp_path_factory):
    from dcp_atomic import CheckpointManager, MemoryTier

    base = tmp_path_factory.mktemp("memory-records")
    memory, root = base / "shm", base / "ckpt"
    memory.mkdir()
    with CheckpointManager(str(root), RUN, memory=MemoryTier(str(memory), replicas=0)) as manager:
        for step in (1, 2):
            assert manager.snapshot(step, _state(step)).result() == step
    return base


def _newest_record(memory) -> str:
    rank_dir = os.path.join(memory, RUN, "r0")
    records = []
    for name in os.listdir(rank_dir):
        if name.endswith(".commit"):
            with open(os.path.join(rank_dir, name)) as f:
                records.append((json.load(f)["step"], os.path.join(rank_dir, name)))
    return max(records)[1]


def _judged(base, case):
    """(what verify says of step 2's slot, what a restore did) after ``case`` changed step 2's record."""
    from dcp_atomic import CheckpointManager, MemoryTier
    from dcp_atomic.errors import CheckpointError
    from dcp_atomic.tools.cli.memory import restorable, slot_rows

    work = base / case.replace(" ", "_")
    shutil.copytree(base / "shm", work / "shm")
    record_path = _newest_record(work / "shm")
    with open(record_path) as f:
        raw = json.load(f)
    if case == "hostile object":
        data_path = record_path.replace(".commit", ".data")
        item = _item(raw, "epoch")
        hostile = _hostile_bytes()
        with open(data_path, "r+b") as f:  # the object's bytes replaced, the rest shifted along
            rest = f.read()
            rest = rest[:item["offset"]] + hostile + rest[item["offset"] + item["nbytes"]:]
            f.seek(0)
            f.write(rest)
            f.truncate()
        grow = len(hostile) - item["nbytes"]
        hasher = BlockHasher(BLOCK_SIZE)
        hasher.update(hostile)
        item["nbytes"], item["checksums"] = len(hostile), hasher.finish()
        for later in raw["items"][raw["items"].index(item) + 1:]:
            later["offset"] += grow
        raw["length"] += grow
    else:
        MUTATIONS[case](raw)
    with open(record_path, "wb") as f:
        f.write(_reseal(raw))
    rows, sound = slot_rows(str(work / "shm"), RUN, read_data=True)
    found, _ = restorable(sound)
    lineage = next(r["lineage"] for r in rows if r.get("step") == 1)  # the job's: step 1's record is untouched
    verified = max((f["step"] for f in found if f["lineage"] == lineage), default=None)
    state = _blank()
    try:
        with CheckpointManager(str(base / "ckpt"), RUN, memory=MemoryTier(str(work / "shm"), replicas=0),
                               timeout=20) as manager:
            step = manager.load(state)
    except CheckpointError as e:
        return verified, ("refused", type(e).__name__)
    except Exception as e:  # an untyped failure: a defect whatever the case
        return verified, ("untyped", f"{type(e).__name__}: {e}")
    return verified, ("loaded", step, _same(state, _state(step)))


@pytest.mark.parametrize("case", [*MUTATIONS, "hostile object"])
def test_a_re_sealed_record_is_judged_alike_by_verify_and_restore_never_silently_or_untyped(snapshotted, case):
    verified, restored = _judged(snapshotted, case)
    assert restored[0] != "untyped", (case, restored)
    if restored[0] == "loaded":
        step, exact = restored[1:]
        assert exact, (case, restored)  # never a silent load of bytes that are not that step's
        assert verified == step, (case, verified, restored)  # verify names the step a restore loads
    assert (restored[0] == "refused") == (case in DOES_NOT_FIT), (case, verified, restored)
    if case in DOES_NOT_FIT:
        assert verified == 2 and restored[1] in ("StorageError", "RankConsistencyError"), (case, verified, restored)
