"""The memory tier's kill campaign (P16), a few rounds of it: each round a world of 4 ranks on 2 simulated nodes
restores, is checked against the witness files, then snapshots every step until a rank or a node is killed
(``testbed/memory_campaign.py`` says what is checked and why; ``benchmarks/memory_campaign.py`` runs 100+ rounds)."""

from __future__ import annotations

import pytest

from testbed.memory_campaign import plan_round, run_campaign, summary

SEED = 16  # its first rounds: node B by a failpoint, node A by a timer and both nodes wiped, rank 2 by a timer and
# node A wiped, rank 0 by a failpoint


@pytest.mark.slow
def test_every_round_restores_the_newest_committed_step_exactly_from_the_tier_the_wipes_leave(root, nodes):
    plans = [plan_round(SEED, number) for number in range(4)]
    assert [(p.victims, p.how, p.wipe) for p in plans] == [
        ((2, 3), "failpoint", ()), ((0, 1), "sigkill", (0, 1)), ((2,), "sigkill", (0,)), ((0,), "failpoint", ())]
    lines = []
    verdicts = run_campaign(4, SEED, root, nodes, say=lines.append, timeout=5)
    report = "\n".join(lines + summary(verdicts, SEED))
    assert [v.problems for v in verdicts] == [[]] * 4, report
    # node B died at its 2nd snapshot after the sequence was handed out: node A's records of both nodes' shares
    # make that step whole, served partly by the holder
    assert (verdicts[0].restored, verdicts[0].tier) == (2, "memory-replica"), report
    assert verdicts[1].wiped == (0, 1) and verdicts[1].tier in ("durable", "none"), report  # every memory copy gone
    assert verdicts[2].wiped == (0,) and verdicts[2].tier in ("memory-replica", "durable"), report
    assert all(v.restored is not None and v.lost <= v.killed_at for v in verdicts), report
