"""The README's first command runs the demo: it must do what the README says it does."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.timeout(420)
def test_demo_kills_a_rank_mid_save_and_resumes_at_another_tp_size(tmp_path):
    command = [os.path.join(os.path.dirname(sys.executable), "dcp-atomic"), "demo", "--root", str(tmp_path / "demo")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=400, cwd=tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "checkpoint step 12 FAILED, nothing committed: RankFailureError" in out and "silent rank(s): 3" in out, out
    assert "committed steps: [4, 8]; latest = 8: checkpoint 12 never became visible" in out, out
    assert "resumed from committed step 8" in out and "allow_reshard=True" in out, out
    assert "committed steps: [4, 8, 12, 16, 20]; latest = 20" in out and "demo finished: OK" in out, out
