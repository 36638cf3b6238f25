"""Onto the strategy from stock Lightning: a job that saved with stock ``ModelParallelStrategy`` (a directory
``<name>.ckpt/`` holding a stock DCP checkpoint and ``meta.pt``) resumes under dcp_atomic's strategy with
``fit(ckpt_path=<that directory>)``, exactly (weights, optimizer state, step, epoch), and saves dcp_atomic
checkpoints from then on, in the same ``dirpath``: the stock directories its callbacks rotate out or re-save go,
as stock Lightning would remove or overwrite them.  Anything else at ``ckpt_path`` is refused by name."""

from __future__ import annotations

import logging
import os

import pytest

from tests.harness import assert_all_ok, run_world
from tests.helpers.lightning import _module_class, _same, _trainer, _weights

pytestmark = pytest.mark.slow


def _full_state(module) -> dict:
    """The module's and its optimizer's unsharded state (every rank takes part: FSDP gathers)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
    from torch.utils._pytree import tree_map

    options = StateDictOptions(full_state_dict=True)
    state = {"state_dict": get_model_state_dict(module, options=options),
             "optimizer_0": get_optimizer_state_dict(module, module.optimizers().optimizer, options=options)}
    return tree_map(lambda v: v.detach().clone() if hasattr(v, "detach") else v, state)  # Adam's step: in place


def _leaves(obj, prefix=""):
    if isinstance(obj, dict):
        return {k: v for key, value in obj.items() for k, v in _leaves(value, f"{prefix}{key}.").items()}
    if isinstance(obj, (list, tuple)):
        return {k: v for i, value in enumerate(obj) for k, v in _leaves(value, f"{prefix}{i}.").items()}
    return {prefix.rstrip("."): obj}


def _differences(a: dict, b: dict) -> list[str]:
    import torch

    a, b = _leaves(a), _leaves(b)
    bad = sorted(set(a) ^ set(b))
    for key in set(a) & set(b):
        x, y = a[key], b[key]
        same = torch.equal(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) else x == y
        if not same:
            bad.append(key)
    return bad


def _from_stock(ctx, package):
    import importlib
    import shutil

    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from dcp_atomic import CheckpointError
    from dcp_atomic.integrations.lightning import _pointer_record, checkpoint_id_of
    from dcp_atomic.format.layout import MARKER, parse_checkpoint_id, step_dir_name

    pl, Module = _module_class(package)
    ModelCheckpoint = importlib.import_module(f"{package}.callbacks").ModelCheckpoint
    ModelParallelStrategy = importlib.import_module(f"{package}.strategies").ModelParallelStrategy  # stock

    class Recording(Module):
        def on_train_start(self):
            super().on_train_start()
            self.state_at_start = _full_state(self)
            self.progress_at_start = (self.trainer.global_step, self.trainer.current_epoch)

    def stock_trainer(max_steps, callbacks=()):
        return pl.Trainer(accelerator="cpu", devices=2, max_steps=max_steps, logger=False, enable_progress_bar=False,
                          enable_model_summary=False, default_root_dir=ctx.root, callbacks=list(callbacks),
                          enable_checkpointing=bool(callbacks),
                          strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1))

    def callbacks():  # top-1 by step and last.ckpt: the resumed run rotates out and re-saves stock directories
        return [ModelCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_last=True)]

    dirpath, copy = os.path.join(ctx.root, "ckpts"), os.path.join(ctx.root, "stock-copy")
    stock_trainer(4, callbacks()).fit(Module(seed=0, data_seed=1))  # 8 batches a rank an epoch: mid-epoch 0
    out = {"stock_files": sorted(os.listdir(dirpath))}
    if ctx.rank == 0:
        shutil.copytree(dirpath, copy)
        dcp_to_torch_save(os.path.join(copy, "last.ckpt"), os.path.join(ctx.root, "stock.pt"))
    dist.barrier()
    saved = torch.load(os.path.join(ctx.root, "stock.pt"), weights_only=False)  # the stock checkpoint's tensors

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("dcp_atomic").addHandler(handler)
    try:
        resumed = Recording(seed=99)
        trainer = _trainer(pl, ctx, 10, callbacks())
        trainer.fit(resumed, ckpt_path=os.path.join(dirpath, "last.ckpt"))
    finally:
        logging.getLogger("dcp_atomic").removeHandler(handler)
    out["weights"] = _differences(resumed.state_at_start["state_dict"], saved["state_dict"])
    out["optimizer"] = _differences(resumed.state_at_start["optimizer_0"], saved["optimizer_0"])
    out["progress"] = (resumed.progress_at_start, trainer.global_step, trainer.current_epoch)
    out["no_digest_warnings"] = [r.getMessage() for r in records if "no digests" in r.getMessage()]
    out["files"] = sorted(os.listdir(dirpath))
    committed = {}
    for name in out["files"]:
        path = os.path.join(dirpath, name)
        record = _pointer_record(path) if os.path.isfile(path) else None
        if record is not None:  # the COMMITTED marker of the step the file names
            step_root, run_id, step = parse_checkpoint_id(checkpoint_id_of(path, record))
            committed[name] = os.path.isfile(os.path.join(step_root, run_id, step_dir_name(step), MARKER))
        else:
            committed[name] = False
    out["committed"] = committed
    # the same continuation under stock Lightning, from the untouched copy: the same weights at step 10
    stock_on = Module(seed=42)
    stock_trainer(10).fit(stock_on, ckpt_path=os.path.join(copy, "last.ckpt"))
    out["same_as_stock_continuation"] = _same(_weights(stock_on), _weights(resumed))
    out["stock_progress"] = (stock_on.trainer.global_step, stock_on.trainer.current_epoch)
    # and the new files resume as any dcp_atomic file does
    again = Recording(seed=7)
    _trainer(pl, ctx, 11).fit(again, ckpt_path=os.path.join(dirpath, "last.ckpt"))
    out["last_resumes"] = (_same(again.at_start, _weights(resumed)), again.progress_at_start)
    # anything else: refused by name, saying what was expected
    refusals = {}
    shards = sorted(n for n in os.listdir(os.path.join(copy, "last.ckpt")) if n.endswith(".distcp"))
    for name, files in (("empty.ckpt", ()), ("half-copied.ckpt", ("meta.pt",)), ("dcp-only.ckpt", (".metadata",)),
                        ("shard-lost.ckpt", ("meta.pt", ".metadata", *shards[:-1]))):
        bad = os.path.join(ctx.root, name)
        if ctx.rank == 0:
            os.makedirs(bad)
            for file in files:
                shutil.copy2(os.path.join(copy, "last.ckpt", file), bad)
        dist.barrier()
        try:
            _trainer(pl, ctx, 11).fit(Module(seed=3), ckpt_path=bad)
            refusals[name] = "loaded"
        except CheckpointError as e:
            refusals[name] = e.message
    out["refusals"] = refusals
    return out


@pytest.mark.parametrize("package", ["pytorch_lightning", "lightning.pytorch"])
def test_fit_resumes_from_a_stock_model_parallel_checkpoint_and_saves_dcp_atomic_checkpoints_on(root, package):
    for rank, out in enumerate(assert_all_ok(run_world(_from_stock, 2, root, args=(package,), timeout=300))):
        assert out["stock_files"] == ["epoch=0-step=4.ckpt", "last.ckpt"]
        assert not out["weights"] and not out["optimizer"], out  # torch.equal, every tensor of the stock checkpoint
        assert out["progress"] == ((4, 0), *out["stock_progress"]) and out["stock_progress"][0] == 10, out
        assert out["same_as_stock_continuation"]  # trained on exactly as stock resuming its own checkpoint
        # stock's epoch=0-step=4.ckpt rotated out, its last.ckpt re-saved: every file now a dcp_atomic commit
        assert out["files"] == ["epoch=1-step=10.ckpt", "last.ckpt", "lightning"], out["files"]
        assert out["committed"] == {"epoch=1-step=10.ckpt": True, "last.ckpt": True, "lightning": False}
        assert out["last_resumes"] == (True, (10, 1)), out["last_resumes"]  # the file says epoch=1-step=10
        assert len(out["no_digest_warnings"]) == (1 if rank == 0 else 0), out["no_digest_warnings"]
        refusals = out["refusals"]
        lost = refusals.pop("shard-lost.ckpt")  # recognised, but a shard is gone: DCP's refusal, typed and named
        assert os.path.join(root, "shard-lost.ckpt") in lost and "could not be read from it" in lost, lost
        for name, message in refusals.items():
            assert os.path.join(root, name) in message and "meta.pt" in message and ".metadata" in message, message
