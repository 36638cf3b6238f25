"""Framework mesh names (DESIGN.md "Framework mesh names"): torchtitan's and Lightning's dims are read into the
right degrees from real DeviceMeshes, a tp / ep change under their names needs consent through AtomicLoadPlanner,
a cp change does not, and an unknown name is reported by name."""

from __future__ import annotations

import json
import logging
import os
import pickle

import pytest
import torch

from dcp_atomic import ConfigurationError, Parallelism
from tests.harness import assert_all_ok, run_world

pytestmark = pytest.mark.slow

RUN = "mesh"


def _degrees(p: Parallelism) -> dict[str, int]:
    return {"tp": p.tp, "dp": p.dp, "pp": p.pp, "cp": p.cp, "ep": p.ep, "world": p.world_size}


# -- reading real meshes -------------------------------------------------------------------------------------------


def _read_meshes(ctx):
    """Meshes named as torchtitan 0.3 and Lightning name them, built for real in a world of 4."""
    from torch.distributed.device_mesh import init_device_mesh

    cases = {
        "torchtitan dense (partial_dtensor)": (("pp", "dp_replicate", "fsdp", "tp"), (1, 1, 2, 2)),
        "torchtitan dense (full_dtensor)": (("pp", "dp_replicate", "dp_shard", "cp", "tp"), (1, 1, 1, 2, 2)),
        "torchtitan dense (spmd_types)": (("dp", "cp", "tp"), (2, 1, 2)),
        "torchtitan sparse": (("pp", "dp_replicate", "efsdp", "ep"), (1, 2, 1, 2)),
        "torchtitan dataloading": (("pp", "batch", "cp", "tp"), (2, 2, 1, 1)),
        "torchtitan hsdp": (("dp_replicate", "dp_shard"), (2, 2)),
        "lightning": (("data_parallel", "tensor_parallel"), (2, 2)),
    }
    out = {}
    for label, (names, shape) in cases.items():
        out[label] = _degrees(Parallelism.from_device_mesh(init_device_mesh("cpu", shape, mesh_dim_names=names)))
    errors = {}
    for label, names, shape in (("unknown", ("dp", "model"), (2, 2)), ("unnamed", None, (4,)),
                                ("flat world", ("world",), (4,))):
        try:
            Parallelism.from_device_mesh(init_device_mesh("cpu", shape, mesh_dim_names=names))
        except ConfigurationError as e:
            errors[label] = pickle.loads(pickle.dumps(e))  # errors cross ranks pickled (DCP)
    torch.distributed.barrier()  # rank 0 hosts the store the others still read while building the last groups
    return out, errors


def test_real_meshes_with_framework_names_read_into_degrees_and_unknown_names_are_named(root):
    results, errors = assert_all_ok(run_world(_read_meshes, 4, root))[0]
    assert results == {
        "torchtitan dense (partial_dtensor)": {"tp": 2, "dp": 2, "pp": 1, "cp": 1, "ep": 1, "world": 4},
        "torchtitan dense (full_dtensor)": {"tp": 2, "dp": 1, "pp": 1, "cp": 2, "ep": 1, "world": 4},
        "torchtitan dense (spmd_types)": {"tp": 2, "dp": 2, "pp": 1, "cp": 1, "ep": 1, "world": 4},
        "torchtitan sparse": {"tp": 1, "dp": 4, "pp": 1, "cp": 1, "ep": 2, "world": 4},
        "torchtitan dataloading": {"tp": 1, "dp": 2, "pp": 2, "cp": 1, "ep": 1, "world": 4},
        "torchtitan hsdp": {"tp": 1, "dp": 4, "pp": 1, "cp": 1, "ep": 1, "world": 4},
        "lightning": {"tp": 2, "dp": 2, "pp": 1, "cp": 1, "ep": 1, "world": 4},
    }
    assert sorted(errors) == ["flat world", "unknown", "unnamed"]
    assert "unknown device-mesh dimension name(s) ['model']" in str(errors["unknown"])
    assert errors["unknown"].details["unknown"] == ["model"]
    assert "mesh_dim_names" in str(errors["unnamed"])
    assert "'world': 4" in str(errors["flat world"]) and "only restates the others" in str(errors["flat world"])


def test_dims_from_several_meshes_merge_by_name_and_contradictions_are_refused():
    dense, sparse = (("dp_replicate", 2), ("fsdp", 2), ("tp", 1)), (("dp_replicate", 2), ("efsdp", 1), ("ep", 2))
    assert _degrees(Parallelism.from_mesh_dims([dense, sparse])) == {"tp": 1, "dp": 4, "pp": 1, "cp": 1, "ep": 2,
                                                                      "world": 4}
    with pytest.raises(ConfigurationError, match=r"efsdp=2 \* ep=2 is not dp_shard=2 \* cp=1 \* tp=1"):
        Parallelism.from_mesh_dims([dense, (("dp_replicate", 2), ("efsdp", 2), ("ep", 2))])
    with pytest.raises(ConfigurationError, match=r"'tp' is 2 on one mesh and 4 on another"):
        Parallelism.from_mesh_dims([(("tp", 2),), (("tp", 4),)])
    with pytest.raises(ConfigurationError, match=r"tp is given as \{'tp': 2, 'tensor_parallel': 4\}"):
        Parallelism.from_mesh_dims([(("tp", 2), ("tensor_parallel", 4))])


def test_manifests_and_callers_from_before_cp_and_ep_keep_their_meaning():
    old = {"tp": 2, "dp": 4, "pp": 1, "mesh_shape": [4, 2], "mesh_dim_names": ["dp", "tp"]}  # a schema-3 manifest
    assert Parallelism.from_dict(old) == Parallelism(2, 4, 1, (4, 2), ("dp", "tp"))  # positional, as before
    assert Parallelism.from_dict(old).describe() == "tensor_parallel_size=2 (dp=4, pp=1, world=8)"
    new = Parallelism(tp=2, dp=2, cp=2, ep=4)
    assert Parallelism.from_dict(json.loads(json.dumps(new.to_dict()))) == new
    assert new.describe() == "tensor_parallel_size=2 (dp=2, pp=1, cp=2, ep=4, world=8)"
    with pytest.raises(ValueError, match=r"Parallelism\(ep=\.\.\.\) must be a divisor of dp\*cp\*tp=2 .*, got 3"):
        Parallelism(dp=2, ep=3)


def test_torchtitans_own_parallel_dims_build_meshes_we_read(root):
    """What torchtitan's ParallelDims.build_mesh actually builds (every spmd backend), not our copy of its names."""
    pytest.importorskip("torchtitan")
    pytest.importorskip("spmd_types", reason="torchtitan 0.3's parallel_dims imports spmd_types "
                        "(pip install --no-deps spmd-types)")
    results = assert_all_ok(run_world(_torchtitan_parallel_dims, 4, root, timeout=120))[0]
    cp_tp = {"tp": 2, "dp": 1, "pp": 1, "cp": 2, "ep": 1, "world": 4}
    folded = {"tp": 2, "dp": 2, "pp": 1, "cp": 1, "ep": 1, "world": 4}  # "fsdp" folds cp in: read as data parallel
    moe = {"tp": 1, "dp": 4, "pp": 1, "cp": 1, "ep": 2, "world": 4}
    expected = {}
    for backend in ("partial_dtensor", "full_dtensor", "spmd_types"):
        expected[f"{backend} cp=2 tp=2 dense"] = folded if backend == "partial_dtensor" else cp_tp
        expected[f"{backend} cp=2 tp=2 dataloading"] = cp_tp
        expected[f"{backend} dp_replicate=2 dp_shard=2 ep=2 dense+sparse"] = moe
        expected[f"{backend} dp_replicate=2 dp_shard=2 ep=2 dataloading"] = {**moe, "ep": 1}
    assert results == expected


def _torchtitan_parallel_dims(ctx):
    from torchtitan.distributed import parallel_dims as module

    module.device_type = "cpu"  # torchtitan picks "cuda" where it finds no accelerator; these ranks are gloo/CPU
    out = {}
    for backend in ("partial_dtensor", "full_dtensor", "spmd_types"):
        for dims in ({"dp_replicate": 1, "dp_shard": 1, "cp": 2, "tp": 2, "pp": 1, "ep": 1},
                     {"dp_replicate": 2, "dp_shard": 2, "cp": 1, "tp": 1, "pp": 1, "ep": 2}):
            parallel_dims = module.ParallelDims(**dims, world_size=ctx.world_size, spmd_backend=backend)
            parallel_dims.build_mesh()
            meshes = parallel_dims._global_meshes  # what the model's DTensors live on, per region
            label = f"{backend} " + " ".join(f"{k}={v}" for k, v in dims.items() if v > 1)
            if dims["ep"] > 1:  # a MoE state dict holds DTensors on both the dense and the sparse mesh
                merged = Parallelism.from_mesh_dims(
                    [zip(m.mesh_dim_names, m.mesh.shape) for m in (meshes["dense"], meshes["sparse"])])
                out[label + " dense+sparse"] = _degrees(merged)
            else:
                out[label + " dense"] = _degrees(Parallelism.from_device_mesh(meshes["dense"]))
            out[label + " dataloading"] = _degrees(Parallelism.from_device_mesh(meshes["dataloading"]))
    torch.distributed.barrier()
    return out


# -- consent through AtomicLoadPlanner, with the frameworks' names -------------------------------------------------


def _tensor(shape, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator)


def _state(layouts, seed):
    """{key: DTensor}: each key's full value is fixed by ``seed``; ``layouts`` maps key -> (names, shape, placements)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    state = {}
    for i, (key, (names, shape, placements)) in enumerate(sorted(layouts.items())):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        state[key] = distribute_tensor(_tensor((8, 4), seed + i), mesh, placements)
    return state


def _save_then_load(ctx, save_layouts, load_layouts, declare=False):
    """Save under one layout; load under another without and then with consent.  Returns (refusal, loaded)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.device_mesh import init_device_mesh

    from dcp_atomic import AtomicLoadPlanner, AtomicSavePlanner, AtomicStorageReader, AtomicStorageWriter

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("dcp_atomic").addHandler(handler)
    logging.getLogger("dcp_atomic").setLevel(logging.INFO)

    saved = _state(save_layouts, seed=1)
    declared = None
    if declare:  # the job declares its layout from its one mesh (the identity check runs on it)
        names, shape, _ = next(iter(save_layouts.values()))
        declared = Parallelism.from_device_mesh(init_device_mesh("cpu", shape, mesh_dim_names=names))
    dcp.save(saved, storage_writer=AtomicStorageWriter(ctx.root, RUN, 1, parallelism=declared, timeout=20),
             planner=AtomicSavePlanner())
    refusal = None
    try:
        dcp.load(_state(load_layouts, seed=99), storage_reader=AtomicStorageReader(ctx.root, RUN, 1, timeout=20),
                 planner=AtomicLoadPlanner())
    except CheckpointException as e:  # DCP wraps the planner's ReshardError (a BaseException); the test reads it
        refusal = str(e)
    target = _state(load_layouts, seed=99)
    dcp.load(target, storage_reader=AtomicStorageReader(ctx.root, RUN, 1, allow_reshard=True, timeout=20),
             planner=AtomicLoadPlanner())
    loaded = {k: v.full_tensor() for k, v in target.items()}
    expected = {k: v.full_tensor() for k, v in saved.items()}
    return refusal, all(torch.equal(loaded[k], expected[k]) for k in expected), records


def _manifest(root) -> dict:
    step_dir = os.path.join(root, RUN, "step_0000000001")
    save_id = json.load(open(os.path.join(step_dir, "COMMITTED")))["save_id"]
    return json.load(open(os.path.join(step_dir, save_id, "manifest.json")))


def test_lightning_tensor_parallel_2_loaded_at_1_needs_consent_then_loads_exactly(root):
    from torch.distributed.tensor import Replicate, Shard

    save = {"w": (("data_parallel", "tensor_parallel"), (1, 2), [Replicate(), Shard(0)])}
    load = {"w": (("data_parallel", "tensor_parallel"), (2, 1), [Shard(0), Replicate()])}
    for refusal, exact, _ in assert_all_ok(run_world(_save_then_load, 2, root, args=(save, load))):
        assert refusal is not None and "ReshardError" in refusal, refusal
        assert ("saved with tensor_parallel_size=2 (dp=1, pp=1, world=2); this job has tensor_parallel_size=1 "
                "(dp=2, pp=1, world=2)") in refusal
        assert exact
    assert _manifest(root)["parallelism"]["tp"] == 2


def test_torchtitan_expert_parallel_change_needs_consent_then_loads_exactly(root):
    from torch.distributed.tensor import Shard

    save = {"dense": (("dp_replicate", "fsdp", "tp"), (1, 4, 1), [Shard(0)] * 3),
            "experts": (("dp_replicate", "efsdp", "ep"), (1, 2, 2), [Shard(0), Shard(1), Shard(0)])}
    load = {"dense": (("dp_replicate", "fsdp", "tp"), (1, 4, 1), [Shard(0)] * 3),
            "experts": (("dp_replicate", "efsdp", "ep"), (1, 4, 1), [Shard(0), Shard(1), Shard(0)])}
    for refusal, exact, _ in assert_all_ok(run_world(_save_then_load, 4, root, args=(save, load), timeout=120)):
        assert refusal is not None and "ReshardError" in refusal, refusal
        assert "saved with tensor_parallel_size=1 (dp=4, pp=1, ep=2, world=4); this job has " \
               "tensor_parallel_size=1 (dp=4, pp=1, world=4)" in refusal
        assert exact
    assert _manifest(root)["parallelism"]["ep"] == 2


def test_torchtitan_context_parallel_change_is_a_data_parallel_reshard(root):
    from torch.distributed.tensor import Replicate, Shard

    save = {"w": (("dp_shard", "cp", "tp"), (1, 2, 2), [Shard(0), Replicate(), Shard(1)])}
    load = {"w": (("dp_shard", "cp", "tp"), (2, 1, 2), [Shard(0), Replicate(), Shard(1)])}
    outcomes = assert_all_ok(run_world(_save_then_load, 4, root, args=(save, load, True), timeout=120))
    for refusal, exact, records in outcomes:
        assert refusal is None, refusal  # no consent needed
        assert exact
    assert any("data-parallel reshard tensor_parallel_size=2 (dp=1, pp=1, cp=2, world=4) -> "
               "tensor_parallel_size=2 (dp=2, pp=1, world=4)" in r for r in outcomes[0][2]), outcomes[0][2]
    parallelism = _manifest(root)["parallelism"]
    assert (parallelism["cp"], parallelism["tp"], parallelism["dp"]) == (2, 2, 1)


def _save_unknown(ctx):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Replicate, Shard

    from dcp_atomic import AtomicSavePlanner, AtomicStorageWriter

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("dcp_atomic").addHandler(handler)
    state = _state({"w": (("shard", "model"), (1, 2), [Replicate(), Shard(0)])}, seed=1)
    dcp.save(state, storage_writer=AtomicStorageWriter(ctx.root, RUN, 1, timeout=20), planner=AtomicSavePlanner())
    return records


def test_unknown_mesh_dim_names_are_warned_by_name_and_no_layout_is_guessed(root):
    records = assert_all_ok(run_world(_save_unknown, 2, root))[0]
    assert any("unknown device-mesh dimension name(s) ['model', 'shard']" in r and "layout checks are skipped" in r
               for r in records), records
    assert _manifest(root)["parallelism"] is None
