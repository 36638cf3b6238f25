"""What the tests and the benchmarks both run on: gloo worlds (:mod:`testbed.worlds`), loopback ports
(:mod:`testbed.ports`) and local S3 servers (:mod:`testbed.s3_servers`); no pytest anywhere in it.

A top-level package beside ``tests/`` and ``benchmarks/``, not ``dcp_atomic._testing``: importable from a checkout
(both run from its root) without the test suite, yet never shipped in the wheel (pyproject packages only dcp_atomic).
"""
