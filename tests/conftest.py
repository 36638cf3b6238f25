import shutil
import tempfile
import warnings

import pytest

pytest_plugins = ["tests.s3_servers", "tests.fault_fixtures"]

warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process.*")
warnings.filterwarnings("ignore", message=".*Failed to initialize NumPy.*")


@pytest.fixture
def root():
    """A scratch checkpoint root, removed after the test."""
    path = tempfile.mkdtemp(prefix="dcp-atomic-test-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(autouse=True)
def _no_failpoints_leak():
    from dcp_atomic import failpoints

    yield
    failpoints.disarm_all()


@pytest.fixture
def nodes():
    """Two simulated nodes' local roots (the local tier), each its own tmpfs (a node's disk), unmounted afterwards;
    ranks map to them with ``tests.helpers.tiers._node_env``."""
    from tests.fault_fixtures import small_tmpfs_ctx

    with small_tmpfs_ctx(size_kib=65536) as a, small_tmpfs_ctx(size_kib=65536) as b:
        yield [a.path, b.path]


# The slow marker (pyproject.toml) sits on each slow test; these are in files other work owns right now, so they are
# marked here instead, by file and test name.
_SLOW_ELSEWHERE = {
    "test_formats.py::test_resharding_reads_and_verifies_only_the_frames_each_rank_needs",
    "test_tier_restore_plan.py::test_after_a_partial_restore_losing_the_other_node_falls_back_to_durable_and_the_next_save_heals",
    "test_tier_restore_plan.py::test_a_source_copy_damaged_after_the_scan_is_refused_by_the_receiver_then_passed_over",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if f"{item.path.name}::{getattr(item, 'originalname', item.name)}" in _SLOW_ELSEWHERE:
            item.add_marker(pytest.mark.slow)
