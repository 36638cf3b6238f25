"""End-to-end behaviour with real gloo process groups on CPU.

Each test starts fresh worlds through ``tests.harness.run_world`` (hard timeout,
killpg cleanup) and checks what a training job would observe.
"""

from __future__ import annotations

import json
import os

import torch

from dcp_atomic import latest_step, list_steps
from tests.harness import assert_all_ok, run_world

RUN = "exp"


# -- rank functions (module level: they travel to the workers by reference) -----------------


def _model(seed: int):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))


def _fsdp_train_and_save(ctx, step):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dcp_atomic import AtomicSavePlanner, AtomicStorageWriter, Parallelism

    mesh = init_device_mesh("cpu", (ctx.world_size,), mesh_dim_names=("dp",))
    model = _model(0)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    torch.manual_seed(1)
    model(torch.randn(4, 16)).sum().backward()
    optim.step()
    msd, osd = get_state_dict(model, optim)
    writer = AtomicStorageWriter(ctx.root, RUN, step, parallelism=Parallelism.from_device_mesh(mesh), timeout=20)
    dcp.save({"model": msd, "optim": osd}, storage_writer=writer, planner=AtomicSavePlanner())
    full = {k: v.full_tensor() for k, v in msd.items()}
    moments = {f"{k}.{m}": s[m].full_tensor() for k, s in osd["state"].items() for m in ("exp_avg", "exp_avg_sq")}
    return {"model": full, "moments": moments, "save_id": writer.save_id}


def _fsdp_load(ctx, step):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dcp_atomic import AtomicLoadPlanner, AtomicStorageReader, Parallelism

    mesh = init_device_mesh("cpu", (ctx.world_size,), mesh_dim_names=("dp",))
    model = _model(123)  # different init: values must come from the checkpoint
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    msd, osd = get_state_dict(model, optim)
    reader = AtomicStorageReader(ctx.root, RUN, step, parallelism=Parallelism.from_device_mesh(mesh), timeout=20)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, storage_reader=reader, planner=AtomicLoadPlanner())
    set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    msd, osd = get_state_dict(model, optim)
    full = {k: v.full_tensor() for k, v in msd.items()}
    moments = {f"{k}.{m}": s[m].full_tensor() for k, s in osd["state"].items() for m in ("exp_avg", "exp_avg_sq")}
    return {"model": full, "moments": moments, "step": reader.step}


def _plain_load(ctx, step):
    """World-size-1 job without FSDP: plain modules and optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from dcp_atomic import AtomicStorageReader

    model = _model(7)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    msd, osd = get_state_dict(model, optim)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, storage_reader=AtomicStorageReader(ctx.root, RUN, step, timeout=20))
    moments = {f"{k}.{m}": s[m] for k, s in sd["optim"]["state"].items() for m in ("exp_avg", "exp_avg_sq")}
    return {"model": dict(sd["model"]), "moments": moments}


def _mixed_state(rank: int, step: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(step)
    full = torch.randn(8, 6)
    return {
        "dtensor": distribute_tensor(full, mesh, [Shard(0)]),
        "replicated": torch.arange(12, dtype=torch.float32).reshape(3, 4) * step,
        "bf16": (torch.linspace(-1, 1, 64) * step).to(torch.bfloat16),
        "int": torch.tensor([step, 2, 3], dtype=torch.int64),
        "extra": {"step": step, "name": "run", "lrs": [0.1, 0.01]},
    }


def _save_mixed(ctx, step, overwrite=False):
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicSavePlanner, AtomicStorageWriter

    writer = AtomicStorageWriter(ctx.root, RUN, step, overwrite=overwrite, timeout=20)
    dcp.save(_mixed_state(ctx.rank, step), storage_writer=writer, planner=AtomicSavePlanner())
    return writer.save_id


def _load_mixed(ctx, step=None):
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageReader

    template = _mixed_state(ctx.rank, 0)
    for value in template.values():
        if isinstance(value, torch.Tensor):
            (value.to_local() if hasattr(value, "to_local") else value).zero_()
    reader = AtomicStorageReader(ctx.root, RUN, step, timeout=10)
    dcp.load(template, storage_reader=reader)
    expected = _mixed_state(ctx.rank, reader.step)
    for key in ("dtensor", "replicated", "bf16", "int"):
        got, want = template[key], expected[key]
        if hasattr(got, "full_tensor"):
            got, want = got.full_tensor(), want.full_tensor()
        assert torch.equal(got, want), f"rank {ctx.rank}: {key} differs after load"
    assert template["extra"] == expected["extra"], template["extra"]
    return {"step": reader.step, "save_id": reader.save_id}


# -- tests ----------------------------------------------------------------------------------


def test_fsdp2_model_and_optimizer_round_trip_then_reload_at_world_1(root):
    saved = assert_all_ok(run_world(_fsdp_train_and_save, 2, root, args=(5,)))
    assert saved[0]["save_id"] == saved[1]["save_id"], "all ranks must write one attempt"
    loaded = assert_all_ok(run_world(_fsdp_load, 2, root, args=(5,)))
    for rank_result in loaded:
        assert rank_result["step"] == 5
        for section in ("model", "moments"):
            for name, value in saved[0][section].items():
                assert torch.equal(rank_result[section][name], value), f"{section} {name}"
    single = assert_all_ok(run_world(_plain_load, 1, root, args=(5,)))[0]
    for name, value in saved[0]["model"].items():
        assert torch.equal(single["model"][name], value), name
    assert sorted(single["moments"]) == sorted(saved[0]["moments"])
    for name, value in saved[0]["moments"].items():
        assert torch.equal(single["moments"][name], value), name


def test_dtensor_plain_and_object_items_over_consecutive_saves(root):
    ids = [assert_all_ok(run_world(_save_mixed, 2, root, args=(step,)))[0] for step in (1, 2, 3)]
    assert len(set(ids)) == 3
    assert list_steps(root, RUN) == [1, 2, 3]
    latest = assert_all_ok(run_world(_load_mixed, 2, root))
    assert [r["step"] for r in latest] == [3, 3]
    older = assert_all_ok(run_world(_load_mixed, 2, root, args=(2,)))
    assert [r["save_id"] for r in older] == [ids[1]] * 2


def test_overwrite_false_refuses_before_writing_and_overwrite_true_replaces(root):
    first = assert_all_ok(run_world(_save_mixed, 2, root, args=(4,)))[0]
    step_dir = os.path.join(root, RUN, "step_0000000004")
    before = sorted(os.listdir(step_dir))
    refused = run_world(_save_mixed, 2, root, args=(4,))
    for outcome in refused:
        assert "CommitConflictError" in outcome.error_chain, outcome.error
        assert "already committed" in outcome.error
    assert sorted(os.listdir(step_dir)) == before, "a refused save must not create an attempt"
    second = assert_all_ok(run_world(_save_mixed, 2, root, args=(4, True)))[0]
    assert second != first
    marker = json.load(open(os.path.join(step_dir, "COMMITTED")))
    assert marker["save_id"] == second
    assert os.path.isdir(os.path.join(step_dir, first)), "the replaced attempt is left for gc, never rewritten"
    loaded = assert_all_ok(run_world(_load_mixed, 2, root, args=(4,)))
    assert {r["save_id"] for r in loaded} == {second}


def test_rank_killed_mid_save_leaves_previous_latest_loadable(root):
    assert_all_ok(run_world(_save_mixed, 2, root, args=(1,)))
    outcomes = run_world(
        _save_mixed, 2, root, args=(2,), rank_env=lambda r: {"DCP_ATOMIC_FAILPOINTS": "write.mid_data@1=kill"},
        pg_timeout=10, timeout=60,
    )
    assert outcomes[1].killed
    assert not outcomes[0].ok, "the surviving rank must see the failure"
    assert list_steps(root, RUN) == [1]
    assert latest_step(root, RUN) == 1
    assert not os.path.exists(os.path.join(root, RUN, "step_0000000002", "COMMITTED"))
    loaded = assert_all_ok(run_world(_load_mixed, 2, root))
    assert [r["step"] for r in loaded] == [1, 1]
    assert_all_ok(run_world(_save_mixed, 2, root, args=(2,)))  # the retry of the step succeeds
    assert list_steps(root, RUN) == [1, 2]


def test_rank0_crash_between_manifest_and_marker_leaves_nothing_visible(root):
    assert_all_ok(run_world(_save_mixed, 2, root, args=(1,)))
    outcomes = run_world(
        _save_mixed, 2, root, args=(2,), env={"DCP_ATOMIC_FAILPOINTS": "commit.after_manifest@0=kill"},
        pg_timeout=10, timeout=60,
    )
    assert outcomes[0].killed
    step_dir = os.path.join(root, RUN, "step_0000000002")
    attempts = [d for d in os.listdir(step_dir) if not d.startswith(".")]
    assert len(attempts) == 1 and os.path.exists(os.path.join(step_dir, attempts[0], "manifest.json"))
    assert "COMMITTED" not in os.listdir(step_dir)
    assert list_steps(root, RUN) == [1]
    loaded = assert_all_ok(run_world(_load_mixed, 2, root))
    assert [r["step"] for r in loaded] == [1, 1]


def test_crash_after_marker_before_latest_commits_and_latest_step_repairs_it(root):
    assert_all_ok(run_world(_save_mixed, 2, root, args=(1,)))
    outcomes = run_world(
        _save_mixed, 2, root, args=(2,), env={"DCP_ATOMIC_FAILPOINTS": "commit.after_marker@0=kill"},
        pg_timeout=10, timeout=60,
    )
    assert outcomes[0].killed
    latest = json.load(open(os.path.join(root, RUN, "LATEST")))
    assert latest["step"] == 1, "LATEST is written after the marker"
    assert latest_step(root, RUN) == 2  # scan finds the newer commit and repairs LATEST
    assert json.load(open(os.path.join(root, RUN, "LATEST")))["step"] == 2
    loaded = assert_all_ok(run_world(_load_mixed, 2, root))
    assert [r["step"] for r in loaded] == [2, 2]


def _two_node_env(rank: int) -> dict:
    return {"LOCAL_RANK": str(rank % 2), "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": str(rank // 2)}


def _save_repeatedly(ctx, steps):
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageWriter

    for step in steps:
        state = {f"shard_{ctx.rank}": torch.full((64,), float(step * 10 + ctx.rank)), "common": torch.ones(4) * step}
        dcp.save(state, storage_writer=AtomicStorageWriter(ctx.root, RUN, step, timeout=20))
    return True


def test_two_nodes_with_local_rank_0_each_save_repeatedly_into_one_directory(root):
    steps = list(range(1, 6))
    assert_all_ok(run_world(_save_repeatedly, 4, root, args=(steps,), rank_env=_two_node_env, timeout=120))
    assert list_steps(root, RUN) == steps
    for step in steps:
        step_dir = os.path.join(root, RUN, f"step_{step:010d}")
        entries = os.listdir(step_dir)
        attempts = [e for e in entries if e != "COMMITTED"]
        assert len(attempts) == 1, f"one attempt per step, no temp debris: {entries}"
        files = sorted(f for f in os.listdir(os.path.join(step_dir, attempts[0])) if f.endswith(".distcp"))
        assert {f.split("_")[2] for f in files} == {"0", "1", "2", "3"}, files


def _save_small(ctx, step):
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageWriter

    dcp.save({f"x{ctx.rank}": torch.ones(8)}, storage_writer=AtomicStorageWriter(ctx.root, RUN, step, timeout=20))
    return True


def test_duplicated_rank_in_environment_is_refused_before_any_data(root):
    outcomes = run_world(_save_small, 2, root, args=(1,), env={"RANK": "0"})
    for outcome in outcomes:
        assert "RankConsistencyError" in outcome.error_chain, outcome.error
        assert "RANK=0 is claimed by rank 0" in outcome.error and "rank 1" in outcome.error
    assert not os.path.exists(os.path.join(root, RUN, "step_0000000001")), "nothing may be written"


def test_world_size_env_disagreeing_with_process_group_is_refused(root):
    outcomes = run_world(_save_small, 2, root, args=(1,), env={"WORLD_SIZE": "4"})
    for outcome in outcomes:
        assert "RankConsistencyError" in outcome.error_chain
        assert "WORLD_SIZE=4" in outcome.error
    assert not os.path.exists(os.path.join(root, RUN, "step_0000000001"))


def _save_with_parallelism(ctx, tp, dp):
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageWriter, Parallelism

    writer = AtomicStorageWriter(ctx.root, RUN, 1, parallelism=Parallelism(tp=tp, dp=dp), timeout=20)
    dcp.save({f"x{ctx.rank}": torch.ones(2)}, storage_writer=writer)


def test_declared_parallelism_inconsistent_with_world_is_refused(root):
    outcomes = run_world(_save_with_parallelism, 2, root, args=(2, 2))
    for outcome in outcomes:
        assert "RankConsistencyError" in outcome.error_chain
        assert "does not match the 2 ranks" in outcome.error


def _load_with_injected_view(ctx):
    """Rank 1 pretends to have resolved another version (what a stale NFS cache causes)."""
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageReader

    class StaleReader(AtomicStorageReader):
        def prepare_local_plan(self, plan):
            plan = super().prepare_local_plan(plan)
            if ctx.rank == 1:
                plan.storage_data.save_id = "20200101T000000Z-00000000"
            return plan

    state = {"x0": torch.zeros(8), "x1": torch.zeros(8)}
    dcp.load(state, storage_reader=StaleReader(ctx.root, RUN, timeout=10))


def test_ranks_resolving_different_versions_fail_together_naming_who_saw_what(root):
    assert_all_ok(run_world(_save_small, 2, root, args=(1,)))
    outcomes = run_world(_load_with_injected_view, 2, root)
    for outcome in outcomes:
        assert "RankConsistencyError" in outcome.error_chain, outcome.error
        assert "rank 1" in outcome.error and "20200101T000000Z-00000000" in outcome.error


def _plain_async_save(ctx):
    """dcp.async_save with the writer alone (no manager), on its own gloo group as DCP requires."""
    from datetime import timedelta

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicSavePlanner, AtomicStorageWriter

    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=20))
    writer = AtomicStorageWriter(ctx.root, RUN, 9, timeout=20)
    future = dcp.async_save(_mixed_state(ctx.rank, 9), storage_writer=writer, planner=AtomicSavePlanner(),
                            process_group=group)
    getattr(future, "upload_completion", future).result(timeout=60)
    return writer.save_id


def test_plain_dcp_async_save_commits_in_the_background(root):
    ids = assert_all_ok(run_world(_plain_async_save, 2, root))
    assert ids[0] == ids[1] and list_steps(root, RUN) == [9]
    assert [r["step"] for r in assert_all_ok(run_world(_load_mixed, 2, root))] == [9, 9]


def _process_executor_async_save(ctx):
    """DCP's process-based async executor pickles the writer and rewrites RANK/WORLD_SIZE in its worker."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from dcp_atomic import AtomicSavePlanner, AtomicStorageWriter

    writer = AtomicStorageWriter(ctx.root, RUN, 3, timeout=20)
    future = dcp.async_save(_mixed_state(ctx.rank, 3), storage_writer=writer, planner=AtomicSavePlanner(),
                            async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    getattr(future, "upload_completion", future).result(timeout=120)
    return True


def test_process_based_async_executor_is_supported(root):
    assert_all_ok(run_world(_process_executor_async_save, 2, root, timeout=150))
    assert list_steps(root, RUN) == [3]
    manifest_ranks = _manifest_ranks(root, 3)
    assert [r["rank"] for r in manifest_ranks] == [0, 1]  # identities checked in the executor's workers
    assert [r["step"] for r in assert_all_ok(run_world(_load_mixed, 2, root))] == [3, 3]


def _manifest_ranks(root, step):
    step_dir = os.path.join(root, RUN, f"step_{step:010d}")
    save_id = json.load(open(os.path.join(step_dir, "COMMITTED")))["save_id"]
    return json.load(open(os.path.join(step_dir, save_id, "ranks.json")))["ranks"]  # sealed by manifest.json
