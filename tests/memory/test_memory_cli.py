"""``dcp-atomic ls|show|verify PATH RUN --memory`` on a real snapshot run: 2 ranks on 2 simulated nodes (failure
domains nodeA/nodeB, each memory path on its own tmpfs), one replica each, so each node holds its own rank's slots and
a replica of the other's.  The command tells the truth: what its seal says for ls/show, what its bytes say for
verify, FAILED with the reason (rank, slot, path) for damage, never OK."""

from __future__ import annotations

import dataclasses
import glob
import json
import os

from dcp_atomic.memory import SlotRecord
from dcp_atomic.tools.cli import main
from tests.harness import assert_all_ok
from tests.helpers.memory import one_node_per_rank
from tests.helpers.tiers import RUN, _flip_byte, _run

WORLD = 2
STEPS = 3


def _snapshot_steps(ctx):
    import torch

    from dcp_atomic import CheckpointManager, MemoryTier

    path = os.path.join(ctx.extra["nodes"][ctx.rank], "mem")
    os.makedirs(path, exist_ok=True)
    with CheckpointManager(ctx.root, RUN, memory=MemoryTier(path, every=1, replicas=1, slots=2), timeout=10) as m:
        for step in range(1, STEPS + 1):
            state = {"w": torch.full((3000,), float(step + 10 * ctx.rank)), "step": step}
            assert m.snapshot(step, state).result() == step


def _mem(nodes, node):
    return os.path.join(nodes[node], "mem")


def _cli(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr().out
    return code, out


def _listed(capsys, command, nodes, node, *extra):
    code, out = _cli(capsys, command, _mem(nodes, node), RUN, "--memory", "--json", *extra)
    return code, json.loads(out)


def _record(nodes, node, rank, step):
    for path in glob.glob(os.path.join(_mem(nodes, node), RUN, f"r{rank}", "slot*.commit")):
        with open(path, "rb") as f:
            if SlotRecord.from_bytes(f.read(), path).step == step:
                return path
    raise AssertionError(f"no record of rank {rank} step {step} on node {node}")


def test_ls_show_verify_list_own_and_replica_slots_and_the_step_this_node_can_restore(root, nodes, capsys):
    assert_all_ok(_run(_snapshot_steps, root, nodes, world=WORLD, rank_env=one_node_per_rank))
    for node in range(2):
        code, listing = _listed(capsys, "ls", nodes, node)
        assert code == 0 and listing["run"] == RUN
        slots = listing["slots"]
        assert sorted((s["rank"], s["step"]) for s in slots) == [(0, 2), (0, 3), (1, 2), (1, 3)], slots
        assert {s["status"] for s in slots} == {"sealed"}
        assert {(s["rank"], s["replica_held_by"]) for s in slots} == {(node, None), (1 - node, node)}, slots
        assert all(s["bytes"] > 3000 * 4 and s["world_size"] == WORLD for s in slots)
        assert [(r["step"], r["world_size"]) for r in listing["restorable"]] == [(3, WORLD)]
        code, checked = _listed(capsys, "verify", nodes, node)
        assert code == 0 and checked["ok"] and {s["status"] for s in checked["slots"]} == {"OK"}
        code, shown = _listed(capsys, "show", nodes, node)
        assert code == 0 and shown["step"] == 3 and len(shown["slots"]) == 2
        assert all([item["key"] for item in items] == ["step", "w"] or [item["key"] for item in items] == ["w", "step"]
                   for items in shown["items"].values()), shown["items"]
    code, text = _cli(capsys, "ls", _mem(nodes, 0), RUN, "--memory")
    assert code == 0 and "this node alone can restore step 3" in text and "replica held by rank 0" in text


def test_a_flipped_byte_is_failed_by_verify_naming_rank_slot_and_path_and_ls_still_lists_the_seal(root, nodes,
                                                                                                    capsys):
    assert_all_ok(_run(_snapshot_steps, root, nodes, world=WORLD, rank_env=one_node_per_rank))
    record = _record(nodes, 1, 0, 3)  # rank 0's replica on node B
    data = record.replace(".commit", ".data")
    _flip_byte(data, offset=200)
    code, listing = _listed(capsys, "ls", nodes, 1)
    assert code == 0 and {s["status"] for s in listing["slots"]} == {"sealed"}  # ls reads the records alone
    code, checked = _listed(capsys, "verify", nodes, 1)
    assert code == 1 and not checked["ok"]
    failed = [s for s in checked["slots"] if s["status"] == "FAILED"]
    assert [(s["rank"], s["step"], s["data"]) for s in failed] == [(0, 3, data)], checked
    assert data in failed[0]["reason"] and "rank 0" in failed[0]["reason"], failed
    assert [r["step"] for r in checked["restorable"]] == [2], checked  # step 3 lacks a sound copy of rank 0 here
    code, text = _cli(capsys, "verify", _mem(nodes, 1), RUN, "--memory")
    line = next(line for line in text.splitlines() if "FAILED" in line)
    assert code == 1 and line.split()[:3] == ["0", line.split()[1], "3"] and "OK" not in line, text
    assert data in text
    code, _ = _listed(capsys, "verify", nodes, 0)  # the other node is untouched
    assert code == 0


def test_a_record_resealed_with_another_step_is_listed_as_its_seal_says_and_failed_by_verify(root, nodes, capsys):
    assert_all_ok(_run(_snapshot_steps, root, nodes, world=WORLD, rank_env=one_node_per_rank))
    path = _record(nodes, 0, 0, 2)
    with open(path, "rb") as f:
        record = SlotRecord.from_bytes(f.read(), path)
    with open(path, "wb") as f:  # the step alone: its bytes still match, its sequence now names two steps
        f.write(dataclasses.replace(record, step=7).to_bytes())
    code, checked = _listed(capsys, "verify", nodes, 0)
    assert code == 1 and not checked["ok"], checked
    assert [s["step"] for s in checked["slots"] if s["record"] == path] == [7], checked
    assert len(checked["conflicts"]) == 1 and path in checked["conflicts"][0], checked
    assert "[2, 7]" in checked["conflicts"][0] and [r["step"] for r in checked["restorable"]] == [3], checked
    newer = _record(nodes, 0, 0, 3)
    with open(newer, "rb") as f:
        items = SlotRecord.from_bytes(f.read(), newer).items  # step 3's digests over step 2's bytes
    with open(path, "wb") as f:
        f.write(dataclasses.replace(record, step=7, items=items).to_bytes())
    code, listing = _listed(capsys, "ls", nodes, 0)
    assert code == 0
    resealed = [s for s in listing["slots"] if s["record"] == path]
    assert [(s["step"], s["status"]) for s in resealed] == [(7, "sealed")], listing
    code, checked = _listed(capsys, "verify", nodes, 0)
    assert code == 1
    resealed = [s for s in checked["slots"] if s["record"] == path]
    assert [(s["rank"], s["step"], s["status"]) for s in resealed] == [(0, 7, "FAILED")], checked
    assert "digest" in resealed[0]["reason"] or "checksum" in resealed[0]["reason"], resealed
    assert [r["step"] for r in checked["restorable"]] == [3], checked
    with open(path, "wb") as f:  # a seal that fails: FAILED in ls too, with the reason
        f.write(record.to_bytes()[:-5] + b"xxxxx")
    code, listing = _listed(capsys, "ls", nodes, 0)
    broken = [s for s in listing["slots"] if s["record"] == path]
    assert [(s["rank"], s["slot"], s["status"]) for s in broken] == [(0, record.slot, "FAILED")], listing
    assert path in broken[0]["reason"], broken
