"""Torch versions: checkpoints move between torch releases (2.13 is the floor; 2.14.1 and 2.15.0 are tested too).

* A ``.metadata`` written by torch 2.15, whose ``TensorProperties`` pickles a ``strides`` field, loads exactly on
  an older torch (it used to be refused as corrupt while ``verify`` said OK); a state no known release writes is a
  :class:`TorchVersionError` naming both torch versions, never corruption.
* torch 2.14's ``CheckpointableTensor`` (a local tensor saved as part of a global one) loads through
  AtomicLoadPlanner without a false "global shape changed".
* Saved on one torch, loaded on the other, both ways (runs where a second interpreter exists:
  ``DCP_ATOMIC_OTHER_PYTHON``, or ``/work/venv214/bin/python`` as ``scripts/test_torch_matrix.sh`` builds it).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
    _MEM_FORMAT_ENCODING,
)

from dcp_atomic import AtomicStorageReader, AtomicStorageWriter, CheckpointError, CorruptCheckpointError
from dcp_atomic import TorchVersionError
from dcp_atomic.format.safe_pickle import load_dcp_metadata
from tests.harness import assert_all_ok, run_world
from tests.helpers.torch_versions import RUN, _assert_loaded, _state, _zeros

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TORCH = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


def _metadata_file(root, step=1) -> str:
    step_dir = os.path.join(root, RUN, f"step_{step:010d}")
    save_id = json.load(open(os.path.join(step_dir, "COMMITTED")))["save_id"]
    return os.path.join(step_dir, save_id, ".metadata")


def _save_as_newer_torch(root, monkeypatch, extra_fields) -> None:
    """Save as a torch whose TensorProperties pickles ``extra_fields(properties)`` after the five fields every
    release pickles, and which the manifest records as torch 2.15.0: DCP's own pickling changes, every digest
    stays consistent.  The same bytes on every torch: 2.15's own ``__getstate__`` already appends ``strides``, so
    only its first five fields are kept (``+ extra_fields`` on all six pickled strides twice there)."""
    create, getstate = TensorProperties.create_from_tensor, TensorProperties.__getstate__

    def create_from_tensor(tensor):
        properties = create(tensor)
        properties.strides = tuple(tensor.stride())  # what 2.15's create_from_tensor records
        return properties

    with monkeypatch.context() as patch:
        patch.setattr(TensorProperties, "create_from_tensor", staticmethod(create_from_tensor))
        patch.setattr(TensorProperties, "__getstate__", lambda self: getstate(self)[:5] + extra_fields(self))
        patch.setattr(torch, "__version__", "2.15.0")
        dcp.save(_state(), storage_writer=AtomicStorageWriter(root, RUN, 1), no_dist=True)


# -- torch 2.15's strides -----------------------------------------------------------------------------------------


def test_metadata_with_torch_215_strides_loads_exactly_and_verifies(root, monkeypatch):
    _save_as_newer_torch(root, monkeypatch, lambda p: (getattr(p, "strides", None),))
    data = open(_metadata_file(root), "rb").read()
    if TORCH < (2, 15):
        with pytest.raises(ValueError, match="too many values to unpack"):
            pickle.loads(data)  # the fixture is what older torch cannot read with its own classes
    else:  # and what 2.15 itself writes: its own classes read it
        assert pickle.loads(data).state_dict_metadata["transposed"].properties.strides == (1, 8)

    target = _zeros()
    dcp.load(target, storage_reader=AtomicStorageReader(root, RUN, 1, timeout=5), no_dist=True)
    _assert_loaded(target)

    properties = load_dcp_metadata(data, where="m").state_dict_metadata["transposed"].properties
    assert type(properties) is TensorProperties  # this torch's own class: DCP compares and re-pickles it
    assert properties.strides == (1, 8) and properties.dtype == torch.float32
    assert properties.memory_format == torch.contiguous_format

    from dcp_atomic.tools.cli import main

    assert main(["verify", root, RUN]) == 0


def test_metadata_with_a_field_no_known_torch_writes_is_a_version_error_naming_both_versions(root, monkeypatch):
    _save_as_newer_torch(root, monkeypatch, lambda p: (getattr(p, "strides", None), "sparse-hint"))
    with pytest.raises(TorchVersionError) as caught:
        AtomicStorageReader(root, RUN, 1, timeout=5).resolve()
    error = caught.value
    assert not isinstance(error, CorruptCheckpointError)  # the bytes are intact: never "corrupt"
    assert f"which torch {torch.__version__} cannot read" in str(error) and "'sparse-hint'" in str(error)
    assert "bytes are intact" in str(error) and error.details["path"].endswith(".metadata")

    data = open(_metadata_file(root), "rb").read()
    with pytest.raises(TorchVersionError, match=r"written by torch 2\.15\.0 holds .* which torch "):
        load_dcp_metadata(data, where="m", written_by="2.15.0")
    again = pickle.loads(pickle.dumps(error))  # errors cross ranks pickled
    assert isinstance(again, CheckpointError) and str(again) == str(error)


def _metadata_with(state, monkeypatch) -> bytes:
    """A ``.metadata`` whose one TensorProperties pickles ``state``, as another release's ``__getstate__`` would."""
    chunk = ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([2, 3]))
    storage = TensorStorageMetadata(properties=TensorProperties(), size=torch.Size([2, 3]), chunks=[chunk])
    with monkeypatch.context() as patch:
        patch.setattr(TensorProperties, "__getstate__", lambda self: state)
        return pickle.dumps(Metadata(state_dict_metadata={"w": storage}))


@pytest.mark.parametrize("state", [
    (torch.bfloat16, torch.strided, False, _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT, False, (3, 1)),
    (torch.bfloat16, torch.strided, False, _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT, (3, 1), False),
    {"dtype": torch.bfloat16, "layout": torch.strided, "requires_grad": False,
     "mem_format_encoding": _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT, "pin_memory": False, "strides": (3, 1)},
], ids=["strides-last", "strides-before-pin_memory", "by-name"])
def test_strides_are_placed_by_type_wherever_a_release_puts_them(state, monkeypatch):
    properties = load_dcp_metadata(_metadata_with(state, monkeypatch), where="m").state_dict_metadata["w"].properties
    assert type(properties) is TensorProperties
    assert (properties.dtype, properties.pin_memory, properties.strides) == (torch.bfloat16, False, (3, 1))


@pytest.mark.parametrize("state", [
    (torch.float32, torch.strided, False, _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT, False, (3, 1), 5),
    {"dtype": torch.float32, "mem_format_encoding": _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT, "swizzle": 2},
    ("float32",),
], ids=["extra-positional", "unknown-name", "too-short"])
def test_states_no_known_release_writes_are_version_errors(state, monkeypatch):
    with pytest.raises(TorchVersionError, match=re.escape(f"which torch {torch.__version__} cannot read")):
        load_dcp_metadata(_metadata_with(state, monkeypatch), where="m", written_by="9.9.9")


def test_this_torchs_own_metadata_unpickles_to_its_own_classes(root):
    dcp.save(_state(), storage_writer=AtomicStorageWriter(root, RUN, 1), no_dist=True)
    properties = load_dcp_metadata(open(_metadata_file(root), "rb").read(), where="m")
    assert all(type(m.properties) is TensorProperties for m in properties.state_dict_metadata.values()
               if isinstance(m, TensorStorageMetadata))


# -- torch 2.14's CheckpointableTensor ----------------------------------------------------------------------------


def _checkpointable(ctx, source: torch.Tensor, global_shape=(8, 4)) -> torch.Tensor:
    """This rank's half of ``source`` as a plain tensor that tells DCP where it lies in the global one."""
    local = source[ctx.rank * 4:(ctx.rank + 1) * 4].clone()
    local.global_shape = global_shape
    local.global_offsets = ((ctx.rank * 4, 0),)
    local.local_offsets = ((0, 0),)
    local.local_sizes = ((4, 4),)
    return local


def _checkpointable_round_trip(ctx):
    from torch.distributed.checkpoint.api import CheckpointException

    from dcp_atomic import AtomicLoadPlanner, AtomicSavePlanner

    full = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    dcp.save({"w": _checkpointable(ctx, full)}, storage_writer=AtomicStorageWriter(ctx.root, RUN, 1, timeout=20),
             planner=AtomicSavePlanner())
    target = {"w": _checkpointable(ctx, torch.zeros(8, 4))}
    dcp.load(target, storage_reader=AtomicStorageReader(ctx.root, RUN, 1, timeout=20), planner=AtomicLoadPlanner())
    refusal = None
    try:  # a global shape that really changed is still refused
        dcp.load({"w": _checkpointable(ctx, torch.zeros(8, 4), global_shape=(16, 4))},
                 storage_reader=AtomicStorageReader(ctx.root, RUN, 1, timeout=20), planner=AtomicLoadPlanner())
    except CheckpointException as e:
        refusal = str(e)
    return torch.equal(target["w"], full[ctx.rank * 4:(ctx.rank + 1) * 4]), refusal


@pytest.mark.skipif(TORCH < (2, 14), reason="CheckpointableTensor arrived in torch 2.14")
def test_checkpointable_tensor_loads_through_atomic_load_planner(root):
    for exact, refusal in assert_all_ok(run_world(_checkpointable_round_trip, 2, root)):
        assert exact
        assert refusal is not None and "'w': global shape changed [8, 4] -> [16, 4]" in refusal, refusal


# -- saved on one torch, loaded on the other -----------------------------------------------------------------------


def _other_python() -> str | None:
    candidate = os.environ.get("DCP_ATOMIC_OTHER_PYTHON") or "/work/venv214/bin/python"
    if not os.path.exists(candidate) or os.path.abspath(candidate) == os.path.abspath(sys.executable):
        return None
    return candidate


_CROSS = textwrap.dedent("""
    import sys, torch, torch.distributed.checkpoint as dcp
    from dcp_atomic import AtomicStorageReader, AtomicStorageWriter
    from tests.helpers.torch_versions import RUN, _state, _zeros, _assert_loaded
    action, root, step = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if action == "save":
        dcp.save(_state(), storage_writer=AtomicStorageWriter(root, RUN, step), no_dist=True)
    else:
        target = _zeros()
        reader = AtomicStorageReader(root, RUN, step, timeout=10)
        dcp.load(target, storage_reader=reader, no_dist=True)
        _assert_loaded(target)
    print(torch.__version__)
""")


def _run(python: str, action: str, root: str, step: int) -> str:
    env = {**os.environ, "PYTHONPATH": REPO, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([python, "-c", _CROSS, action, root, str(step)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"{python} {action}: {done.stderr[-3000:]}"
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(_other_python() is None, reason="no second torch: set DCP_ATOMIC_OTHER_PYTHON or run "
                    "scripts/test_torch_matrix.sh (builds /work/venv214)")
def test_saved_on_one_torch_loads_on_the_other_both_ways(root):
    other = _other_python()
    here_version = _run(sys.executable, "save", root, 1)
    other_version = _run(other, "load", root, 1)
    assert here_version != other_version, "the two interpreters must run different torch releases"
    assert _run(other, "save", root, 2) == other_version
    assert _run(sys.executable, "load", root, 2) == here_version
    versions = {step: json.load(open(os.path.join(os.path.dirname(_metadata_file(root, step)), "manifest.json")))
                ["versions"]["torch"] for step in (1, 2)}
    assert versions == {1: here_version, 2: other_version}
