"""``dcp-atomic diff`` and ``dcp-atomic stats`` on real checkpoints saved through ``CheckpointManager``.

diff: keys whose recorded block digests agree are unchanged without a byte of them read (the tool counts the data
bytes it read); the others are read once, verified, and compared; a damaged step is refused by its path.  stats:
each step's row holds the figures its save reported to ``on_saved`` (and its drain to ``on_drained``)."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_atomic import Callbacks, CheckpointManager, LocalTierOptions
from dcp_atomic._base.retry import Deadline
from dcp_atomic.format.layout import RunLayout
from dcp_atomic.protocol.commit import read_committed
from dcp_atomic.stores.backends import open_storage
from dcp_atomic.tools.cli import main
from tests.harness import assert_all_ok, run_world

RUN = "exp"


def _state(**changes) -> dict:
    g = torch.Generator().manual_seed(0)
    state = {"model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g),
                       "emb": torch.randn(128, 16, generator=g)},
             "optim": {"lr": 0.1, "step": 3}}
    for key, value in changes.items():
        head, name = key.split(".")
        if value is None:
            del state[head][name]
        else:
            state[head][name] = value
    return state


def _save(root: str, steps: dict[int, dict], options: dict | None = None) -> list[dict]:
    saved: list[dict] = []
    with CheckpointManager(root, RUN, storage_options=options, callbacks=Callbacks(on_saved=saved.append)) as manager:
        for step, state in steps.items():
            manager.save(step, state)
    return saved


def _diff(capsys, *argv: str) -> dict:
    assert main(["--json", "diff", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def _extents(root: str, step: int, key: str, options: dict | None = None) -> list[tuple[str, int, int]]:
    """(data file path, offset, stored length) of each chunk of ``key`` in ``step``, as its manifest records it."""
    layout = RunLayout(open_storage(root, options), RUN)
    committed = read_committed(layout, step, Deadline(5))
    committed.load_items(layout, None, Deadline(5))
    return [(layout.data_file(step, committed.save_id, entry.name, committed.manifest.data_prefixes), item.pos,
             item.length)
            for entry in committed.manifest.files for item in entry.items if item.key == key]


def _flip(path: str, offset: int) -> None:
    os.chmod(path, 0o644)  # committed data files are read-only
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


# -- diff ----------------------------------------------------------------------------------------------------------


def test_identical_steps_are_unchanged_from_their_digests_without_reading_a_data_byte(root, capsys):
    _save(root, {1: _state(), 2: _state()})
    report = _diff(capsys, root, RUN, "1", "2")
    keys = ["model.b", "model.emb", "model.w", "optim.lr", "optim.step"]
    assert report["unchanged"] == keys and report["unchanged_by_digest"] == len(keys)
    assert report["counts"] == {"added": 0, "removed": 0, "changed": 0, "unchanged": len(keys)}
    assert report["bytes_read"] == 0


def test_one_changed_tensor_is_the_only_key_read_and_its_max_abs_difference_is_exact(root, capsys):
    w = _state()["model"]["w"]
    moved = w.clone()
    moved[5, 7] += 0.25
    moved[9, 1] -= 0.125
    _save(root, {1: _state(), 2: _state(**{"model.w": moved})})
    report = _diff(capsys, root, RUN, "1", "2")
    assert [c["key"] for c in report["changed"]] == ["model.w"]
    change = report["changed"][0]
    assert change["max_abs"] == pytest.approx(0.25, abs=1e-6)
    assert change["relative"] == pytest.approx(change["max_abs"] / float(w.abs().max()))
    assert change["dtype"] is None and change["shape"] is None
    assert report["unchanged_by_digest"] == 4
    stored = sum(length for step in (1, 2) for _, _, length in _extents(root, step, "model.w"))
    assert report["bytes_read"] == stored, "only model.w's stored bytes, once per step"
    assert main(["diff", root, RUN, "1", "2"]) == 0  # the table: counts first, then the changed key
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"run {RUN}: step 1 -> step 2: 1 changed, 0 added, 0 removed, 4 unchanged")
    assert lines[2].split()[:2] == ["model.w", "0.25"]


def test_added_removed_dtype_and_object_changes_by_name_and_the_table_truncates(root, capsys):
    base = _state()
    step2 = _state(**{"model.emb": None, "model.extra": torch.ones(4), "model.b": base["model"]["b"].bfloat16(),
                      "optim.lr": 0.05})
    _save(root, {1: base, 2: step2})
    report = _diff(capsys, root, RUN, "1", "2")
    assert report["added"] == ["model.extra"] and report["removed"] == ["model.emb"]
    changed = {c["key"]: c for c in report["changed"]}
    assert set(changed) == {"model.b", "optim.lr"}
    assert changed["model.b"]["dtype"] == ["float32", "bfloat16"]
    assert changed["model.b"]["max_abs"] == pytest.approx(float((base["model"]["b"].bfloat16().double()
                                                                 - base["model"]["b"].double()).abs().max()))
    assert changed["optim.lr"] == {**changed["optim.lr"], "kind": "object", "equal": False}
    assert report["unchanged"] == ["model.w", "optim.step"]
    assert main(["diff", root, RUN, "1", "2", "--limit", "1"]) == 0
    out = capsys.readouterr().out
    assert "dtype float32 -> bfloat16" in out and "... 1 more" in out and "optim.lr" not in out
    assert "added: model.extra" in out and "removed: model.emb" in out


def test_tolerance_counts_a_small_difference_as_unchanged(root, capsys):
    moved = _state()["model"]["w"] + 1e-4
    _save(root, {1: _state(), 2: _state(**{"model.w": moved})})
    assert [c["key"] for c in _diff(capsys, root, RUN, "1", "2")["changed"]] == ["model.w"]
    report = _diff(capsys, root, RUN, "1", "2", "--tolerance", "1e-3")
    assert report["changed"] == [] and "model.w" in report["unchanged"] and report["unchanged_by_digest"] == 4


def test_a_damaged_step_is_refused_by_its_path_with_exit_1(root, capsys):
    moved = _state()["model"]["w"] * 2
    _save(root, {1: _state(), 2: _state(**{"model.w": moved})})
    (path, pos, length), = _extents(root, 2, "model.w")
    _flip(path, pos + length // 2)  # in the key diff reads
    assert main(["diff", root, RUN, "1", "2"]) == 1
    err = capsys.readouterr().err
    assert path in err and "checksum mismatch" in err
    (path, pos, length), = _extents(root, 1, "model.emb")
    _flip(path, pos + length // 2)  # in a key whose digests agree: only --verify reads it
    assert main(["diff", root, RUN, "1", "1"]) == 0
    capsys.readouterr()
    assert main(["--json", "diff", root, RUN, "1", "2", "--verify"]) == 1
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["type"] == "CorruptCheckpointError" and "step 1 of run 'exp' fails verification" in error["message"]
    assert path in error["message"]


def _save_sharded(ctx):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (ctx.world_size,), mesh_dim_names=("dp",))
    full = _state()["model"]
    moved = full["w"].clone()
    moved[40, 3] += 0.5  # a row rank 1 holds
    with CheckpointManager(ctx.root, RUN, timeout=20) as manager:
        for step, w in ((1, full["w"]), (2, moved)):
            manager.save(step, {"model": {"w": distribute_tensor(w, mesh, [Shard(0)]),
                                          "emb": distribute_tensor(full["emb"], mesh, [Shard(0)])}})


def test_a_sharded_tensor_saved_by_two_ranks_is_compared_whole(root, capsys):
    assert_all_ok(run_world(_save_sharded, 2, root, timeout=120))
    assert len(_extents(root, 2, "model.w")) == 2, "two chunks, one per rank"
    report = _diff(capsys, root, RUN, "1", "2")
    assert [c["key"] for c in report["changed"]] == ["model.w"] and report["changed"][0]["max_abs"] == pytest.approx(0.5, abs=1e-6)
    assert report["unchanged"] == ["model.emb"] and report["unchanged_by_digest"] == 1
    assert report["bytes_read"] == sum(n for step in (1, 2) for _, _, n in _extents(root, step, "model.w"))


def test_diff_on_an_s3_root(s3_moto, capsys):
    options = s3_moto.options()
    moved = _state()["model"]["emb"] - 1.0
    _save(s3_moto.root, {1: _state(), 2: _state(**{"model.emb": moved})}, options)
    report = _diff(capsys, "--storage-options", json.dumps(options), s3_moto.root, RUN, "1", "2")
    assert [c["key"] for c in report["changed"]] == ["model.emb"]
    assert report["changed"][0]["max_abs"] == pytest.approx(1.0)
    assert report["bytes_read"] == sum(n for step in (1, 2) for _, _, n in _extents(s3_moto.root, step, "model.emb",
                                                                                      options))


# -- stats ---------------------------------------------------------------------------------------------------------


def test_stats_rows_hold_what_each_save_reported_and_a_step_without_records_is_dashes(root, tmp_path, capsys):
    saved: list[dict] = []
    with CheckpointManager(root, RUN, reuse=True, callbacks=Callbacks(on_saved=saved.append)) as manager:
        for step in (1, 2, 3):
            manager.save(step, {"frozen": torch.ones(256, 256), "w": torch.full((64,), float(step))})
    stock = str(tmp_path / "stock")
    dcp.save({"w": torch.zeros(4)}, storage_writer=dcp.FileSystemWriter(stock))
    assert main(["import", stock, root, RUN, "4"]) == 0
    capsys.readouterr()
    assert main(["--json", "stats", root, RUN]) == 0
    rows = {row["step"]: row for row in json.loads(capsys.readouterr().out)["steps"]}
    assert sorted(rows) == [1, 2, 3, 4]
    for stats in saved:
        row = rows[stats["step"]]
        assert row["save_id"] == stats["save_id"] and row["tier"] == stats["tier"] == "durable"
        assert (row["bytes"], row["bytes_written"], row["bytes_reused"]) == (
            stats["bytes"], stats["bytes_written"], stats["bytes_reused"])
        assert 0 < row["save_seconds"] <= stats["seconds"] + 0.01  # wall clock vs perf_counter
        assert row["write_seconds"] == pytest.approx(max(r["write_seconds"] for r in stats["ranks"]))
        assert row["drain_seconds"] is None
    assert rows[3]["bytes_reused"] > 0, "the frozen tensor was linked, not written"
    assert all(rows[4][name] is None for name in ("save_seconds", "bytes", "bytes_written", "drain_seconds"))
    assert main(["stats", root, RUN]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["step", "tier", "save", "write", "bytes", "written", "reused", "drain"]
    assert lines[4].split() == ["4", "durable", "-", "-", "-", "-", "-", "-"]
    assert lines[3].split()[:2] == ["3", "durable"] and lines[3].split()[-1] == "-"


def test_stats_of_drained_steps_show_the_drain_time_and_the_local_tier(tmp_path, capsys):
    durable, local = str(tmp_path / "durable"), str(tmp_path / "local")
    saved: list[dict] = []
    drained: list[dict] = []
    with CheckpointManager(durable, RUN, local=LocalTierOptions(local, replicas=0),
                           callbacks=Callbacks(on_saved=saved.append, on_drained=drained.append)) as manager:
        for step in (1, 2):
            manager.save(step, {"w": torch.full((1024,), float(step))})
    assert main(["--json", "stats", durable, RUN]) == 0
    rows = {row["step"]: row for row in json.loads(capsys.readouterr().out)["steps"]}
    for stats, drain in zip(saved, sorted(drained, key=lambda d: d["step"])):
        row = rows[stats["step"]]
        assert row["tier"] == stats["tier"] == "local" and row["drained"]
        assert row["bytes"] == stats["bytes"] == drain["bytes"]
        assert 0 < row["drain_seconds"] <= drain["seconds"] + 0.01
    assert main(["stats", durable, RUN]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1].split()[:2] == ["1", "local*"] and "drained here" in out
    assert main(["--json", "stats", local, RUN]) == 0  # the node's own copies: saved here, drained elsewhere
    rows = json.loads(capsys.readouterr().out)["steps"]
    assert [(r["tier"], r["drained"], r["drain_seconds"]) for r in rows] == [("local", False, None)] * len(rows)
    assert {r["step"]: r["bytes"] for r in rows} == {s["step"]: s["bytes"] for s in saved if s["step"] in
                                                     {r["step"] for r in rows}}


def test_stats_plot_writes_a_png_or_names_the_extra_that_brings_matplotlib(root, tmp_path, capsys):
    """Runs either way: with the ``plot`` extra installed it draws; without it, exit 3 (a missing extra) naming what
    to install.  A path that cannot be a PNG, or whose folder is missing, is a usage error naming it, before
    anything is read."""
    _save(root, {1: _state(), 2: _state()})
    out = str(tmp_path / "stats.png")
    for wrong, said in ((str(tmp_path / "missing" / "x.png"), "does not exist"), (str(tmp_path / "x.txt"), ".png")):
        assert main(["stats", root, RUN, "--plot", wrong]) == 2
        err = capsys.readouterr().err
        assert err.startswith("dcp-atomic: UsageError") and wrong in err and said in err, err
        assert not os.path.exists(wrong)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert main(["stats", root, RUN, "--plot", out]) == 3
        err = capsys.readouterr().err
        assert "pip install matplotlib" in err and "[plot] extra" in err and not os.path.exists(out), err
        return
    assert main(["stats", root, RUN, "--plot", out]) == 0
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
