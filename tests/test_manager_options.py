"""The manager's faces: its package imports the manager only on first use, and its options objects."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_tier_policy_does_not_run_the_manager():
    code = ("import sys, dcp_atomic.manager.tiering; "
            "print('dcp_atomic.manager.checkpoint_manager' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"
    from dcp_atomic import CheckpointManager
    from dcp_atomic.manager import CheckpointManager as same
    from dcp_atomic.manager.checkpoint_manager import CheckpointManager as itself

    assert CheckpointManager is same is itself
