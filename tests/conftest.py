import shutil
import tempfile
import warnings

import pytest

from testbed.worlds import preload

pytest_plugins = ["tests.s3_servers", "tests.fault_fixtures"]

preload("pytest", "tests.harness")  # every rank of a test's world imports its test module, and so pytest

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
    from dcp_atomic._base import failpoints

    yield
    failpoints.disarm_all()


@pytest.fixture
def nodes():
    """Two simulated nodes' local roots (the local tier), each its own tmpfs (a node's disk), unmounted afterwards;
    ranks map to them with ``tests.helpers.tiers._node_env``."""
    from tests.fault_fixtures import small_tmpfs_ctx

    with small_tmpfs_ctx(size_kib=65536) as a, small_tmpfs_ctx(size_kib=65536) as b:
        yield [a.path, b.path]


def pytest_collection_modifyitems(config, items):
    """Slow tests first (a stable sort: files keep their order otherwise).  Under pytest-xdist every worker then
    ends the run on short tests, so the wall time is not set by one long test that happened to start last."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
