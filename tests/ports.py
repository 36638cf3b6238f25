"""The tests' loopback ports: defined in :mod:`testbed.ports` (the benchmarks use them too), imported here."""

from testbed.ports import free_port, free_ports  # noqa: F401
