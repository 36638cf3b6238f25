"""Bounded staging (P16, G18): ``async_save`` with ``Staging`` holds the pool, not a host copy of the state; an
in-place change before ``wait_staged()`` fails the save on every rank with nothing committed; what is copied at the
call keeps its value at the call; the ``Stager`` alone feeds a sink within its pool, byte for byte."""

from __future__ import annotations

import hashlib
import io
import threading

import pytest
import torch

from dcp_atomic import ArgumentError, ArgumentTypeError, CheckpointManager, Staging, StagingRaceError
from dcp_atomic.staging import Stager
from tests.harness import assert_all_ok, run_world
from tests.helpers.tiers import _manager, _run

RUN = "exp"
MiB = 1 << 20


def _state(rank: int, tensors: int, mib: int) -> dict:
    """Rank-local keys (plain tensors of one key must agree across ranks), values that tell rank and key apart."""
    return {f"rank{rank}": {f"w{k}": torch.full((mib * MiB // 4,), float(rank * 100 + k)) for k in range(tensors)}}


def _rss_growth(action) -> int:
    """Peak resident memory above the level at the start of ``action``, in bytes (Linux: the high-water mark is
    reset through /proc/self/clear_refs, so what came before does not count)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")

    def kib(field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))

    before = kib("VmRSS")
    action()
    return (kib("VmHWM") - before) * 1024


def _save_and_measure(ctx, state_mib: int, pool_mib: int):

    state = _state(ctx.rank, tensors=state_mib // 32, mib=32)
    staging = Staging(pool_bytes=pool_mib * MiB, window_bytes=4 * MiB)
    growth = {}
    for step, (name, option) in enumerate([("staged", staging), ("stock", None)], start=1):
        with CheckpointManager(ctx.root, f"{RUN}-{name}", staging=option, timeout=60) as manager:
            def save():
                future = manager.async_save(step, state)
                manager.wait_staged()
                future.result()

            growth[name] = _rss_growth(save)
            loaded = {f"rank{ctx.rank}": {key: torch.empty_like(t) for key, t in state[f"rank{ctx.rank}"].items()}}
            manager.load(loaded)
            exact = all(torch.equal(loaded[f"rank{ctx.rank}"][key], t) for key, t in state[f"rank{ctx.rank}"].items())
            growth[f"{name}_exact"] = exact
    return growth


def test_async_save_with_staging_grows_host_memory_by_the_pool_not_by_the_state(root):
    state_mib, pool_mib, slack_mib = 256, 16, 48  # slack: DCP's plans and metadata, the writer's threads, allocator
    for rank, growth in enumerate(assert_all_ok(run_world(_save_and_measure, 2, root, args=(state_mib, pool_mib),
                                                          timeout=120))):
        assert growth["staged_exact"] and growth["stock_exact"], growth
        assert growth["staged"] <= (pool_mib + slack_mib) * MiB, (rank, growth["staged"] / MiB)
        assert growth["stock"] >= 0.9 * state_mib * MiB, (rank, growth["stock"] / MiB)  # DCP's copy of the state


def _race(ctx):
    """Step 1 committed; step 2 with ``w0`` changed on rank 1 while the writer waits at its first byte (a failpoint
    that holds it until the change is made); step 3 the same change after ``wait_staged()``."""
    from dcp_atomic._base import failpoints

    state = _state(ctx.rank, tensors=2, mib=2)
    live = state[f"rank{ctx.rank}"]
    changed = threading.Event()
    failpoints.arm("write.before_data", lambda rank, step: changed.wait(30))
    outcome = {}
    with CheckpointManager(ctx.root, RUN, staging=Staging(pool_bytes=4 * MiB, window_bytes=MiB),
                           timeout=30) as manager:
        outcome["waited_with_no_save"] = manager.wait_staged()
        manager.async_save(1, state)
        changed.set()
        manager.wait()
        at_step_1 = {key: t.clone() for key, t in live.items()}
        changed.clear()
        future = manager.async_save(2, state)
        if ctx.rank == 1:
            live["w0"].add_(1)  # an optimizer.step() before wait_staged()
        changed.set()
        outcome["waited"] = manager.wait_staged()
        try:
            future.result()
            outcome["step2"] = "committed"
        except StagingRaceError as e:
            outcome["step2"] = (type(e).__name__, e.details)
        outcome["steps_after_race"] = manager.steps()
        loaded = {f"rank{ctx.rank}": {key: torch.empty_like(t) for key, t in live.items()}}
        outcome["loaded_step"] = manager.load(loaded)
        outcome["previous_exact"] = all(torch.equal(loaded[f"rank{ctx.rank}"][k], t) for k, t in at_step_1.items())

        future = manager.async_save(3, state)
        manager.wait_staged()
        at_step_3 = {key: t.clone() for key, t in live.items()}
        live["w0"].add_(1)  # after wait_staged(): the save has read it already
        future.result()
        manager.load(loaded, step=3)
        outcome["step3_exact"] = all(torch.equal(loaded[f"rank{ctx.rank}"][k], t) for k, t in at_step_3.items())
    return outcome


def test_an_in_place_change_before_wait_staged_fails_the_save_on_every_rank_and_commits_nothing(root):
    for outcome in assert_all_ok(run_world(_race, 2, root, timeout=90)):
        assert outcome["step2"] == ("StagingRaceError", {"step": 2, "rank": 1, "key": "rank1.w0"}), outcome
        assert outcome["steps_after_race"] == [1] and outcome["loaded_step"] == 1, outcome
        assert outcome["previous_exact"] and outcome["step3_exact"], outcome
        assert outcome["waited_with_no_save"] == 0.0, outcome


def test_a_pool_smaller_than_one_window_is_an_argument_error_naming_both_numbers(tmp_path):
    with pytest.raises(ArgumentError) as refused:
        Staging(pool_bytes=MiB, window_bytes=4 * MiB)
    assert f"pool_bytes={MiB}" in str(refused.value) and f"window_bytes={4 * MiB}" in str(refused.value)
    assert refused.value.details["argument"] == "Staging(pool_bytes=...)"
    with pytest.raises(ArgumentError, match=r"Staging\(window_bytes=\.\.\.\)"):
        Staging(pool_bytes=MiB, window_bytes=0)
    with pytest.raises(ArgumentTypeError, match=r"Staging\(eager=\.\.\.\)"):
        Staging(eager="model.bn")  # a string is not a tuple of prefixes
    with pytest.raises(ArgumentTypeError, match=r"CheckpointManager\(staging=\.\.\.\)"):
        CheckpointManager(tmp_path, RUN, staging={"pool_bytes": MiB})


def test_the_eager_rule_copies_small_tensors_and_the_named_prefixes_whatever_their_size():
    staging = Staging(eager=("model.bn",))
    assert staging.copies_eagerly("model.fc.weight", None, MiB) and not staging.copies_eagerly("model.fc.weight", None,
                                                                                                 MiB + 1)
    assert staging.copies_eagerly("model.bn", None, 1 << 30) and staging.copies_eagerly("model.bn.mean", None, 1 << 30)
    assert not staging.copies_eagerly("model.bnx.mean", None, 1 << 30)  # a prefix of whole key parts


def _eager_items(ctx):
    """A BatchNorm-like buffer and a plain object changed after the call, while the writer is held at its first
    byte: they were copied at the call, so the save commits their values at the call."""
    import numpy

    from dcp_atomic import Callbacks
    from dcp_atomic._base import failpoints

    state = {f"rank{ctx.rank}": {"weight": torch.ones(MiB), "running_mean": torch.zeros(16)},
             "progress": {"epoch": 3, "seen": [1, 2], "rng": numpy.arange(4)}}
    changed = threading.Event()
    failpoints.arm("write.before_data", lambda rank, step: changed.wait(30))
    saved = []
    with CheckpointManager(ctx.root, RUN, staging=Staging(pool_bytes=8 * MiB, window_bytes=MiB),
                           callbacks=Callbacks(on_saved=saved.append), timeout=30) as manager:
        future = manager.async_save(1, state)
        state[f"rank{ctx.rank}"]["running_mean"].add_(5)  # forward mutates buffers before wait_staged()
        state["progress"]["epoch"] = 99
        state["progress"]["seen"].append(3)
        state["progress"]["rng"][0] = 99  # a mutable leaf (numpy RNG state), not a container the stager rebuilds
        changed.set()
        future.result()
        loaded = {f"rank{ctx.rank}": {"weight": torch.empty(MiB), "running_mean": torch.empty(16)},
                  "progress": {"epoch": -1, "seen": None, "rng": None}}
        manager.load(loaded)
    progress = {**loaded["progress"], "rng": loaded["progress"]["rng"].tolist()}
    return torch.equal(loaded[f"rank{ctx.rank}"]["running_mean"], torch.zeros(16)), progress, saved


def test_items_copied_at_the_call_may_change_afterwards_and_are_saved_as_they_were(root):
    outcomes = assert_all_ok(run_world(_eager_items, 2, root, timeout=60))
    for mean_at_call, progress, _ in outcomes:
        assert mean_at_call and progress == {"epoch": 3, "seen": [1, 2], "rng": [0, 1, 2, 3]}, progress
    stats = outcomes[0][2][0]  # rank 0's on_saved: the staging's figures (docs/statistics.md)
    assert stats["pool_bytes"] == 8 * MiB and 0.0 < stats["stage_call_seconds"] <= stats["stage_seconds"], stats
    assert stats["stage_wait_seconds"] == 0.0 and 0 < stats["peak_host_bytes"] <= 8 * MiB + MiB, stats


class _RecordingSink:
    """Every window the stager hands over, checked against the pool as it arrives."""

    def __init__(self, stager: Stager, hold: threading.Event | None = None) -> None:
        self.stager, self.hold = stager, hold
        self.data: dict[int, bytearray] = {}
        self.finished: list[int] = []
        self.largest_window = self.most_pool_bytes = 0

    def write(self, index: int, offset: int, data: memoryview) -> None:
        if self.hold is not None:
            self.hold.wait(30)
        self.largest_window = max(self.largest_window, len(data))
        self.most_pool_bytes = max(self.most_pool_bytes, self.stager.pool.allocated_bytes)
        item = self.data.setdefault(index, bytearray())
        assert offset == len(item), (index, offset, len(item))  # in order, no gap, no overlap
        item += data

    def finish(self, index: int) -> None:
        self.finished.append(index)


def test_the_stager_feeds_a_sink_window_by_window_within_its_pool_byte_for_byte():
    staging = Staging(pool_bytes=3 * MiB, window_bytes=MiB, eager_bytes=64 << 10)
    stager = Stager(staging)
    items = [("big", torch.arange(5 * MiB // 4, dtype=torch.int32)),  # five windows
             ("odd", torch.randn(MiB // 4 + 3)),  # one window and a bit
             ("buffer", torch.randn(100)),  # small: eager
             ("strided", torch.randn(512, 512).t()),  # not laid out flat: eager
             ("empty", torch.empty(0)),
             ("progress", {"epoch": 3})]
    sink = _RecordingSink(stager)
    staged = stager.stage(items, sink, step=7, rank=0)
    assert staged.wait() >= 0.0
    staged.result()
    assert sorted(sink.finished) == list(range(len(items)))
    assert sink.largest_window <= staging.window_bytes and sink.most_pool_bytes <= staging.pool_bytes, (
        sink.largest_window, sink.most_pool_bytes)
    for index, (key, value) in enumerate(items[:-1]):
        expected = value.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        assert bytes(sink.data.get(index, b"")) == expected, key
    assert torch.load(io.BytesIO(bytes(sink.data[len(items) - 1])), weights_only=True) == {"epoch": 3}
    assert staged.peak_host_bytes <= staging.pool_bytes + 2 * MiB  # the pool and the eager copies


class _DigestSink:
    """Keeps a digest per item and nothing else, so that the host memory measured is the stager's own."""

    def __init__(self) -> None:
        self.hashes: dict[int, "hashlib._Hash"] = {}
        self.finished: list[int] = []

    def write(self, index: int, offset: int, data: memoryview) -> None:
        self.hashes.setdefault(index, hashlib.sha256()).update(data)

    def finish(self, index: int) -> None:
        self.finished.append(index)


def test_a_state_of_small_tensors_is_staged_within_the_pool_each_written_into_the_sink_at_the_call():
    """Every FSDP shard at scale is small (eager): 128 MiB of 256 KiB tensors through an 8 MiB pool must not be
    held as a host copy beside the sink (it was: the whole state, copied at the call and written later)."""
    staging = Staging(pool_bytes=8 * MiB, window_bytes=8 * MiB)  # eager_bytes: 1 MiB, so every tensor is eager
    stager = Stager(staging)
    items = [(f"layers.{i}.weight", torch.full((MiB // 16,), float(i))) for i in range(512)]
    sink = _DigestSink()
    staged = []
    growth = _rss_growth(lambda: staged.append(stager.stage(items, sink, step=1, rank=0)))
    assert growth < 24 * MiB, f"staging grew host memory by {growth / MiB:.1f} MiB with an 8 MiB pool"
    assert sorted(sink.finished) == list(range(len(items)))  # written at the call, before stage() returned
    staged[0].result()
    assert staged[0].peak_host_bytes <= staging.pool_bytes
    for index, (_, tensor) in enumerate(items):
        assert sink.hashes[index].digest() == hashlib.sha256(tensor.numpy().tobytes()).digest()


def test_an_async_save_of_small_tensors_packs_their_copies_into_the_pool_and_reads_the_rest_live(tmp_path):
    """The same state through ``async_save``: its copies at the call were host memory beside the pool (+130 MiB);
    now they are packed into the pool's windows (all but one) and the small tensors that find no room are read
    live, as large ones are.  The saved step is the state at the call, exactly."""
    from dcp_atomic import Callbacks

    staging = Staging(pool_bytes=8 * MiB, window_bytes=2 * MiB)
    state = {"layers": {f"{i}.weight": torch.full((MiB // 16,), float(i)) for i in range(512)}}
    saved = []
    with CheckpointManager(tmp_path, RUN, staging=staging, timeout=60,
                           callbacks=Callbacks(on_saved=saved.append)) as manager:
        futures = []
        growth = _rss_growth(lambda: futures.append(manager.async_save(1, state)))
        manager.wait_staged()
        futures[0].result()
        assert growth < 24 * MiB, f"async_save's call grew host memory by {growth / MiB:.1f} MiB with an 8 MiB pool"
        assert saved[0]["peak_host_bytes"] <= staging.pool_bytes, saved[0]
        loaded = {"layers": {key: torch.empty_like(t) for key, t in state["layers"].items()}}
        assert manager.load(loaded) == 1
    assert all(torch.equal(loaded["layers"][key], t) for key, t in state["layers"].items())


def test_a_small_tensor_the_pool_had_no_room_for_is_read_live_and_its_change_is_refused_with_what_to_do(tmp_path):
    """A pool of two windows (the manager's are 4 MiB blocks) packs copies into at most one (the writer keeps the
    other): ``bn`` and ``w0`` are copied into it at the call and may change at once; ``w1`` (as small by the rule)
    finds no room, is read live, and changing it before ``wait_staged()`` fails the save by name, saying how to
    have it copied."""
    from dcp_atomic._base import failpoints

    state = {"bn": torch.zeros(16), "w0": torch.ones(3 * MiB // 4), "w1": torch.full((3 * MiB // 4,), 2.0)}  # 3 MiB
    at_call = {key: t.clone() for key, t in state.items()}
    reading = threading.Event()
    failpoints.arm("write.before_data", lambda rank, step: reading.wait(30))
    staging = Staging(pool_bytes=8 * MiB, window_bytes=4 * MiB, eager_bytes=4 * MiB)
    with CheckpointManager(tmp_path, RUN, staging=staging, timeout=30) as manager:
        future = manager.async_save(1, state)
        state["bn"].add_(5)  # forward, before wait_staged(): copies made at the call
        state["w0"].add_(5)
        reading.set()
        future.result()
        loaded = {key: torch.empty_like(t) for key, t in state.items()}
        assert manager.load(loaded) == 1
        assert all(torch.equal(loaded[key], at_call[key]) for key in state), "the copies made at the call"
        reading.clear()
        future = manager.async_save(2, state)
        state["w1"].add_(1)
        reading.set()
        with pytest.raises(StagingRaceError) as raced:
            future.result()
        assert manager.steps() == [1]
    assert raced.value.details["key"] == "w1", raced.value.details
    assert "pool had none" in str(raced.value) and "Staging(eager=...)" in str(raced.value), str(raced.value)


def test_the_stager_aborts_a_tensor_changed_before_its_last_window_naming_its_key():
    staging = Staging(pool_bytes=MiB, window_bytes=MiB // 4)
    stager = Stager(staging)
    weight, hold = torch.zeros(MiB // 2), threading.Event()  # 2 MiB: eight windows, beyond eager_bytes
    sink = _RecordingSink(stager, hold)
    staged = stager.stage([("layer.weight", weight)], sink, step=5, rank=3)
    weight.add_(1)  # the sink holds the first window: the copy cannot have finished
    hold.set()
    assert staged.wait() >= 0.0
    with pytest.raises(StagingRaceError) as race:
        staged.result()
    assert race.value.details == {"step": 5, "rank": 3, "key": "layer.weight"}
    assert sink.finished == []


def _local_tier_race(ctx):
    """The local tier (two simulated nodes, one replica each): a step changed before ``wait_staged()`` on rank 3
    fails on every rank, and no local root holds it."""
    from dcp_atomic._base import failpoints

    manager = _manager(ctx, staging=Staging(pool_bytes=4 * MiB, window_bytes=MiB))
    state = _state(ctx.rank, tensors=2, mib=2)
    changed = threading.Event()
    failpoints.arm("write.before_data", lambda rank, step: changed.wait(30))
    manager.async_save(1, state)
    changed.set()
    manager.wait()
    changed.clear()
    future = manager.async_save(2, state)
    if ctx.rank == 3:
        state["rank3"]["w1"].mul_(2)
    changed.set()
    try:
        future.result()
        failed = None
    except StagingRaceError as e:
        failed = e.details
    steps = manager.steps(tier="local")
    manager.close()
    return failed, steps


def test_the_local_tier_fails_a_raced_step_on_every_rank_and_keeps_the_previous_one(root, nodes):
    for failed, steps in assert_all_ok(_run(_local_tier_race, root, nodes)):
        assert failed == {"step": 2, "rank": 3, "key": "rank3.w1"} and steps == [1], (failed, steps)


def _dtensor_shards_packed(ctx):
    """FSDP-like state: small DTensor shards (each rank's local shard packed into the pool at the call and rewrapped
    as a DTensor) changed right after the call, while the writer is held: the step holds the values at the call."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from dcp_atomic._base import failpoints

    mesh = init_device_mesh("cpu", (ctx.world_size,))
    state = {"layers": {f"{i}.weight": distribute_tensor(torch.full((64, 16), float(i)), mesh, [Shard(0)])
                        for i in range(8)}}
    at_call = {key: t.full_tensor().clone() for key, t in state["layers"].items()}
    reading = threading.Event()
    failpoints.arm("write.before_data", lambda rank, step: reading.wait(30))
    staging = Staging(pool_bytes=8 * MiB, window_bytes=4 * MiB)
    with CheckpointManager(ctx.root, RUN, staging=staging, timeout=30) as manager:
        future = manager.async_save(1, state)
        for t in state["layers"].values():
            t.to_local().add_(100)  # copies made at the call: the step keeps the values at the call
        reading.set()
        future.result()
        loaded = {"layers": {key: distribute_tensor(torch.zeros(64, 16), mesh, [Shard(0)]) for key in at_call}}
        manager.load(loaded)
    return all(torch.equal(loaded["layers"][key].full_tensor(), at_call[key]) for key in at_call)


def test_dtensor_shards_copied_at_the_call_are_packed_into_the_pool_and_saved_as_they_were(root):
    assert assert_all_ok(run_world(_dtensor_shards_packed, 2, root, timeout=90)) == [True, True]
