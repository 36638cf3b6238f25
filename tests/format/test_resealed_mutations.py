"""Every manifest field checked: one-field mutations of a re-sealed manifest never load wrong values.

Someone with write access (or a buggy tool) can recompute every control-file
digest: the manifest's sha256 in the marker and the marker's self-checksum are
identities, not MACs.  So each case here changes one field of ``manifest.json``
(every field of every item and file, and the top-level ones), re-seals the
chain, and loads through the reader in this process (no process group).  A load
must either raise one of our typed errors (possibly wrapped by DCP) or give
exactly the saved values; the manifest parser, ``audit_step`` (``verify``) and
the CLI's ``show`` must never raise anything but our typed errors.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import json
import os
import pickle
import random
import time

import pytest
import torch

from tests.helpers.sealed import RUN, seal, Sealed, typed


# -- re-sealing (what anyone with write access can compute) ----------------------------------------------


# -- the checkpoints --------------------------------------------------------------------------------------

FORMATS = {"raw": {}, "stock_readable": {"stock_readable": True}, "zstd": {"compression": "zstd"}}
BLOCK = 256


def _state() -> dict:
    g = torch.Generator().manual_seed(11)
    return {
        "smooth": torch.linspace(-3, 3, 700),  # compressible: zstd frames with byte planes
        "ones": torch.ones(48),  # compressible, one frame
        "noise": torch.randn(13, 11, generator=g).to(torch.bfloat16),
        "ints": torch.arange(90, dtype=torch.int64) * 7,
        "empty": torch.zeros(0, 3),
        "scalar": torch.tensor(1.25),
        "meta": {"epoch": 3, "tags": ["a", "b"]},
    }


def _template() -> dict:
    return {"smooth": torch.full((700,), -7.0), "ones": torch.full((48,), -7.0), "noise": torch.full((13, 11), -7.0, dtype=torch.bfloat16),
            "ints": torch.full((90,), -7, dtype=torch.int64), "empty": torch.zeros(0, 3),
            "scalar": torch.tensor(-7.0), "meta": {"epoch": -1, "tags": []}}


def _exact(got: dict) -> bool:
    want = _state()
    tensors = all(torch.equal(got[k], want[k]) for k in want if isinstance(want[k], torch.Tensor))
    return tensors and got["meta"] == want["meta"]


def _save(root: str, step: int, options: dict) -> None:
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageWriter

    dcp.save(_state(), storage_writer=AtomicStorageWriter(root, RUN, step, block_size=BLOCK, thread_count=2, **options))


def _load(root: str, step: int) -> tuple[str, str]:
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageReader

    got = _template()
    try:
        reader = AtomicStorageReader(root, RUN, step, timeout=0.05, thread_count=2)
        dcp.load(got, storage_reader=reader)
    except BaseException as e:  # noqa: BLE001 - classified here
        return ("refused" if typed(e) else "untyped"), f"{type(e).__name__}: {str(e)[-400:]}"
    return ("exact" if _exact(got) else "silent"), ""


def _side_tools(root: str, step: int, data: bytes, where: str) -> list[str]:
    """Parser, audit and ``show`` on the mutated manifest: only our typed errors may escape."""
    from dcp_atomic import CheckpointError
    from dcp_atomic.tools import cli
    from dcp_atomic.tools.audit import audit_step
    from dcp_atomic.format.layout import RunLayout
    from dcp_atomic.format.manifest import Manifest
    from dcp_atomic.stores.backends import open_storage

    problems = []
    tools = {
        "Manifest.from_json": lambda: Manifest.from_json(data, where=where),
        "audit_step": lambda: audit_step(RunLayout(open_storage(root), RUN), step, threads=1, timeout=0.05),
        "show": lambda: cli.main(["--timeout", "0.05", "show", root, RUN, str(step)]),
    }
    for name, tool in tools.items():
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                tool()
        except CheckpointError:
            pass
        except BaseException as e:  # noqa: BLE001
            problems.append(f"{name}: {type(e).__name__}: {e}")
    return problems


# -- mutations --------------------------------------------------------------------------------------------

_ODD_VALUES = [None, -1, 0, 1, 2**40, 1.5, True, "x", [], {}, [1, 2], {"a": 1}]


def _paths(manifest: dict) -> list[tuple]:
    """Every field: top-level keys, nested records one level down, every file field, every item field."""
    paths = []
    for key, value in manifest.items():
        if key in ("files", "_pristine_shards"):
            continue
        paths.append((key,))
        if isinstance(value, dict):
            paths += [(key, k) for k in value]
        elif isinstance(value, list):
            paths += [(key, i) for i in range(len(value))]
    for f, entry in enumerate(manifest["files"]):
        paths += [("files", f, k) for k in entry if k != "items"] + [("files", f, "items")]
        for i, item in enumerate(entry["items"]):
            paths += [("files", f, "items", i, k) for k in item]
    return paths


def _siblings(manifest: dict, field: str) -> list:
    """Values the same item field takes elsewhere in the manifest (a plausible swap)."""
    return [item[field] for entry in manifest["files"] for item in entry["items"] if field in item]


def _relabels(manifest: dict, item: dict) -> list[str]:
    """Stored dtypes a garbled ``dtype`` field could name: other element sizes, the same size (bf16 -> fp16:
    refused because the manifest records which keys a planner cast, and to what), and no dtype at all."""
    stored = item.get("dtype") or (manifest.get("keys", {}).get(item.get("key")) or {}).get("dtype")
    names = ["torch.float16", "torch.bfloat16", "torch.int8", "torch.float32", "torch.float64", "torch.int64",
             "torch.int16", "torch.int32"]
    return [n for n in names if n != stored] + ["torch.nope"]


def _mutate(rng: random.Random, manifest: dict, path: tuple) -> str:
    parent = manifest
    for part in path[:-1]:
        parent = parent[part]
    last, old = path[-1], parent[path[-1]]
    choices = ["odd", "delete"]
    if isinstance(old, bool):
        choices += ["flip"]
    elif isinstance(old, int):
        choices += ["nudge", "nudge", "nudge"]
    if isinstance(old, str):
        choices += ["swap", "swap", "string"]
    if isinstance(old, list) and old:
        choices += ["drop", "duplicate", "reverse"]
    if isinstance(old, dict) and old:
        choices += ["drop_key"]
    if len(path) == 5:
        choices += ["swap", "swap"]
    kind = rng.choice(choices)
    if kind == "odd":
        new = rng.choice(_ODD_VALUES)
    elif kind == "delete":
        if isinstance(parent, list):
            del parent[last]
            return f"delete {path}"
        del parent[last]
        return f"delete {path}"
    elif kind == "flip":
        new = not old
    elif kind == "nudge":
        new = old + rng.choice([-64, -4, -2, -1, 1, 2, 4, 8, 64, 256])
    elif kind == "swap":
        pool = [v for v in _siblings(manifest, last) if v != old] if len(path) == 5 else []
        pool += {"format": ["raw", "torch_save"], "codec": ["none", "zstd"], "kind": ["tensor", "bytes"],
                 "dtype": _relabels(manifest, parent) if last == "dtype" else []}.get(last, [])
        pool = [v for v in pool if v != old]
        new = rng.choice(pool) if pool else rng.choice(_ODD_VALUES)
    elif kind == "string":
        new = old[:-1] if old else "x"
    elif kind == "drop":
        new = old[: rng.randrange(len(old))] + old[rng.randrange(len(old)) + 1:] if len(old) > 1 else []
    elif kind == "duplicate":
        new = old + [copy.deepcopy(rng.choice(old))]
    elif kind == "reverse":
        new = list(reversed(old)) if len(old) > 1 else old + old
    else:  # drop_key
        new = dict(old)
        del new[rng.choice(sorted(new))]
    parent[last] = new
    return f"{kind} {path}: {str(old)[:60]} -> {str(new)[:60]}"


def _fuzz(root: str, seed: int, rounds: int) -> list[dict]:
    results = []
    for step, (fmt, options) in enumerate(FORMATS.items()):
        _save(root, step, options)
        results += _fuzz_step(root, step, fmt, seed, rounds)
    return results


def _fuzz_step(root: str, step: int, fmt: str, seed: int, rounds: int) -> list[dict]:
    """``rounds`` one-field mutations of every manifest field (shards' items included) of the saved ``step``."""
    results = []
    pristine = Sealed(root, step)
    assert _load(root, step)[0] == "exact", f"{fmt}: the pristine checkpoint must load"
    paths = _paths(pristine.manifest)
    for case in range(rounds * len(paths)):
        rng = random.Random(f"{seed}/{fmt}/{case}")
        path = paths[case % len(paths)]
        ck = Sealed(root, step)
        what = _mutate(rng, ck.manifest, path)
        data = ck.write_manifest()
        try:
            outcome, detail = _load(root, step)
            problems = _side_tools(root, step, data, ck.manifest_path)
        finally:
            pristine.restore()
        results.append({"format": fmt, "mutation": what, "outcome": outcome, "detail": detail,
                        "tools": problems})
    assert _load(root, step)[0] == "exact", f"{fmt}: the checkpoint must be pristine again"
    return results


def _assert_no_wrong_load(results: list[dict]) -> None:
    """A fuzz's verdict: no mutation loaded wrong values or failed untyped, and no tool crashed."""
    silent = [r for r in results if r["outcome"] == "silent"]
    untyped = [r for r in results if r["outcome"] == "untyped"]
    crashed = [r for r in results if r["tools"]]
    assert not silent, f"{len(silent)} silent wrong loads, e.g. {silent[:5]}"
    assert not untyped, f"{len(untyped)} loads failed without our typed error, e.g. {untyped[:5]}"
    assert not crashed, f"{len(crashed)} tool crashes, e.g. {crashed[:5]}"


@pytest.mark.slow
def test_one_field_mutations_of_a_resealed_manifest_never_load_wrong_values(root):
    started = time.monotonic()
    results = _fuzz(root, seed=20261130, rounds=2)
    _assert_no_wrong_load(results)
    assert len(results) >= 300, len(results)
    refused = sum(r["outcome"] == "refused" for r in results)
    formats = {r["format"] for r in results if r["outcome"] == "refused"}
    assert refused >= len(results) // 2 and formats == set(FORMATS), (refused, formats)
    print(f"{len(results)} mutations, {refused} refused, {time.monotonic() - started:.1f}s")


def _save_reused_with_dead_bytes(root: str) -> int:
    """Step 11 saved with reuse over step 10, which differs in ``ones`` alone: step 10's one plain file (one writer
    thread) holds the tensors (more than half its bytes, the two pickled ``meta`` items the rest), so step 11 links
    it under a stable name, and ``ones``'s old bytes there, with the pickles', are dead in step 11 (no item of it
    references them).  Returns 11."""
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageWriter

    before = _state() | {"ones": torch.full((48,), 2.0)}
    for step, state in ((10, before), (11, _state())):
        dcp.save(state, storage_writer=AtomicStorageWriter(root, RUN, step, block_size=BLOCK, thread_count=1,
                                                           reuse=True))
    files = Sealed(root, 11).manifest["files"]
    dead = [f["name"] for f in files if sum(i["length"] for i in f["items"]) < f["size"]]
    assert dead and all("_s" in name for name in dead), files  # linked under stable names, with dead bytes
    return 11


@pytest.mark.slow
def test_one_field_mutations_of_a_reused_step_with_dead_bytes_never_load_wrong_values(root):
    """A reused step whose linked file holds bytes it does not reference (reuse, P15): re-sealed one-field changes
    of its file records and items (a size, a place moved into the dead bytes, an item dropped or duplicated) are
    refused or load exactly, and the tools raise only our typed errors."""
    step = _save_reused_with_dead_bytes(root)
    results = _fuzz_step(root, step, "reused", seed=20261205, rounds=2)
    _assert_no_wrong_load(results)
    assert len(results) >= 100 and sum(r["outcome"] == "refused" for r in results) >= len(results) // 2


@pytest.mark.parametrize("case", ["payload_shifted", "format_flipped", "zstd_logical_length_missing"])
def test_the_reviewers_silent_cases_are_refused_or_exact(root, case):
    """The three one-field changes the outside review found loading wrong values silently."""
    fmt = "zstd" if case.startswith("zstd") else "stock_readable"
    _save(root, 1, FORMATS[fmt])
    ck = Sealed(root, 1)
    key = "ones" if fmt == "zstd" else "smooth"
    item = next(i for _, i in ck.items() if i["key"] == key)
    if case == "payload_shifted":
        item["payload"] += 2
    elif case == "format_flipped":
        item["format"] = "raw"
    else:
        assert item["codec"] == "zstd" and len(item["checksums"]) == 1, "a one-frame compressed item"
        del item["logical_length"]
    ck.write_manifest()
    outcome, detail = _load(root, 1)
    assert outcome in ("refused", "exact"), (outcome, detail)
    if case != "payload_shifted":  # a payload offset that cannot be proven loads the stock way, exactly
        assert outcome == "refused" and key in detail, detail


# -- the other sealed control files: per-rank shards, ranks.json, .metadata's dtypes ---------------


class _SealedFiles:
    """One attempt's shards, ``ranks.json`` and ``.metadata`` rewritten as stored (no merged view), each
    re-recorded in ``manifest.json`` (size, sha256) and the marker re-sealed over it."""

    def __init__(self, root: str, step: int) -> None:
        self.ck = Sealed(root, step)
        self.saved = {name: open(os.path.join(self.ck.attempt, name), "rb").read()
                      for name in ("ranks.json", ".metadata")}

    def write(self, name: str, data: bytes) -> None:
        with open(os.path.join(self.ck.attempt, name), "wb") as f:
            f.write(data)
        top = json.loads(self.ck.manifest_bytes)
        digest = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        if name == "ranks.json":
            top["ranks_file"].update(digest)
        elif name == ".metadata":
            top["dcp_metadata"].update(digest)
        else:
            next(ref for ref in top["shards"] if ref["name"] == name).update(digest)
        self.ck.write_manifest(json.dumps(top, indent=1, sort_keys=True).encode())

    def restore(self) -> None:
        self.ck.restore()
        for name, data in self.saved.items():
            with open(os.path.join(self.ck.attempt, name), "wb") as f:
                f.write(data)


def _to_prefixed_schema(root: str, step: int, prefixes: int = 4) -> None:
    """Move a saved attempt's data under hashed prefixes and record it (``requires: ["data_prefixes"]``, as S3 saves
    write it)."""
    from dcp_atomic.format.layout import data_prefix

    ck = Sealed(root, step)
    save_id = ck.marker["save_id"]
    for entry in ck.manifest["files"]:
        target = os.path.join(root, data_prefix(save_id, entry["name"], prefixes), RUN, f"step_{step:010d}", save_id)
        os.makedirs(target, exist_ok=True)
        os.replace(os.path.join(ck.attempt, entry["name"]), os.path.join(target, entry["name"]))
    ck.manifest.update(data_prefixes=prefixes, requires=["data_prefixes"])
    ck.write_manifest()


def _every_path(node, prefix: tuple = ()) -> list[tuple]:
    """Every field and list entry of a JSON document, nested ones included."""
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    paths = []
    for key, value in children:
        paths.append(prefix + (key,))
        paths += _every_path(value, prefix + (key,))
    return paths


_SAME_WIDTH = {1: ["torch.int8", "torch.uint8", "torch.bool"], 2: ["torch.float16", "torch.bfloat16", "torch.int16"],
               4: ["torch.float32", "torch.int32"], 8: ["torch.float64", "torch.int64", "torch.complex64"]}


def _file_cases(rng: random.Random, sealed: _SealedFiles):
    """(description, file name, new bytes) for one-field changes of every shard, ranks.json, and every tensor's
    dtype in .metadata and in the shards' items (to each other dtype of its element size, and to one of another
    size: a same-size relabel is what would load reinterpreted bytes)."""
    attempt = sealed.ck.attempt
    metadata = sealed.ck.metadata()
    for name in sorted(n for n in os.listdir(attempt) if SHARD_NAME.fullmatch(n)) + ["ranks.json"]:
        body = json.load(open(os.path.join(attempt, name)))
        for path in _every_path(body):
            mutated = copy.deepcopy(body)
            what = _mutate(rng, mutated, path)
            yield f"{name}: {what}", name, json.dumps(mutated, sort_keys=True, separators=(",", ":")).encode()
        for path, item in _shard_tensor_items(body):
            planned = metadata.state_dict_metadata[item["key"]].properties.dtype
            for relabel in _relabel_names(planned, rng):
                mutated = copy.deepcopy(body)
                _at(mutated, path)["dtype"] = relabel
                yield (f"{name}: {item['key']!r} item dtype {planned} -> {relabel}", name,
                       json.dumps(mutated, sort_keys=True, separators=(",", ":")).encode())
    for key, md in sorted(metadata.state_dict_metadata.items()):
        if not hasattr(md, "properties"):
            continue
        old = md.properties.dtype
        for relabel in _relabel_names(old, rng):
            md.properties.dtype = getattr(torch, relabel[6:])
            yield f".metadata: {key!r} dtype {old} -> {relabel}", ".metadata", pickle.dumps(metadata)
        md.properties.dtype = old


def _relabel_names(dtype: torch.dtype, rng: random.Random) -> list[str]:
    names = [n for n in _SAME_WIDTH[dtype.itemsize] if n != str(dtype)]
    return names + [rng.choice([n for size, group in _SAME_WIDTH.items() if size != dtype.itemsize for n in group])]


def _shard_tensor_items(body: dict) -> list[tuple[tuple, dict]]:
    """(path, item) of every tensor item a manifest shard records."""
    return [(("files", f, "items", i), item) for f, entry in enumerate(body["files"])
            for i, item in enumerate(entry["items"]) if item.get("kind") == "tensor"] if "files" in body else []


def _at(node, path: tuple):
    for part in path:
        node = node[part]
    return node


SHARD_NAME = __import__("re").compile(r"manifest\.\d+\.json")


def test_one_field_mutations_of_shards_ranks_json_and_metadata_dtypes_never_load_wrong_values(root):
    """Every format, with data under hashed prefixes where the format has them (stock-readable
    checkpoints keep data where stock DCP finds it)."""
    started = time.monotonic()
    results = []
    for step, (fmt, options) in enumerate(FORMATS.items()):
        _save(root, step, options)
        if fmt != "stock_readable":
            _to_prefixed_schema(root, step)
            assert json.load(open(Sealed(root, step).manifest_path))["requires"] == ["data_prefixes"]
        assert _load(root, step)[0] == "exact", f"{fmt}: the pristine checkpoint must load"
        rng = random.Random(f"20261201/{fmt}")
        sealed = _SealedFiles(root, step)
        for what, name, data in list(_file_cases(rng, sealed)):
            try:
                sealed.write(name, data)
                outcome, detail = _load(root, step)
            finally:
                sealed.restore()
            results.append({"format": fmt, "mutation": what, "outcome": outcome, "detail": detail})
        assert _load(root, step)[0] == "exact", f"{fmt}: the checkpoint must be pristine again"
    silent = [r for r in results if r["outcome"] == "silent"]
    untyped = [r for r in results if r["outcome"] == "untyped"]
    assert not silent, f"{len(silent)} silent wrong loads, e.g. {silent[:5]}"
    assert not untyped, f"{len(untyped)} loads failed without our typed error, e.g. {untyped[:5]}"
    # a zero-element item is never read (DCP plans no read for it): its relabel may load exactly
    relabels = [r for r in results if r["mutation"].startswith(".metadata")
                or " item dtype " in r["mutation"] and "'empty'" not in r["mutation"]]
    assert relabels and all(r["outcome"] == "refused" for r in relabels), [r for r in relabels if r["outcome"] != "refused"][:5]
    assert any(" item dtype " in r["mutation"] for r in relabels)
    shards = {r["format"] for r in results if r["mutation"].startswith("manifest.0.json") and r["outcome"] == "refused"}
    assert shards == set(FORMATS), shards
    print(f"{len(results)} mutations, {sum(r['outcome'] == 'refused' for r in results)} refused, "
          f"{time.monotonic() - started:.1f}s")


def _load_latest(root: str) -> tuple[str, str]:
    """The latest step through LATEST (step=None), classified as :func:`_load` does."""
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageReader

    got = _template()
    try:
        dcp.load(got, storage_reader=AtomicStorageReader(root, RUN, None, timeout=0.05, thread_count=2))
    except BaseException as e:  # noqa: BLE001 - classified here
        return ("refused" if typed(e) else "untyped"), f"{type(e).__name__}: {str(e)[-400:]}"
    return ("exact" if _exact(got) else "silent"), ""


def _resealed_mutations(path: str, seed: str, load, rounds: int = 3):
    """Each field of the self-checksummed file at ``path`` mutated ``rounds`` times, the file re-sealed, then
    ``load()``; the file is restored after each.  Yields (mutation, what ``load`` returned)."""
    pristine = open(path, "rb").read()
    body = json.loads(pristine)
    for case, field_path in enumerate(p for p in _every_path(body) if p != ("checksum",)):
        for round_ in range(rounds):
            mutated = copy.deepcopy(body)
            what = _mutate(random.Random(f"{seed}/{case}/{round_}"), mutated, field_path)
            try:
                with open(path, "wb") as f:
                    f.write(seal(mutated))
                got = load()
            finally:
                with open(path, "wb") as f:
                    f.write(pristine)
            yield what, got


def test_one_field_mutations_of_resealed_markers_and_latest_are_refused_typed_or_load_exactly(root):
    """Every field of COMMITTED and LATEST, each mutated and the file re-sealed (its self-checksum recomputed, as
    an editor or a buggy tool would leave it): every load is exact or a typed refusal, never silent or untyped."""
    results = []
    for step, (fmt, options) in enumerate(FORMATS.items()):
        import shutil

        shutil.rmtree(os.path.join(root, RUN), ignore_errors=True)  # one step per run: LATEST names it
        _save(root, step, options)
        step_dir = os.path.join(root, RUN, f"step_{step:010d}")
        for name, path, load in (("COMMITTED", os.path.join(step_dir, "COMMITTED"), lambda: _load(root, step)),
                                 ("LATEST", os.path.join(root, RUN, "LATEST"), lambda: _load_latest(root))):
            for what, (outcome, detail) in _resealed_mutations(path, f"20261202/{fmt}/{name}", load):
                results.append({"format": fmt, "file": name, "mutation": what, "outcome": outcome, "detail": detail})
        assert _load(root, step)[0] == "exact" and _load_latest(root)[0] == "exact"
    silent = [r for r in results if r["outcome"] == "silent"]
    untyped = [r for r in results if r["outcome"] == "untyped"]
    assert not silent, f"{len(silent)} silent wrong loads, e.g. {silent[:5]}"
    assert not untyped, f"{len(untyped)} loads failed without our typed error, e.g. {untyped[:5]}"
    for name in ("COMMITTED", "LATEST"):
        assert any(r["outcome"] == "refused" for r in results if r["file"] == name), name
    print(f"{len(results)} mutations, {sum(r['outcome'] == 'refused' for r in results)} refused")


# -- the tiers' and the run's other control files: local markers, COMMITS; shards of worlds 2 and 3 ---------------


def _classify(run: "Callable[[], tuple[int, dict]]", expected: dict[int, dict]) -> tuple[str, str]:
    """``run()`` loads and returns (step it reports, state): exact if the state is that step's saved one."""
    try:
        step, got = run()
    except BaseException as e:  # noqa: BLE001 - classified here
        return ("refused" if typed(e) else "untyped"), f"{type(e).__name__}: {str(e)[-300:]}"
    want = expected.get(step)
    same = want is not None and all(torch.equal(got[k], want[k]) for k in want if isinstance(want[k], torch.Tensor))
    return ("exact" if same and got["meta"] == want["meta"] else "silent"), f"step {step}"


def _tally(results: list[dict]) -> str:
    silent = [r for r in results if r["outcome"] == "silent"]
    untyped = [r for r in results if r["outcome"] == "untyped"]
    assert not silent, f"{len(silent)} silent wrong loads, e.g. {silent[:5]}"
    assert not untyped, f"{len(untyped)} failed without our typed error, e.g. {untyped[:5]}"
    return f"{len(results)} mutations, {sum(r['outcome'] == 'refused' for r in results)} refused"


def _small(step: int) -> dict:
    return {"w": torch.arange(64.0) * step, "b": torch.full((5,), float(step), dtype=torch.bfloat16),
            "meta": {"step": step}}


def _small_target() -> dict:
    return {"w": torch.full((64,), -1.0), "b": torch.full((5,), -1.0, dtype=torch.bfloat16), "meta": {"step": -1}}


def test_one_field_mutations_of_resealed_local_markers_never_restore_wrong_values(root):
    """Both tiers, one process: the newest local step's marker (every field, each re-sealed) mutated under a
    restore that may choose either local step or the durable one: what loads is exactly the step it says it
    is, or a typed refusal."""
    from dcp_atomic import CheckpointManager, LocalTierOptions

    durable, local = os.path.join(root, "durable"), os.path.join(root, "local")
    with CheckpointManager(durable, RUN, local=LocalTierOptions(local, replicas=0, keep_local=3), timeout=5) as manager:
        manager.save(1, _small(1), durable=True)
        manager.save(2, _small(2), durable=False)
        manager.save(3, _small(3), durable=False)
        manager.wait()
    expected = {s: _small(s) for s in (1, 2, 3)}

    def restore() -> tuple[int, dict]:
        got = _small_target()
        with CheckpointManager(durable, RUN, local=LocalTierOptions(local, replicas=0), timeout=0.5) as manager:
            return manager.load(got), got

    path = os.path.join(local, RUN, f"step_{3:010d}", "COMMITTED")
    body = json.loads(open(path, "rb").read())
    assert body.get("lineage") and body.get("sequence"), body  # the fields that decide ownership and order
    results = [{"mutation": what, "outcome": outcome, "detail": detail} for what, (outcome, detail)
               in _resealed_mutations(path, "20261202/local", lambda: _classify(restore, expected))]
    assert _classify(restore, expected) == ("exact", "step 3")
    assert any(r["detail"] != "step 3" for r in results if r["outcome"] == "exact"), "no mutation moved the restore"
    print(_tally(results))


def _commits_journal_cases(body: dict, rounds: int):
    """(description, mutated journal): every field ``rounds`` times (seeded), then each entry's ``sequence`` moved
    above and below every other one with its save id unchanged (a re-sealed or hand-edited journal)."""
    for case, field_path in enumerate(p for p in _every_path(body) if p != ("checksum",)):
        for round_ in range(rounds):
            mutated = copy.deepcopy(body)
            yield _mutate(random.Random(f"20261203/commits/{case}/{round_}"), mutated, field_path), mutated
    sequences = [c["sequence"] for c in body["commits"]]
    for i, entry in enumerate(body["commits"]):
        for sequence in (max(sequences) + 10, min(sequences) - 1):
            mutated = copy.deepcopy(body)
            mutated["commits"][i]["sequence"] = sequence
            yield f"sequence of step {entry['step']}: {entry['sequence']} -> {sequence}", mutated


def test_one_field_mutations_of_a_resealed_commits_journal_never_cost_a_kept_step(root):
    """``keep_last=3`` after steps 1-5: each one-field change of the ``COMMITS`` journal (re-sealed), then the
    commit of step 6, each case in a copy of its own (this process numbers a root's commits above the last it
    made there, which would hide the journal's numbers).  The journal is a hint: the save commits, and steps 4-6
    (the three newest commits by their markers) are kept and load exactly; a kept step lost is the lie this test
    is about, typed or not."""
    import shutil

    from dcp_atomic import CheckpointManager

    pristine = os.path.join(root, "pristine")
    with CheckpointManager(pristine, RUN, keep_last=3, timeout=5) as manager:
        for step in range(1, 6):
            manager.save(step, _small(step))
    body = json.loads(open(os.path.join(pristine, RUN, "COMMITS"), "rb").read())
    assert [c["step"] for c in body["commits"]] == [3, 4, 5], body
    kept = (4, 5, 6)
    expected = {s: _small(s) for s in kept}
    results = []
    for case, (what, mutated) in enumerate(_commits_journal_cases(body, rounds=3)):
        durable = os.path.join(root, f"case{case}")
        shutil.copytree(pristine, durable)
        with open(os.path.join(durable, RUN, "COMMITS"), "wb") as f:
            f.write(seal(mutated))
        result = {"mutation": what, "outcome": "exact", "detail": ""}
        results.append(result)
        try:
            with CheckpointManager(durable, RUN, keep_last=3, timeout=0.5) as manager:
                manager.save(6, _small(6))
        except BaseException as e:  # noqa: BLE001 - classified here
            result.update(outcome="refused" if typed(e) else "untyped", detail=f"save: {type(e).__name__}: {e}")
            continue
        for step in kept:
            def load(step=step) -> tuple[int, dict]:
                got = _small_target()
                with CheckpointManager(durable, RUN, timeout=0.5) as manager:
                    return manager.load(got, step=step), got

            outcome, detail = _classify(load, expected)
            if outcome != "exact":  # refused or not, a kept step that no longer loads is lost
                result.update(outcome="silent", detail=f"kept step {step} lost: {detail}")
                break
        shutil.rmtree(durable)
    assert len(results) >= 108, len(results)
    lost = [r for r in results if r["outcome"] == "silent"]
    assert not lost, f"{len(lost)} of {len(results)} journals cost a kept step, e.g. {lost[:5]}"
    refused = [r for r in results if r["outcome"] == "refused"]
    assert not refused, f"{len(refused)} saves failed over a journal, which is a hint, e.g. {refused[:5]}"
    print(_tally(results) + f"; kept steps 4-6 whole after all {len(results)}, 0 lost a kept step")


def _rank_state(rank: int) -> dict:
    g = torch.Generator().manual_seed(100 + rank)
    return {f"r{rank}.w": torch.randn(40, generator=g), f"r{rank}.i": torch.arange(30, dtype=torch.int32) * rank,
            f"r{rank}.meta": {"rank": rank}}


def _save_world(ctx) -> None:
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageWriter

    dcp.save(_rank_state(ctx.rank), storage_writer=AtomicStorageWriter(ctx.root, RUN, 1, block_size=BLOCK))


def _verify_ok(root: str) -> bool:
    """``dcp-atomic verify ROOT RUN 1`` as a user runs it: exit status 0."""
    from dcp_atomic.tools import cli

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return cli.main(["--timeout", "0.05", "verify", root, RUN, "1"]) == 0


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_one_field_mutations_of_every_ranks_shard_of_worlds_2_and_3_never_load_wrong_values(root, world):
    """A step saved by a real gloo world of 2 or 3 ranks (each rank its own keys), loaded whole in one process:
    every field of every rank's manifest shard and of ``ranks.json`` mutated and re-sealed; exact or typed, and
    ``verify`` and ``show`` raise nothing else (``ranks.json`` is not read by a load: it is theirs)."""
    from tests.harness import assert_all_ok, run_world

    assert_all_ok(run_world(_save_world, world, root))
    want: dict = {}
    for rank in range(world):
        want.update(_rank_state(rank))

    def load() -> tuple[int, dict]:
        import torch.distributed.checkpoint as dcp

        from dcp_atomic import AtomicStorageReader

        got = {k: (torch.full_like(v, -3) if isinstance(v, torch.Tensor) else {"rank": -1}) for k, v in want.items()}
        dcp.load(got, storage_reader=AtomicStorageReader(root, RUN, 1, timeout=0.05, thread_count=2))
        got["meta"] = {k: got[k] for k in want if k.endswith(".meta")}
        return 1, got

    expected = {1: {**want, "meta": {k: want[k] for k in want if k.endswith(".meta")}}}
    assert _classify(load, expected) == ("exact", "step 1")
    sealed = _SealedFiles(root, 1)
    shards = sorted(n for n in os.listdir(sealed.ck.attempt) if SHARD_NAME.fullmatch(n))
    assert shards == [f"manifest.{r}.json" for r in range(world)], shards
    results = []
    rng = random.Random(f"20261202/world{world}")
    for what, name, data in [case for case in _file_cases(rng, sealed) if not case[0].startswith(".metadata")]:
        try:
            sealed.write(name, data)
            outcome, detail = _classify(load, expected)
            problems = _side_tools(root, 1, sealed.ck.manifest_bytes, sealed.ck.manifest_path)  # verify, show
            if outcome == "refused" and _verify_ok(root):
                problems.append(f"verify passes a step the load refuses ({detail})")
        finally:
            sealed.restore()
        results.append({"file": name, "mutation": what, "outcome": outcome, "detail": detail})
        results += [{"file": name, "mutation": what, "outcome": "untyped", "detail": p} for p in problems]
    assert _classify(load, expected) == ("exact", "step 1")
    for name in shards:
        assert any(r["outcome"] == "refused" for r in results if r["file"] == name), name
    assert any(r["file"] == "ranks.json" for r in results)
    print(_tally(results), {name: sum(r["outcome"] == "refused" for r in results if r["file"] == name)
                            for name in shards + ["ranks.json"]})


# -- a planner's casts are recorded, so a relabel of a stored dtype is told from a cast ------------------------


def _casting_planner(cast_on_rank: int | None = None):
    """'Save as bf16' for ``w`` (on every rank, or on ``cast_on_rank`` only), as a user's planner would."""
    import torch.distributed as dist
    from torch.distributed.checkpoint import DefaultSavePlanner

    class CastW(DefaultSavePlanner):
        def resolve_data(self, write_item):
            data = super().resolve_data(write_item)
            here = cast_on_rank is None or dist.get_rank() == cast_on_rank
            return data.to(torch.bfloat16) if write_item.index.fqn == "w" and here else data

    return CastW()


def _load_w(root: str, n: int) -> torch.Tensor:
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageReader

    got = {"w": torch.full((n,), -3.0)}
    dcp.load(got, storage_reader=AtomicStorageReader(root, RUN, 1, timeout=0.05))
    return got["w"]


def test_a_recorded_cast_loads_and_a_same_size_relabel_of_a_stored_dtype_is_refused(root):
    """A planner's "save as bf16" is recorded in the manifest per key (``stored_dtypes``); a shard whose item
    dtype was relabelled to another of the same size (bf16 -> fp16), or a manifest record changed to say so,
    would load the bytes reinterpreted and is refused naming the key.  Before, both loaded silently."""
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageWriter

    w = torch.linspace(-3, 3, 96) * 1.001
    dcp.save({"w": w}, storage_writer=AtomicStorageWriter(root, RUN, 1, block_size=BLOCK), planner=_casting_planner())
    assert torch.equal(_load_w(root, 96), w.to(torch.bfloat16).float())  # as stock DCP loads a cast
    ck = Sealed(root, 1)
    top = json.loads(ck.manifest_bytes)
    assert top["stored_dtypes"] == {"w": ["torch.bfloat16"]}
    ((_, item),) = ck.items()
    assert item["dtype"] == "torch.bfloat16"
    item["dtype"] = "torch.float16"  # the same two bytes per element, read as another type
    ck.write_manifest()
    with pytest.raises(BaseException) as refused:  # DCP wraps it in a CheckpointException
        _load_w(root, 96)
    assert typed(refused.value) and "'w'" in str(refused.value) and "torch.float16" in str(refused.value)
    ck.restore()
    top["stored_dtypes"]["w"] = ["torch.float16"]
    item["dtype"] = "torch.float16"
    Sealed(root, 1).write_manifest(json.dumps(top).encode())  # the manifest alone now disagrees with the shard
    with pytest.raises(BaseException) as refused:  # DCP wraps it in a CheckpointException
        _load_w(root, 96)
    assert typed(refused.value), refused.value
    assert not _verify_ok(root)  # verify refuses what the load refuses
    ck.restore()
    assert torch.equal(_load_w(root, 96), w.to(torch.bfloat16).float())


def _save_half_cast(ctx) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from dcp_atomic import AtomicStorageWriter

    mesh = init_device_mesh("cpu", (2,))
    w = distribute_tensor(torch.linspace(-3, 3, 64) * 1.001, mesh, [Shard(0)])
    dcp.save({"w": w}, storage_writer=AtomicStorageWriter(ctx.root, RUN, 1, block_size=BLOCK),
             planner=_casting_planner(cast_on_rank=0))


def test_a_key_cast_on_one_rank_only_records_both_dtypes_and_loads(root):
    """Rank 0's planner casts its chunk of ``w``, rank 1's does not: the manifest records both dtypes for ``w``,
    the step loads as each rank stored it, and rank 1's chunk relabelled to a type neither stored is refused."""
    from tests.harness import assert_all_ok, run_world

    assert_all_ok(run_world(_save_half_cast, 2, root))
    w = torch.linspace(-3, 3, 64) * 1.001
    assert json.loads(Sealed(root, 1).manifest_bytes)["stored_dtypes"] == {"w": ["torch.bfloat16", "torch.float32"]}
    assert torch.equal(_load_w(root, 64), torch.cat([w[:32].to(torch.bfloat16).float(), w[32:]]))
    ck = Sealed(root, 1)
    (item,) = [item for _, item in ck.items() if item.get("dtype") is None]  # rank 1's, stored as planned
    item["dtype"] = "torch.int32"
    ck.write_manifest()
    with pytest.raises(BaseException) as refused:  # DCP wraps it in a CheckpointException
        _load_w(root, 64)
    assert typed(refused.value) and "torch.int32" in str(refused.value), refused.value
