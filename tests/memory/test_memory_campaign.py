"""The memory tier's kill campaign (P16), a few rounds of it: each round a world of 4 ranks on 2 simulated nodes
restores, is checked against the witness files, then snapshots every step until a rank or a node is killed
(``testbed/memory_campaign.py`` says what is checked and why; ``benchmarks/memory_campaign.py`` runs 100+ rounds)."""

from __future__ import annotations

import pytest

from testbed.memory_campaign import plan_round, run_campaign, summary

SEED = 1586  # its first rounds (all killing rank 2): by a timer with node A wiped, by a failpoint while a replica
# had half landed in place, by a timer with both nodes wiped, by a failpoint before its record


@pytest.mark.slow
def test_every_round_restores_the_newest_committed_step_exactly_from_the_tier_the_wipes_leave(root, nodes):
    plans = [plan_round(SEED, number) for number in range(4)]
    assert [(p.victims, p.how, p.wipe, p.phase) for p in plans] == [
        ((2,), "sigkill", (0,), ""), ((2,), "failpoint", (), "replica_half_received"),
        ((2,), "sigkill", (0, 1), ""), ((2,), "failpoint", (), "before_record")]
    lines = []
    verdicts = run_campaign(4, SEED, root, nodes, say=lines.append, timeout=5)
    report = "\n".join(lines + summary(verdicts, SEED))
    assert [v.problems for v in verdicts] == [[]] * 4, report
    assert verdicts[0].wiped == (0,) and verdicts[0].tier in ("memory-replica", "durable"), report
    # rank 2 died with a replica half landed in its slot (that slot's record retired): the step before is restored
    # (from the durable root where that step's durable save came after its snapshot: a newer sequence)
    assert verdicts[1].restored == verdicts[1].killed_at - 1 and verdicts[1].tier in ("memory", "durable"), report
    assert verdicts[2].wiped == (0, 1) and verdicts[2].tier in ("durable", "none"), report  # every memory copy gone
    # rank 2 died after the sequence, before its own record: its holder's verified copy makes its share whole
    assert verdicts[3].restored == verdicts[3].killed_at and verdicts[3].tier != "none", report
    assert all(v.restored is not None and v.lost <= v.killed_at for v in verdicts), report
