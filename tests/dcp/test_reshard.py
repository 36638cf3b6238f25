"""P6 with real DTensor tensor parallelism on CPU/gloo: consent, refusals, exact values."""

from __future__ import annotations

import json
import os

import pytest
import torch

from dcp_atomic import list_steps
from tests.harness import assert_all_ok, run_world
from tests.helpers.reshard import _build, _full, RUN, _save_layout


def _load_layout(ctx, layout, step, allow_reshard, reader_kwargs=None):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from dcp_atomic import AtomicLoadPlanner, AtomicStorageReader

    model = _build(layout, seed=999)  # different values: everything must come from the checkpoint
    state = {"model": get_model_state_dict(model)}
    reader = AtomicStorageReader(ctx.root, RUN, step, allow_reshard=allow_reshard, timeout=20, **(reader_kwargs or {}))
    dcp.load(state, storage_reader=reader, planner=AtomicLoadPlanner())
    set_model_state_dict(model, state["model"])
    return _full(model)


def _assert_same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def _manifest(root, step) -> dict:
    step_dir = os.path.join(root, RUN, f"step_{step:010d}")
    save_id = json.load(open(os.path.join(step_dir, "COMMITTED")))["save_id"]
    return json.load(open(os.path.join(step_dir, save_id, "manifest.json")))


@pytest.mark.slow
def test_tp2_to_tp1_needs_consent_then_loads_exact_and_back(root):
    saved = assert_all_ok(run_world(_save_layout, 2, root, args=({"tp": 2}, 1, 1)))[0]
    manifest = _manifest(root, 1)
    ranks = json.load(open(os.path.join(root, RUN, "step_0000000001", manifest["save_id"], "ranks.json")))["ranks"]
    assert manifest["parallelism"]["tp"] == 2 and ranks[0]["parallelism_source"] == "inferred"
    assert manifest["keys"]["model.up.weight"]["kind"] == "dtensor"
    assert manifest["keys"]["model.up.weight"]["placements"] == ["Shard(dim=0)"]

    refused = run_world(_load_layout, 2, root, args=({"dp": 2}, 1, False))
    for outcome in refused:
        assert "ReshardError" in outcome.error_chain, outcome.error
        assert ("saved with tensor_parallel_size=2 (dp=1, pp=1, world=2); this job has tensor_parallel_size=1 "
                "(dp=2, pp=1, world=2); pass allow_reshard=True") in outcome.error
    for loaded in assert_all_ok(run_world(_load_layout, 2, root, args=({"dp": 2}, 1, True))):
        _assert_same(loaded, saved)

    saved_tp1 = assert_all_ok(run_world(_save_layout, 2, root, args=({"dp": 2}, 2, 2)))[0]
    for loaded in assert_all_ok(run_world(_load_layout, 2, root, args=({"tp": 2}, 2, True))):
        _assert_same(loaded, saved_tp1)


def test_fsdp2_plus_tp_world4_reloads_exactly_at_dp4_and_at_tp2_on_world2(root):
    saved = assert_all_ok(run_world(_save_layout, 4, root, args=({"dp": 2, "tp": 2}, 1, 3), timeout=120))[0]
    assert _manifest(root, 1)["parallelism"]["tp"] == 2 and _manifest(root, 1)["parallelism"]["dp"] == 2
    for loaded in assert_all_ok(run_world(_load_layout, 4, root, args=({"dp": 4}, 1, True), timeout=120)):
        _assert_same(loaded, saved)
    for loaded in assert_all_ok(run_world(_load_layout, 2, root, args=({"tp": 2}, 1, True))):
        _assert_same(loaded, saved)  # dp 2 -> 1 with tp kept: no consent needed


def test_layout_dependent_keys_are_refused_together_even_with_consent(root):
    assert_all_ok(run_world(_save_layout, 2, root, args=({"tp": 2}, 1, 1, {"layout_dependent": ["*.up.weight"]})))
    assert _manifest(root, 1)["keys"]["model.up.weight"]["layout_dependent"] is True
    outcomes = run_world(_load_layout, 2, root, args=({"dp": 2}, 1, True, {"layout_dependent": ["*.down.bias"]}))
    for outcome in outcomes:
        assert "ReshardError" in outcome.error_chain, outcome.error
        assert "2 key(s) cannot be loaded soundly" in outcome.error
        assert "'model.up.weight': declared layout-dependent" in outcome.error
        assert "'model.down.bias': declared layout-dependent" in outcome.error


def _save_divergent(ctx, case, divergence="raise"):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    from dcp_atomic import AtomicSavePlanner, AtomicStorageWriter

    state = {"ok": torch.ones(4), "step": 7}
    if case == "content":
        state["manual_shard"] = torch.full((4, 8), float(ctx.rank))
    elif case == "shape":
        state["manual_shard"] = torch.zeros(4 + ctx.rank, 8)
    elif case == "object":
        state["rng"] = {"seed": 1000 + ctx.rank}
    elif case == "replica":
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        state["replicated"] = DTensor.from_local(torch.ones(16) + (1e-3 if ctx.rank else 0.0), mesh, [Replicate()],
                                                 run_check=False)
    dcp.save(state, storage_writer=AtomicStorageWriter(ctx.root, RUN, 1, timeout=20),
             planner=AtomicSavePlanner(divergence=divergence))


def test_plain_tensors_objects_and_replicas_that_differ_across_ranks_are_refused_at_save(root):
    expectations = {
        "content": "'manual_shard': plain tensor differs across ranks (ranks 0 vs ranks 1); max |difference|",
        "shape": "'manual_shard': plain tensor with different shapes/dtypes across ranks (rank 0 [4, 8]",
        "object": "'rng.seed': object differs across ranks (ranks 0 vs ranks 1)",
        "replica": "'replicated': replicas of chunk at offset [0] diverged (ranks 0 vs ranks 1); max |difference| "
                   "over 16 sampled elements: 0.001",
    }
    for case, text in expectations.items():
        for outcome in run_world(_save_divergent, 2, root, args=(case,)):
            assert "ReshardError" in outcome.error_chain, (case, outcome.error)
            assert text in outcome.error, (case, outcome.error)
            assert "give each rank its own key" in outcome.error
        assert not os.path.exists(os.path.join(root, RUN, "step_0000000001")), f"{case}: nothing may be written"


def test_warn_mode_saves_rank_local_state_and_marks_it_per_rank(root):
    assert_all_ok(run_world(_save_divergent, 2, root, args=("content", "warn")))
    assert list_steps(root, RUN) == [1]
    keys = _manifest(root, 1)["keys"]
    assert keys["manual_shard"]["per_rank"] is True and "per_rank" not in keys["ok"]


def _load_with_changed_shapes(ctx):
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicLoadPlanner, AtomicStorageReader

    state = {"a": torch.zeros(4), "b": torch.zeros(3, 3), "c": torch.zeros(2)}
    dcp.load(state, storage_reader=AtomicStorageReader(ctx.root, RUN, 1, timeout=10), planner=AtomicLoadPlanner())


def _save_abc(ctx):
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicSavePlanner, AtomicStorageWriter

    state = {"a": torch.ones(4), "b": torch.ones(2, 3), "c": torch.ones(5)}
    dcp.save(state, storage_writer=AtomicStorageWriter(ctx.root, RUN, 1, timeout=20), planner=AtomicSavePlanner())


def test_every_key_whose_global_shape_changed_is_listed_in_one_error(root):
    assert_all_ok(run_world(_save_abc, 1, root))
    outcome = run_world(_load_with_changed_shapes, 1, root)[0]
    assert "ReshardError" in outcome.error_chain, outcome.error
    assert "2 key(s) cannot be loaded soundly" in outcome.error
    assert "'b': global shape changed [2, 3] -> [3, 3]" in outcome.error
    assert "'c': global shape changed [5] -> [2]" in outcome.error
