"""The private names of torch, s3fs, gcsfs and CPython that dcp_atomic relies on (``dcp_atomic/_base/internals.py``), pinned
against the installed releases: each test says which internal a new release moved, before a save meets it.
``scripts/test_torch_matrix.sh`` runs this file on torch 2.14.1 and 2.15.0 too.

And the rule that keeps them pinnable: no other module of the package touches a private name of these libraries.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import pickle

import fsspec.asyn
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlanner

from dcp_atomic._base import internals
from tests.harness import assert_all_ok, run_world

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "dcp_atomic")
#: the libraries whose private names only internals.py may use
_VENDORS = ("torch", "s3fs", "gcsfs", "fsspec", "aiobotocore", "botocore")
#: private attributes of those libraries' objects, as the package used them before they were gathered
_VENDOR_ATTRIBUTES = {
    "_get_default_store", "_call_s3", "_session_is_owned", "_pipe_file", "_request", "_location", "_endpoint",
    "_enable_plan_caching", "_cached_plans_key", "_pending_local_plan", "_cached_all_plans", "_cached_global_plan",
    "_cached_metadata", "_cached_save_plan", "_cached_final_save_plan", "_register_atexit",
}


def _offences(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in _VENDORS:
            found += [f"from {node.module} import {a.name}" for a in node.names if a.name.startswith("_")]
        elif isinstance(node, ast.Attribute) and node.attr in _VENDOR_ATTRIBUTES:
            found.append(f".{node.attr}")
        elif isinstance(node, ast.Constant) and node.value in _VENDOR_ATTRIBUTES:  # getattr(x, "_name")
            found.append(f"{node.value!r}")
    return found


def test_no_module_but_internals_touches_a_private_name_of_torch_s3fs_or_gcsfs():
    offences = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            path = os.path.join(folder, name)
            if name.endswith(".py") and path != internals.__file__:
                with open(path) as f:
                    found = _offences(ast.parse(f.read(), path))
                if found:
                    offences[os.path.relpath(path, PACKAGE)] = found
    assert offences == {}, f"private library names outside _base/internals.py (wrap them there): {offences}"
    # the check itself sees each form it looks for
    assert _offences(ast.parse("from torch.x import _y\nfs._call_s3\ngetattr(p, '_enable_plan_caching')")) == [
        "from torch.x import _y", "._call_s3", "'_enable_plan_caching'"]


# --- torch.distributed.checkpoint -------------------------------------------------------------------------------


def test_stock_dcp_records_each_item_as_the_storage_info_the_writer_builds(tmp_path):
    """Stock FileSystemWriter's .metadata holds StorageInfo(relative_path, offset, length): the writer builds the
    same class, so stock readers open its attempts."""
    dcp.save({"w": torch.arange(6.0)}, checkpoint_id=str(tmp_path), no_dist=True)
    metadata = dcp.FileSystemReader(str(tmp_path)).read_metadata()
    infos = list(metadata.storage_data.values())
    assert infos and all(type(info) is internals.StorageInfo for info in infos)
    assert [f.name for f in dataclasses.fields(internals.StorageInfo)][:3] == ["relative_path", "offset", "length"]
    assert pickle.loads(pickle.dumps(internals.StorageInfo("a", 0, 1))) == internals.StorageInfo("a", 0, 1)


def test_tensor_properties_pickle_the_memory_format_codes_safe_pickle_decodes():
    from dcp_atomic.format.safe_pickle import _MEMORY_FORMATS

    properties = dcp.metadata.TensorProperties.create_from_tensor(torch.zeros(2, 3))
    state = properties.__getstate__()
    assert state[3] in _MEMORY_FORMATS  # (dtype, layout, requires_grad, memory_format, pin_memory[, strides])
    assert {member.name for member in internals.MEM_FORMAT_ENCODING} >= {
        "TORCH_CONTIGUOUS_FORMAT", "TORCH_CHANNELS_LAST", "TORCH_PRESERVE_FORMAT"}


def test_plan_caching_is_read_and_its_coordinator_caches_put_back_by_the_names_torch_uses():
    class Caching(DefaultSavePlanner):
        pass

    planner = Caching(enable_plan_caching=True)
    assert internals.caches_plans(planner) and not internals.caches_plans(DefaultSavePlanner())
    assert internals.plan_cache_key(planner) == "Caching"
    before = internals.coordinator_plan_caches()
    planner.set_up_planner({"w": torch.zeros(3)}, None, True)
    local = planner.create_local_plan()
    assert hasattr(planner, "_pending_local_plan")  # held until finish_plan caches it
    internals.forget_pending_local_plan(planner)
    assert not hasattr(planner, "_pending_local_plan")
    planner.create_global_plan([local])
    assert all("Caching" in getattr(SavePlanner, name) for name in before)  # the coordinator cached this plan
    internals.restore_coordinator_plan_caches(before)
    assert all("Caching" not in getattr(SavePlanner, name) for name in before)
    assert internals.coordinator_plan_caches() == before


def test_a_whole_step_loads_without_a_template_through_load_state_dict_from_keys(tmp_path):
    dcp.save({"w": torch.arange(4.0)}, checkpoint_id=str(tmp_path), no_dist=True)
    state = internals.load_state_dict_from_keys(storage_reader=dcp.FileSystemReader(str(tmp_path)))
    assert torch.equal(state["w"], torch.arange(4.0))


def _store_roundtrip(ctx):
    store = internals.default_store()
    store.set(f"internals/{ctx.rank}", str(ctx.rank))
    seen = sorted(store.get(f"internals/{r}").decode() for r in range(ctx.world_size))  # get waits for the key
    torch.distributed.barrier()  # the store lives in rank 0's process: it must outlive rank 1's reads
    return seen


def test_the_default_store_is_the_groups_rendezvous_store(tmp_path):
    results = assert_all_ok(run_world(_store_roundtrip, 2, str(tmp_path), timeout=120))
    assert results == [["0", "1"], ["0", "1"]]


# --- s3fs and gcsfs ---------------------------------------------------------------------------------------------


def test_s3fs_calls_botocore_without_its_retries_and_leaves_a_shared_session_open():
    s3fs = pytest.importorskip("s3fs")
    assert inspect.iscoroutinefunction(s3fs.S3FileSystem._call_s3)
    fs = s3fs.S3FileSystem(anon=True, skip_instance_cache=True)
    session = object()
    internals.share_s3_session(fs, session)
    assert fs.session is session and fs._session_is_owned is False
    assert "_session_is_owned" in inspect.getsource(s3fs.S3FileSystem)  # what close_session reads


def test_gcsfs_creates_exclusively_and_routes_every_request_through_one_function():
    gcsfs = pytest.importorskip("gcsfs")
    fs = gcsfs.GCSFileSystem(token="anon", endpoint_url="http://127.0.0.1:9", skip_instance_cache=True)
    assert internals.gcs_creates_exclusively(fs)
    assert internals.gcs_location(fs) == "http://127.0.0.1:9"
    assert inspect.iscoroutinefunction(type(fs)._request.__wrapped__)
    seen = []

    async def route(once, method, path, *args, **kwargs):
        seen.append((method, path))
        return "answered"

    internals.gcs_route_requests(fs, route)
    assert fsspec.asyn.sync(fs.loop, fs._request, "GET", "b/x/o") == "answered"  # what every gcsfs call awaits
    assert seen == [("GET", "b/x/o")]


# --- CPython ----------------------------------------------------------------------------------------------------


def test_a_function_run_before_the_thread_pools_stop_can_still_use_them():
    """What a manager never closed relies on at exit: its save in flight still gets its thread pools (an ``atexit``
    handler is refused them: "cannot schedule new futures after interpreter shutdown")."""
    import subprocess
    import sys

    script = ("import atexit, concurrent.futures as cf\n"
              "from dcp_atomic._base import internals\n"
              "def ask(who):\n"
              "    try:\n"
              "        print(who, cf.ThreadPoolExecutor(1).submit(lambda: 42).result())\n"
              "    except RuntimeError as e:\n"
              "        print(who, e)\n"
              "atexit.register(ask, 'atexit:')\n"
              "internals.before_thread_pools_stop(ask, 'before the pools stop:')\n")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(PACKAGE))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["before the pools stop: 42",
                                        "atexit: cannot schedule new futures after interpreter shutdown"], done.stdout


#: the private attributes of Accelerate's and Lightning's objects that the integrations use (each pinned below)
_FRAMEWORK_PRIVATES = {
    "accelerate": {"_models", "_optimizers", "_schedulers", "_dataloaders", "_custom_objects",
                   "_save_model_state_pre_hook", "_load_model_state_pre_hook"},
    "lightning": {"_checkpoint_connector"},
}


def _private_attributes_used(module: str) -> set[str]:
    """Private attributes the integration module reads on objects other than its own (``self``/``cls``)."""
    with open(os.path.join(PACKAGE, "integrations", f"{module}.py")) as f:
        tree = ast.parse(f.read())
    own = {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    own |= {target.attr for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign))
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"}
    used = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
                and node.attr not in own):
            used.add(node.attr)
    return used


def test_the_private_attributes_of_accelerate_and_lightning_the_integrations_use_exist_in_the_installed_releases():
    """Pinned as torch's are: a release that renames one fails here, naming it, before a user's save meets it; and
    the integrations use no other private name of theirs without adding it here."""
    from accelerate import Accelerator
    import lightning.pytorch as pl

    assert _private_attributes_used("accelerate") <= _FRAMEWORK_PRIVATES["accelerate"], (
        _private_attributes_used("accelerate"))
    assert _private_attributes_used("lightning") <= _FRAMEWORK_PRIVATES["lightning"], (
        _private_attributes_used("lightning"))
    accelerator = Accelerator(cpu=True)
    missing = [name for name in sorted(_FRAMEWORK_PRIVATES["accelerate"]) if not hasattr(accelerator, name)]
    trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    missing += [name for name in sorted(_FRAMEWORK_PRIVATES["lightning"]) if not hasattr(trainer, name)]
    assert not missing, missing
    assert callable(trainer._checkpoint_connector.dump_checkpoint)  # what lightning.py calls on it
    assert len(accelerator._save_model_state_pre_hook) == len(accelerator._load_model_state_pre_hook) == 0
