"""Hashed data prefixes on S3 (docs/s3.md, "Key layout for scale") against the suite's real S3 servers.

Data objects of a save spread over ``<root>/_dXX/<run>/step_N/<save_id>/`` (16 prefixes by default on
``s3://``); control files keep their fixed names.  Where the data lives is a fact of the manifest
(``data_prefixes``), never of the reader's options: these tests save with one setting and read, verify,
gc and list with another.
"""

from __future__ import annotations

import json
import re

import pytest
import s3fs  # noqa: F401  (the S3 backend's dependency: a missing install fails here, never skips)
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcp_atomic import AtomicStorageReader, AtomicStorageWriter, ConfigurationError, CorruptCheckpointError
from dcp_atomic.tools.audit import audit_step
from dcp_atomic.stores.backends import open_storage
from dcp_atomic.tools.cli import main
from dcp_atomic.format.layout import RunLayout, data_prefix
from dcp_atomic.format.manifest import Manifest, ShardRef
from dcp_atomic.stores.s3 import DATA_PREFIXES, DEFAULT_DATA_PREFIXES
from tests.harness import assert_all_ok, run_world

RUN = "exp"
PREFIXED = re.compile(r"_d([0-9a-f]{2})/exp/step_(\d{10})/([^/]+)/(__\d+_\d+\.distcp)")
pytestmark = pytest.mark.timeout(120)


def _rank_state(rank: int, step: int) -> dict:
    """Five tensors per rank (one file per writer thread with thread_count=4), a shared one, an object."""
    generator = torch.Generator().manual_seed(100 * step + rank)
    state = {f"r{rank}_{i}": torch.randn(64 + i, generator=generator) for i in range(5)}
    state["shared"] = torch.arange(10, dtype=torch.float64) * step
    state["bf16"] = (torch.linspace(-1, 1, 33) * step).to(torch.bfloat16)
    state["meta"] = {"step": step}
    return state


def _prefixed_world(ctx):
    """Step 1 with the default layout, step 2 with prefixes off; each read back with the *other* setting."""
    options = ctx.extra["storage_options"]
    ids = {}
    for step, prefixes in ((1, None), (2, 0)):
        save_options = options if prefixes is None else {**options, DATA_PREFIXES: prefixes}
        writer = AtomicStorageWriter(ctx.root, RUN, step, thread_count=4, timeout=20, storage_options=save_options)
        dcp.save(_rank_state(ctx.rank, step), storage_writer=writer)
        ids[step] = writer.save_id
    for step, reader_prefixes in ((1, 0), (2, 16)):
        target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"step": -1} for k, v in
                  _rank_state(ctx.rank, 0).items()}
        reader = AtomicStorageReader(ctx.root, RUN, step, timeout=20,
                                     storage_options={**options, DATA_PREFIXES: reader_prefixes})
        dcp.load(target, storage_reader=reader)
        for key, want in _rank_state(ctx.rank, step).items():
            got = target[key]
            assert (torch.equal(got, want) and got.dtype == want.dtype if isinstance(want, torch.Tensor)
                    else got == want), f"rank {ctx.rank}: {key} of step {step} differs"
    return ids


def test_world2_saves_spread_over_hashed_prefixes_and_load_bit_exact_whatever_the_reader_says(s3):
    ids = assert_all_ok(run_world(_prefixed_world, 2, s3.root, extra={"storage_options": s3.options()}, timeout=90))
    assert ids[0] == ids[1]
    save1, save2 = ids[0][1], ids[0][2]
    keys = s3.keys()
    prefixed = [PREFIXED.fullmatch(k) for k in keys if k.startswith("_d")]
    assert all(prefixed), [k for k in keys if k.startswith("_d")]
    assert {(m.group(2), m.group(3)) for m in prefixed} == {("0000000001", save1)}, "only step 1 is prefixed"
    names = sorted(m.group(4) for m in prefixed)
    assert names == sorted(f"__{r}_{k}.distcp" for r in range(2) for k in range(4)), names
    assert all(int(m.group(1), 16) < DEFAULT_DATA_PREFIXES for m in prefixed)
    assert len({m.group(1) for m in prefixed}) > 1, "8 files of one save landed under a single prefix"
    assert all(m.group(1) == data_prefix(save1, m.group(4), DEFAULT_DATA_PREFIXES)[2:] for m in prefixed)
    attempt1 = f"{RUN}/step_0000000001/{save1}/"
    assert not [k for k in keys if k.startswith(attempt1) and k.endswith(".distcp")], "no data beside the manifest"
    assert f"{RUN}/step_0000000001/COMMITTED" in keys and f"{attempt1}manifest.json" in keys
    manifest1 = json.loads(s3.get(f"{attempt1}manifest.json"))
    assert manifest1["data_prefixes"] == DEFAULT_DATA_PREFIXES and manifest1["requires"] == ["data_prefixes"]
    manifest2 = json.loads(s3.get(f"{RUN}/step_0000000002/{save2}/manifest.json"))
    assert "data_prefixes" not in manifest2 and manifest2["requires"] == [], "P=0: the classic place"
    assert len([k for k in keys if k.startswith(f"{RUN}/step_0000000002/{save2}/__")]) == 8


def _state(seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(40, 50, generator=generator), "b": torch.randn(9, generator=generator),
            "meta": {"seed": seed}}


def _save(s3, step: int, seed: int, **options) -> AtomicStorageWriter:
    writer = AtomicStorageWriter(s3.root, RUN, step, thread_count=2, timeout=10, storage_options=s3.options(**options))
    dcp.save(_state(seed), storage_writer=writer)
    return writer


def _load(s3, step: int, seed: int, **options) -> None:
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"seed": -1} for k, v in _state(seed).items()}
    dcp.load(target, storage_reader=AtomicStorageReader(s3.root, RUN, step, timeout=5,
                                                        storage_options=s3.options(**options)))
    for key, want in _state(seed).items():
        assert torch.equal(target[key], want) if isinstance(want, torch.Tensor) else target[key] == want, key


def _data_keys(s3, save_id: str) -> list[str]:
    return [k for k in s3.keys() if f"/{save_id}/" in k and k.endswith(".distcp")]


def test_gc_removes_prefixed_data_of_deleted_steps_crashed_attempts_and_stale_uploads(s3_moto, capsys):
    from dcp_atomic._base import failpoints

    s3 = s3_moto
    orphan = _save(s3, 0, seed=0).save_id
    for key in s3.keys(f"{RUN}/step_0000000000/"):  # what an older dcp_atomic's gc leaves: data, no step record
        s3.client.delete_object(Bucket=s3.bucket, Key=f"{s3.prefix}/{key}")
    old = _save(s3, 1, seed=1).save_id
    kept = _save(s3, 2, seed=2).save_id
    failpoints.arm("commit.before_metadata", "raise")  # data written, no manifest, no marker: a crashed attempt
    with pytest.raises(CheckpointException):
        _save(s3, 3, seed=3)
    failpoints.disarm_all()
    crashed = next(k.split("/")[2] for k in s3.keys(f"{RUN}/step_0000000003/") if k.endswith("/ATTEMPT"))
    assert _data_keys(s3, old) and _data_keys(s3, crashed) and all(k.startswith("_d") for k in _data_keys(s3, crashed))
    dead = s3.client.create_multipart_upload(  # a killed rank's upload, under a prefix gc's listing has not seen
        Bucket=s3.bucket, Key=f"{s3.prefix}/_d0e/{RUN}/step_0000000003/{crashed}/__1_0.distcp")
    foreign = s3.client.create_multipart_upload(Bucket=s3.bucket,
                                                Key=f"{s3.prefix}/_d0e/other/step_0000000003/x.distcp")
    flags = ["--storage-options", json.dumps(s3.options()), "--json"]
    assert main(flags + ["gc", s3.root, RUN, "--keep-last", "1", "--lease-hours", "0"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["delete_steps"] == [1] and [3, crashed] in report["delete_attempts"], report
    assert all(path.endswith(f"/{RUN}/step_0000000000/{orphan}") for path in report["delete_data"]), report
    assert report["delete_data"] and _data_keys(s3, orphan) == []
    assert _data_keys(s3, old) == [] and _data_keys(s3, crashed) == [], "prefixed data of gc'd attempts is gone"
    assert not s3.keys(f"{RUN}/step_0000000001/") and not s3.keys(f"{RUN}/step_0000000003/")
    left = {u["UploadId"] for u in s3.uploads()}
    assert dead["UploadId"] not in left and foreign["UploadId"] in left, "only this run's stale uploads are aborted"
    assert _data_keys(s3, kept) and all(k.startswith("_d") for k in _data_keys(s3, kept))
    _load(s3, 2, seed=2)
    assert main(flags + ["ls", s3.root]) == 0
    assert [row["run"] for row in json.loads(capsys.readouterr().out)["runs"]] == [RUN], "no _dXX listed as a run"


def test_verify_and_load_name_a_damaged_or_missing_prefixed_object(s3_moto, capsys):
    s3 = s3_moto
    writer = _save(s3, 1, seed=1)
    storage = open_storage(s3.root, s3.options())
    assert audit_step(RunLayout(storage, RUN), 1).ok
    victim = max(_data_keys(s3, writer.save_id), key=lambda k: len(s3.get(k)))
    assert PREFIXED.fullmatch(victim), victim
    original = s3.get(victim)
    flipped = bytearray(original)
    flipped[len(flipped) // 2] ^= 0x01
    s3.put(victim, bytes(flipped))
    report = audit_step(RunLayout(storage, RUN), 1)
    assert len(report.problems) == 1 and f"{s3.prefix}/{victim}" in report.problems[0], report.problems
    assert "checksum mismatch" in report.problems[0]
    with pytest.raises(CheckpointException) as info:
        _load(s3, 1, seed=1, **{DATA_PREFIXES: 0})  # the reader's options do not move the data
    inner = [w[0] if isinstance(w, tuple) else w for w in info.value.failures.values()]
    assert any(isinstance(e, CorruptCheckpointError) and victim in str(e) for e in inner), inner
    s3.client.delete_object(Bucket=s3.bucket, Key=f"{s3.prefix}/{victim}")
    flags = ["--storage-options", json.dumps(s3.options()), "--json"]
    assert main(flags + ["verify", s3.root, RUN, "1"]) == 1
    problems = json.loads(capsys.readouterr().out)[0]["problems"]
    assert problems == [f"{s3.bucket}/{s3.prefix}/{victim}: missing"], problems


def test_stock_readable_forces_the_classic_layout(s3_moto):
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    s3 = s3_moto
    writer = AtomicStorageWriter(s3.root, RUN, 1, stock_readable=True, timeout=10,
                                 storage_options=s3.options(**{DATA_PREFIXES: 16}))
    dcp.save(_state(4), storage_writer=writer)
    assert not [k for k in s3.keys() if k.startswith("_d")]
    attempt = f"{RUN}/step_0000000001/{writer.save_id}"
    assert "data_prefixes" not in json.loads(s3.get(f"{attempt}/manifest.json"))
    options = s3.options()
    stock = {k: options[k] for k in ("endpoint_url", "key", "secret", "client_kwargs")}
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"seed": -1} for k, v in _state(4).items()}
    dcp.load(target, storage_reader=FsspecReader(f"{s3.root}/{attempt}", **stock))  # torch's own reader
    assert torch.equal(target["w"], _state(4)["w"]) and target["meta"] == {"seed": 4}


# -- without a server ----------------------------------------------------------------------------


def _manifest(prefixes: int) -> Manifest:
    return Manifest(run_id=RUN, step=1, save_id="20250101T000000Z-0123abcd", world_size=1, parallelism=None,
                    ranks=[{"host": "h"}], files=[], dcp_metadata={"name": ".metadata", "size": 0, "sha256": "0" * 64},
                    versions={}, started_at=0.0, written_at=0.0, data_prefixes=prefixes,
                    shards=[ShardRef(rank=0, name="manifest.0.json", size=1, sha256="0" * 64)])


def test_manifest_requires_data_prefixes_by_name_where_it_records_them_and_reads_schema_3():
    prefixed = json.loads(_manifest(16).to_json())
    assert prefixed["data_prefixes"] == 16 and prefixed["schema_version"] == 5
    assert prefixed["requires"] == ["data_prefixes"]
    assert Manifest.from_json(_manifest(16).to_json(), where="m").requires("data_prefixes")
    classic = json.loads(_manifest(0).to_json())
    assert "data_prefixes" not in classic and classic["requires"] == []
    assert Manifest.from_json(_manifest(0).to_json(), where="m").data_prefixes == 0
    # written before features had names: schema 3 meant "data under hashed prefixes", and is written back as 3
    schema_3 = {**{k: v for k, v in prefixed.items() if k != "requires"}, "schema_version": 3}
    old = Manifest.from_json(json.dumps(schema_3).encode(), where="m")
    assert old.data_prefixes == 16 and old.requires("data_prefixes") and json.loads(old.to_json()) == schema_3
    for body, problem in (({**prefixed, "data_prefixes": 0}, "data_prefixes"),
                          ({**prefixed, "data_prefixes": 257}, "data_prefixes"),
                          ({**prefixed, "data_prefixes": True}, "data_prefixes"),
                          ({k: v for k, v in prefixed.items() if k != "data_prefixes"}, "data_prefixes"),
                          ({**classic, "data_prefixes": 16}, "data_prefixes"),
                          ({**classic, "schema_version": 3}, "data_prefixes")):
        with pytest.raises(CorruptCheckpointError, match=problem):
            Manifest.from_json(json.dumps(body).encode(), where="m")


def test_layout_puts_only_data_under_stable_prefixes():
    storage = open_storage("s3://bucket/root", {"key": "k", "secret": "s", "endpoint_url": "http://127.0.0.1:9"})
    layout = RunLayout(storage, RUN)
    save_id = "20250101T000000Z-0123abcd"
    assert layout.data_file(7, save_id, "__3_1.distcp") == f"bucket/root/{RUN}/step_0000000007/{save_id}/__3_1.distcp"
    path = layout.data_file(7, save_id, "__3_1.distcp", prefixes=16)
    assert path == layout.data_file(7, save_id, "__3_1.distcp", prefixes=16), "stable"
    assert re.fullmatch(rf"bucket/root/_d0[0-9a-f]/{RUN}/step_0000000007/{save_id}/__3_1\.distcp", path), path
    assert {data_prefix(save_id, f"__{r}_0.distcp", 16) for r in range(256)} == {f"_d{i:02x}" for i in range(16)}
    with pytest.raises(ValueError, match="data file name"):
        layout.data_file(7, save_id, "../x", prefixes=16)
    for bad in (-1, 257, "16", 1.5, True):
        with pytest.raises(ConfigurationError, match=DATA_PREFIXES):
            open_storage("s3://bucket/root", {"key": "k", "secret": "s", DATA_PREFIXES: bad})
    assert open_storage("s3://bucket/root", {"key": "k", "secret": "s"}).data_prefixes == DEFAULT_DATA_PREFIXES
    assert open_storage("s3://bucket/root", {"key": "k", "secret": "s", DATA_PREFIXES: 0}).data_prefixes == 0
