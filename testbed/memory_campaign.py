"""The memory tier's kill campaign (P16): rounds of a job that snapshots every step until a rank or a whole node dies,
each round first restoring what the previous one left and checking it against a witness the restore code never reads.

Why a witness: a restore that checks itself against its own records proves nothing.  Every rank appends to its own
file (fsynced) the step it is about to snapshot (``attempt``), the step whose future resolved (``committed``: memory-
committed on every rank), the step it is about to ``save()`` and the step whose save returned (``saving``/``saved``).
The newest step committed on any rank is a lower bound of the next restore, the newest attempted an upper bound; a
step saved durably after its snapshot is the newer commit (one sequence), so a restore of it must come from the
durable root.  The state of a step is a pure function of (rank, step) (:func:`state_at`), so a restore is checked
with ``torch.equal`` against it on every rank: a torn or mixed version cannot pass.

One round (:func:`campaign_rank` on a fresh world of 4 ranks on 2 simulated nodes, each node's memory path its own
directory): restore (``manager.load``), then train and snapshot every step, ``save()`` every :data:`SAVE_EVERY`
steps, until the round's victim (one rank, or both ranks of a node) dies: SIGKILLed by a failpoint at a memory phase
of its n-th snapshot, or by a timer thread in the victim at a random moment (phases between failpoints, saves).
After the kill some rounds wipe one node's memory path (the next restore must come from the replicas) or both (from
the durable root).  :func:`run_campaign` plays the rounds and judges each; ``benchmarks/memory_campaign.py`` is its
command line, ``tests/memory/test_memory_campaign.py`` runs a few rounds.
"""

from __future__ import annotations

import os
import random
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from testbed.worlds import Outcome, run_world

WORLD, NODES = 4, 2
RUN = "campaign"
SAVE_EVERY = 4  # a durable save() every 4th step: the tier a restore takes when both nodes' memory is gone
# memory phase -> does the step whose snapshot dies there survive?  (before_record: rank 0 gave the sequence and
# every share's copy is verified on a live holder, whose record makes the share whole)
PHASES = {"after_retire": False, "after_slot_write": False, "replica_send": False, "replica_retired": False,
          "replica_half_received": False, "replica_receive": False,
          "before_record": True, "after_record": True}


def node_env(rank: int) -> dict[str, str]:
    """torchrun's variables of a world of 4 as 2 nodes of 2 ranks (failure domains nodeA/nodeB)."""
    node = rank // 2
    return {"DCP_ATOMIC_FAILURE_DOMAIN": "nodeAB"[4 + node], "LOCAL_RANK": str(rank % 2),
            "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": str(node)}


# -- the job ----------------------------------------------------------------------------------------------------


def state_at(rank: int, step: int) -> dict:
    """This rank's state after ``step`` training steps: unique to (rank, step) in every tensor, so a share of
    another step or rank never equals it; each rank's tensors under its own keys (rank-local state, as a durable
    save of it needs).  Over 64 KiB per rank, so replicas cross transfer chunks."""
    import torch

    generator = torch.Generator().manual_seed(rank * 1_000_003 + step)
    return {f"weights.rank{rank}": torch.randn(48, 1024, generator=generator),
            f"moments.rank{rank}": torch.randn(1000, generator=generator).to(torch.bfloat16),
            f"counts.rank{rank}": torch.randint(0, 1 << 40, (7,), generator=generator),
            "progress": {"step": step}}


def _train(state: dict, rank: int, step: int) -> None:
    """One training step, in place (as an optimizer changes the tensors the snapshots read)."""
    for key, value in state_at(rank, step).items():
        if key == "progress":
            state[key]["step"] = value["step"]
        else:
            state[key].copy_(value)


def _exact(state: dict, rank: int, step: int) -> bool:
    import torch

    want = state_at(rank, step)
    return state["progress"] == want["progress"] and all(
        torch.equal(state[k], want[k]) for k in want if k != "progress")


@dataclass(frozen=True)
class Plan:
    """One round's victim and how it dies; ``wipe``: the nodes whose memory path is emptied after the kill."""

    round: int
    victims: tuple[int, ...] = ()
    how: str = ""  # "failpoint" | "sigkill" | "" (the last world: restore only)
    phase: str = ""  # failpoint: memory.<phase>
    nth: int = 0  # failpoint: at the victim's nth snapshot of the round
    delay_s: float = 0.0  # sigkill: seconds after the restore
    wipe: tuple[int, ...] = ()

    def describe(self) -> str:
        who = f"node {'AB'[self.victims[0] // 2]}" if len(self.victims) == 2 else f"rank {self.victims[0]}"
        how = (f"failpoint memory.{self.phase} at snapshot {self.nth}" if self.how == "failpoint" else
               f"sigkill after {self.delay_s:.2f}s")
        return f"{who:7} {how}"


def plan_round(seed: int, number: int, max_delay_s: float = 2.0) -> Plan:
    """The seeded choices of round ``number``: the same for the same (seed, number), whatever ran before."""
    chooser = random.Random(f"{seed}:{number}")
    victims = (chooser.randrange(WORLD),) if chooser.random() < 0.6 else ((0, 1), (2, 3))[chooser.randrange(2)]
    wipe = chooser.random()
    wiped = () if wipe < 0.7 else (chooser.randrange(NODES),) if wipe < 0.92 else (0, 1)
    if chooser.random() < 0.5:
        return Plan(number, victims, "failpoint", phase=chooser.choice(list(PHASES)), nth=chooser.randint(1, 6),
                    wipe=wiped)
    return Plan(number, victims, "sigkill", delay_s=round(chooser.uniform(0.0, max_delay_s), 3), wipe=wiped)


class _Witness:
    """This rank's witness file: one fsynced line per event, read by the campaign after the world is gone."""

    def __init__(self, directory: str, rank: int) -> None:
        self.fd = os.open(os.path.join(directory, f"r{rank}"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def __call__(self, *words) -> None:
        os.write(self.fd, (" ".join(str(w) for w in words) + "\n").encode())
        os.fsync(self.fd)


def campaign_rank(ctx, plan: Plan, max_steps: int = 400):
    """One rank of a round: restore and check it, then (unless ``plan`` only restores) train and snapshot every step
    until the victim dies; a victim under ``sigkill`` starts its timer once restored."""
    import signal
    import threading

    import torch  # noqa: F401 (state_at)

    from dcp_atomic import CheckpointManager, MemoryTier
    from dcp_atomic.errors import CheckpointNotFoundError
    from dcp_atomic.exchange import file_transfer

    file_transfer.CHUNK_BYTES = file_transfer.DIRECT_CHUNK_BYTES = 64 << 10  # a replica lands in several chunks
    witness = _Witness(ctx.extra["witness"], ctx.rank)
    path = os.path.join(ctx.extra["nodes"][ctx.rank * NODES // ctx.world_size], "mem")
    os.makedirs(path, exist_ok=True)
    memory = MemoryTier(path, every=1, replicas=1, slots=2)
    state = state_at(ctx.rank, 0)
    with CheckpointManager(ctx.root, RUN, memory=memory, timeout=ctx.extra.get("timeout", 5)) as manager:
        try:
            start = manager.load(state)
            tier = (manager.restored_from or {}).get("tier") or "durable"
        except CheckpointNotFoundError:
            start, tier = 0, "none"
        witness("restored", start, tier, _exact(state, ctx.rank, start))
        if not plan.how:
            return start
        if plan.how == "sigkill" and ctx.rank in plan.victims:
            threading.Timer(plan.delay_s, os.kill, (os.getpid(), signal.SIGKILL)).start()
        for step in range(start + 1, start + max_steps + 1):
            _train(state, ctx.rank, step)
            witness("attempt", step)
            assert manager.snapshot(step, state).result() == step
            witness("committed", step)
            if step % SAVE_EVERY == 0:
                witness("saving", step)
                manager.save(step, state)
                witness("saved", step)
    return start


# -- the campaign ----------------------------------------------------------------------------------------------


@dataclass
class Seen:
    """What one world's witness files say."""

    restored: list[tuple[int, str, bool]]  # per rank: (step, tier, exact)
    attempted: int  # the newest step any rank began to snapshot (0: none)
    committed: int  # the newest step whose snapshot resolved on any rank (0: none)
    saving: set[int]
    saved: set[int]


def read_witness(directory: str) -> Seen:
    restored: list = [None] * WORLD
    attempted = committed = 0
    saving, saved = set(), set()
    for rank in range(WORLD):
        path = os.path.join(directory, f"r{rank}")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            for line in f:
                word, *rest = line.split()
                if word == "restored":
                    restored[rank] = (int(rest[0]), rest[1], rest[2] == "True")
                elif word == "attempt":
                    attempted = max(attempted, int(rest[0]))
                elif word == "committed":
                    committed = max(committed, int(rest[0]))
                elif word == "saving":
                    saving.add(int(rest[0]))
                elif word == "saved":
                    saved.add(int(rest[0]))
    return Seen(restored, attempted, committed, saving, saved)


@dataclass
class Expected:
    """What the restore after a round must be, from the witness alone."""

    lower: int  # the newest step known committed (memory, or durable when both nodes are wiped)
    upper: int  # the newest step that may have committed
    tiers: tuple[str, ...]
    exact_step: int | None = None  # a failpoint kill of every victim at a known phase: the step itself
    saving: frozenset[int] = frozenset()  # every durable save begun so far, and every one that returned (a step saved
    saved: frozenset[int] = frozenset()  # is never snapshotted again: restores never go below it)


@dataclass
class Verdict:
    plan: Plan
    killed_at: int = 0  # the newest step attempted when the victim died
    restored: int | None = None
    tier: str = ""
    seconds: float = 0.0
    wiped: tuple[int, ...] = ()
    killed: tuple[int, ...] = ()  # the ranks SIGKILLed (a node's second rank may have died of its mate's error first)
    problems: list[str] = field(default_factory=list)

    @property
    def lost(self) -> int | None:
        return None if self.restored is None else max(0, self.killed_at - self.restored)

    def line(self, seed: int) -> str:
        wiped = {(): "-", (0,): "A", (1,): "B", (0, 1): "AB"}[self.wiped]
        verdict = "ok" if not self.problems else "FAIL: " + "; ".join(self.problems)
        return (f"round {self.plan.round:3} {self.plan.describe():50} died at step {self.killed_at:4}  wiped {wiped:2}  "
                f"restored {self.restored if self.restored is not None else '?':>4} from {self.tier or '?':14} "
                f"lost {self.lost if self.lost is not None else '?':>2}  {self.seconds:5.1f}s  {verdict}")


def _expected(plan: Plan, start: int, seen: Seen, outcomes: list[Outcome], wiped: tuple[int, ...],
              saving: frozenset[int], saved: frozenset[int]) -> Expected:
    """The restore the next world must make after ``plan``'s kill (``start``: this round's restored step;
    ``saving``, ``saved``: the durable saves any rank began, and saw return, over every round)."""
    if wiped == (0, 1):
        newest = max(saved, default=0)
        return Expected(newest, max(saving, default=0), ("durable",) if newest else ("durable", "none"),
                        saving=saving, saved=saved)
    lower, upper = max(seen.committed, start), max(seen.attempted, start)
    tiers = ("memory-replica",) if wiped else ("memory", "memory-replica")
    exact = None
    if plan.how == "failpoint" and not wiped and all(outcomes[v].killed for v in plan.victims):
        dying = start + plan.nth
        exact = dying if PHASES[plan.phase] else dying - 1
    return Expected(lower, upper, tiers, exact, saving, saved)


def _judge(verdict: Verdict, restored: list, expected: Expected) -> None:
    """The restore the world after the kill made (per rank: step, tier, exact) against ``expected``."""
    if any(r is None for r in restored):
        verdict.problems.append(f"ranks {[k for k, r in enumerate(restored) if r is None]} never reported a restore")
        return
    steps, tiers = {s for s, _, _ in restored}, {t for _, t, _ in restored}
    verdict.restored, verdict.tier = min(steps), "/".join(sorted(tiers))
    if len(steps) > 1 or len(tiers) > 1:
        verdict.problems.append(f"ranks disagree: {restored}")
    if not all(exact for _, _, exact in restored):
        verdict.problems.append(f"not exact (torn or mixed) on ranks {[k for k, r in enumerate(restored) if not r[2]]}")
    step, tier = verdict.restored, restored[0][1]
    if not expected.lower <= step <= expected.upper:
        verdict.problems.append(f"step {step} outside [{expected.lower}, {expected.upper}] (committed, attempted)")
    if expected.exact_step is not None and step != expected.exact_step:
        verdict.problems.append(f"step {step}, the failpoint's phase says {expected.exact_step}")
    allowed = expected.tiers
    if step in expected.saved and "durable" not in allowed:  # saved after its snapshot: the newer commit
        allowed = ("durable",)
    elif step in expected.saving and "durable" not in allowed:  # a save the kill may or may not have finished
        allowed = (*allowed, "durable")
    if tier not in allowed:
        verdict.problems.append(f"restored from {tier}, expected {' or '.join(allowed)}")


def _judge_kill(verdict: Verdict, outcomes: list[Outcome]) -> None:
    """Every victim died (killed, or an error once its node-mate was killed); every survivor reported a typed error."""
    plan = verdict.plan
    verdict.killed = tuple(o.rank for o in outcomes if o.killed)
    if not verdict.killed:
        verdict.problems.append(f"no victim was killed: {[(o.rank, o.error_type, o.exitcode) for o in outcomes]}")
    for o in outcomes:
        if o.killed:
            continue
        if o.error_type is None:
            verdict.problems.append(f"rank {o.rank} trained on to the end: nobody died")
        elif o.error_type in ("HarnessTimeout", "NoResult", "ProcessDied") or o.exitcode != 0:
            verdict.problems.append(f"rank {o.rank} never reported ({o.error_type}, exit {o.exitcode}): "
                                    f"{(o.error or '')[:200]!r}")


def _wipe(nodes: list[str], which: tuple[int, ...]) -> None:
    for node in which:
        shutil.rmtree(os.path.join(nodes[node], "mem"), ignore_errors=True)


def run_campaign(rounds: int, seed: int, root: str, nodes: list[str], *, say: Callable[[str], None] = print,
                 timeout: float = 5.0, world_timeout: float = 90.0) -> list[Verdict]:
    """Play ``rounds`` kill rounds and one restoring world after the last; one judged :class:`Verdict` per round.
    ``root``: the durable root (and the witness files beside it); ``nodes``: the 2 nodes' directories."""
    witness = os.path.join(root, "witness")
    durable_root = os.path.join(root, "durable")
    os.makedirs(durable_root, exist_ok=True)
    verdicts: list[Verdict] = []
    pending: tuple[Verdict, Expected] | None = None
    saving: frozenset[int] = frozenset()
    saved: frozenset[int] = frozenset()
    for number in range(rounds + 1):
        plan = plan_round(seed, number) if number < rounds else Plan(number)
        shutil.rmtree(witness, ignore_errors=True)
        os.makedirs(witness)
        spec = f"memory.{plan.phase}#{plan.nth}=kill" if plan.how == "failpoint" else None

        def rank_env(rank, spec=spec, victims=plan.victims):
            return {**node_env(rank), "DCP_ATOMIC_FAILPOINTS": spec if rank in victims else None}

        started = time.monotonic()
        outcomes = run_world(campaign_rank, WORLD, durable_root, args=(plan,), rank_env=rank_env,
                             extra={"nodes": nodes, "witness": witness, "timeout": timeout},
                             timeout=world_timeout, pg_timeout=max(10.0, 2 * timeout))
        seconds = time.monotonic() - started
        seen = read_witness(witness)
        if pending is not None:  # this world's restore judges the previous round
            verdict, expected = pending
            _judge(verdict, seen.restored, expected)
            say(verdict.line(seed))
            verdicts.append(verdict)
        if not plan.how:
            if any(not o.ok for o in outcomes):
                verdicts[-1].problems.append(f"the restoring world failed: {[(o.rank, o.error_type) for o in outcomes]}")
            break
        start = seen.restored[0][0] if seen.restored[0] else 0
        verdict = Verdict(plan, killed_at=max(seen.attempted, start), seconds=seconds)
        _judge_kill(verdict, outcomes)
        # a wipe needs a step this round committed on both nodes: else this round's start may be held on one node
        # only (restored from its replicas) and a wipe would lose it, which no design promises to survive
        wiped = plan.wipe if (seen.committed > start or plan.wipe == (0, 1)) else ()
        _wipe(nodes, wiped)
        verdict.wiped = wiped
        saving, saved = saving | seen.saving, saved | seen.saved
        pending = verdict, _expected(plan, start, seen, outcomes, wiped, saving, saved)
    return verdicts


def summary(verdicts: list[Verdict], seed: int) -> list[str]:
    """The campaign's summary lines: rounds, kills, restores by tier, steps lost, failures with their round."""
    ways = Counter(f"{'node' if len(v.plan.victims) == 2 else 'rank'} by {v.plan.how}" for v in verdicts)
    tiers = Counter(v.tier or "?" for v in verdicts)
    failed = [v for v in verdicts if v.problems]

    def lost(served) -> str:
        steps = [v.lost for v in verdicts if v.lost is not None and served(v.tier)]
        return f"max {max(steps, default=0)}, mean {sum(steps) / max(len(steps), 1):.2f} over {len(steps)}"

    lines = [f"rounds {len(verdicts)}, kills {sum(bool(v.killed) for v in verdicts)} "
             f"({', '.join(f'{k} {n}' for k, n in sorted(ways.items()))}; "
             f"{sum(len(v.killed) for v in verdicts)} ranks SIGKILLed); wiped after the kill: one node "
             f"{sum(len(v.wiped) == 1 for v in verdicts)}, both {sum(len(v.wiped) == 2 for v in verdicts)}",
             "restores by tier: " + ", ".join(f"{k} {n}" for k, n in sorted(tiers.items())),
             f"steps lost: from memory {lost(lambda tier: tier.startswith('memory'))}; "
             f"from the durable root {lost(lambda tier: not tier.startswith('memory'))}",
             f"seconds per round: mean {sum(v.seconds for v in verdicts) / max(len(verdicts), 1):.1f}",
             f"failures: {len(failed)}"]
    lines += [f"  round {v.plan.round} (seed {seed}; reproduce: --seed {seed} --rounds {v.plan.round + 1}): "
              + "; ".join(v.problems) for v in failed]
    return lines
