"""The fault matrix: every phase of a save, every backend, one named cell each.

Each cell is one real job of two gloo ranks driving a ``CheckpointManager``
(``timeout=3``, so the group's timeout too): it commits step 1, then step 2 fails
by a real fault placed with a named failpoint or a fixture (a SIGKILLed or
SIGSTOPped rank, a hung NFS server, a full disk, an injected I/O error).  Then,
for every cell, the same invariants:

1. every live rank got a typed error: the library's own (``StorageError`` with the
   errno), or the manager's ``RankFailureError`` naming the silent rank; a crash
   after the marker is instead settled as committed by reading the marker;
2. nothing partial is visible: ``list_steps`` / ``latest_step`` / a reader see
   step 1 only (before the marker), or step 2 complete (after it);
3. a restarted job (fresh processes; on NFS with the ranks on the *other*
   clients, whose caches the failed job left stale) loads the latest commit
   bit-exact through the manager, and the retry of step 2 succeeds (or, when step
   2 is already committed, is refused with ``CommitConflictError`` before a byte
   is written, and step 3 succeeds);
4. a stale ``LATEST`` (crash between marker and ``LATEST``) is repaired by the
   next ``latest_step`` or manager load;
5. ``dcp-atomic gc --lease-hours 0`` removes every piece of debris and the
   final state loads bit-exact in a fresh process.

Backends: ``local`` (a plain directory), ``nfs`` (rank 0 on bindfs client A, rank
1 on client B of one directory; 1 s attribute / entry / negative caches),
``tmpfs`` (a small tmpfs for ENOSPC).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
from dataclasses import dataclass, field

import pytest
import torch

from dcp_atomic import AtomicStorageReader, CheckpointNotFoundError, latest_step, list_steps
from tests.fault_fixtures import debris, failpoint_env, gc_all_debris, nfs_clients_ctx, small_tmpfs_ctx
from tests.harness import run_world

pytestmark = pytest.mark.slow

RUN = "exp"
WORK_TIMEOUT = 8.0  # the manager's work limit: a rank alive but stuck longer is named
TIMEOUT = 3.0  # the manager's timeout: its gloo groups and every library wait
NFS_CACHE_S = 1.0
WORLD = 2


# -- state ------------------------------------------------------------------------------------


def _state(rank: int, step: int, big: int = 0) -> dict:
    """Tiny, deterministic per (rank, step); ``big`` extra floats on rank 1 from step 2 on (ENOSPC)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    sd = {
        f"r{rank}.a": torch.randn(64, generator=g),
        f"r{rank}.b": torch.randn(16, 8, generator=g).to(torch.bfloat16),
        "shared": torch.arange(16, dtype=torch.float32) * step,  # identical on every rank
        "progress": {"step": step},
    }
    if big and rank == 1 and step >= 2:
        sd["r1.big"] = torch.randn(big, generator=g)
    return sd


def _zeros(sd: dict) -> dict:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"step": -1} for k, v in sd.items()}


def _differences(got: dict, want: dict) -> list[str]:
    bad = [k for k in want if k not in got]
    for k, v in want.items():
        if k in got and (not torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] != v):
            bad.append(k)
    return bad


def _all_ranks_state(step: int, big: int) -> dict:
    out: dict = {}
    for rank in range(WORLD):
        out.update(_state(rank, step, big))
    return out


# -- rank functions ---------------------------------------------------------------------------------


def _outcome(error: BaseException | None, **extra) -> dict:
    from dcp_atomic import CheckpointError

    if error is None:
        return {"error": None, **extra}
    details = getattr(error, "details", {}) or {}
    return {
        "error": type(error).__name__,
        "typed": isinstance(error, CheckpointError),
        "message": str(error),
        "silent": details.get("silent"),
        "errno": details.get("errno"),
        **extra,
    }


def _job_with_fault(ctx, big, prepare):
    """Commit step 1, then attempt step 2 (the failpoint/fixture makes it fail); report what this rank saw."""
    import torch.distributed as dist

    from dcp_atomic import CheckpointManager

    root = ctx.extra["roots"][ctx.rank]
    # A hung NFS server leaves its client alive (heartbeats go on) with a write that never returns: P8
    # names it at work_timeout, kept short here so the cell stays fast.
    manager = CheckpointManager(root, RUN, timeout=TIMEOUT, work_timeout=WORK_TIMEOUT, thread_count=1)
    manager.save(1, _state(ctx.rank, 1, big))
    if prepare:
        if ctx.rank == 0:
            _prepare_fault(prepare)
        dist.barrier()  # the default group: the fault is in place before any rank starts step 2
    try:
        manager.save(2, _state(ctx.rank, 2, big))
    except BaseException as e:  # noqa: BLE001 - the type is what the test asserts
        return _outcome(e)
    return _outcome(None)  # no collective here: after a failure the group is unusable


def _prepare_fault(prepare: dict) -> None:
    from tests.fault_fixtures import SmallTmpfs

    kind = prepare["kind"]
    if kind == "hang_nfs_server":
        os.kill(prepare["pid"], signal.SIGSTOP)  # client B's server stops answering
    elif kind == "fill_bytes":
        SmallTmpfs(prepare["path"], 0, 0).fill_bytes(leave=prepare["leave"])
    elif kind == "fill_bytes_at":
        # The disk fills up exactly when this rank reaches the named failpoint of step 2.
        from dcp_atomic._base import failpoints

        original = failpoints.hit

        def hit(name, rank=None):
            if name == prepare["failpoint"]:
                SmallTmpfs(prepare["path"], 0, 0).fill_bytes(leave=prepare["leave"])
            return original(name, rank)

        failpoints.hit = hit
    elif kind == "fill_inodes":
        # Step 2 needs exactly as many inodes before its marker as step 1's tree holds besides COMMITTED.
        step1 = os.path.join(prepare["root"], RUN, "step_0000000001")
        needed = 1 + sum(len(dirs) + len([f for f in files if f != "COMMITTED"]) for _, dirs, files in os.walk(step1))
        fs = SmallTmpfs(prepare["path"], 0, 0)
        os.makedirs(fs.ballast_dir, exist_ok=True)
        fs.fill_inodes(leave=needed)
    else:
        raise ValueError(kind)


def _restarted_job(ctx, expect_step, big, retry_step):
    """A fresh job: load the latest commit through the manager (bit-exact), then retry ``retry_step``."""
    from dcp_atomic import CheckpointManager, CommitConflictError

    root = ctx.extra["roots"][ctx.rank]
    manager = CheckpointManager(root, RUN, timeout=TIMEOUT, thread_count=1)
    template = _zeros(_state(ctx.rank, expect_step, big))
    loaded = manager.load(template)
    wrong = _differences(template, _state(ctx.rank, loaded, big))
    result = {"loaded": loaded, "wrong": wrong, "retry": None, "next": None}
    try:
        manager.save(retry_step, _state(ctx.rank, retry_step, big))
        result["retry"] = "committed"
    except CommitConflictError as e:
        result["retry"] = "CommitConflictError: " + str(e)
        manager.save(retry_step + 1, _state(ctx.rank, retry_step + 1, big))
        result["next"] = "committed"
    result["steps"] = manager.steps()
    manager.close()
    return result


# -- cells ----------------------------------------------------------------------------------------------


@dataclass
class Cell:
    backend: str  # local | nfs | tmpfs
    failpoints: dict[int, str] = field(default_factory=dict)  # rank -> DCP_ATOMIC_FAILPOINTS
    prepare: dict | None = None  # a fault rank 0 puts in place between step 1 and step 2
    victim: int | None = None  # the rank that dies or freezes (None: a storage fault)
    frozen: bool = False  # the victim never answers: do not wait for it
    after_marker: bool = False  # the crash happens once step 2 is committed
    error: str = "RankFailureError"  # what every live rank must see
    errno: int | None = None
    big: int = 0  # floats of an extra item on rank 1 from step 2 on


K = "=kill"
CELLS = {
    # local directory: kills at every phase, a frozen store-hosting rank 0
    "local-kill0-mid_write": Cell("local", {0: "write.mid_data@0#2" + K}, victim=0),
    "local-kill1-mid_write": Cell("local", {1: "write.mid_data@1#2" + K}, victim=1),
    "local-kill1-after_data": Cell("local", {1: "write.after_data@1#2" + K}, victim=1),
    "local-kill0-before_manifest": Cell("local", {0: "commit.after_metadata@0#2" + K}, victim=0),
    "local-kill0-after_manifest": Cell("local", {0: "commit.after_manifest@0#2" + K}, victim=0),
    "local-kill0-after_marker": Cell("local", {0: "commit.after_marker@0#2" + K}, victim=0, after_marker=True),
    "local-freeze0-mid_write": Cell("local", {0: "write.mid_data@0#2=stop"}, victim=0, frozen=True),
    # two NFS-like clients with stale caches: rank 0 on A, rank 1 on B
    "nfs-kill0-mid_write": Cell("nfs", {0: "write.mid_data@0#2" + K}, victim=0),
    "nfs-kill1-mid_write": Cell("nfs", {1: "write.mid_data@1#2" + K}, victim=1),
    "nfs-kill0-after_manifest": Cell("nfs", {0: "commit.after_manifest@0#2" + K}, victim=0),
    "nfs-kill0-after_marker": Cell("nfs", {0: "commit.after_marker@0#2" + K}, victim=0, after_marker=True),
    "nfs-freeze1-mid_write": Cell("nfs", {1: "write.mid_data@1#2=stop"}, victim=1, frozen=True),
    "nfs-server_hang-client_B": Cell("nfs", prepare={"kind": "hang_nfs_server"}, victim=1, frozen=True),
    "nfs-eio-at_manifest": Cell("nfs", {0: "commit.after_metadata@0#2=raise"}, error="StorageError", errno=5),
    # a full disk
    "tmpfs-enospc-mid_write": Cell("tmpfs", prepare={"kind": "fill_bytes", "leave": 256 << 10},
                                   error="StorageError", errno=28, big=256 << 10),
    "tmpfs-enospc-at_marker": Cell("tmpfs", prepare={"kind": "fill_bytes_at", "failpoint": "commit.after_manifest",
                                                     "leave": 0}, error="StorageError", errno=28),
    "tmpfs-no_inodes-at_marker": Cell("tmpfs", prepare={"kind": "fill_inodes"}, error="StorageError", errno=28),
}


def _params():
    for name in CELLS:
        yield pytest.param(name, id=name)


def _open_backend(cell: Cell, stack):
    if cell.backend == "local":
        path = tempfile.mkdtemp(prefix="dcp-atomic-cell-")
        stack.callback(shutil.rmtree, path, True)
        return {"server": path, "fault_roots": [path] * WORLD, "retry_roots": [path] * WORLD, "clients": None}
    if cell.backend == "nfs":
        clients = stack.enter_context(nfs_clients_ctx(cache_seconds=NFS_CACHE_S))
        # The restarted job puts rank 0 on the other client: the new coordinator has the stale caches.
        return {"server": clients.backing, "fault_roots": clients.roots("AB"), "retry_roots": clients.roots("BA"),
                "clients": clients}
    fs = stack.enter_context(small_tmpfs_ctx(size_kib=4096, nr_inodes=256))
    root = os.path.join(fs.path, "ckpt")
    os.mkdir(root)
    return {"server": root, "fault_roots": [root] * WORLD, "retry_roots": [root] * WORLD, "clients": None, "fs": fs}


def _assert_only_step1_visible(roots: list[str]) -> None:
    """What an operator's `dcp-atomic ls` or an eval job would see, on the server and on each client."""
    for root in roots:
        assert list_steps(root, RUN) == [1], root
        assert latest_step(root, RUN, repair=False) == 1, root
        with pytest.raises(CheckpointNotFoundError):
            AtomicStorageReader(root, RUN, 2, timeout=0.3).resolve()
        assert AtomicStorageReader(root, RUN, timeout=1).resolve().step == 1


@pytest.mark.parametrize("name", list(_params()))
def test_fault_matrix_cell(name):
    cell = CELLS[name]
    with contextlib.ExitStack() as stack:
        env = _open_backend(cell, stack)
        server, clients = env["server"], env["clients"]
        prepare = dict(cell.prepare) if cell.prepare else None
        if prepare and prepare["kind"] == "hang_nfs_server":
            prepare["pid"] = clients.b.proc.pid
            clients.b.frozen_now = True  # whatever happens, SIGCONT it before the test touches B again
        elif prepare:
            prepare.update(path=env["fs"].path, root=server)
        live = [r for r in range(WORLD) if r != cell.victim]

        # 1. the failing job
        outcomes = run_world(
            _job_with_fault, WORLD, server, args=(cell.big, prepare), extra={"roots": env["fault_roots"]},
            # Bounded: the live ranks must answer within the manager's own deadlines (about 2x TIMEOUT).
            rank_env=failpoint_env(cell.failpoints), pg_timeout=6, timeout=25,
            wait_for=live if cell.frozen else None,
        )
        if clients is not None:
            clients.b.thaw()
        if "fs" in env:
            env["fs"].release()  # the operator frees space (ballast lives outside the run directory)
        for rank in live:
            assert outcomes[rank].ok, f"rank {rank}: {outcomes[rank].error}"
        if cell.victim is not None:
            victim = outcomes[cell.victim]
            assert victim.killed or victim.error_type == "NotAwaited", (victim.error_type, victim.error)
        seen = {r: outcomes[r].value for r in live}

        # 2. nothing partial is visible, on the server and on every client
        roots = [server] + ([c.path for c in clients.clients] if clients else [])
        latest_file = json.load(open(os.path.join(server, RUN, "LATEST")))
        if cell.after_marker:
            assert list_steps(server, RUN) == [1, 2]
            assert latest_file["step"] == 1, "LATEST is written after the marker: it must still be stale"
            for r in live:  # the manager settles DCP's failure by reading the marker: committed
                assert seen[r]["error"] is None, seen[r]
        else:
            _assert_only_step1_visible(roots)
            assert latest_file["step"] == 1

        # 3. a restarted job loads bit-exact and retries the step
        if cell.after_marker and cell.backend == "local":
            assert latest_step(server, RUN) == 2  # a scan repairs the stale LATEST ...
            assert json.load(open(os.path.join(server, RUN, "LATEST")))["step"] == 2
        expect = 2 if cell.after_marker else 1
        restarted = run_world(_restarted_job, WORLD, server, args=(expect, cell.big, 2),
                              extra={"roots": env["retry_roots"]}, timeout=60)
        for outcome in restarted:
            assert outcome.ok, f"rank {outcome.rank}: {outcome.error}"
            value = outcome.value
            assert value["loaded"] == expect and value["wrong"] == [], value
            if cell.after_marker:
                assert value["retry"].startswith("CommitConflictError") and "already committed" in value["retry"]
                assert value["next"] == "committed" and value["steps"] == [1, 2, 3]
            else:
                assert value["retry"] == "committed" and value["steps"] == [1, 2]
        final = 3 if cell.after_marker else 2
        if cell.after_marker:  # nothing partial was left, and the refused retry wrote nothing
            assert debris(os.path.join(server, RUN)) == []
        assert json.load(open(os.path.join(server, RUN, "LATEST")))["step"] == final  # ... or the next load/save

        # 5. gc removes the debris; everything left loads bit-exact in a fresh process
        assert gc_all_debris(server, RUN) == 0
        assert debris(os.path.join(server, RUN)) == []
        assert list_steps(server, RUN) == list(range(1, final + 1))
        for step in range(1, final + 1):
            assert _load_everything_step(server, step, cell.big) == [], step

        # 1 (last, so that a known typing bug does not hide the invariants above): typed errors
        for r in live:
            if cell.after_marker:
                continue
            got = seen[r]
            assert got["error"] == cell.error and got["typed"], f"rank {r}: {got}"
            if cell.error == "RankFailureError":
                assert str(got["silent"]).startswith(str(cell.victim)), f"rank {r} names {got['silent']!r}"
            if cell.errno is not None:
                assert got["errno"] == cell.errno, f"rank {r}: {got}"


def _load_everything_step(root: str, step: int, big: int) -> list[str]:
    import torch.distributed.checkpoint as dcp

    want = _all_ranks_state(step, big)
    got = _zeros(want)
    reader = AtomicStorageReader(root, RUN, step, timeout=2)
    dcp.load(got, storage_reader=reader)
    return _differences(got, want)
