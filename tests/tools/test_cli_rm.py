"""``dcp-atomic rm`` and the removal primitives under it (G9): nothing without ``--yes``, ``LATEST`` and the
``COMMITS`` journal telling the truth afterwards, and never a byte of another run, even one whose name starts with
this run's name, on a local root and on an S3 root whose data lies under hashed prefixes."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_atomic import AtomicStorageReader, AtomicStorageWriter, CheckpointManager, CheckpointNotFoundError
from dcp_atomic.stores.backends import open_storage
from dcp_atomic.protocol.commit import read_latest
from dcp_atomic.format.layout import RunLayout
from dcp_atomic.protocol.retention import _read_journal, remove_run, remove_step
from dcp_atomic._base.retry import Deadline
from dcp_atomic.tools.cli import main

RUN, SIBLING = "exp1", "exp10"  # the sibling's name starts with the run's: a prefix match would reach it


def _state(step: int) -> dict:
    return {"w": torch.arange(8.0) + step, "b": torch.full((3,), float(step))}


def _save(root: str, run: str, step: int, options: dict | None = None) -> None:
    dcp.save(_state(step), storage_writer=AtomicStorageWriter(root, run, step, storage_options=options, timeout=10))


def _load_latest(root: str, run: str, options: dict | None = None) -> int:
    target = {"w": torch.zeros(8), "b": torch.zeros(3)}
    reader = AtomicStorageReader(root, run, None, storage_options=options, timeout=5)
    dcp.load(target, storage_reader=reader)
    assert torch.equal(target["w"], _state(reader.step)["w"])
    return reader.step


def _tree(root: str) -> dict[str, bytes]:
    found = {}
    for directory, _, files in os.walk(root):
        for name in files:
            path = os.path.join(directory, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, root)] = f.read()
    return found


def _layout(root: str, run: str, options: dict | None = None) -> RunLayout:
    return RunLayout(open_storage(root, options), run)


def test_rm_without_yes_shows_the_plan_exits_2_and_touches_nothing(root, capsys):
    for step in (1, 2):
        _save(root, RUN, step)
    before = _tree(root)
    assert main(["rm", root, RUN, "2"]) == 2
    out, err = capsys.readouterr()
    assert "would remove committed step 2" in out and "LATEST would then name step 1" in out
    assert "--yes" in err
    assert main(["rm", root, RUN, "--json"]) == 2
    plan = json.loads(capsys.readouterr().out)
    assert plan["schema"] == 1 and plan["removed"] is False and plan["committed_steps"] == [1, 2]
    assert _tree(root) == before, "rm without --yes must not change a byte"


def test_rm_of_the_latest_step_points_latest_and_the_journal_at_the_previous_commit(root, capsys):
    with CheckpointManager(root, RUN, keep_last=5, timeout=30) as manager:  # keep_last: the COMMITS journal exists
        for step in (10, 30, 20):  # commit order 10, 30, 20: after 20 goes, 30 is the most recent, not 10
            manager.save(step, _state(step))
    layout = _layout(root, RUN)
    assert read_latest(layout, Deadline(1)).step == 20
    assert main(["rm", root, RUN, "20", "--yes"]) == 0
    assert "LATEST now names step 30" in capsys.readouterr().out
    assert not os.path.exists(layout.step_dir(20))
    assert read_latest(layout, Deadline(1)).step == 30
    assert [m.step for m in _read_journal(layout)] == [10, 30]
    assert _load_latest(root, RUN) == 30
    with CheckpointManager(root, RUN, keep_last=5, timeout=30) as manager:  # a resumed job sees the same
        assert manager.latest_step() == 30 and manager.steps() == [10, 30]
        manager.save(40, _state(40))  # and commits on top of it
    assert [m.step for m in _read_journal(layout)] == [10, 30, 40]

    assert main(["--json", "rm", root, RUN, "10", "--yes"]) == 0  # not the latest: LATEST keeps its step
    report = json.loads(capsys.readouterr().out)
    assert report == {"schema": 1, "run": RUN, "step": 10, "committed": True, "attempts": report["attempts"],
                      "latest_after": 40, "removed": True, "left_in_flight": [], "committed_again": None}
    assert read_latest(layout, Deadline(1)).step == 40


def test_rm_of_the_last_commit_deletes_latest_and_an_uncommitted_step_goes_too(root):
    _save(root, RUN, 1)
    _save(root, RUN, 2)
    layout = _layout(root, RUN)
    os.remove(layout.marker(2))  # step 2: an attempt that never committed
    assert remove_step(layout, 2) == [os.listdir(layout.step_dir(2))[0]]  # inside its lease: a save in flight?
    assert remove_step(layout, 2, lease_seconds=0) == []  # the operator says it crashed (rm --lease-hours 0)
    assert not os.path.exists(layout.step_dir(2))
    assert read_latest(layout, Deadline(1)).step == 1
    remove_step(layout, 1)
    assert not os.path.exists(layout.latest()), "no commit left: no LATEST naming a deleted step"
    assert os.listdir(layout.run_dir) == []
    with pytest.raises(CheckpointNotFoundError, match="no step 1"):
        remove_step(layout, 1)


def test_rm_of_a_missing_run_or_step_is_one_line(root, capsys):
    _save(root, RUN, 1)
    assert main(["rm", root, RUN, "7", "--yes"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no step 7" in err and "Traceback" not in err
    assert main(["--json", "rm", root, "nope", "--yes"]) == 1
    error = json.loads(capsys.readouterr().out)
    assert error["schema"] == 1 and "no run 'nope'" in error["error"]["message"]
    assert _load_latest(root, RUN) == 1


def test_rm_of_a_run_leaves_a_run_whose_name_it_prefixes_untouched(root, capsys):
    for run in (RUN, SIBLING):
        for step in (1, 2):
            _save(root, run, step)
    layout = _layout(root, RUN)
    os.remove(layout.marker(2))  # an uncommitted attempt goes with the run too
    sibling = {path: data for path, data in _tree(root).items() if path.startswith(SIBLING + os.sep)}
    assert main(["rm", root, RUN, "--yes", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["committed_steps"] == [1]
    assert sorted(os.listdir(root)) == [SIBLING]
    assert _tree(root) == sibling
    assert _load_latest(root, SIBLING) == 2
    assert main(["ls", root, RUN]) == 1  # gone


@pytest.mark.slow
def test_rm_on_s3_removes_hashed_prefix_data_and_never_a_sibling_run(s3_moto):
    s3 = s3_moto
    options = s3.options()
    for run in (RUN, SIBLING):
        for step in (1, 2, 3):
            _save(s3.root, run, step, options)
    prefixed = lambda run: [k for k in s3.keys() if k.startswith("_d") and k.split("/")[1] == run]  # noqa: E731
    assert prefixed(RUN) and prefixed(SIBLING), "this root spreads data over hashed prefixes"
    sibling = {k: s3.get(k) for k in s3.keys() if k.split("/")[0] == SIBLING or k in prefixed(SIBLING)}

    layout = _layout(s3.root, RUN, options)
    step3 = [k for k in prefixed(RUN) if k.split("/")[2] == "step_0000000003"]
    assert step3
    flags = ["--storage-options", json.dumps(options)]
    assert main(flags + ["rm", s3.root, RUN, "3", "--yes"]) == 0
    assert not set(step3) & set(s3.keys()) and not s3.keys(f"{RUN}/step_0000000003/")
    assert read_latest(layout, Deadline(2)).step == 2
    assert _load_latest(s3.root, RUN, options) == 2

    assert remove_run(layout) == [1, 2]
    assert prefixed(RUN) == [] and not [k for k in s3.keys() if k.split("/")[0] == RUN]
    assert {k: s3.get(k) for k in s3.keys()} == sibling, "the sibling run's objects are exactly as they were"
    assert _load_latest(s3.root, SIBLING, options) == 3
    assert main(flags + ["ls", s3.root, RUN]) == 1


@pytest.mark.slow
def test_after_rm_on_seaweedfs_ls_and_gc_see_no_trace_of_the_removed_step(s3_seaweedfs, capsys):
    """SeaweedFS keeps the folders of deleted objects and lists them: the removed step must not come back as a
    ``partial`` row in ``ls`` nor as an abandoned attempt in ``gc``."""
    s3 = s3_seaweedfs
    options = s3.options()
    for step in (1, 2, 3):
        _save(s3.root, RUN, step, options)
    flags = ["--storage-options", json.dumps(options), "--json"]
    assert main(flags + ["rm", s3.root, RUN, "3", "--yes"]) == 0
    capsys.readouterr()
    assert main(flags + ["ls", s3.root, RUN]) == 0
    assert [row["step"] for row in json.loads(capsys.readouterr().out)["steps"]] == [1, 2]
    assert main(flags + ["gc", s3.root, RUN, "--keep-last", "5", "--dry-run"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["delete_steps"], plan["delete_attempts"], plan["kept_steps"]) == ([], [], [1, 2]), plan
