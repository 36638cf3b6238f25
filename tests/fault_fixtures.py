"""Real faults as pytest fixtures: stale NFS-like clients, a full disk, and helpers for killed/frozen ranks.

Registered through ``pytest_plugins`` in ``tests/conftest.py``.  Every fixture
owns fresh state (its own backing directory, mounts, tmpfs) and always cleans it
up, in the only safe order: ``SIGCONT`` a frozen FUSE daemon, unmount (lazily if
busy), and only then delete the directories.  ``rmtree`` into a live bindfs mount
would delete the backing files through it, so a directory that is still mounted
is never deleted.

* ``nfs_clients``: two bindfs FUSE mounts ("client A", "client B") of one backing
  directory (the "server").  Each mount is its own FUSE connection with its own
  kernel dentry / attribute / negative-lookup caches, so what one client does is
  seen late, or torn, by the other, as on NFS (/work/shared/TESTING.md).
  ``client.expire()`` drops a client's caches by remounting it (~16 ms) instead of
  sleeping past the timeout; ``client.frozen()`` is a hung NFS server
  (``SIGSTOP`` of that client's daemon).
* ``small_tmpfs``: a tmpfs of a few MiB and a fixed inode budget, with
  ``fill_bytes`` / ``fill_inodes`` ballast to put ENOSPC exactly where a test
  wants it, and ``release()`` to free the space again (the operator's fix).
* helpers for failpoints in worker ranks (``failpoint_env``) and for asserting
  that a run directory holds no debris (``debris``).
* ``fat_volume``: a real FAT filesystem (an image file, mounted through FUSE by
  ``fusefat``: no kernel vfat module or loop device needed), where ``link()``
  fails with EPERM as on any filesystem without hard links.
* ``HoldingProxy``: a reverse proxy that holds chosen requests (say, two jobs'
  conditional marker writes) until all parties have sent theirs, then forwards
  them together, so a race test provably races.
* ``watched_reads``: a spy on this process's POSIX whole-file reads, so a test that
  says "the lag was waited out" can show that the library did miss the file first
  (and, with ``on_miss``, make the file appear only after that miss).

bindfs and fuse3 are installed by ``scripts/test.sh`` (as root).  These fixtures
do not skip when they are missing: they fail, naming the fix, so CI never passes
without running the fault tests.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import pytest

MOUNT_WAIT_S = 10.0


# -- mount table ----------------------------------------------------------------------------


def _unescape_mountinfo(field_: str) -> str:
    return field_.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def is_mounted(path: str) -> bool:
    target = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        return any(_unescape_mountinfo(line.split()[4]) == target for line in f)


def _fusermount() -> str:
    for name in ("fusermount3", "fusermount"):
        found = shutil.which(name)
        if found:
            return found
    raise RuntimeError("fusermount not found (apt-get install -y fuse3)")


def _require_fault_tools(*tools: str) -> None:
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pytest.fail(f"fault fixtures need {missing}: run `bash scripts/test.sh` as root, or "
                    "`apt-get install -y bindfs fuse3 fusefat dosfstools` (they are not optional: the fault matrix "
                    "must run)",
                    pytrace=False)
    if os.geteuid() != 0:
        pytest.fail("fault fixtures need root (/dev/fuse and mount are root-only here)", pytrace=False)


# -- NFS-like clients ------------------------------------------------------------------------


class FuseClient:
    """One bindfs mount of the shared backing directory: an NFS client with its own caches."""

    def __init__(self, name: str, backing: str, path: str, *, cache_seconds: float, kernel_cache: bool) -> None:
        self.name = name
        self.backing = backing
        self.path = path
        self.cache_seconds = cache_seconds
        self.kernel_cache = kernel_cache
        self.proc: subprocess.Popen | None = None
        self.frozen_now = False
        self.remounts = 0

    def __repr__(self) -> str:
        return f"FuseClient({self.name}, {self.path}, cache={self.cache_seconds}s, kernel_cache={self.kernel_cache})"

    def mount(self) -> None:
        t = self.cache_seconds
        options = f"entry_timeout={t},attr_timeout={t},negative_timeout={t}"
        if self.kernel_cache:
            options += ",kernel_cache"
        self.proc = subprocess.Popen(
            ["bindfs", "-f", "--no-allow-other", "-o", options, self.backing, self.path],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
        )
        deadline = time.monotonic() + MOUNT_WAIT_S
        while not is_mounted(self.path):
            if self.proc.poll() is not None:
                proc, self.proc = self.proc, None
                err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                raise RuntimeError(f"bindfs for {self.name} exited with {proc.returncode}: {err}")
            if time.monotonic() > deadline:
                self.unmount()
                raise RuntimeError(f"bindfs mount {self.path} not live after {MOUNT_WAIT_S}s")
            time.sleep(0.002)

    def unmount(self) -> None:
        """SIGCONT, unmount (lazily if busy), reap the daemon.  Safe to call twice."""
        self.thaw()
        if is_mounted(self.path):
            done = subprocess.run([_fusermount(), "-u", self.path], capture_output=True)
            if done.returncode != 0 and is_mounted(self.path):
                subprocess.run([_fusermount(), "-uz", self.path], capture_output=True)
        if self.proc is not None:
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)
            if self.proc.stderr:
                self.proc.stderr.close()
            self.proc = None

    def expire(self) -> None:
        """Forget every cached dentry, attribute and negative lookup: remount (~16 ms), no sleeping."""
        self.unmount()
        self.mount()
        self.remounts += 1

    def freeze(self) -> None:
        """A hung NFS server for this client: every access to the mount blocks until :meth:`thaw`."""
        assert self.proc is not None, "not mounted"
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.frozen_now = True

    def thaw(self) -> None:
        if self.frozen_now and self.proc is not None:
            os.kill(self.proc.pid, signal.SIGCONT)
        self.frozen_now = False

    @contextlib.contextmanager
    def frozen(self) -> Iterator[None]:
        self.freeze()
        try:
            yield
        finally:
            self.thaw()


@dataclass
class NfsClients:
    """The shared directory (``backing``, the server's truth) and its two clients."""

    backing: str
    a: FuseClient
    b: FuseClient
    base: str

    @property
    def clients(self) -> list[FuseClient]:
        return [self.a, self.b]

    def roots(self, order: str = "AB") -> list[str]:
        """Per-rank roots: rank r uses client order[r % len(order)]."""
        pick = {"A": self.a.path, "B": self.b.path}
        return [pick[c] for c in order]


@contextlib.contextmanager
def nfs_clients_ctx(cache_seconds: float = 3.0, kernel_cache_b: bool = False) -> Iterator[NfsClients]:
    _require_fault_tools("bindfs")
    _fusermount()
    base = tempfile.mkdtemp(prefix="dcp-atomic-nfs-")
    backing, path_a, path_b = (os.path.join(base, n) for n in ("server", "clientA", "clientB"))
    for d in (backing, path_a, path_b):
        os.mkdir(d)
    a = FuseClient("A", backing, path_a, cache_seconds=cache_seconds, kernel_cache=False)
    b = FuseClient("B", backing, path_b, cache_seconds=cache_seconds, kernel_cache=kernel_cache_b)
    try:
        a.mount()
        b.mount()
        yield NfsClients(backing=backing, a=a, b=b, base=base)
    finally:
        for client in (a, b):
            try:
                client.unmount()
            except Exception:  # keep going: the other mount must come down too
                pass
        still = [c.path for c in (a, b) if is_mounted(c.path)]
        if still:  # never rmtree through a live mount: it would delete the backing files
            raise RuntimeError(f"could not unmount {still}; leaving {base} in place")
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def nfs_clients(request) -> Iterator[NfsClients]:
    """Two stale-caching clients of one directory; ``@pytest.mark.nfs(cache_seconds=..., kernel_cache_b=...)``."""
    marker = request.node.get_closest_marker("nfs")
    options = dict(marker.kwargs) if marker else {}
    with nfs_clients_ctx(**options) as clients:
        yield clients


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "nfs(cache_seconds=3.0, kernel_cache_b=False): options of the nfs_clients fixture")
    config.addinivalue_line("markers", "tmpfs(size_kib=8192, nr_inodes=4096): options of the small_tmpfs fixture")


# -- full disk ---------------------------------------------------------------------------------


@dataclass
class SmallTmpfs:
    """A tmpfs of its own; ballast files put ENOSPC where the test wants it."""

    path: str
    size_kib: int
    nr_inodes: int
    ballast: list[str] = field(default_factory=list)

    @property
    def ballast_dir(self) -> str:
        return os.path.join(self.path, ".ballast")

    def free_bytes(self) -> int:
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize

    def free_inodes(self) -> int:
        return os.statvfs(self.path).f_favail

    def fill_bytes(self, leave: int) -> None:
        """Write ballast until at most ``leave`` bytes are free."""
        os.makedirs(self.ballast_dir, exist_ok=True)
        name = os.path.join(self.ballast_dir, f"bytes{len(self.ballast)}")
        self.ballast.append(name)
        chunk = b"\xab" * (1 << 20)
        with open(name, "wb") as f:
            while self.free_bytes() > leave:
                want = min(len(chunk), self.free_bytes() - leave)
                try:
                    f.write(chunk[:max(want, 1)])
                    f.flush()
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    break

    def fill_inodes(self, leave: int) -> None:
        """Create empty ballast files until exactly ``leave`` inodes are free."""
        os.makedirs(self.ballast_dir, exist_ok=True)
        n = 0
        while self.free_inodes() > leave:
            name = os.path.join(self.ballast_dir, f"inode{len(self.ballast)}_{n}")
            open(name, "wb").close()
            self.ballast.append(name)
            n += 1
        assert self.free_inodes() == leave, (self.free_inodes(), leave)

    def release(self) -> None:
        """The operator frees space: all ballast goes."""
        shutil.rmtree(self.ballast_dir, ignore_errors=True)
        self.ballast.clear()


@contextlib.contextmanager
def small_tmpfs_ctx(size_kib: int = 8192, nr_inodes: int = 4096) -> Iterator[SmallTmpfs]:
    _require_fault_tools("mount", "umount")
    path = tempfile.mkdtemp(prefix="dcp-atomic-tmpfs-")
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k,nr_inodes={nr_inodes},mode=0755", "tmpfs", path],
                       check=True, capture_output=True)
        yield SmallTmpfs(path=path, size_kib=size_kib, nr_inodes=nr_inodes)
    finally:
        if is_mounted(path):
            if subprocess.run(["umount", path], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", path], capture_output=True)
        if is_mounted(path):
            raise RuntimeError(f"could not unmount tmpfs {path}; leaving it in place")
        os.rmdir(path)


@pytest.fixture
def small_tmpfs(request) -> Iterator[SmallTmpfs]:
    """A fresh tmpfs (default 8 MiB, 4096 inodes; ``@pytest.mark.tmpfs(size_kib=..., nr_inodes=...)``)."""
    marker = request.node.get_closest_marker("tmpfs")
    with small_tmpfs_ctx(**(dict(marker.kwargs) if marker else {})) as fs:
        yield fs


# -- a filesystem without hard links ----------------------------------------------------------------


@contextlib.contextmanager
def fat_volume_ctx(size_mib: int = 32) -> Iterator[str]:
    """A fresh FAT volume mounted read-write through fusefat; yields the mount point."""
    _require_fault_tools("fusefat", "mkfs.vfat")
    _fusermount()
    base = tempfile.mkdtemp(prefix="dcp-atomic-fat-")
    image, path = os.path.join(base, "volume.img"), os.path.join(base, "mnt")
    os.mkdir(path)
    with open(image, "wb") as f:
        f.truncate(size_mib << 20)
    subprocess.run(["mkfs.vfat", image], check=True, capture_output=True)
    proc = subprocess.Popen(["fusefat", "-f", "-o", "rw+", image, path], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + MOUNT_WAIT_S
        while not is_mounted(path):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"fusefat did not mount {image} on {path} (exit {proc.poll()})")
            time.sleep(0.002)
        yield path
    finally:
        if is_mounted(path):
            if subprocess.run([_fusermount(), "-u", path], capture_output=True).returncode != 0:
                subprocess.run([_fusermount(), "-uz", path], capture_output=True)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)
        if is_mounted(path):  # never rmtree through a live mount
            raise RuntimeError(f"could not unmount {path}; leaving {base} in place")
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def fat_volume() -> Iterator[str]:
    """The mount point of a fresh FAT volume: a real filesystem on which ``link()`` fails (EPERM)."""
    with fat_volume_ctx() as path:
        yield path


# -- worlds with failpoints ----------------------------------------------------------------------


def failpoint_env(spec_by_rank: dict[int, str]) -> Callable[[int], dict[str, str | None]]:
    """``rank_env`` for ``run_world``: arm ``DCP_ATOMIC_FAILPOINTS`` on the given ranks only."""

    def rank_env(rank: int) -> dict[str, str | None]:
        return {"DCP_ATOMIC_FAILPOINTS": spec_by_rank.get(rank)}

    return rank_env


# -- requests that provably overlap ----------------------------------------------------------------


@dataclass
class HeldRequest:
    group: str
    arrived: float
    forwarded: float | None = None
    answered: float | None = None
    status: int | None = None
    together: bool = False  # released because every party had arrived (not by the hold timeout)


class HoldingProxy:
    """Reverse proxy on 127.0.0.1 in front of ``upstream`` (an http URL).  A request that ``match(method, path,
    headers, body)`` maps to a group name is held until ``parties`` requests of that group have arrived (or
    ``hold_s`` passed), then all of them are forwarded at once; later requests of a group (retries) pass through.

    ``overlapped(group)``: every held request of the group was sent upstream before any reply came back, so
    the server had to arbitrate them concurrently (sequential requests cannot prove a put-if-absent atomic)."""

    def __init__(self, upstream: str, match: Callable[[str, str, dict, bytes], str | None], *, parties: int = 2,
                 hold_s: float = 30.0) -> None:
        import http.server
        import urllib.parse

        from tests.s3_servers import _QuietServer, _read_body

        parsed = urllib.parse.urlsplit(upstream)
        self.upstream = (parsed.hostname, parsed.port)
        self.match, self.parties, self.hold_s = match, parties, hold_s
        self.held: list[HeldRequest] = []
        self._barriers: dict[str, threading.Barrier] = {}
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                proxy._handle(self, _read_body(self))

            do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = do_GET

        self.server = _QuietServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()

    def requests(self, group: str) -> list[HeldRequest]:
        with self._lock:
            return [r for r in self.held if r.group == group]

    def overlapped(self, group: str) -> bool:
        """Every party's request was sent before any party had an answer: no job could have seen the other's
        outcome first, so the store arbitrated a real race.  (When the held requests are released, which one
        the server gets first is thread scheduling: a loaded machine can answer one before it forwards the
        other, and that is still the race the test is about.)"""
        held = self.requests(group)
        return (len(held) == self.parties and all(r.together and r.answered is not None for r in held)
                and max(r.arrived for r in held) < min(r.answered for r in held))

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handle(self, handler, body: bytes) -> None:
        import http.client

        from tests.s3_servers import HOP_BY_HOP

        headers = {k: v for k, v in handler.headers.items() if k.lower() not in HOP_BY_HOP}
        if body or handler.command in ("PUT", "POST", "PATCH"):
            headers["Content-Length"] = str(len(body))
        group = self.match(handler.command, handler.path, {k.lower(): v for k, v in headers.items()}, body)
        record = None
        if group is not None:
            with self._lock:
                if len([r for r in self.held if r.group == group]) < self.parties:
                    record = HeldRequest(group, time.monotonic())
                    self.held.append(record)
                    barrier = self._barriers.setdefault(group, threading.Barrier(self.parties))
        if record is not None:
            try:
                barrier.wait(self.hold_s)
                record.together = True
            except threading.BrokenBarrierError:
                pass
            record.forwarded = time.monotonic()
        conn = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            conn.request(handler.command, handler.path, body=body if body or "Content-Length" in headers else None,
                         headers=headers)
            reply = conn.getresponse()
            status, reply_headers, reply_body = reply.status, reply.getheaders(), reply.read()
        finally:
            conn.close()
        if record is not None:
            record.answered, record.status = time.monotonic(), status
        handler.send_response(status)
        length = None
        for k, v in reply_headers:
            if k.lower() == "content-length":
                length = v
            elif k.lower() not in HOP_BY_HOP:
                handler.send_header(k, v)
        handler.send_header("Content-Length", length if handler.command == "HEAD" and length else str(len(reply_body)))
        handler.end_headers()
        if handler.command != "HEAD":
            handler.wfile.write(reply_body)


def conditional_marker_create(method: str, path: str, headers: dict, body: bytes) -> str | None:
    """``HoldingProxy`` match: a create-if-absent of a commit marker (S3: PUT with ``If-None-Match: *``; GCS: an
    upload with ``ifGenerationMatch=0``), grouped by its step directory."""
    import re

    if method not in ("PUT", "POST") or not (headers.get("if-none-match") == "*" or "ifGenerationMatch=0" in path):
        return None
    found = re.search(rb"step_\d{10}(?=/COMMITTED)", path.encode() + body[:4096])
    return found.group().decode() if found else None


# -- what the library read ------------------------------------------------------------------------


@dataclass
class ReadLog:
    """Whole-file reads (``LocalStorage.read_file``) in this process: (monotonic time, path, outcome), where
    the outcome is ``"ok"`` or the error's type name."""

    events: list[tuple[float, str, str]] = field(default_factory=list)

    def of(self, path: str, outcome: str | None = None) -> list[float]:
        """When ``path`` was read (with that outcome)."""
        path = os.path.realpath(path)
        return [t for t, p, o in self.events if p == path and (outcome is None or o == outcome)]


@contextlib.contextmanager
def watched_reads(on_miss: Callable[[str], None] | None = None) -> Iterator[ReadLog]:
    """Record every whole-file read of the POSIX backend in this process; ``on_miss(path)`` runs after a read
    that found no file (from the reading thread, before the library sees the error).  The real read runs
    unchanged: a spy, not a stub."""
    from dcp_atomic.stores.storage import LocalStorage

    log, lock = ReadLog(), threading.Lock()
    real = LocalStorage.read_file

    def read_file(storage, path):
        try:
            data = real(storage, path)
        except BaseException as e:
            with lock:
                log.events.append((time.monotonic(), os.path.realpath(path), type(e).__name__))
            if on_miss is not None and isinstance(e, FileNotFoundError):
                on_miss(os.path.realpath(path))
            raise
        with lock:
            log.events.append((time.monotonic(), os.path.realpath(path), "ok"))
        return data

    LocalStorage.read_file = read_file
    try:
        yield log
    finally:
        LocalStorage.read_file = real


# -- what is on disk -------------------------------------------------------------------------------


def committed_save_ids(run_dir: str) -> dict[int, str]:
    out = {}
    for name in sorted(os.listdir(run_dir)) if os.path.isdir(run_dir) else []:
        marker = os.path.join(run_dir, name, "COMMITTED")
        if name.startswith("step_") and os.path.exists(marker):
            out[int(name[5:])] = json.load(open(marker))["save_id"]
    return out


def debris(run_dir: str) -> list[str]:
    """Everything under ``run_dir`` that no committed checkpoint names (temp files, partial attempts).

    A clean run directory holds ``LATEST``, retention's ``COMMITS`` journal and, per step,
    ``COMMITTED`` plus the one attempt it names, which holds exactly its manifest's files,
    ``.metadata``, ``manifest.json``, one ``manifest.<rank>.json`` per rank, ``ranks.json`` and ``ATTEMPT``.
    """
    found = []
    if not os.path.isdir(run_dir):
        return found
    for name in sorted(os.listdir(run_dir)):
        path = os.path.join(run_dir, name)
        if name in ("LATEST", "COMMITS"):
            continue
        if not (name.startswith("step_") and os.path.isdir(path)):
            found.append(path)
            continue
        marker = os.path.join(path, "COMMITTED")
        if not os.path.exists(marker):
            found.append(path)  # a step that never committed: all of it is debris
            continue
        save_id = json.load(open(marker))["save_id"]
        for entry in sorted(os.listdir(path)):
            if entry not in ("COMMITTED", save_id):
                found.append(os.path.join(path, entry))
        attempt = os.path.join(path, save_id)
        manifest = json.load(open(os.path.join(attempt, "manifest.json")))
        expected = {f["name"] for f in manifest["files"]} | {".metadata", "manifest.json", "ATTEMPT"}
        expected |= {manifest["ranks_file"]["name"]} if manifest.get("ranks_file") else set()
        expected |= {f"manifest.{r}.json" for r in range(manifest["world_size"])}
        for entry in sorted(os.listdir(attempt)):
            if entry not in expected:
                found.append(os.path.join(attempt, entry))
    return found


def gc_all_debris(root: str, run_id: str) -> int:
    """The operator's cleanup: ``dcp-atomic gc ROOT RUN --keep-last <all> --lease-hours 0``."""
    from dcp_atomic.tools.cli import main

    return main(["gc", root, run_id, "--keep-last", "1000000", "--lease-hours", "0"])
