"""Retention policies beside ``keep_last``: ``Retention(keep_every=, keep_period=, best=)`` through real
``CheckpointManager`` saves, in one process and in a 2-rank gloo world, and ``dcp-atomic gc`` with the same options
on an S3 root (moto): what each part keeps, the union with what protects a step (the newest commit, ``LATEST``, the
durable-pending local step), the per-commit cost with ``best`` (manifests read once per process), and Lightning's
top-k mapped onto what the strategy keeps."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from dcp_atomic import ArgumentError, Best, CheckpointManager, LocalTierOptions, Retention, StorageError, list_steps
from dcp_atomic.format.layout import RunLayout
from dcp_atomic.protocol.commit import read_marker, write_latest
from dcp_atomic.stores.backends import open_storage
from dcp_atomic._base.retry import Deadline
from dcp_atomic.tools.cli import main
from tests.harness import assert_all_ok, run_world

RUN = "exp"


def _state(step: int) -> dict:
    return {"w": torch.arange(4.0) + step}


def _save_all(manager, steps, metric=None) -> None:
    """Save each step; ``metric``: step -> the metadata to save with it (a step absent from it saves none)."""
    for step in steps:
        manager.save(step, _state(step), metadata=(metric or {}).get(step))


def test_keep_every_and_keep_last_over_25_saves_keep_the_multiples_the_last_n_and_the_newest(root):
    with CheckpointManager(root, RUN, retention=Retention(keep_last=2, keep_every=10), timeout=30) as manager:
        _save_all(manager, range(1, 26))
    assert list_steps(root, RUN) == [10, 20, 24, 25]
    with CheckpointManager(root, "every", retention=Retention(keep_every=10), timeout=30) as manager:
        _save_all(manager, range(1, 26))
    assert list_steps(root, "every") == [10, 20, 25]  # 25: the newest commit stays whatever the policy says


_LOSSES = {1: 0.5, 2: 0.3, 4: 0.2, 5: "n/a", 6: 0.3, 7: 0.9}  # step 3 records none, step 5 no number


def _best_in_a_world(ctx):
    """Rank 0 records the warnings; every rank saves steps 1..7 with ``val_loss`` (rank 0's metadata is kept)."""
    records: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("dcp_atomic").addHandler(handler)
    kept = {}
    for mode in ("min", "max"):
        run = f"best-{mode}"
        with CheckpointManager(ctx.root, run, retention=Retention(best=Best("val_loss", k=2, mode=mode)),
                               timeout=30) as manager:
            _save_all(manager, range(1, 8), {s: {"val_loss": v} for s, v in _LOSSES.items()})
        torch.distributed.barrier()  # rank 0 applies retention after the others returned from the save
        kept[mode] = list_steps(ctx.root, run)
    return {"kept": kept, "warnings": [r for r in records if "val_loss" in r]}


def test_best_k_by_a_metric_min_and_max_in_a_2_rank_world_skips_steps_without_it_and_breaks_ties_by_newest(root):
    rank0, rank1 = assert_all_ok(run_world(_best_in_a_world, 2, root, timeout=120))
    # min: 4 (0.2), then 6 over 2 (both 0.3: the newer ranks first); 7 is the newest
    assert rank0["kept"] == {"min": [4, 6, 7], "max": [1, 7]}, rank0
    assert rank1["kept"] == rank0["kept"]
    missing = [w for w in rank0["warnings"] if "3 (missing)" in w]
    assert len(missing) == 2, rank0["warnings"]  # once per run (each run its own step 3), not once per commit
    assert any("5 ('n/a')" in w for w in rank0["warnings"]), rank0["warnings"]


def test_keep_period_keeps_the_first_commit_of_each_window_of_rank0_wall_clock(root, monkeypatch):
    from dcp_atomic.format import manifest

    clock = {1: 1000.0, 2: 1050.0, 3: 1120.0, 4: 1150.0, 5: 1199.0, 6: 1210.0, 7: 1390.0, 8: 1400.0}
    with CheckpointManager(root, RUN, retention=Retention(keep_period=100), timeout=30) as manager:
        for step, at in clock.items():
            monkeypatch.setattr(manifest, "now", lambda at=at: at)  # the committer's clock (Marker.committed_at)
            manager.save(step, _state(step))
    layout = RunLayout(open_storage(root), RUN)
    assert read_marker(layout, 8, Deadline(1)).committed_at == 1400.0  # the patch reached the committer
    assert list_steps(root, RUN) == [1, 3, 6, 7, 8]  # windows 10, 11, 12, 13 and the newest (14)


def test_the_newest_step_stays_even_when_best_ranks_it_worst_and_latest_stays_whatever_the_policy(root, capsys):
    with CheckpointManager(root, RUN, retention=Retention(best=Best("loss", k=1)), timeout=30) as manager:
        _save_all(manager, (1, 2, 3), {1: {"loss": 0.1}, 2: {"loss": 0.2}, 3: {"loss": 0.9}})
    assert list_steps(root, RUN) == [1, 3]  # 3 ranks worst, and is the newest
    layout = RunLayout(open_storage(root), RUN)
    write_latest(layout, read_marker(layout, 1, Deadline(1)))  # a LATEST that lags (its update failed)
    assert main(["gc", root, RUN, "--keep-last", "1", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "step 1: kept (LATEST)" in out and "step 3: kept (newest, keep_last)" in out, out


def test_both_tiers_the_durable_pending_local_step_stays_and_the_policy_rules_the_durable_root(root, tmp_path):
    from dcp_atomic._base import failpoints
    from dcp_atomic.tiers import drain

    def fail_step_7(rank, step):
        if step == 7:
            raise OSError(28, "injected: durable root full")

    drain.RETRY_BACKOFF = 0.01
    failpoints.arm("drain.before_upload", fail_step_7)
    local_root = str(tmp_path / "local")
    local = LocalTierOptions(local_root, replicas=0, keep_local=1, durable_every=None)
    manager = CheckpointManager(root, RUN, local=local, retention=Retention(keep_last=1, keep_every=2), timeout=30)
    try:
        for step in range(1, 7):
            manager.save(step, _state(step), durable=True)
            manager.wait()  # each drained before the next save: a step still waiting would be replaced by the next
        manager.save(7, _state(7), durable=True)
        with pytest.raises(Exception, match="injected"):
            manager.wait()  # step 7 is durable-pending: saved for a durable copy that failed
        manager.save(8, _state(8), durable=False)
        manager.save(9, _state(9), durable=False)
        local_steps = list_steps(local_root, RUN)
        durable_steps = list_steps(root, RUN)
    finally:
        failpoints.disarm_all()
        try:
            manager.close()
        except StorageError:
            pass  # close drains the last step again: still injected
    assert local_steps == [7, 9], local_steps  # keep_local=1 keeps 9; 7 waits for its durable copy
    assert durable_steps == [2, 4, 6], durable_steps  # drained 1..6: the multiples of 2, 6 the newest and last


def test_a_step_whose_manifest_cannot_be_read_for_best_is_kept_not_ranked_out(root, caplog):
    with CheckpointManager(root, RUN, timeout=30) as manager:  # no policy: nothing reads the manifests yet
        _save_all(manager, (1, 2), {1: {"loss": 0.1}, 2: {"loss": 0.5}})
    layout = RunLayout(open_storage(root), RUN)
    manifest = layout.attempt_file(1, read_marker(layout, 1, Deadline(1)).save_id, "manifest.json")
    os.chmod(manifest, 0o644)
    with open(manifest, "r+b") as f:  # the best step's manifest damaged: its loss cannot be known
        f.write(b"#")
    with CheckpointManager(root, RUN, retention=Retention(best=Best("loss", k=1)), timeout=30) as manager:
        manager.save(3, _state(3), metadata={"loss": 0.9})
    assert list_steps(root, RUN) == [1, 2, 3]  # 1 left whole (it may be the best), 2 the best readable, 3 newest
    assert any("step 1" in r.getMessage() and "kept until it can be read" in r.getMessage() for r in caplog.records)


class _CountedReads:
    """The manager's own storage, its reads counted by kind (a spy on the real call)."""

    def __init__(self, storage):
        self.manifests = self.markers = 0
        read = storage.read_file

        def counted(path):
            self.manifests += path.endswith("manifest.json")
            self.markers += path.endswith("COMMITTED")
            return read(path)

        storage.read_file = counted


def test_per_commit_reads_stay_o_kept_with_best_manifests_read_once_per_process(root):
    saves = 30
    with CheckpointManager(root, RUN, retention=Retention(keep_last=2, best=Best("loss", k=3)),
                           timeout=30) as manager:
        reads = _CountedReads(manager.layout.storage)
        _save_all(manager, range(1, saves + 1), {s: {"loss": 1.0 / s if s % 2 else float(s)}
                                                 for s in range(1, saves + 1)})
    kept = list_steps(root, RUN)
    assert kept == [25, 27, 29, 30], kept  # best 1/29, 1/27, 1/25; the last 2: 29, 30
    assert reads.manifests <= saves, reads.manifests  # each commit's own manifest once, never the kept ones again
    assert reads.markers <= saves * (len(kept) + 3), reads.markers  # the journal's kept steps, never every step


def test_gc_dry_run_on_s3_lists_what_keeps_each_step_deletes_nothing_then_gc_deletes_exactly_those(s3_moto, capsys):
    options = s3_moto.options()
    with CheckpointManager(s3_moto.root, RUN, storage_options=options, timeout=30) as manager:  # keeps every step
        _save_all(manager, range(1, 13), {s: {"acc": s % 5} for s in range(1, 13)})
    flags = ["--storage-options", json.dumps(options)]
    policy = ["--keep-last", "2", "--keep-every", "5", "--best", "acc:1:max"]
    before = s3_moto.keys()
    assert main(flags + ["gc", s3_moto.root, RUN, *policy, "--dry-run"]) == 0
    out = capsys.readouterr().out
    # acc 4 at steps 4 and 9: the newer ranks first
    for line in ("step 9: kept (best acc=4 (#1))", "step 5: kept (keep_every 5)", "step 10: kept (keep_every 5)",
                 "step 11: kept (keep_last)", "step 12: kept (newest, keep_last, LATEST)", "step 4: would delete",
                 "step 1: would delete"):
        assert line in out, (line, out)
    assert s3_moto.keys() == before, "a dry run must not change an object"
    assert main(flags + ["--json", "gc", s3_moto.root, RUN, *policy, "--dry-run"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["kept_steps"] == [5, 9, 10, 11, 12] and report["delete_steps"] == [1, 2, 3, 4, 6, 7, 8], report
    assert report["kept_reasons"]["12"] == ["newest", "keep_last", "LATEST"] and report["policy"].startswith("keep_last=2")
    assert main(flags + ["gc", s3_moto.root, RUN, *policy]) == 0
    assert list_steps(s3_moto.root, RUN, options) == report["kept_steps"]


def test_retention_arguments_are_checked_and_keep_last_with_retention_is_refused(root):
    with pytest.raises(ArgumentError, match=r"Retention\(keep_every=\.\.\.\)"):
        Retention(keep_every=0)
    with pytest.raises(ArgumentError, match=r"Best\(mode=\.\.\.\)"):
        Best("loss", mode="lowest")
    with pytest.raises(ArgumentError, match=r"keep_last.*retention=Retention\(keep_last=3"):
        CheckpointManager(root, RUN, keep_last=3, retention=Retention(keep_every=10))
    assert main(["gc", root, RUN, "--best", "loss:two:min"]) == 2


def _lightning_top_k(ctx):
    from tests.helpers.lightning import _module_class, _trainer

    pl, Module = _module_class("pytorch_lightning")
    from pytorch_lightning.callbacks import ModelCheckpoint

    class Logged(Module):
        def training_step(self, batch, index):
            loss = super().training_step(batch, index)
            self.log("loss", [0.5, 0.2, 0.9, 0.1, 0.7, 0.4][self.global_step % 6], sync_dist=True)
            return loss

    dirpath = os.path.join(ctx.root, "ckpts")
    top = ModelCheckpoint(dirpath=dirpath, monitor="loss", mode="min", save_top_k=2, every_n_train_steps=1,
                          save_last=True)
    _trainer(pl, ctx, 6, [top]).fit(Logged())
    return {"files": sorted(n for n in os.listdir(dirpath) if n.endswith(".ckpt")),
            "best": sorted(os.path.basename(p) for p in top.best_k_models)}


def test_lightning_save_top_k_leaves_exactly_the_two_best_files_states_and_last(root):
    from dcp_atomic.format.layout import parse_checkpoint_id
    from dcp_atomic.integrations.lightning import checkpoint_id_for

    for out in assert_all_ok(run_world(_lightning_top_k, 2, root, timeout=240)):
        assert out["best"] == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"], out  # losses 0.2 and 0.1
        assert out["files"] == sorted(out["best"] + ["last.ckpt"]), out
    dirpath = os.path.join(root, "ckpts")
    named = {parse_checkpoint_id(checkpoint_id_for(os.path.join(dirpath, name), step))[1:]
             for name, step in (("epoch=0-step=2.ckpt", 2), ("epoch=0-step=4.ckpt", 4), ("last.ckpt", 6))}
    namespace = os.path.join(dirpath, "lightning")
    committed = {(run, step) for run in os.listdir(namespace) for step in list_steps(namespace, run)}
    assert committed == named  # the two best files' states and last's; every rotated-out one is gone
