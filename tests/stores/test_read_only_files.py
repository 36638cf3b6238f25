"""Every file of a committed step is read-only on POSIX (mode 0o444, or 0o440 under a stricter umask): a writer that
is not root (a ``torch.save`` over a file, any tool opening it for writing) is refused instead of truncating the one
inode that every hard-linked step shares (reuse, P15; ``import --link``).  Saved, reuse-linked and imported steps
here, in one process; the local tier, replicas, the drain and a tier restore on a gloo world at the end.  Removal
(``rm``, ``gc``, retention) needs write permission on the directory, not the file, and keeps working.

Tests run as root, whom modes do not stop: they assert the mode bits, and once, as ``nobody`` owning the file as a
job's user would, that a write is refused."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import subprocess
import sys

import pytest
import torch

from tests.harness import assert_all_ok
from tests.helpers.reuse_state import COLS, ROWS, RUN, empty, exact, frozen, full, mesh, state
from tests.helpers.tiers import _manager, _run


def _step_dir(root, step):
    return os.path.join(root, RUN, f"step_{step:010d}")


def _attempt(root, step):
    with open(os.path.join(_step_dir(root, step), "COMMITTED")) as f:
        return os.path.join(_step_dir(root, step), json.load(f)["save_id"])


def _writable(root, step) -> dict[str, str]:
    """path -> mode of every file of ``step`` (marker, control and data files, partial copies) that is not read-only."""
    found = {}
    for directory, _, names in os.walk(_step_dir(root, step)):
        for name in names:
            mode = stat.S_IMODE(os.stat(os.path.join(directory, name)).st_mode)
            if mode not in (0o444, 0o440):
                found[os.path.join(directory, name)] = oct(mode)
    return found


def _writer_of(root, step, key) -> int:
    """The rank whose files hold ``key`` (an item DCP saves once, on the rank its dedup picks)."""
    from dcp_atomic.format.manifest import ManifestShard

    for rank in (0, 1):
        path = os.path.join(_attempt(root, step), f"manifest.{rank}.json")
        with open(path, "rb") as f:
            if any(item.key == key for entry in ManifestShard.from_json(f.read(), where=path).files
                   for item in entry.items):
                return rank
    raise AssertionError(f"no rank of step {step} stored {key!r}")


def _steps(root) -> list[int]:
    return sorted(int(n[len("step_"):]) for n in os.listdir(os.path.join(root, RUN)) if n.startswith("step_"))


def _data_files(root, step) -> list[str]:
    attempt = _attempt(root, step)
    return sorted(os.path.join(attempt, n) for n in os.listdir(attempt) if n.endswith(".distcp"))


def _save(root, step, adapter=None):
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageWriter

    state = {"base": frozen(), "adapter": torch.full((4, 4), float(step) if adapter is None else adapter)}
    dcp.save(state, storage_writer=AtomicStorageWriter(root, RUN, step, reuse=True, timeout=20))


def _loads(root, step) -> bool:
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageReader

    out = {"base": torch.zeros(ROWS, COLS), "adapter": torch.zeros(4, 4)}
    dcp.load(out, storage_reader=AtomicStorageReader(root, RUN, step, timeout=20))
    return torch.equal(out["base"], frozen()) and torch.equal(out["adapter"], torch.full((4, 4), float(step)))


def test_saved_linked_and_imported_steps_are_read_only_and_rm_gc_and_retention_still_remove_them(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp

    from dcp_atomic.tools.cli import main

    root, stock = str(tmp_path / "root"), str(tmp_path / "stock")
    for step in (1, 2, 3):  # 1: no base; 2: the stable file written; 3: it is step 2's, hard-linked
        _save(root, step)
    [stable2] = [p for p in _data_files(root, 2) if "_s0" in p]
    [stable3] = [p for p in _data_files(root, 3) if "_s0" in p]
    assert os.stat(stable2).st_ino == os.stat(stable3).st_ino
    os.chmod(stable3, 0o644)  # as an older dcp_atomic left it: the step that links it next makes it read-only
    _save(root, 4)
    [stable4] = [p for p in _data_files(root, 4) if "_s0" in p]
    assert os.stat(stable4).st_ino == os.stat(stable2).st_ino
    dcp.save({"base": frozen(), "adapter": torch.full((4, 4), 5.0)}, storage_writer=dcp.FileSystemWriter(stock))
    stock_files = sorted(os.path.join(stock, n) for n in os.listdir(stock) if n.endswith(".distcp"))
    assert stock_files and all(os.stat(p).st_mode & 0o200 for p in stock_files)  # stock DCP's: writable
    assert main(["import", stock, root, RUN, "5"]) == 0  # copied
    assert main(["import", stock, root, RUN, "6", "--link"]) == 0  # the stock files' inodes
    capsys.readouterr()
    assert {os.stat(p).st_ino for p in _data_files(root, 6)} == {os.stat(p).st_ino for p in stock_files}
    for step in (1, 2, 3, 4, 5, 6):
        assert _data_files(root, step), step
        assert _writable(root, step) == {}, step
    assert all(stat.S_IMODE(os.stat(p).st_mode) in (0o444, 0o440) for p in stock_files)  # one inode, one mode

    assert main(["rm", root, RUN, "1", "--yes"]) == 0
    assert main(["gc", root, RUN, "--keep-last", "3", "--lease-hours", "0"]) == 0  # steps 2 and 3 go
    capsys.readouterr()
    assert _steps(root) == [4, 5, 6]
    assert _loads(root, 4)  # its linked file outlived the steps that wrote it
    # retention right after a commit (the manager's path, keep_last=3): step 7 commits, step 4 goes
    from dcp_atomic._base.retry import Deadline
    from dcp_atomic.format.layout import RunLayout
    from dcp_atomic.protocol import read_marker, retain_after_commit
    from dcp_atomic.stores import LocalStorage

    _save(root, 7)
    layout = RunLayout(LocalStorage(root), RUN)
    retain_after_commit(layout, read_marker(layout, 7, Deadline(5)), 3)
    assert _steps(root) == [5, 6, 7] and _loads(root, 7)


def test_a_job_user_that_is_not_root_cannot_truncate_a_file_hard_linked_into_several_steps(tmp_path, capsys):
    """The finding: a stray ``torch.save`` onto a shared hard-linked file truncated the one file four kept steps
    pointed to.  Here the file belongs to ``nobody`` (as a job's files belong to its user) and ``nobody`` opens it
    for writing, as ``torch.save`` does: refused, and every step sharing it still verifies."""
    from dcp_atomic.tools.cli import main

    root = str(tmp_path / "root")
    for step in (1, 2, 3):
        _save(root, step)
    [shared] = [p for p in _data_files(root, 3) if "_s0" in p]
    nobody = pwd.getpwnam("nobody")
    os.chown(shared, nobody.pw_uid, nobody.pw_gid)
    stray_write = (f"import os; os.chdir({os.path.dirname(shared)!r}); os.setgid({nobody.pw_gid}); "
                   f"os.setuid({nobody.pw_uid}); open({os.path.basename(shared)!r}, 'wb')")
    done = subprocess.run([sys.executable, "-c", stray_write], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "PermissionError" in done.stderr, (done.returncode, done.stderr)
    assert os.path.getsize(shared) > 0
    assert main(["verify", root, RUN, "2"]) == 0 and main(["verify", root, RUN, "3"]) == 0
    capsys.readouterr()


def test_a_link_whose_file_cannot_be_made_read_only_leaves_no_name_import_says_copy_and_reuse_writes(tmp_path, capsys,
                                                                                                       monkeypatch):
    """A file another user owns (``chmod`` says ``EPERM``; as root here, a patched ``make_read_only``) is never linked
    into a step as a writable file: ``import --link`` fails with the advice to copy and commits nothing, a save writes
    its own file instead of linking."""
    import errno

    import torch.distributed.checkpoint as dcp

    from dcp_atomic.stores import storage
    from dcp_atomic.tools.cli import main

    def not_the_owner(file):
        if isinstance(file, str):  # a path: the target of a link (a descriptor: a file this process writes)
            raise PermissionError(errno.EPERM, "Operation not permitted", file)

    root, stock = str(tmp_path / "root"), str(tmp_path / "stock")
    for step in (1, 2):
        _save(root, step)
    dcp.save({"base": frozen(), "adapter": torch.full((4, 4), 5.0)}, storage_writer=dcp.FileSystemWriter(stock))
    monkeypatch.setattr(storage, "make_read_only", not_the_owner)
    assert main(["import", stock, root, RUN, "5", "--link"]) == 1
    assert "another user owns the stock files" in capsys.readouterr().err
    assert not os.path.exists(os.path.join(_step_dir(root, 5), "COMMITTED"))
    assert not [n for d, _, names in os.walk(_step_dir(root, 5)) for n in names if n.endswith(".distcp")]
    _save(root, 3)  # step 2's stable file cannot be linked: written
    [stable2] = [p for p in _data_files(root, 2) if "_s0" in p]
    [stable3] = [p for p in _data_files(root, 3) if "_s0" in p]
    assert os.stat(stable3).st_ino != os.stat(stable2).st_ino and _loads(root, 3)


# -- the local tier, its replicas, the drain, a tier restore and retention on two nodes -------------------------------


def _one_rank_per_node(rank):
    return {"DCP_ATOMIC_FAILURE_DOMAIN": "nodeAB"[4 + rank], "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
            "GROUP_RANK": str(rank)}


def _save_both_tiers(ctx):
    world = mesh(ctx.world_size)
    with _manager(ctx, local_root=ctx.extra["nodes"][ctx.rank], reuse=True, keep_local=2, keep_last=2) as manager:
        for step in (1, 2, 3):
            manager.save(step, state(world, step), durable=True)
            manager.wait()
    return True


def _restore(ctx):
    world = mesh(ctx.world_size)
    with _manager(ctx, local_root=ctx.extra["nodes"][ctx.rank]) as manager:
        loaded = empty(world)
        step = manager.load(loaded)
        tier = manager.restored_from["tier"]
    return step, tier, exact(full(loaded), full(state(world, step)))


def test_local_replicated_drained_and_restored_steps_are_read_only_and_retention_still_removes_them(root, nodes):
    assert_all_ok(_run(_save_both_tiers, root, nodes, world=2, rank_env=_one_rank_per_node))
    # the durable root (drained, both ranks' stable files linked there), each node's local root (its rank's linked)
    for where, linked in ((root, (0, 1)), (nodes[0], (0,)), (nodes[1], (1,))):
        assert _steps(where) == [2, 3], where  # keep_last=2 / keep_local=2 removed step 1
        for step in (2, 3):
            assert len(_data_files(where, step)) >= 4, (where, step)  # each rank's own files and its replica's
            assert _writable(where, step) == {}, (where, step)
        for rank in linked:  # reuse linked step 2's stable files into step 3 (a replica is a whole copy)
            name = f"__{rank}_s0.distcp"
            assert os.stat(os.path.join(_attempt(where, 3), name)).st_ino == \
                os.stat(os.path.join(_attempt(where, 2), name)).st_ino, (where, name)
    # The node of the rank that did not store the step counter (DCP saves it once) is replaced, its disk back empty:
    # its rank's restore receives its own files and the other rank's file that holds the counter, all read-only
    writer = _writer_of(root, 3, "step")
    replaced = 1 - writer
    shutil.rmtree(os.path.join(nodes[replaced], RUN))
    restored = assert_all_ok(_run(_restore, root, nodes, world=2, rank_env=_one_rank_per_node))
    assert restored == [(3, "local", True)] * 2, restored
    received = [os.path.basename(p) for p in _data_files(nodes[replaced], 3)]
    assert any(n.startswith(f"__{replaced}_") for n in received) and any(n.startswith(f"__{writer}_") for n in received)
    assert _writable(nodes[replaced], 3) == {}
