"""Loopback ports for test servers and gloo worlds that parallel test workers never hand out twice.

"Bind port 0, read the number, close, pass it on" races: until the server binds it again, any process may take
that port, and with several pytest-xdist workers starting worlds and servers at once, one does.  Here each
worker draws from its own block below the kernel's ephemeral range (32768+), which outgoing connections never
use, cycling through it and skipping ports something still holds.
"""

from __future__ import annotations

import itertools
import os
import re
import socket
import threading

_BASE, _BLOCK = 20000, 1000  # 20000-31999: 8 workers' blocks + 4 for sessions without workers, below the ephemeral range


def _worker_index() -> int:
    """An xdist worker's own block (0-7); a session without workers takes one of blocks 8-11 by its pid, so it does
    not share a worker's block, and two such sessions side by side (developers' runs) rarely share one."""
    match = re.fullmatch(r"gw(\d+)", os.environ.get("PYTEST_XDIST_WORKER", ""))
    return int(match.group(1)) % 8 if match else 8 + os.getpid() % 4


_offset = itertools.count(os.getpid() % _BLOCK)  # a fresh session does not retrace the last one's steps
_lock = threading.Lock()


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free right now, from this worker's block."""
    start = _BASE + _BLOCK * _worker_index()
    ports: list[int] = []
    with _lock:
        for _ in range(_BLOCK):
            port = start + next(_offset) % _BLOCK
            if port not in ports and _bindable(port):
                ports.append(port)
                if len(ports) == n:
                    return ports
    raise RuntimeError(f"no {n} free loopback port(s) in {start}-{start + _BLOCK - 1}")


def free_port() -> int:
    return free_ports(1)[0]
