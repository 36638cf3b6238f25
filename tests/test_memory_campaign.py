"""The memory tier's kill campaign (P16), a few rounds of it: each round a world of 4 ranks on 2 simulated nodes
restores, is checked against the witness files, then snapshots every step until a rank or a node is killed
(``testbed/memory_campaign.py`` says what is checked and why; ``benchmarks/memory_campaign.py`` runs 100+ rounds)."""

from __future__ import annotations

import pytest

from testbed.memory_campaign import plan_round, run_campaign, summary

SEED = 1064  # its first rounds: node B by a failpoint after its records, rank 0 by a failpoint with its copies received,
# node B by a timer and both nodes wiped, rank 3 by a timer and node B wiped


@pytest.mark.slow
def test_every_round_restores_the_newest_committed_step_exactly_from_the_tier_the_wipes_leave(root, nodes):
    plans = [plan_round(SEED, number) for number in range(4)]
    assert [(p.victims, p.how, p.wipe, p.phase) for p in plans] == [
        ((2, 3), "failpoint", (), "after_record"), ((0,), "failpoint", (), "replica_receive"),
        ((2, 3), "sigkill", (0, 1), ""), ((3,), "sigkill", (1,), "")]
    lines = []
    verdicts = run_campaign(4, SEED, root, nodes, say=lines.append, timeout=5)
    report = "\n".join(lines + summary(verdicts, SEED))
    assert [v.problems for v in verdicts] == [[]] * 4, report
    # node B died after every record of its snapshot was written: that step is memory-committed and restored
    assert (verdicts[0].restored, verdicts[0].tier) == (verdicts[0].killed_at, "memory"), report
    # rank 0 died holding verified copies that no sequence numbered yet: the step before is restored
    assert (verdicts[1].restored, verdicts[1].tier) == (verdicts[1].killed_at - 1, "memory"), report
    assert verdicts[2].wiped == (0, 1) and verdicts[2].tier in ("durable", "none"), report  # every memory copy gone
    assert verdicts[3].wiped == (1,) and verdicts[3].tier in ("memory-replica", "durable"), report
    assert all(v.restored is not None and v.lost <= v.killed_at for v in verdicts), report
