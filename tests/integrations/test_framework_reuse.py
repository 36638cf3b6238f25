"""``reuse=`` through the frameworks: the Lightning strategy (a re-saved ``last.ckpt``; every
file of a directory with the local tier) and torchtitan's checkpoint config store a frozen layer once and link it
after, and every step still loads exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.harness import assert_all_ok, run_world
from tests.helpers.integrations import _sharded_model, _Stateful, _train_step
from tests.helpers.lightning import _module_class, _resumed_weights, _same, _weights

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _reuse_of(root: str, run_id: str, step: int) -> tuple[int, int]:
    """(bytes_written, bytes_reused) of a committed step, as ``dcp-atomic show --json`` reports them."""
    shown = subprocess.run([sys.executable, "-m", "dcp_atomic", "show", root, run_id, str(step), "--json"],
                           env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    stats = json.loads(shown.stdout)["stats"]
    return (sum(s.get("bytes_written", s["bytes"]) for s in stats), sum(s.get("bytes_reused", 0) for s in stats))


def _frozen_first_layer(module) -> None:
    for parameter in module.net[0].parameters():
        parameter.requires_grad_(False)


def _lightning_last(ctx, reuse):
    pl, Module = _module_class("lightning.pytorch")
    from lightning.pytorch.callbacks import ModelCheckpoint

    from dcp_atomic.integrations.lightning import strategy_class

    class Frozen(Module):
        def configure_optimizers(self):
            _frozen_first_layer(self)
            return torch.optim.Adam([p for p in self.net.parameters() if p.requires_grad], lr=0.01)

    dirpath = os.path.join(ctx.root, "ckpts")
    module = Frozen(seed=0)
    strategy = strategy_class("lightning.pytorch")(data_parallel_size=2, tensor_parallel_size=1, timeout=30,
                                                   reuse=reuse)
    pl.Trainer(accelerator="cpu", devices=2, max_steps=6, logger=False, enable_progress_bar=False,
               enable_model_summary=False, default_root_dir=ctx.root, strategy=strategy,
               callbacks=[ModelCheckpoint(dirpath=dirpath, every_n_train_steps=2, save_last=True)]).fit(module)
    resumed = _resumed_weights(pl, Frozen, ctx, os.path.join(dirpath, "last.ckpt"), 7)
    return _same(resumed, _weights(module))


@pytest.mark.parametrize("reuse", [True, False])
def test_lightning_reuse_links_the_frozen_layer_of_a_re_saved_last_ckpt_and_it_loads_exactly(root, reuse):
    from dcp_atomic import list_steps
    from dcp_atomic.integrations.lightning import checkpoint_id_for

    for exact in assert_all_ok(run_world(_lightning_last, 2, root, args=(reuse,), timeout=240)):
        assert exact
    run_dir = os.path.dirname(checkpoint_id_for(os.path.join(root, "ckpts", "last.ckpt"), 6))
    lightning_root, run_id = os.path.split(run_dir)
    # last.ckpt saved at steps 2, 4 and 6, each earlier one retired once the file names the next: the save of step 4
    # wrote the unchanged items into a stable file (its base, step 2, had none), the save of step 6 links it
    (step,) = list_steps(lightning_root, run_id)
    assert step == 6
    written, reused = _reuse_of(lightning_root, run_id, step)
    frozen = (8 * 16 + 16) * 4  # the first Linear's weight and bias, float32, over both ranks
    if reuse:
        assert reused >= frozen, (written, reused)
    else:
        assert reused == 0, (written, reused)


def _torchtitan_job(ctx, reuse):
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    from dcp_atomic.integrations.torchtitan import AtomicCheckpointManager

    model = _sharded_model(0)
    for parameter in model[0].parameters():
        parameter.requires_grad_(False)
    optim = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.01)
    train_state = {"step": 0}

    def build():
        cfg = AtomicCheckpointManager.Config(enable=True, folder="ckpt", interval=1, async_mode="disabled",
                                             timeout=20, reuse=reuse)
        optimizers = _Stateful(lambda: get_optimizer_state_dict(model, optim),
                               lambda sd: set_optimizer_state_dict(model, optim, sd))
        states = {"train_state": _Stateful(lambda: {"step": torch.tensor(train_state["step"])},
                                           lambda sd: train_state.update(step=int(sd["step"])))}
        return cfg.build(dataloader=None, model_parts=[model], optimizers=optimizers,
                         lr_schedulers=_Stateful(lambda: {}, lambda sd: None), states=states, sd_adapter=None,
                         base_folder=ctx.root)

    manager = build()
    for step in (1, 2, 3):  # step 2 writes the unchanged items into a stable file (step 1 had none), step 3 links it
        _train_step(model, optim, step)
        train_state["step"] = step
        manager.save(step)
    manager.close()
    saved = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    for parameter in model.parameters():  # load over other values: what load restores is what step 3 held
        with torch.no_grad():
            parameter.zero_()
    manager = build()
    manager.load(step=3)
    manager.close()
    return all(torch.equal(saved[k], v.full_tensor()) for k, v in model.state_dict().items())


@pytest.mark.parametrize("reuse", [True, False])
def test_torchtitan_reuse_from_its_config_links_the_frozen_layer_and_loads_exactly(root, reuse):
    for exact in assert_all_ok(run_world(_torchtitan_job, 2, root, args=(reuse,), timeout=240)):
        assert exact
    frozen = (8 * 16 + 16) * 4
    written, reused = _reuse_of(root, "ckpt", 3)
    if reuse:
        assert reused >= frozen, (written, reused)
    else:
        assert reused == 0, (written, reused)
