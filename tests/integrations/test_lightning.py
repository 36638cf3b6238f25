"""Lightning the way its users run it: a ``Trainer`` with ``ModelCheckpoint`` callbacks and ``ckpt_path``, over a
job's life — two fresh runs into one ``dirpath``, a weights-only and a full checkpoint at the same step, a rollback
to an earlier file and training on, ``ckpt_path="last"``, ``trainer.save_checkpoint`` and ``load_from_checkpoint``
— each file must load the state of the run and moment that wrote it.  Both ``pytorch_lightning`` and
``lightning.pytorch``."""

from __future__ import annotations

import os

import pytest
import torch

from tests.harness import assert_all_ok, run_world
from tests.helpers.lightning import _module_class, _resumed_weights, _same, _trainer, _weights

pytestmark = pytest.mark.slow


def _two_runs_one_dirpath(ctx, package):
    pl, Module = _module_class(package)
    callbacks_module = __import__(f"{package}.callbacks", fromlist=["ModelCheckpoint"])
    dirpath = os.path.join(ctx.root, "ckpts")

    def callbacks():  # weights-only every step and first: it fires before the full checkpoint at steps 2 and 4
        return [callbacks_module.ModelCheckpoint(dirpath=dirpath, filename="weights-{step}", every_n_train_steps=1,
                                                 save_top_k=-1, save_weights_only=True),
                callbacks_module.ModelCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_top_k=-1,
                                                 save_last=True)]

    runs = {}
    for name, seed, data_seed in (("first", 0, 1), ("second", 5, 6)):
        module = Module(seed=seed, data_seed=data_seed)
        _trainer(pl, ctx, 4, callbacks()).fit(module)
        runs[name] = _weights(module)
    files = sorted(n for n in os.listdir(dirpath) if n.endswith(".ckpt"))
    out = {"files": files, "runs_differ": not _same(runs["first"], runs["second"])}
    # each file loads its own run's state; the full one with its optimizer (resuming needs it)
    for name, file in (("first", "epoch=0-step=4.ckpt"), ("second", "epoch=0-step=4-v1.ckpt"),
                       ("first", "last.ckpt"), ("second", "last-v1.ckpt")):
        out[file] = _same(_resumed_weights(pl, Module, ctx, os.path.join(dirpath, file), 5), runs[name])
    # weights-only files hold the weights; load_from_checkpoint reads them outside any Trainer state
    for name, file in (("first", "weights-step=4.ckpt"), ("second", "weights-step=4-v1.ckpt")):
        loaded = Module.load_from_checkpoint(os.path.join(dirpath, file))
        out[file] = _same(_weights(loaded), runs[name])
    return out


@pytest.mark.parametrize("package", ["pytorch_lightning", "lightning.pytorch"])
def test_two_runs_in_one_dirpath_and_weights_only_beside_full_each_load_their_own_state(root, package):
    for out in assert_all_ok(run_world(_two_runs_one_dirpath, 2, root, args=(package,), timeout=300)):
        assert out["runs_differ"]
        assert out["files"] == ["epoch=0-step=2-v1.ckpt", "epoch=0-step=2.ckpt", "epoch=0-step=4-v1.ckpt",
                                "epoch=0-step=4.ckpt", "last-v1.ckpt", "last.ckpt"] + [
                                f"weights-step={n}{v}.ckpt" for n in range(1, 5) for v in ("-v1", "")]
        bad = [file for file, ok in out.items() if file.endswith(".ckpt") and ok is not True]
        assert not bad, f"files that did not load their own run's state: {bad}"


def _rollback_and_last(ctx):
    pl, Module = _module_class("pytorch_lightning")
    from pytorch_lightning.callbacks import ModelCheckpoint

    dirpath = os.path.join(ctx.root, "ckpts")

    def callbacks():
        return [ModelCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_top_k=-1, save_last=True)]

    first = Module(seed=0, data_seed=1)
    _trainer(pl, ctx, 6, callbacks()).fit(first)
    at_6 = _weights(first)
    # a loss spike: go back to step 2 and train on other data; the files of steps 4 and 6 are re-saved
    rolled = Module(seed=0, data_seed=7)
    trainer = _trainer(pl, ctx, 6, callbacks())
    trainer.fit(rolled, ckpt_path=os.path.join(dirpath, "epoch=0-step=2.ckpt"))
    rolled_6 = _weights(rolled)
    manual = os.path.join(dirpath, "manual.ckpt")
    trainer.save_checkpoint(manual)
    return {
        "rolled_started_at_2": trainer.global_step == 6 and rolled.at_start is not None,
        "branches_differ": not _same(at_6, rolled_6),
        # the restored callback state predates last.ckpt, so Lightning versions the new branch's last file
        "last_v1_is_the_new_branch": _same(_resumed_weights(pl, Module, ctx, os.path.join(dirpath, "last-v1.ckpt"),
                                                            7), rolled_6),
        "last_is_the_old_branch": _same(_resumed_weights(pl, Module, ctx, os.path.join(dirpath, "last.ckpt"), 7),
                                        at_6),
        "manual": _same(_resumed_weights(pl, Module, ctx, manual, 7), rolled_6),
        "old_step_6_file": _same(_resumed_weights(pl, Module, ctx, os.path.join(dirpath, "epoch=0-step=6.ckpt"), 7),
                                 at_6),
        "files": sorted(n for n in os.listdir(dirpath) if n.endswith(".ckpt")),
    }


def test_rollback_to_an_earlier_file_trains_on_and_last_follows_the_new_branch(root):
    for out in assert_all_ok(run_world(_rollback_and_last, 2, root, timeout=300)):
        assert out["rolled_started_at_2"] and out["branches_differ"]
        assert out["last_v1_is_the_new_branch"] and out["last_is_the_old_branch"] and out["manual"], out["files"]
        assert out["old_step_6_file"]  # Lightning versioned the new branch's names: the old file keeps its state
        assert {"epoch=0-step=6-v1.ckpt", "last.ckpt", "last-v1.ckpt"} <= set(out["files"])


def _ckpt_path_last(ctx):
    pl, Module = _module_class("pytorch_lightning")
    from pytorch_lightning.callbacks import ModelCheckpoint

    dirpath = os.path.join(ctx.root, "ckpts")
    first = Module(seed=0)
    _trainer(pl, ctx, 4, [ModelCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_last=True)]).fit(first)
    resumed = Module(seed=3)
    trainer = _trainer(pl, ctx, 6, [ModelCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_last=True)])
    trainer.fit(resumed, ckpt_path="last")
    return _same(resumed.at_start, _weights(first)), trainer.global_step


def test_ckpt_path_last_resumes_from_the_last_commit(root):
    for exact, global_step in assert_all_ok(run_world(_ckpt_path_last, 2, root, timeout=240)):
        assert exact and global_step == 6


def test_checkpoint_ids_keep_names_apart():
    from dcp_atomic.integrations.lightning import checkpoint_id_for
    from dcp_atomic.format.layout import parse_checkpoint_id

    ids = {checkpoint_id_for(f"/ckpts/{name}", 4) for name in ("epoch=0-step=4.ckpt", "epoch_0-step_4.ckpt",
                                                               "last.ckpt", "last-v1.ckpt", "a" * 300)}
    assert len(ids) == 5
    for checkpoint_id in ids:
        root, run_id, step = parse_checkpoint_id(checkpoint_id)
        assert root == "/ckpts/lightning" and step == 4


def _ckpt_path_best(ctx):
    pl, Module = _module_class("pytorch_lightning")
    from pytorch_lightning.callbacks import ModelCheckpoint

    class Validated(Module):
        def validation_step(self, batch, _):
            loss = self.net(batch).pow(2).mean()
            self.log("val_loss", loss, sync_dist=True)
            return loss

        def val_dataloader(self):
            torch.manual_seed(11)
            return torch.utils.data.DataLoader(torch.randn(16, 8), batch_size=4)

    best = ModelCheckpoint(dirpath=os.path.join(ctx.root, "ckpts"), monitor="val_loss", mode="min", save_top_k=2)
    trainer = _trainer(pl, ctx, 8, [best], val_check_interval=2, check_val_every_n_epoch=None)
    trainer.fit(Validated(data_seed=1))
    (metrics,) = trainer.validate(ckpt_path="best", verbose=False)  # loads the best file through the strategy
    return {"best_score": float(best.best_model_score), "validated": metrics["val_loss"],
            "best": os.path.basename(best.best_model_path),
            "kept": sorted(n for n in os.listdir(best.dirpath) if n.endswith(".ckpt"))}


def test_ckpt_path_best_loads_the_best_checkpoint_top_k_keeps_two(root):
    for out in assert_all_ok(run_world(_ckpt_path_best, 2, root, timeout=240)):
        assert out["validated"] == out["best_score"], out  # the weights loaded are the ones that scored best
        assert out["best"] in out["kept"] and len(out["kept"]) == 2, out
    namespace = os.path.join(root, "ckpts", "lightning")
    assert len(os.listdir(namespace)) == 2  # the runs of the rotated-out files are gone


def _copied_and_moved(ctx):
    """``cp -a`` of a dirpath, then the original's step-4 file re-saved with other weights (a rollback that saves
    the same name at the same step): the archive resumes its own state; a moved archive too; the file copied alone
    (its state is not beside it) names the original's step-4 save, which is gone, and says so at once."""
    import shutil

    import torch.distributed as dist

    pl, Module = _module_class("pytorch_lightning")
    from pytorch_lightning.callbacks import ModelCheckpoint

    from dcp_atomic import CheckpointNotFoundError

    dirpath, archive = os.path.join(ctx.root, "ckpts"), os.path.join(ctx.root, "archive")
    first = Module(seed=0, data_seed=1)
    _trainer(pl, ctx, 4, [ModelCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_top_k=-1)]).fit(first)
    at_4 = _weights(first)
    name = "epoch=0-step=4.ckpt"
    if ctx.rank == 0:
        shutil.copytree(dirpath, archive, symlinks=True)  # cp -a
    dist.barrier()
    rolled = Module(seed=0, data_seed=7)  # back to step 2, other data, and step 4 saved again under the same name
    trainer = _trainer(pl, ctx, 4)
    trainer.fit(rolled, ckpt_path=os.path.join(dirpath, "epoch=0-step=2.ckpt"))
    trainer.save_checkpoint(os.path.join(dirpath, name))
    out = {"branches_differ": not _same(at_4, _weights(rolled)),
           "original": _same(_resumed_weights(pl, Module, ctx, os.path.join(dirpath, name), 5), _weights(rolled)),
           "archive": _same(_resumed_weights(pl, Module, ctx, os.path.join(archive, name), 5), at_4)}
    moved, alone = os.path.join(ctx.root, "moved"), os.path.join(ctx.root, "alone")
    if ctx.rank == 0:
        os.rename(archive, moved)
        os.makedirs(alone)
        shutil.copy2(os.path.join(moved, name), alone)
    dist.barrier()
    out["moved"] = _same(_resumed_weights(pl, Module, ctx, os.path.join(moved, name), 5), at_4)
    if ctx.rank == 0:  # outside a Trainer, as users call it: the moved file's own state, and no noise
        import logging
        import warnings

        records: list[logging.LogRecord] = []
        handler = logging.Handler()
        handler.emit = records.append
        logging.getLogger("dcp_atomic").addHandler(handler)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                loaded = Module.load_from_checkpoint(os.path.join(moved, name))
        finally:
            logging.getLogger("dcp_atomic").removeHandler(handler)
        out["hooks_moved"] = _same(_weights(loaded), at_4)
        out["noise"] = [str(w.message) for w in caught if "torch.distributed is disabled" in str(w.message)] + [
            r.getMessage() for r in records if r.levelno >= logging.WARNING]
    # a save in the moved copy that replaces one of its files retires the copy's old state, not the original's
    on = _trainer(pl, ctx, 5)
    on.fit(Module(seed=3), ckpt_path=os.path.join(moved, name))
    on.save_checkpoint(os.path.join(moved, "epoch=0-step=2.ckpt"))
    out["original_kept"] = _same(_resumed_weights(pl, Module, ctx, os.path.join(dirpath, "epoch=0-step=2.ckpt"), 5),
                                 rolled.at_start)
    try:
        _resumed_weights(pl, Module, ctx, os.path.join(alone, name), 5)
        out["alone"] = "loaded"
    except CheckpointNotFoundError as e:
        out["alone"] = e.message
    if ctx.rank == 0:
        try:
            Module.load_from_checkpoint(os.path.join(alone, name))
            out["alone_hooks"] = "loaded"
        except BaseException as e:  # noqa: BLE001 - DCP wraps it
            out["alone_hooks"] = f"{type(e).__name__}: {e}"
    return out


def test_a_copied_dirpath_resumes_its_own_state_a_moved_one_loads_and_a_file_copied_alone_says_its_save_is_gone(root):
    for rank, out in enumerate(assert_all_ok(run_world(_copied_and_moved, 2, root, timeout=420))):
        assert out["branches_differ"] and out["original"], out
        assert out["archive"], "the copy resumed the original's re-saved state"
        assert out["moved"] and out["original_kept"], out
        assert "is gone: the step was saved again since" in out["alone"], out["alone"]
        if rank == 0:
            assert "is gone: the step was saved again since" in out["alone_hooks"], out["alone_hooks"]
            assert out["hooks_moved"] and not out["noise"], out
