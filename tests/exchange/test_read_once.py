"""Read once: a stored item several ranks need is read from storage once and shared over the group.

Real gloo worlds of 4: replicated plain tensors and objects, HSDP-like DTensors (``dp_replicate=2 x
dp_shard=2``), every format; bytes read from storage counted by the reader and, on S3, at the server; a peer
that damages what it sends, a peer killed mid-exchange, resharding with sharing on.
"""

from __future__ import annotations

import os
import re
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_atomic.exchange import Need, plan_exchange
from tests.harness import assert_all_ok, run_world
from tests.helpers.read_once import _blank, _state, _survivors_barrier

RUN = "exp"
pytestmark = pytest.mark.timeout(240)

TOP_KEYS = {"embed", "norm", "empty", "hsdp", "extra", "layers"}  # shared keys of _state
FORMATS = {1: {}, 2: {"compression": "zstd"}, 3: {"stock_readable": True}}  # step -> writer options


# -- rank functions ----------------------------------------------------------------------------


def _check(rank: int, step: int, got: dict) -> list[str]:
    return _differences(_state(rank, step), got)


def _differences(want, have, where: str = "") -> list[str]:
    if isinstance(want, dict) and all(isinstance(v, torch.Tensor) for v in want.values()) and where:
        return [d for k in want for d in _differences(want[k], have[k], f"{where}.{k}")]
    if isinstance(want, dict) and not where:
        return [d for k in want for d in _differences(want[k], have[k], k)]
    if hasattr(want, "to_local"):
        want, have = want.to_local(), have.to_local()
    same = torch.equal(have, want) if isinstance(want, torch.Tensor) else have == want
    return [] if same else [where]


def _save_and_load(ctx, options_key=None):
    """Save each format, then load it with sharing on and off; per step: (wrong keys, stats on, stats off)."""
    from dcp_atomic import AtomicStorageReader, AtomicStorageWriter

    options = ctx.extra.get("storage_options")
    results = {}
    for step, writer_options in FORMATS.items():
        dcp.save(_state(ctx.rank, step), storage_writer=AtomicStorageWriter(
            ctx.root, RUN, step, timeout=30, storage_options=options, **writer_options))
        loads = {}
        for share in (True, False, None):
            got = _blank(ctx.rank)
            reader = AtomicStorageReader(ctx.root, RUN, step, timeout=30, share_reads=share, storage_options=options,
                                         share_buffer_bytes=ctx.extra.get("budget", 256 << 20))
            dcp.load(got, storage_reader=reader)
            loads[share] = (_check(ctx.rank, step, got), reader.read_stats.to_dict())
        results[step] = loads
    return results


def _stored_bytes(root: str, step: int) -> int:
    step_dir = os.path.join(root, RUN, f"step_{step:010d}")
    attempt = next(d for d in os.listdir(step_dir) if os.path.isdir(os.path.join(step_dir, d)))
    return sum(os.path.getsize(os.path.join(step_dir, attempt, f))
               for f in os.listdir(os.path.join(step_dir, attempt)) if f.endswith(".distcp"))


def test_replicas_read_each_stored_byte_once_in_every_format_and_load_exact(root):
    """The small exchange budget forces several rounds; sharing off is the control (each replica reads its copy)."""
    results = assert_all_ok(run_world(_save_and_load, 4, root, extra={"budget": 1 << 20}, timeout=200))
    for step in FORMATS:
        unique = _stored_bytes(root, step)
        on = [r[step][True] for r in results]
        off = [r[step][False] for r in results]
        assert all(wrong == [] for wrong, _ in on + off), (step, on, off)
        read_on = sum(stats["storage_bytes"] for _, stats in on)
        read_off = sum(stats["storage_bytes"] for _, stats in off)
        assert read_on <= 1.05 * unique, (step, read_on, unique)
        assert read_off >= 2.5 * unique, (step, read_off, unique)  # the control really reads R copies
        assert all(stats["rounds"] >= 2 for _, stats in on), on  # 4.4 MB items over a 1 MiB budget
        sent = sum(stats["peer_bytes_sent"] for _, stats in on)
        assert sent == sum(stats["peer_bytes_received"] for _, stats in on) and sent > unique
        assert all(stats["rounds"] == 0 and stats["peer_bytes_received"] == 0 for _, stats in off)
        # the default on one host's POSIX file system: read directly (the page cache already reads once)
        assert all(wrong == [] and stats["rounds"] == 0 for wrong, stats in (r[step][None] for r in results))


@pytest.mark.slow
def test_replicas_read_each_object_once_at_a_real_s3_server(s3_moto):
    """Counted at the server: GET bytes during the shared load are the stored bytes, once."""
    s3 = s3_moto
    extra = {"storage_options": s3.options()}
    assert_all_ok(run_world(_save_once, 4, s3.root, extra=extra, timeout=120))
    for share, at_most in ((True, 1.05), (False, None), (None, 1.05)):  # None: the default shares on S3
        s3.proxy.reset()
        assert_all_ok(run_world(_load_once, 4, s3.root, args=(share,), extra=extra, timeout=120))
        data_gets = [r for r in s3.proxy.requests("GET") if r.key.endswith(".distcp")]
        read = sum(r.reply_bytes for r in data_gets)
        unique = sum(o["Size"] for o in s3.client.list_objects_v2(Bucket=s3.bucket)["Contents"]
                     if o["Key"].endswith(".distcp"))
        if at_most:
            assert read <= at_most * unique, (read, unique)
        else:
            assert read >= 2.5 * unique, (read, unique)


def _save_once(ctx):
    from dcp_atomic import AtomicStorageWriter

    dcp.save(_state(ctx.rank, 1), storage_writer=AtomicStorageWriter(
        ctx.root, RUN, 1, timeout=30, storage_options=ctx.extra["storage_options"]))


def _load_once(ctx, share):
    from dcp_atomic import AtomicStorageReader

    got = _blank(ctx.rank)
    dcp.load(got, storage_reader=AtomicStorageReader(ctx.root, RUN, 1, timeout=30, share_reads=share,
                                                     storage_options=ctx.extra["storage_options"]))
    assert _check(ctx.rank, 1, got) == []


def _load_with_faults(ctx):
    """Save step 1; a load where rank 1 flips a byte of what it sends; then, through the manager, a load where
    rank 2 is killed mid-exchange (only the second part's outcome is returned)."""
    from dcp_atomic import AtomicStorageReader, AtomicStorageWriter, Callbacks, CheckpointManager
    from dcp_atomic._base import failpoints

    dcp.save(_state(ctx.rank, 1), storage_writer=AtomicStorageWriter(ctx.root, RUN, 1, timeout=30))
    failpoints.arm("read.exchange_send", "flip", rank=1)
    try:
        dcp.load(_blank(ctx.rank), storage_reader=AtomicStorageReader(ctx.root, RUN, 1, timeout=30, share_reads=True))
        flipped = "loaded"
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        flipped = repr(e)
    failpoints.disarm_all()
    stats = []
    manager = CheckpointManager(ctx.root, RUN, timeout=6, share_reads=True, callbacks=Callbacks(on_loaded=stats.append))
    manager.load(_blank(ctx.rank))
    shared = stats[-1]
    failpoints.arm("read.exchange_send", "kill", rank=2)
    started = time.monotonic()
    try:
        manager.load(_blank(ctx.rank))
        killed = "loaded"
    except Exception as e:  # noqa: BLE001
        killed = f"{type(e).__name__}: {e}"
    seconds = time.monotonic() - started
    _survivors_barrier(ctx, parties=[0, 1, 3])  # rank 0 hosts the store: it must outlive its peers' verdicts
    return flipped, shared, killed, seconds


def test_a_peer_that_damages_what_it_sends_is_named_and_a_killed_peer_fails_every_rank_in_bound(root):
    outcomes = run_world(_load_with_faults, 4, root, timeout=150, wait_for=[0, 1, 3])
    survivors = [o for o in outcomes if o.rank != 2]
    for outcome in survivors:
        assert outcome.ok, outcome.error
    flips = [o.value[0] for o in survivors]
    # Every rank's load fails (DCP gathers read errors); the receivers of rank 1's bytes name it and the key.
    assert all(f != "loaded" for f in flips), flips
    named = [f for f in flips if "CorruptCheckpointError" in f and "received from rank 1" in f]
    keys = {k for f in named for k in re.findall(r"item '([^']+)'", f)}
    assert named and keys and all(k.split(".")[0] in TOP_KEYS for k in keys), (keys, flips)
    shared = [o.value[1] for o in survivors]
    assert all(s["bytes_from_peers"] > 0 and s["bytes_from_storage"] < s["bytes"] for s in shared), shared
    for outcome in survivors:
        _, _, killed, seconds = outcome.value
        assert killed.startswith("RankFailureError") and "2" in killed, killed
        assert seconds < 60, seconds  # within a few timeouts (6 s), never a hang
    assert outcomes[2].killed


def _load_expecting_failure(ctx):
    from dcp_atomic import AtomicStorageReader, AtomicStorageWriter

    dcp.save(_state(ctx.rank, 1), storage_writer=AtomicStorageWriter(ctx.root, RUN, 1, timeout=30))
    started = time.monotonic()
    try:
        dcp.load(_blank(ctx.rank), storage_reader=AtomicStorageReader(ctx.root, RUN, 1, timeout=30, share_reads=True))
        return "loaded", time.monotonic() - started
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        return repr(e), time.monotonic() - started


def test_a_storage_error_on_one_rank_ends_every_rank_s_shared_load_at_once_with_that_error(root):
    """Rank 1's storage read fails before any byte moves: its peers learn it at the round's status collective
    instead of waiting for its bytes, and DCP raises rank 1's own error on every rank."""
    outcomes = run_world(_load_expecting_failure, 4, root, env={"DCP_ATOMIC_FAILPOINTS": "read.before_data@1=raise"},
                         timeout=90, pg_timeout=60)
    for outcome in assert_all_ok(outcomes):
        error, seconds = outcome
        assert "injected I/O error" in error and "read.before_data" in error, error
        assert seconds < 20, seconds  # not the 60 s group timeout


def _reshard_shared(ctx):
    """Saved at dp2 x tp2 (FSDP2 + TP), loaded at tp4 with consent: the norm, sharded over dp at save, is
    replicated at tp4, so its stored chunks are shared; the TP weights are resharded into other pieces."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from dcp_atomic import AtomicLoadPlanner, AtomicStorageReader
    from tests.helpers.reshard import _build, _full, _save_layout

    saved = _save_layout(ctx, {"dp": 2, "tp": 2}, 1, 3)
    model = _build({"tp": 4}, seed=999)
    state = {"model": get_model_state_dict(model)}
    reader = AtomicStorageReader(ctx.root, "exp", 1, allow_reshard=True, timeout=30, share_reads=True)
    dcp.load(state, storage_reader=reader, planner=AtomicLoadPlanner())
    set_model_state_dict(model, state["model"])
    return saved, _full(model), reader.read_stats.to_dict()


def test_resharding_with_shared_reads_loads_exact(root):
    results = assert_all_ok(run_world(_reshard_shared, 4, root, timeout=150))
    for saved, loaded, _ in results:
        assert sorted(saved) == sorted(loaded)
        for key in saved:
            assert torch.equal(saved[key], loaded[key]), key
    assert all(stats["shared_items"] > 0 and stats["peer_bytes_received"] > 0 for _, _, stats in results), results


def _framework_style_shared_load(ctx):
    """As torchtitan and Lightning hold DCP: a location-less reader retargeted by ``checkpoint_id`` (here
    torchtitan's ``step-<N>``), loading on a subgroup it is told about; and a second reader NOT told about the
    subgroup, which must read directly (its default group is not DCP's world), never hang."""
    import torch.distributed as dist

    from dcp_atomic import AtomicStorageReader, AtomicStorageWriter

    dcp.save(_state(ctx.rank, 1), storage_writer=AtomicStorageWriter(ctx.root, RUN, 1, timeout=30))
    pair = dist.new_group([0, 1]), dist.new_group([2, 3])  # every rank creates every group, in one order
    group = pair[ctx.rank // 2]
    shared, direct = (AtomicStorageReader(share_reads=True, timeout=30, process_group=group),
                      AtomicStorageReader(share_reads=True, timeout=30))
    stats = []
    for reader in (shared, direct):
        got = _blank(ctx.rank)
        dcp.load(got, storage_reader=reader, checkpoint_id=os.path.join(ctx.root, RUN, "step-1"),
                 process_group=group)
        assert _check(ctx.rank, 1, got) == [], reader
        stats.append(reader.read_stats.to_dict())
    return stats


def test_a_location_less_reader_retargeted_by_checkpoint_id_shares_on_a_subgroup_it_is_given(root):
    """Two pairs load the same step each on their own subgroup: with the subgroup the pair shares; a reader
    left on the default group (whose size is not DCP's world) reads directly."""
    for shared, direct in assert_all_ok(run_world(_framework_style_shared_load, 4, root, timeout=150)):
        assert shared["rounds"] >= 1 and shared["peer_bytes_received"] > 0, shared
        assert direct["rounds"] == 0 and direct["peer_bytes_received"] == 0, direct


# -- the schedule, without processes (scale by simulation) ----------------------------------------------


def _replicated(world: int, items: int, size: int) -> tuple[dict, dict]:
    needs = {("k", (i,)): [Need(r, (0,), (size,)) for r in range(world)] for i in range(items)}
    return needs, {ident: size * 4 for ident in needs}


def test_schedule_balances_senders_bounds_rounds_and_leaves_disjoint_reads_alone():
    needs, lengths = _replicated(4, 40, 1000)
    needs[("split", (0,))] = [Need(0, (0,), (5,)), Need(1, (5,), (5,))]  # disjoint halves: read directly
    lengths[("split", (0,))] = 40
    needs[("only", (0,))] = [Need(3, (0,), (9,))]
    lengths[("only", (0,))] = 36
    plans = plan_exchange(needs, lengths, ["a", "a", "b", "b"], budget=16_000)
    fetched = [sum(lengths[i] for r in p.rounds for i in r.fetch) for p in plans]
    assert max(fetched) - min(fetched) <= 4000, fetched  # 160 kB over 4 ranks, one item apart
    assert all(("split", (0,)) not in p.idents and ("only", (0,)) not in p.idents for p in plans)
    assert len({len(p.rounds) for p in plans}) == 1 and len(plans[0].rounds) >= 10
    for n in range(len(plans[0].rounds)):
        for rank, p in enumerate(plans):
            held = sum(lengths[i] for i in p.rounds[n].fetch)
            held += sum(lengths[i] for _, idents, _ in p.rounds[n].receives for i in idents)
            assert held <= 16_000, (n, rank, held)
            # every message has a partner with the same tag and size
            for receiver, first, stop, tag in p.rounds[n].sends:
                match = [idents for sender, idents, t in plans[receiver].rounds[n].receives
                         if sender == rank and t == tag]
                assert match == [p.rounds[n].fetch[first:stop]]
    for rank, p in enumerate(plans):  # every rank gets every replicated item exactly once
        got = [i for r in p.rounds for i in r.fetch]
        got += [i for r in p.rounds for _, idents, _ in r.receives for i in idents]
        assert sorted(got) == sorted(i for i in needs if i[0] == "k"), rank


@pytest.mark.slow
def test_schedule_for_a_thousand_ranks_is_one_message_per_peer_per_round():
    """1,024 replicas of 1,000 small items: every rank reads ~1 item and each pair exchanges at most one message
    per round (items with one receiver set are packed back to back)."""
    needs, lengths = _replicated(1024, 1000, 256)
    plans = plan_exchange(needs, lengths, [f"h{r // 8}" for r in range(1024)], budget=256 << 20)
    assert len(plans[0].rounds) == 1
    counts = [len(p.rounds[0].fetch) for p in plans]
    assert max(counts) - min(counts) <= 1 and sum(counts) == 1000
    assert all(len(p.rounds[0].sends) == 1023 * (1 if p.rounds[0].fetch else 0) for p in plans)
