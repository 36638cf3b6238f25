"""The manager's faces: its package imports the manager only on first use, and its options objects."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest


def test_importing_the_tier_policy_does_not_run_the_manager():
    code = ("import sys, dcp_atomic.manager.tiering, dcp_atomic.manager.options; "
            "print('dcp_atomic.manager.checkpoint_manager' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"
    from dcp_atomic import CheckpointManager
    from dcp_atomic.manager import CheckpointManager as same
    from dcp_atomic.manager.checkpoint_manager import CheckpointManager as itself

    assert CheckpointManager is same is itself


# -- options objects: the new form, the deprecated flat keywords -------------------------------------------------


def _two_tier_run(root, options):
    """Save steps 1 and 2 (step 2 durable) in one process, load the latest; (steps per tier, loaded, saved steps)."""
    import torch

    from dcp_atomic import CheckpointManager

    saved = []
    with CheckpointManager(os.path.join(root, "durable"), "run", timeout=20, **options(saved.append)) as manager:
        for step in (1, 2):
            manager.save(step, {"w": torch.arange(4.0) + step}, durable=step == 2)
        manager.wait()
        steps = (manager.steps(tier="local"), manager.steps(tier="durable"), manager.durable_every)
        state = {"w": torch.zeros(4)}
        loaded = (manager.load(state), manager.restored_from["tier"], state["w"].tolist())
    return steps, loaded, [stats["step"] for stats in saved]


def test_the_options_objects_and_the_deprecated_flat_keywords_run_the_same_manager(tmp_path):
    from dcp_atomic import Callbacks, LocalTierOptions

    def grouped(saved):
        return {"local": LocalTierOptions(str(tmp_path / "new" / "local"), replicas=0, keep_local=1,
                                          durable_every=None),
                "callbacks": Callbacks(on_saved=saved)}

    def flat(saved):
        return {"local_root": str(tmp_path / "old" / "local"), "replicas": 0, "keep_local": 1, "durable_every": None,
                "on_saved": saved}

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the new form warns of nothing
        new = _two_tier_run(str(tmp_path / "new"), grouped)
    with pytest.warns(DeprecationWarning) as caught:
        old = _two_tier_run(str(tmp_path / "old"), flat)
    said = {str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)}
    assert any("CheckpointManager(keep_local=...) is deprecated" in m and "local=LocalTierOptions(...)" in m
               for m in said), said
    assert any("CheckpointManager(on_saved=...) is deprecated" in m and "callbacks=Callbacks(...)" in m
               for m in said), said
    assert new == old == (([2], [2], None), (2, "local", [2.0, 3.0, 4.0, 5.0]), [1, 2]), (new, old)


def test_a_group_given_both_ways_is_an_argument_error_and_options_check_themselves(tmp_path):
    from dcp_atomic import ArgumentError, Callbacks, CheckpointManager, ConfigurationError, LocalTierOptions

    root = str(tmp_path / "durable")
    with pytest.warns(DeprecationWarning), pytest.raises(ArgumentError, match=r"local=.*local_root"):
        CheckpointManager(root, "run", local=LocalTierOptions(str(tmp_path / "l")), local_root=str(tmp_path / "l"))
    with pytest.warns(DeprecationWarning), pytest.raises(ArgumentError, match=r"callbacks=.*on_failed"):
        CheckpointManager(root, "run", callbacks=Callbacks(), on_failed=print)
    with pytest.raises(ArgumentError, match=r"LocalTierOptions\(keep_local=\.\.\.\) must be an int >= 1"):
        LocalTierOptions(str(tmp_path / "l"), keep_local=0)
    with pytest.raises(ArgumentError, match=r"LocalTierOptions\(durable_every=\.\.\.\)"):
        LocalTierOptions(str(tmp_path / "l"), durable_every=0)
    default, explicit = LocalTierOptions("/l"), LocalTierOptions("/l", durable_every=None)
    assert (default.durable_every, default.durable_every_given) == (1, False)
    assert (explicit.durable_every, explicit.durable_every_given) == (None, True)
    with pytest.warns(DeprecationWarning), pytest.raises(ConfigurationError, match="durable_every=2 needs local_root"):
        CheckpointManager(root, "run", durable_every=2)
