"""Corruption fuzzing and hostile input, end to end through the load path.

Fuzzing: one single-rank process world saves a checkpoint, then applies 210
seeded mutations (single-byte flips, truncations, swaps of byte ranges inside a
file, swaps of two whole files) across every file of it (``LATEST``, the marker,
the manifest and its rank shard, ``.metadata``, ``ATTEMPT``, both data files), loading after each
one: a load either fails with one of the library's errors, or returns exactly
the saved values.  Zero silent loads, zero unclear errors.

Hostile input: an attacker who can write the directory can also recompute every
digest and self-checksum (they are not MACs), so each case below rewrites the
whole chain (``.metadata`` -> manifest digest -> marker digest and seal) to be
consistent, then loads through the plain reader and through
``CheckpointManager.load``.  ``tests/manager/test_single_process.py`` checks the parsers
and the unpickler on their own; here every case runs the full load path, under an
audit hook that records every file the process opens.  Each case must be refused
with a clear error, nothing executed, nothing opened outside the checkpoint root.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import shutil
import tempfile

import pytest
import torch

from tests import manifest_view
from tests.harness import assert_all_ok, run_world

pytestmark = pytest.mark.slow

RUN = "exp"
OUR_ERRORS = ("CheckpointNotFoundError", "CommitConflictError", "CorruptCheckpointError", "RankConsistencyError",
              "ReshardError", "StorageError", "ConfigurationError", "RankFailureError", "CheckpointError")


# -- shared helpers (they run inside the worker) -------------------------------------------------------


def _state(step: int = 2) -> dict:
    g = torch.Generator().manual_seed(7 + step)
    return {
        "a": torch.randn(3000, generator=g),  # 12 KB: three 4 KiB checksum blocks
        "b": torch.randn(40, 7, generator=g).to(torch.bfloat16),
        "c": torch.arange(100, dtype=torch.int64) * 3,
        "meta": {"epoch": step, "name": "fuzz"},
    }


def _template() -> dict:
    return {"a": torch.zeros(3000), "b": torch.zeros(40, 7, dtype=torch.bfloat16),
            "c": torch.zeros(100, dtype=torch.int64), "meta": {"epoch": -1, "name": ""}}


def _exact(got: dict, step: int = 2) -> bool:
    want = _state(step)
    return all(torch.equal(got[k], want[k]) for k in ("a", "b", "c")) and got["meta"] == want["meta"]


def _save_two_steps(root: str) -> None:
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageWriter

    for step in (1, 2):
        writer = AtomicStorageWriter(root, RUN, step, block_size=4096, thread_count=2)
        dcp.save(_state(step), storage_writer=writer)


def _error_names(exc: BaseException) -> list[str]:
    """Our error classes found in what DCP raised (wrapped, or as text inside torch's AssertionError)."""
    from tests.harness import _describe_chain

    chain = _describe_chain(exc)
    names = [n for n in OUR_ERRORS if n in chain]
    failures = getattr(exc, "failures", {}) or {}
    inner = [w[0] if isinstance(w, tuple) else w for w in failures.values()] + [exc]
    for e in inner:  # torch 2.13: read_metadata errors arrive as AssertionError("... read failed: <our message>")
        if isinstance(e, AssertionError):
            names += [n for n in OUR_ERRORS if f"read failed: {n}: " in str(e)]
    return names


def _load_plain(root: str, step=None, timeout=0.05):
    """Resolve (typed errors), then DCP's load; returns (outcome, detail)."""
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageReader

    reader = AtomicStorageReader(root, RUN, step, timeout=timeout, thread_count=1)
    got = _template()
    try:
        reader.resolve()
        dcp.load(got, storage_reader=reader)
    except BaseException as e:  # noqa: BLE001 - classified by the caller
        names = _error_names(e)
        return ("refused" if names else "unclear"), f"{type(e).__name__}: {names}: {str(e)[-600:]}"
    return ("exact" if _exact(got) and reader.step == 2 else "silent"), f"step {reader.step}"


# -- fuzzing --------------------------------------------------------------------------------------------

MUTATIONS = ("flip", "truncate", "swap_ranges", "swap_files")


def _mutate(rng: random.Random, files: dict[str, bytes], target: str, kind: str) -> dict[str, bytes]:
    """New contents for the files this mutation changes."""
    data = bytearray(files[target])
    if kind == "flip":
        i = rng.randrange(len(data))
        data[i] ^= rng.randrange(1, 256)
        return {target: bytes(data)}
    if kind == "truncate":
        return {target: bytes(data[: rng.randrange(len(data))])}
    if kind == "swap_ranges":
        n = rng.randint(1, max(1, len(data) // 4))
        i, j = sorted(rng.sample(range(0, len(data) - n + 1), 2)) if len(data) - n + 1 >= 2 else (0, 0)
        if j < i + n:  # keep the two ranges apart
            j = min(len(data) - n, i + n)
        data[i:i + n], data[j:j + n] = data[j:j + n], data[i:i + n]
        return {target: bytes(data)}
    other = rng.choice(sorted(set(files) - {target}))
    return {target: files[other], other: files[target]}


def _fuzz(ctx, cases, seed):
    import dcp_atomic

    root = ctx.root
    _save_two_steps(root)
    run_dir = os.path.join(root, RUN)
    step_dir = os.path.join(run_dir, "step_0000000002")
    attempt = os.path.join(step_dir, json.load(open(os.path.join(step_dir, "COMMITTED")))["save_id"])
    paths = {"LATEST": os.path.join(run_dir, "LATEST"), "COMMITTED": os.path.join(step_dir, "COMMITTED")}
    paths.update({name: os.path.join(attempt, name) for name in sorted(os.listdir(attempt))})
    assert sorted(paths) == sorted(["LATEST", "COMMITTED", "manifest.json", "manifest.0.json", ".metadata", "ATTEMPT",
                                    "ranks.json", "__0_0.distcp", "__0_1.distcp"]), sorted(paths)
    pristine = {name: open(path, "rb").read() for name, path in paths.items()}
    checksummed = {"manifest.json", "manifest.0.json", ".metadata", "__0_0.distcp", "__0_1.distcp"}
    assert _load_plain(root)[0] == "exact"
    results = []
    names = sorted(paths)
    for case in range(cases):
        rng = random.Random(seed * 100003 + case)
        target = names[case % len(names)]
        kind = MUTATIONS[(case // len(names)) % len(MUTATIONS)]
        changed = _mutate(rng, pristine, target, kind)
        changed = {n: d for n, d in changed.items() if d != pristine[n]}
        for name, data in changed.items():
            with open(paths[name], "wb") as f:
                f.write(data)
        try:
            outcome, detail = _load_plain(root)
        finally:
            for name in changed:
                with open(paths[name], "wb") as f:
                    f.write(pristine[name])
            for extra in set(os.listdir(attempt)) - set(paths):  # nothing may appear; remove if it did
                os.unlink(os.path.join(attempt, extra))
        must_refuse = bool(set(changed) & checksummed)
        results.append({"case": case, "file": target, "kind": kind, "changed": sorted(changed),
                        "outcome": outcome, "detail": detail, "must_refuse": must_refuse})
    assert _load_plain(root)[0] == "exact", "the checkpoint must be pristine again"
    return {"results": results, "version": dcp_atomic.__version__ if hasattr(dcp_atomic, "__version__") else None}


def test_corruption_fuzzing_never_loads_silently(root):
    cases = 210
    report = assert_all_ok(run_world(_fuzz, 1, root, args=(cases, 20261129), timeout=240))[0]
    results = report["results"]
    assert len(results) == cases
    silent = [r for r in results if r["outcome"] == "silent"]
    unclear = [r for r in results if r["outcome"] == "unclear"]
    missed = [r for r in results if r["must_refuse"] and r["outcome"] != "refused"]
    assert not silent, f"{len(silent)} silent loads, e.g. {silent[:3]}"
    assert not unclear, f"{len(unclear)} refusals without one of our errors, e.g. {unclear[:3]}"
    assert not missed, f"{len(missed)} changes to checksummed files not refused, e.g. {missed[:3]}"
    per_file = {}
    for r in results:
        per_file.setdefault(r["file"], set()).add(r["kind"])
    assert all(kinds == set(MUTATIONS) for kinds in per_file.values()) and len(per_file) == 9, per_file
    refused = sum(r["outcome"] == "refused" for r in results)
    assert refused >= cases * 0.7, f"only {refused}/{cases} mutations refused: is the fuzzer changing anything?"


# -- hostile input ------------------------------------------------------------------------------------------


def _seal(body: dict) -> bytes:
    """What anyone can compute: the control files' self-checksum is a sha256 of canonical JSON, not a MAC."""
    body = {k: v for k, v in body.items() if k != "checksum"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return json.dumps({**body, "checksum": hashlib.sha256(canonical).hexdigest()}, indent=1).encode()


class _Checkpoint:
    """Paths and raw JSON of one committed step (items merged in from the rank shards), with consistent re-sealing
    shard -> manifest -> marker (the attacker's tools)."""

    def __init__(self, root: str, step: int = 2) -> None:
        self.root, self.step = root, step
        self.run_dir = os.path.join(root, RUN)
        self.step_dir = os.path.join(self.run_dir, f"step_{step:010d}")
        self.marker_path = os.path.join(self.step_dir, "COMMITTED")
        self.marker = json.load(open(self.marker_path))
        self.attempt = os.path.join(self.step_dir, self.marker["save_id"])
        self.manifest_path = os.path.join(self.attempt, "manifest.json")
        self.manifest = manifest_view.load(self.attempt)
        self.metadata_path = os.path.join(self.attempt, ".metadata")

    def write_metadata(self, data: bytes) -> None:
        with open(self.metadata_path, "wb") as f:
            f.write(data)
        self.manifest["dcp_metadata"].update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
        self.write_manifest()

    def write_manifest(self) -> None:
        data = manifest_view.dump(self.attempt, self.manifest)
        self.marker["manifest_sha256"] = hashlib.sha256(data).hexdigest()
        self.write_marker()

    def write_marker(self, data: bytes | None = None) -> None:
        with open(self.marker_path, "wb") as f:
            f.write(_seal(self.marker) if data is None else data)

    def write_latest(self, body: dict) -> None:
        with open(os.path.join(self.run_dir, "LATEST"), "wb") as f:
            f.write(_seal(body))

    def trusted_metadata(self):
        return pickle.loads(open(self.metadata_path, "rb").read())  # our own file, before tampering


class _Exploit:
    def __init__(self, canary: str) -> None:
        self.canary = canary

    def __reduce__(self):
        return (os.system, (f"touch {self.canary}",))


def _storage_info_of(metadata, fqn: str):
    return next((index, info) for index, info in metadata.storage_data.items() if index.fqn == fqn)


def _craft(case: str, ck: _Checkpoint, outside: str) -> None:
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    canary = os.path.join(outside, "pwned")
    if case == "metadata_pickle_executes_code":
        ck.write_metadata(pickle.dumps(_Exploit(canary)))
    elif case == "metadata_pickle_nested_in_real_metadata":
        metadata = ck.trusted_metadata()
        metadata.planner_data = _Exploit(canary)  # a real Metadata carrying a payload in a field DCP keeps
        ck.write_metadata(pickle.dumps(metadata))
    elif case == "metadata_storage_path_escapes_root":
        metadata = ck.trusted_metadata()
        index, info = _storage_info_of(metadata, "a")
        metadata.storage_data[index] = _StorageInfo("../../../outside/__0_0.distcp", info.offset, info.length)
        ck.write_metadata(pickle.dumps(metadata))
    elif case == "manifest_file_escapes_root":
        ck.manifest["files"][0]["name"] = "../../../outside/__0_0.distcp"
        ck.write_manifest()
    elif case == "manifest_absolute_path":
        ck.manifest["files"][0]["name"] = os.path.join(outside, "__0_0.distcp")
        ck.write_manifest()
    elif case == "manifest_absurd_length_over_limit":
        ck.manifest["files"][0]["items"][0]["length"] = 1 << 60
        ck.write_manifest()
    elif case == "manifest_and_metadata_absurd_but_plausible_length":
        # 512 TiB claimed for the bytes item: under the 2**50 sanity limit, one giant checksum block, the
        # DCP metadata agreeing; the file on disk is a few KiB.
        huge = 1 << 49  # beyond any address space, so no allocator can hand it out
        metadata = ck.trusted_metadata()
        index, info = _storage_info_of(metadata, "meta.name")
        entry = next(f for f in ck.manifest["files"] if f["name"] == info.relative_path)
        item = next(i for i in entry["items"] if i["key"] == "meta.name")
        assert item["pos"] == info.offset and entry["items"][-1] is item, "the item must end its file"
        item["length"], item["block_size"] = huge, huge
        entry["size"] = item["pos"] + huge
        metadata.storage_data[index] = _StorageInfo(info.relative_path, info.offset, huge)
        ck.write_metadata(pickle.dumps(metadata))
    elif case == "manifest_schema_from_the_future":
        ck.manifest["schema_version"] = 6  # 5: features named in ``requires``
        ck.write_manifest()
    elif case == "manifest_needs_a_feature_from_the_future":
        ck.manifest["requires"] = ["sparse_blocks"]
        ck.write_manifest()
    elif case == "marker_schema_from_the_future":
        ck.marker["schema_version"] = 2
        ck.write_marker()
    elif case == "latest_schema_from_the_future":
        latest = json.load(open(os.path.join(ck.run_dir, "LATEST")))
        ck.write_latest({**latest, "schema_version": 2})
    elif case == "marker_names_a_foreign_manifest_path":
        other = _Checkpoint(ck.root, 1)
        ck.marker["manifest"] = f"../step_0000000001/{other.marker['save_id']}/manifest.json"
        ck.write_marker()
    elif case == "marker_names_another_steps_attempt":
        other = _Checkpoint(ck.root, 1)
        ck.marker.update(save_id=other.marker["save_id"], manifest=f"{other.marker['save_id']}/manifest.json",
                         manifest_sha256=other.marker["manifest_sha256"])
        ck.write_marker()
    elif case == "marker_copied_from_another_step":
        ck.write_marker(open(_Checkpoint(ck.root, 1).marker_path, "rb").read())
    elif case == "marker_digest_of_another_manifest":
        ck.marker["manifest_sha256"] = _Checkpoint(ck.root, 1).marker["manifest_sha256"]
        ck.write_marker()
    elif case == "marker_bad_self_checksum":
        raw = json.load(open(ck.marker_path))
        raw["save_id"] = _Checkpoint(ck.root, 1).marker["save_id"]
        ck.write_marker(json.dumps(raw, indent=1).encode())
    elif case == "latest_names_an_uncommitted_step":
        os.makedirs(os.path.join(ck.run_dir, "step_0000000003", ck.marker["save_id"]))
        latest = json.load(open(os.path.join(ck.run_dir, "LATEST")))
        ck.write_latest({**latest, "step": 3})
    else:
        raise ValueError(case)


# case -> (what CheckpointManager.load must do: raise this class, or "loads step 2" exactly, since LATEST is only a
# hint the manager may bypass by scanning the markers; text the plain reader's refusal must contain)
LOADS_STEP_2 = "loads step 2"
HOSTILE = {
    "metadata_pickle_executes_code": ("CorruptCheckpointError", "refusing to load posix.system"),
    "metadata_pickle_nested_in_real_metadata": ("CorruptCheckpointError", "refusing to load posix.system"),
    "metadata_storage_path_escapes_root": ("CorruptCheckpointError", "__0_0.distcp"),
    "manifest_file_escapes_root": ("CorruptCheckpointError", "invalid data file name"),
    "manifest_absolute_path": ("CorruptCheckpointError", "invalid data file name"),
    "manifest_absurd_length_over_limit": ("CorruptCheckpointError", "below 2**50"),
    "manifest_and_metadata_absurd_but_plausible_length": ("CorruptCheckpointError", "__0_"),
    "manifest_schema_from_the_future": ("CorruptCheckpointError", "schema_version 6 is not supported"),
    "manifest_needs_a_feature_from_the_future": ("CorruptCheckpointError", "needs sparse_blocks, which this "
                                                 "dcp_atomic does not know (it reads data_prefixes, stable_files); "
                                                 "upgrade dcp_atomic"),
    "marker_schema_from_the_future": ("CorruptCheckpointError", "schema_version 2 is not supported"),
    "marker_names_a_foreign_manifest_path": ("CorruptCheckpointError", "foreign manifest path"),
    "marker_names_another_steps_attempt": ("CorruptCheckpointError", "names this manifest but it cannot be read"),
    "marker_copied_from_another_step": ("CorruptCheckpointError", "belongs to run 'exp' step 1"),
    "marker_digest_of_another_manifest": ("CorruptCheckpointError", "does not match the commit marker"),
    "marker_bad_self_checksum": ("CorruptCheckpointError", "self-checksum mismatch"),
    "latest_schema_from_the_future": (LOADS_STEP_2, "schema_version 2 is not supported"),
    "latest_names_an_uncommitted_step": (LOADS_STEP_2, "step 3"),
}


def _hostile_world(ctx, cases):
    import sys

    from dcp_atomic import CheckpointError, CheckpointManager

    base = ctx.root
    pristine, outside = os.path.join(base, "pristine"), os.path.join(base, "outside")
    os.makedirs(outside)
    _save_two_steps(pristine)
    shutil.copy(os.path.join(pristine, RUN, "step_0000000002", _Checkpoint(pristine).marker["save_id"],
                             "__0_0.distcp"), outside)  # a real data file, reachable by a ../ path
    opened: list[str] = []

    def audit(event, args):
        if event == "open" and isinstance(args[0], (str, bytes)):
            path = os.fsdecode(args[0])
            opened.append(os.path.normpath(path if os.path.isabs(path) else os.path.join(os.getcwd(), path)))

    sys.addaudithook(audit)
    open(os.path.join(outside, "__0_0.distcp"), "rb").close()  # the instrument itself must see opens
    results = {"_audit_hook_saw_control_open": os.path.join(outside, "__0_0.distcp") in opened}
    for case in cases:
        root = os.path.join(base, case)
        shutil.copytree(pristine, root)
        _craft(case, _Checkpoint(root), outside)
        del opened[:]
        outcome = {"plain": _load_plain(root, timeout=0.2)}
        got = _template()
        try:
            with CheckpointManager(root, RUN, timeout=0.5) as manager:
                step = manager.load(got)
            outcome["manager"] = {"error": None, "step": step, "exact": _exact(got, step)}
        except BaseException as e:  # noqa: BLE001
            outcome["manager"] = {"error": type(e).__name__, "typed": isinstance(e, CheckpointError),
                                  "message": str(e)[:1500]}
        outcome["opened_outside"] = sorted({p for p in opened if p.startswith(base + os.sep)
                                            and not p.startswith(root + os.sep)})
        outcome["executed"] = os.path.exists(os.path.join(outside, "pwned"))
        results[case] = outcome
    return results


@pytest.fixture(scope="module")
def hostile_results():
    """One single-rank world tries every case, each on its own copy of a pristine checkpoint."""
    base = tempfile.mkdtemp(prefix="dcp-atomic-hostile-")
    try:
        yield assert_all_ok(run_world(_hostile_world, 1, base, args=(list(HOSTILE),), timeout=180))[0]
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_checkpoint_is_refused_end_to_end(hostile_results, case):
    expected, text = HOSTILE[case]
    assert hostile_results["_audit_hook_saw_control_open"], "the audit hook does not record opens"
    got = hostile_results[case]
    assert not got["executed"], "crafted .metadata ran code"
    assert got["opened_outside"] == [], f"opened outside the checkpoint root: {got['opened_outside']}"
    plain, detail = got["plain"]
    assert plain == "refused", f"plain load: {plain}: {detail}"
    assert text in detail, f"plain load refusal does not say {text!r}: {detail}"
    manager = got["manager"]
    if expected == LOADS_STEP_2:
        assert manager == {"error": None, "step": 2, "exact": True}, manager
        return
    assert manager["error"] is not None, f"the manager loaded a hostile checkpoint instead of refusing: {manager}"
    assert manager["typed"] and manager["error"] == expected, f"manager: {manager}"
    assert text in manager["message"], f"manager's error does not say {text!r}: {manager['message']}"
