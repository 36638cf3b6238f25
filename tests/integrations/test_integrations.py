"""Framework integrations driven through the frameworks' own code at world 2 on CPU."""

from __future__ import annotations

import os

import pytest
import torch

from dcp_atomic import list_steps
from tests.harness import assert_all_ok, run_world
from tests.helpers.integrations import _sharded_model, _Stateful, _train_step


def _full(model, optim):
    weights = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    moments = {f"{p}.{k}": optim.state[param][k].full_tensor().clone()
               for p, param in model.named_parameters() for k in ("exp_avg", "exp_avg_sq")}
    return weights, moments


def _torchtitan_manager(ctx, model, optim, train_state, mode, **config):
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    from dcp_atomic.integrations.torchtitan import AtomicCheckpointManager

    cfg = AtomicCheckpointManager.Config(enable=True, folder=f"ckpt_{mode}", interval=2, keep_latest_k=1,
                                         async_mode=mode, last_save_model_only=True, export_dtype="bfloat16",
                                         timeout=20, **config)
    optimizers = _Stateful(lambda: get_optimizer_state_dict(model, optim),
                           lambda sd: set_optimizer_state_dict(model, optim, sd))
    schedulers = _Stateful(lambda: {"last_epoch": torch.tensor(train_state["step"])}, lambda sd: None)
    states = {"train_state": _Stateful(lambda: {"step": torch.tensor(train_state["step"])},
                                       lambda sd: train_state.update(step=int(sd["step"])))}
    return cfg.build(dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
                     states=states, sd_adapter=None, base_folder=ctx.root)


def _torchtitan_rank(ctx, mode):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageReader

    model = _sharded_model(0)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    train_state = {"step": 0}
    manager = _torchtitan_manager(ctx, model, optim, train_state, mode)
    out = {"fresh_load": manager.load()}
    saved = []
    for step in range(1, 5):
        _train_step(model, optim, step)
        train_state["step"] = step
        saved.append(manager.save(step))
        manager.maybe_wait_for_staging()
    manager.maybe_wait_for_saving()
    expected = _full(model, optim)
    folder = os.path.join(ctx.root, f"ckpt_{mode}")
    if ctx.rank == 0:  # a crashed save of a later step: "latest" must not pick it
        os.makedirs(os.path.join(folder, "step_0000000006", "20260101T000000Z-deadbeef"))
    dist.barrier()

    fresh, fresh_optim, fresh_state = _sharded_model(7), None, {"step": 0}
    fresh_optim = torch.optim.Adam(fresh.parameters(), lr=0.01)
    _train_step(fresh, fresh_optim, 99)
    resumed = _torchtitan_manager(ctx, fresh, fresh_optim, fresh_state, mode, load_step=4)
    out["load_step_4"] = resumed.load(step=4)
    out["latest_load"] = resumed.load()
    got = _full(fresh, fresh_optim)
    out["exact"] = all(torch.equal(a, b) for part in (0, 1) for a, b in zip(expected[part].values(),
                                                                            got[part].values()))
    out["resumed_step"] = fresh_state["step"]
    resumed.close()

    out["last_saved"] = manager.save(5, last_step=True)  # model only, in export_dtype
    manager.maybe_wait_for_saving()
    last = {k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in expected[0].items()}
    dcp.load(last, storage_reader=AtomicStorageReader(), checkpoint_id=f"{folder}/step-5")
    out["last_exact"] = all(torch.equal(last[k], v.to(torch.bfloat16)) for k, v in expected[0].items())
    manager.close()
    out["saved"] = saved
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_torchtitan_checkpointer_saves_resumes_and_keeps_latest_k(root, mode):
    results = assert_all_ok(run_world(_torchtitan_rank, 2, root, args=(mode,), timeout=180))
    for out in results:
        assert out["fresh_load"] is False
        assert out["saved"] == [False, True, False, True]  # interval=2
        assert out["load_step_4"] is True and out["latest_load"] is True and out["exact"]
        assert out["resumed_step"] == 4
        assert out["last_saved"] is True and out["last_exact"]
    # keep_latest_k=1 through retention, which counts committed steps only: a sync save of step 4 is committed
    # when torchtitan purges, so step 2 goes; an async one is still in flight, so step 2 (the last good one)
    # stays. torchtitan purges after interval saves, not after the last one. The crashed step 6 never counts.
    assert list_steps(root, f"ckpt_{mode}") == ([4, 5] if mode == "disabled" else [2, 4, 5])


def test_torchtitan_config_accepts_keep_latest_k_1_and_builds_our_manager():
    from dcp_atomic.integrations.torchtitan import AtomicCheckpointManager

    config = AtomicCheckpointManager.Config(enable=False, keep_latest_k=1)
    assert config.keep_latest_k == 1
    assert type(config.build(dataloader=None, model_parts=[], optimizers=None, lr_schedulers=None, states={},
                             sd_adapter=None)) is AtomicCheckpointManager


def _lightning_rank(ctx):
    from pytorch_lightning.callbacks import ModelCheckpoint

    from tests.helpers.lightning import _module_class, _same, _trainer, _weights

    pl, Module = _module_class("pytorch_lightning")
    dirpath = os.path.join(ctx.root, "ckpts")

    def callbacks():
        return [ModelCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_top_k=1, save_last=True)]

    canary = os.path.join(ctx.root, "pwned")
    if ctx.rank == 0:  # files in the checkpoint directory that are not ours are never unpickled, never in the way
        _plant_foreign_files(dirpath, canary)
    first = Module()
    _trainer(pl, ctx, 4, callbacks()).fit(first)
    saved = _weights(first)
    second = Module()
    resumed = _trainer(pl, ctx, 6, callbacks())
    resumed.fit(second, ckpt_path=os.path.join(dirpath, "last.ckpt"))
    return {"exact": _same(saved, second.at_start), "files": sorted(os.listdir(dirpath)),
            "global_step": resumed.global_step, "code_ran": os.path.exists(canary)}


@pytest.mark.slow
def test_lightning_trainer_saves_resumes_and_removes_through_the_library(root):
    results = assert_all_ok(run_world(_lightning_rank, 2, root, timeout=240))
    for out in results:
        assert out["exact"] and out["global_step"] == 6
        assert not out["code_ran"]
        assert out["files"] == ["epoch=0-step=6.ckpt", "foreign.ckpt", "last.ckpt", "lightning", "notes.ckpt",
                                "stock.ckpt"]  # pointers, the runs of each name, the planted foreign files
    # save_top_k=1 removed the runs of epoch=0-step=2 and 4 through retention, last.ckpt's run keeps step 6 only
    namespace = os.path.join(root, "ckpts", "lightning")
    runs = sorted(os.listdir(namespace))
    assert [r.split("-")[0] for r in runs] == ["epoch_0", "last.ckpt"], runs
    assert [list_steps(namespace, r) for r in runs] == [[6], [6]]


# -- Lightning reads only its own pointers, without unpickling; rank 0's failures reach every rank ---------


class _Exploit:
    def __init__(self, canary):
        self.canary = canary

    def __reduce__(self):
        return (os.system, (f"touch {self.canary}",))


def _plant_foreign_files(directory: str, canary: str) -> None:
    os.makedirs(directory, exist_ok=True)
    torch.save({"x": _Exploit(canary)}, os.path.join(directory, "foreign.ckpt"))
    with open(os.path.join(directory, "notes.ckpt"), "w") as f:
        f.write("hello, not a checkpoint\n")
    os.makedirs(os.path.join(directory, "stock.ckpt"), exist_ok=True)  # Lightning's own sharded checkpoints


def test_lightning_retirement_skips_foreign_files_without_unpickling_them(root):
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageWriter
    from dcp_atomic.integrations.lightning import _pointer, _retire_if_unreferenced, _write_pointer, checkpoint_id_for
    from dcp_atomic.format.layout import parse_checkpoint_id

    canary = os.path.join(root, "pwned")
    _plant_foreign_files(root, canary)
    last = os.path.join(root, "last.ckpt")
    ids = {step: checkpoint_id_for(last, step) for step in (5, 6)}
    for step, checkpoint_id in ids.items():
        dcp.save({"w": torch.ones(2)}, storage_writer=AtomicStorageWriter(), checkpoint_id=checkpoint_id)
    namespace, run, _ = parse_checkpoint_id(ids[6])
    for name in ("foreign.ckpt", "notes.ckpt", "stock.ckpt"):
        assert _pointer(os.path.join(root, name)) is None
    _write_pointer(last, {"global_step": 6}, ids[6])  # last.ckpt moved on to step 6
    _retire_if_unreferenced(root, ids[5])  # no file names step 5, last.ckpt names its run: the step goes
    assert not os.path.exists(canary), "retirement unpickled a foreign file and ran its code"
    assert list_steps(namespace, run) == [6]
    _retire_if_unreferenced(root, ids[5])  # already gone: nothing to do, no error
    _retire_if_unreferenced(root, ids[6])  # last.ckpt names it: kept
    assert list_steps(namespace, run) == [6]
    os.remove(last)
    _retire_if_unreferenced(root, ids[6])  # no file names the run any more: the whole run goes
    assert not os.path.exists(os.path.join(namespace, run)) and not os.path.exists(canary)


def test_lightning_file_is_published_atomically_and_its_directory_fsynced_after_the_rename(root, monkeypatch):
    """The file names the checkpoint to resume: its rename must survive a power loss, so its directory is fsynced
    after it (it once was not), and it is whole and readable (torch.load, and the record read without unpickling)."""
    from dcp_atomic.integrations.lightning import _pointer_record, _write_pointer

    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(source, target, **kwargs) -> None:
        events.append(("rename", os.fspath(target)))
        real_replace(source, target, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    directory = os.path.join(root, "ckpts")
    path = os.path.join(directory, "last.ckpt")
    _write_pointer(path, {"global_step": 6}, "the-checkpoint-id", {"save_id": "s1"})
    renamed = events.index(("rename", path))
    assert ("fsync", directory) in events[renamed:], events
    assert torch.load(path, weights_only=True)["global_step"] == 6
    assert _pointer_record(path)["save_id"] == "s1"
    assert os.listdir(directory) == ["last.ckpt"]  # no temp file left


def _lightning_failing_pointer_rank(ctx):
    """Rank 0 cannot publish Lightning's file: every rank must fail at that save, none may wait in a collective."""
    import time

    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ModelCheckpoint

    from dcp_atomic.integrations import lightning

    if ctx.rank == 0:
        def disk_full(*args, **kwargs):
            raise OSError(28, "No space left on device")

        lightning._write_pointer = disk_full

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 2)

        def configure_model(self):
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

        def training_step(self, batch, _):
            return self.net(batch).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.net.parameters(), lr=0.1)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.randn(16, 4), batch_size=4)

    trainer = pl.Trainer(accelerator="cpu", devices=2, max_steps=2, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=ctx.root,
                         strategy=lightning.AtomicModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1,
                                                                        timeout=20),
                         callbacks=[ModelCheckpoint(dirpath=os.path.join(ctx.root, "ckpts"), every_n_train_steps=2)])
    started = time.monotonic()
    try:
        trainer.fit(Module())
    except Exception as e:  # noqa: BLE001 - the test inspects what each rank got
        return {"error": type(e).__name__, "message": str(e), "seconds": time.monotonic() - started}
    return {"error": None}


@pytest.mark.slow
def test_lightning_pointer_failure_on_rank_0_fails_every_rank_at_once(root):
    results = assert_all_ok(run_world(_lightning_failing_pointer_rank, 2, root, timeout=120))
    for out in results:
        assert out["error"] == "CheckpointError" and "No space left on device" in out["message"], out
        assert "global rank 0" in out["message"] and out["seconds"] < 60, out


# -- torchtitan's "latest step" is scanned by global rank 0 alone and broadcast -------------------------


def _torchtitan_find_load_step_rank(ctx, folder):
    import types

    import torch.distributed as dist

    from dcp_atomic.errors import CheckpointError
    from dcp_atomic.integrations import torchtitan

    scans = []
    real = torchtitan.latest_step

    def counted(*args, **kwargs):
        scans.append(args)
        return 1 if ctx.rank == 1 else real(*args, **kwargs)  # rank 1 would see a stale listing (NFS caches)

    torchtitan.latest_step = counted
    manager = types.SimpleNamespace(folder=folder)
    found = torchtitan.AtomicCheckpointManager._find_load_step(manager)
    if ctx.rank == 0:
        with open(os.path.join(folder, "step_0000000002", "COMMITTED"), "w") as f:
            f.write("damaged")
    dist.barrier()
    try:  # a scan that fails on rank 0 fails every rank with rank 0's error, rather than leaving them waiting
        torchtitan.AtomicCheckpointManager._find_load_step(manager)
        failure = None
    except CheckpointError as e:
        failure = type(e).__name__
    return {"found": found, "scans": len(scans), "failure": failure}


def test_torchtitan_latest_step_is_scanned_by_rank_0_and_broadcast(root):
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageWriter

    folder = os.path.join(root, "ckpt")
    for step in (1, 2):
        dcp.save({"w": torch.ones(2)}, storage_writer=AtomicStorageWriter(), checkpoint_id=f"{folder}/step-{step}")
    results = assert_all_ok(run_world(_torchtitan_find_load_step_rank, 2, root, args=(folder,), timeout=90))
    assert [r["found"] for r in results] == [2, 2], results
    assert [r["scans"] for r in results] == [2, 0], "only global rank 0 may list the checkpoint folder"
    assert [r["failure"] for r in results] == ["CorruptCheckpointError"] * 2, results
