"""Two tiers (P13) at more ranks and more copies: world 6 as 3 nodes, ``replicas=2``, and uneven failure domains.

One world of 6 ranks (``DCP_ATOMIC_FAILURE_DOMAIN`` nodeA/nodeB/nodeC, two ranks each, each node's ``local_root``
its own tmpfs) is spawned once for the file and runs each test's scenarios in turn (:class:`_SharedWorld`): a
gloo world of 6 costs seconds to start on a small machine, a scenario a fraction of that.  Tests stay independent:
each saves under a run id of its own and builds fresh managers and models, the test process changes the disks
between two scenarios as a replaced node would (its local root emptied), and a scenario that fails on any rank
ends the world, so the next test gets a fresh one.  The uneven domains (3+2+1 ranks) are declared through the
manager's ``LocalTierOptions(failure_domain=)`` in the same world: it is what ``$DCP_ATOMIC_FAILURE_DOMAIN`` defaults.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import tempfile
import threading
import time
import traceback

import pytest
import torch

from dcp_atomic import Callbacks
from dcp_atomic.tiers.placement import place_replicas
from tests.fault_fixtures import small_tmpfs_ctx
from tests.harness import Outcome, assert_all_ok, run_world
from tests.helpers.fsdp_app import _AppState, _fsdp_app, _full, _train_step
from tests.helpers.tier_integrations import _data_files, _local_steps, _titan
from tests.helpers.tiers import _exact, _flip_byte

WORLD = 6
NODES = "ABC"
EVEN = [f"node{NODES[rank // 2]}" for rank in range(WORLD)]  # the environment's domains: 2+2+2
UNEVEN = ["nodeA", "nodeA", "nodeA", "nodeB", "nodeB", "nodeC"]  # declared with failure_domain=: 3+2+1


def _three_nodes(rank: int) -> dict[str, str]:
    node = rank // 2
    return {"DCP_ATOMIC_FAILURE_DOMAIN": EVEN[rank], "LOCAL_RANK": str(rank % 2), "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": str(node)}


# -- one world for the whole file ------------------------------------------------------------------------------


def _serve(ctx):
    """Each rank: run the test process's commands (``cmd/<n>.pt``: a function and its arguments) in order, each
    answered by ``res/<n>.<rank>.pt``; a command of None ends the world."""
    with open(os.path.join(ctx.root, "pids", str(ctx.rank)), "w") as f:
        f.write(str(os.getpid()))
    n = 0
    while True:
        command = os.path.join(ctx.root, "cmd", f"{n}.pt")
        while not os.path.exists(command):
            time.sleep(0.02)
        fn, args = torch.load(command, weights_only=False)
        if fn is None:
            return None
        try:
            outcome = Outcome(ctx.rank, value=fn(ctx, *args), exitcode=0)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            outcome = Outcome(ctx.rank, error_type=type(e).__name__, error=f"{e}\n{traceback.format_exc()}",
                              exitcode=0)
        answer = os.path.join(ctx.root, "res", f"{n}.{ctx.rank}.pt")
        torch.save(outcome, answer + ".tmp")
        os.replace(answer + ".tmp", answer)
        n += 1


class _SharedWorld:
    """A world of 6 ranks kept running across tests (see the module doc); a failed scenario ends it."""

    LIFETIME = 600  # the world's hard limit; each scenario has its own, far shorter

    def __init__(self, nodes: list[str]) -> None:
        self.nodes, self.world, self.broken = nodes, None, False

    def _start(self) -> None:
        root = tempfile.mkdtemp(prefix="dcp-atomic-worlds-")
        for sub in ("cmd", "res", "pids"):
            os.mkdir(os.path.join(root, sub))
        world = {"root": root, "count": 0, "outcomes": None}
        world["thread"] = threading.Thread(target=lambda: world.update(outcomes=run_world(
            _serve, WORLD, root, rank_env=_three_nodes, extra={"nodes": self.nodes}, timeout=self.LIFETIME,
            pg_timeout=30)), daemon=True)
        world["thread"].start()
        self.world = world

    def call(self, fn, *args, timeout: float = 90) -> list[Outcome]:
        """Every rank runs ``fn(ctx, *args)``; one Outcome per rank.  Any failure ends the world."""
        if self.world is None:
            self._start()
        world = self.world
        n, world["count"] = world["count"], world["count"] + 1
        command = os.path.join(world["root"], "cmd", f"{n}.pt")
        torch.save((fn, args), command + ".tmp")
        os.replace(command + ".tmp", command)
        answers = [os.path.join(world["root"], "res", f"{n}.{rank}.pt") for rank in range(WORLD)]
        deadline = time.monotonic() + timeout
        while not all(map(os.path.exists, answers)) and world["thread"].is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        outcomes = [torch.load(a, weights_only=False) if os.path.exists(a) else
                    Outcome(rank, error_type="HarnessTimeout", error=f"no answer to {fn.__name__} within {timeout}s")
                    for rank, a in enumerate(answers)]
        if not all(o.ok for o in outcomes):
            self.end(kill=True)
        return outcomes

    def end(self, kill: bool = False) -> None:
        world, self.world = self.world, None
        if world is None:
            return
        if not kill:
            self_stop = os.path.join(world["root"], "cmd", f"{world['count']}.pt")
            torch.save((None, ()), self_stop + ".tmp")
            os.replace(self_stop + ".tmp", self_stop)
            world["thread"].join(30)
        for pid_file in glob.glob(os.path.join(world["root"], "pids", "*")) if world["thread"].is_alive() else ():
            with open(pid_file) as f, contextlib.suppress(ProcessLookupError, ValueError):  # its own session
                os.killpg(int(f.read()), signal.SIGKILL)
        world["thread"].join(30)
        shutil.rmtree(world["root"], ignore_errors=True)


@pytest.fixture(scope="module")
def world():
    """The shared world and its three nodes' local roots (tmpfs each, as ``tests.conftest.nodes``)."""
    with small_tmpfs_ctx(size_kib=65536) as a, small_tmpfs_ctx(size_kib=65536) as b, \
            small_tmpfs_ctx(size_kib=65536) as c:
        shared = _SharedWorld([a.path, b.path, c.path])
        try:
            yield shared
        finally:
            shared.end()


# -- what the scenarios run on every rank ------------------------------------------------------------------------


def _node_of(domain: str) -> int:
    return NODES.index(domain[-1])


def _manager(ctx, run: str, replicas: int, domains: list[str] | None, **kwargs):
    """``domains``: each rank's failure domain, passed as ``LocalTierOptions(failure_domain=)`` (None: the
    environment's)."""
    from dcp_atomic import CheckpointManager, LocalTierOptions
    from dcp_atomic.exchange import file_transfer

    file_transfer.CHUNK_BYTES = 64 << 10  # every replica and restore transfer crosses chunk boundaries
    domain = (domains or EVEN)[ctx.rank]
    local = LocalTierOptions(ctx.extra["nodes"][_node_of(domain)], replicas=replicas,
                             failure_domain=domains[ctx.rank] if domains else None,
                             durable_every=None)  # drains are asked for by durable=
    return CheckpointManager(ctx.root, run, local=local, timeout=20, **kwargs)


def _own(step: int, rank: int) -> torch.Tensor:
    """A plain tensor only this rank saves (under a key of its own): each rank's files differ, not just shards."""
    return torch.randn(5, generator=torch.Generator().manual_seed(1000 * step + rank))


def _state(ctx, model, optim, step: int) -> dict:
    own = _own(step, ctx.rank) if step >= 0 else torch.zeros(5)
    return {"app": _AppState(model, optim), "progress": {"step": step}, f"rank{ctx.rank}": own}


def _save(ctx, run: str, steps: list[int], replicas: int = 2, domains: list[str] | None = None):
    """Train, saving each step to the local tier; the full weights at the last one."""
    model, optim = _fsdp_app(ctx.world_size, 0)
    with _manager(ctx, run, replicas, domains) as manager:
        for step in steps:
            _train_step(model, optim, step)
            assert manager.save(step, _state(ctx, model, optim, step)) == step
        assert manager.steps(tier="durable") == []
    return _full(model)


def _restore(ctx, run: str, replicas: int = 2, domains: list[str] | None = None):
    """A fresh model (other seed), restored by a fresh manager: the step, its values and who served them."""
    model, optim = _fsdp_app(ctx.world_size, 42)
    stats = []
    with _manager(ctx, run, replicas, domains, callbacks=Callbacks(on_loaded=stats.append)) as manager:
        state = _state(ctx, model, optim, -1)
        step = manager.load(state)
        served = manager.restored_from
    assert state["progress"]["step"] == step
    return {"step": step, "full": _full(model), "own": state[f"rank{ctx.rank}"], "served": served, "stats": stats}


def _check_restored(outcomes: list[Outcome], saved: list, step: int, domains: list[str] = EVEN,
                    fetching: tuple[int, ...] = (), quiet: tuple[int, ...] | None = None) -> list[dict]:
    """Every rank loaded ``step`` from the local tier exactly; bytes moved between nodes into each ``fetching``
    node and into no ``quiet`` one (default: all others).  Which of a node's ranks receives is the restore's
    business, not this test's."""
    restored = assert_all_ok(outcomes)
    into = [0, 0, 0]
    for rank, out in enumerate(restored):
        assert out["step"] == step and out["served"]["tier"] == "local", out["served"]
        _exact(out["full"], saved[0])
        assert torch.equal(out["own"], _own(step, rank)), rank  # each rank's own value, not another's
        assert out["stats"][0]["bytes_from_replicas"] == out["served"]["bytes_fetched"], (rank, out["stats"])
        into[_node_of(domains[rank])] += out["served"]["bytes_fetched"]
    quiet = tuple(node for node in range(3) if node not in fetching) if quiet is None else quiet
    assert all(into[node] > 0 for node in fetching) and all(into[node] == 0 for node in quiet), into
    return restored


def _on_disk(nodes: list[str], run: str, step: int) -> dict[int, set[int]]:
    """Each rank's data file: the nodes whose local root holds it."""
    where: dict[int, set[int]] = {}
    for node, node_root in enumerate(nodes):
        for name in _data_files(node_root, step, run):
            where.setdefault(int(name.split("_")[2]), set()).add(node)
    return where


def _placed(domains: list[str], replicas: int) -> dict[int, set[int]]:
    """Each rank's files: its own node and its replica holders' nodes, as the placement says."""
    holders = place_replicas(domains, replicas).holders
    return {rank: {_node_of(domains[rank])} | {_node_of(domains[h]) for h in holders[rank]} for rank in range(WORLD)}


def _lose(nodes: list[str], run: str, *lost: int) -> None:
    """Nodes replaced: their local disks come back empty."""
    for node in lost:
        shutil.rmtree(os.path.join(nodes[node], run))


# -- placement over every small layout (pure) --------------------------------------------------------------------


def _layouts(n: int, largest: int | None = None):
    """Domain sizes summing to ``n``, largest first."""
    if n == 0:
        yield []
    for size in range(min(n, largest or n), 0, -1):
        for rest in _layouts(n - size, size):
            yield [size, *rest]


def test_placement_over_every_layout_of_up_to_9_ranks_keeps_its_promises():
    checked = 0
    for n in range(2, 10):
        for sizes in _layouts(n):
            blocks = [f"d{d}" for d, size in enumerate(sizes) for _ in range(size)]  # a node's ranks together
            dealt = [f"d{d}" for turn in range(sizes[0]) for d, size in enumerate(sizes) if turn < size]  # round robin
            for domains in (blocks, dealt):
                for replicas in range(1, len(sizes)):
                    holders = place_replicas(domains, replicas).holders
                    held = [0] * n
                    for rank, copies in enumerate(holders):
                        assert len({domains[h] for h in copies} | {domains[rank]}) == replicas + 1, (domains, rank)
                        for h in copies:
                            held[h] += 1
                    for domain in set(domains):  # inside a domain the copies held differ by at most one
                        counts = [held[r] for r in range(n) if domains[r] == domain]
                        assert max(counts) - min(counts) <= 1, (domains, replicas, held)
                    # even exactly when it can be: (replicas + 1) * widest <= n (placement.py's module doc)
                    assert (set(held) == {replicas}) == ((replicas + 1) * max(sizes) <= n), (domains, replicas, held)
                    checked += 1
    assert checked == 498  # every layout, both orders, every replicas a layout allows


# -- world 6 as 3 nodes, two replicas ------------------------------------------------------------------------------


def test_a_save_puts_every_ranks_files_on_its_own_node_and_on_both_others(world):
    saved = assert_all_ok(world.call(_save, "placed", [10, 20]))
    assert _placed(EVEN, 2) == {rank: {0, 1, 2} for rank in range(WORLD)}  # 3 domains, 2 copies: every node
    for step in (10, 20):
        assert _on_disk(world.nodes, "placed", step) == _placed(EVEN, 2), step
    for node_root in world.nodes:
        assert _local_steps(node_root, "placed") == [10, 20]
    holders = place_replicas(EVEN, 2).holders
    assert all(len({EVEN[h] for h in holders[r]} | {EVEN[r]}) == 3 for r in range(WORLD)), holders
    assert [len(place_replicas(EVEN, 2).held_by(r)) for r in range(WORLD)] == [2] * WORLD  # spread evenly
    _check_restored(world.call(_restore, "placed"), saved, 20)  # every node had everything: nothing moved


def test_one_lost_node_is_restored_exactly_from_the_replicas(world):
    saved = assert_all_ok(world.call(_save, "lose_one", [10, 20]))
    _lose(world.nodes, "lose_one", 2)
    _check_restored(world.call(_restore, "lose_one"), saved, 20, fetching=(2,))


def test_two_lost_nodes_are_restored_exactly_from_the_last_nodes_copies(world):
    saved = assert_all_ok(world.call(_save, "lose_two", [10, 20]))
    _lose(world.nodes, "lose_two", 1, 2)
    _check_restored(world.call(_restore, "lose_two"), saved, 20, fetching=(1, 2))


def test_a_flipped_byte_in_one_copy_of_three_is_never_loaded_and_an_intact_copy_serves(world):
    saved = assert_all_ok(world.call(_save, "flipped", [10, 20]))
    [primary] = glob.glob(os.path.join(world.nodes[1], "flipped", f"step_{20:010d}", "*", "__3_0.distcp"))
    _flip_byte(primary)  # rank 3's own copy, on its own node B; A and C keep theirs
    _check_restored(world.call(_restore, "flipped"), saved, 20, fetching=(1,))  # node B took rank 3's back


def _construct(ctx, replicas: int, domains: list[str] | None):
    """The refusal (type and message) on this rank, or None when the manager was built."""
    try:
        _manager(ctx, "refused", replicas, domains).close()
    except Exception as e:  # noqa: BLE001 - the test reads it
        # a refused manager leaves nothing running behind it (its heartbeat thread, its process groups)
        deadline = time.monotonic() + 10  # a closed heartbeat's thread ends at its next beat
        while (heartbeats := [t.name for t in threading.enumerate() if t.name == "dcp-atomic-heartbeat"]) \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        return type(e).__name__, str(e), heartbeats
    return None


def test_fewer_domains_than_replicas_plus_one_is_refused_at_construction(world):
    for replicas, domains, needs, listed in [
            (3, None, "replicas=3 needs at least 4 failure domains", "span 3: 'nodeA' (ranks 0, 1), 'nodeB' (ranks 2, 3)"),
            (2, ["nodeA"] * 3 + ["nodeB"] * 3, "replicas=2 needs at least 3 failure domains",
             "span 2: 'nodeA' (ranks 0, 1, 2), 'nodeB' (ranks 3, 4, 5)")]:
        for out in assert_all_ok(world.call(_construct, replicas, domains)):
            assert out is not None and out[0] == "ConfigurationError", out
            assert needs in out[1] and listed in out[1] and "or lower replicas" in out[1], out[1]
            assert out[2] == [], out[2]


# -- torchtitan's manager, built from its config ----------------------------------------------------------------


def _titan_job(ctx, last_step: int, data_seed: int, config: dict):
    return _titan(ctx, last_step, data_seed, folder="titan", replicas=2, **config)


def test_torchtitan_with_two_replicas_restores_a_replaced_node_at_load_step(world):
    first = assert_all_ok(world.call(_titan_job, 6, 1, {}))  # saves 2, 4, 6 (interval 2); drains 4
    for node_root in world.nodes:
        assert _local_steps(node_root, "titan") == [4, 6] and len(_data_files(node_root, 6, "titan")) == WORLD
    _lose(world.nodes, "titan", 1)
    resumed = assert_all_ok(world.call(_titan_job, 6, 2, {"load_step": 6, "async_mode": "disabled"}))
    for rank, out in enumerate(resumed):
        assert out["started"] == 6 and out["served"]["tier"] == "local" and out["served"]["step"] == 6, out["served"]
        weights, moments = out["start"]
        want_weights, want_moments = first[rank]["saved"][6]
        _exact(weights, want_weights)
        _exact(moments, want_moments)
    fetched = [out["served"]["bytes_fetched"] for out in resumed]
    assert fetched[2] + fetched[3] > 0 and fetched[:2] + fetched[4:] == [0, 0, 0, 0], fetched  # into node B only


# -- uneven domains: 3 + 2 + 1 ranks ------------------------------------------------------------------------------


@pytest.mark.slow
def test_uneven_domains_one_replica_each_rank_holds_one_copy_and_a_lost_node_is_restored(world):
    holders = place_replicas(UNEVEN, 1).holders
    assert [len(place_replicas(UNEVEN, 1).held_by(r)) for r in range(WORLD)] == [1] * WORLD  # spread evenly
    assert all(UNEVEN[h] != UNEVEN[r] for r in range(WORLD) for h in holders[r]), holders
    saved = assert_all_ok(world.call(_save, "uneven1", [10], 1, UNEVEN))
    where = _on_disk(world.nodes, "uneven1", 10)
    assert where == _placed(UNEVEN, 1)  # each rank's files on its own node and its holder's, nowhere else
    assert [sum(node in nodes for nodes in where.values()) for node in range(3)] == [6, 4, 2]  # A: 3 own + 3 held
    _lose(world.nodes, "uneven1", 0)  # the widest node: half the ranks' own files
    # node A's ranks read their own files from B and C; B and C, holding only 4 and 2 ranks' files, may need some
    _check_restored(world.call(_restore, "uneven1", 1, UNEVEN), saved, 10, UNEVEN, fetching=(0,), quiet=())


def test_uneven_domains_two_replicas_spread_as_far_as_they_can_and_the_single_rank_node_restores_all(world):
    placement = place_replicas(UNEVEN, 2)
    held = [len(placement.held_by(r)) for r in range(WORLD)]
    # nodeC's one rank must hold a copy of every other rank; inside each domain the copies differ by at most one
    assert held == [1, 1, 1, 2, 2, 5], held
    saved = assert_all_ok(world.call(_save, "uneven2", [10], 2, UNEVEN))
    assert _on_disk(world.nodes, "uneven2", 10) == _placed(UNEVEN, 2)
    _lose(world.nodes, "uneven2", 0, 1)  # five of six ranks' nodes gone
    _check_restored(world.call(_restore, "uneven2", 2, UNEVEN), saved, 10, UNEVEN, fetching=(0, 1))
