"""Lightning's per-file calls (real process groups, gloo, world 2): re-saving a file name without the ``.ckpt``
suffix keeps the state it now names, and ``load_from_checkpoint`` on rank 0 alone does not wait for the other ranks."""

from __future__ import annotations

import os

import pytest

from tests.harness import assert_all_ok, run_world

pytestmark = pytest.mark.slow


# -- Lightning -----------------------------------------------------------------------------------------------


def _lightning_module():
    from tests.helpers.lightning import _module_class

    return _module_class("pytorch_lightning")


def _resave_non_ckpt_name(ctx):
    """``trainer.save_checkpoint("final.pt")`` at step 2, then again at step 4 (a later fit): the name moves on."""
    from dcp_atomic import list_steps
    from dcp_atomic.integrations.lightning import _pointer
    from dcp_atomic.format.layout import parse_checkpoint_id
    from tests.helpers.lightning import _resumed_weights, _same, _trainer, _weights

    pl, Module = _lightning_module()
    final = os.path.join(ctx.root, "models", "final.pt")
    module = Module(seed=0)
    trainer = _trainer(pl, ctx, 2)
    trainer.fit(module)
    trainer.save_checkpoint(final)
    trainer = _trainer(pl, ctx, 4)
    trainer.fit(module)  # a fresh Trainer: global_step counts to 4 again
    trainer.save_checkpoint(final)
    at_4 = _weights(module)
    root, run_id, step = parse_checkpoint_id(_pointer(final))
    return {"pointer_step": step, "committed": list_steps(root, run_id),
            "loads": _same(_resumed_weights(pl, Module, ctx, final, 5), at_4)}


def test_resaving_a_name_without_the_ckpt_suffix_keeps_the_state_it_now_names(root):
    """Re-saving one name at a new step retires the step it named before.  Only ``*.ckpt`` files were asked
    which steps they name, so ``final.pt``'s own new pointer was not seen and its whole run was removed, the
    step just committed included: the file then named a checkpoint that no longer existed."""
    for out in assert_all_ok(run_world(_resave_non_ckpt_name, 2, root, timeout=240)):
        assert out["pointer_step"] == 4 and out["committed"] == [4] and out["loads"], out


def _load_from_checkpoint_on_rank_zero(ctx):
    """The usual end of a script: rank 0 alone evaluates the best file; rank 1 waits for it outside any collective."""
    from datetime import timedelta

    import torch.distributed as dist
    from pytorch_lightning.callbacks import ModelCheckpoint

    from tests.helpers.lightning import _same, _trainer, _weights

    pl, Module = _lightning_module()
    dirpath = os.path.join(ctx.root, "ckpts")
    module = Module(seed=0)
    _trainer(pl, ctx, 2, [ModelCheckpoint(dirpath=dirpath, every_n_train_steps=2)]).fit(module)
    trained = _weights(module)
    store = dist.distributed_c10d._get_default_store()
    if ctx.rank == 0:
        try:
            loaded = Module.load_from_checkpoint(os.path.join(dirpath, "epoch=0-step=2.ckpt"))
            return _same(_weights(loaded), trained)
        finally:
            store.set("review/evaluated", "1")
            store.wait(["review/acknowledged"], timedelta(seconds=60))  # rank 0 hosts the store: outlive the waiter
    store.wait(["review/evaluated"], timedelta(seconds=60))
    store.set("review/acknowledged", "1")
    return True


def test_load_from_checkpoint_on_rank_zero_alone_does_not_wait_for_the_other_ranks(root):
    """``Module.load_from_checkpoint`` is a per-process call in Lightning (it unpickles one file), but with a
    process group initialised the hooks loaded through DCP's collectives: rank 0 alone hung until the group's
    timeout, then failed with gloo's untyped error."""
    for ok in assert_all_ok(run_world(_load_from_checkpoint_on_rank_zero, 2, root, timeout=180, pg_timeout=20)):
        assert ok is True
