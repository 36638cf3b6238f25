"""The tests' worlds: :func:`run_world` and its types are defined in :mod:`testbed.worlds` (the benchmarks run
them too, without the test suite) and imported here; :func:`assert_all_ok` is the tests' own."""

from __future__ import annotations

from typing import Any

from testbed.worlds import Outcome, RankContext, _describe_chain, run_world  # noqa: F401


def assert_all_ok(outcomes: list[Outcome]) -> list[Any]:
    bad = [o for o in outcomes if not o.ok]
    assert not bad, "\n".join(f"rank {o.rank}: {o.error_type} (exit {o.exitcode}): {o.error}" for o in bad)
    return [o.value for o in outcomes]
