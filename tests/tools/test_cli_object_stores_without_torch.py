"""The command line on object stores answers without importing torch: ``ls`` and ``show`` of an
``s3://`` root import neither torch nor DCP; ``verify`` imports them only once the root has answered (it unpickles
``.metadata`` as a load does); and against an unreachable endpoint (``s3://`` or ``gs://``) every one of them fails
typed before torch is imported: importing torch takes seconds, a minute and more on a loaded login node."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from tests.tools.test_cli import _NO_TORCH_PROBE

pytestmark = pytest.mark.timeout(300)

RUN = "run"


def _probe(*argv: str) -> dict:
    done = subprocess.run([sys.executable, "-c", _NO_TORCH_PROBE, *argv], capture_output=True, text=True,
                          timeout=240)
    assert done.stdout.strip(), done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _closed_port() -> int:
    with socket.socket() as s:  # bound, then released: nothing listens there
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ls_and_show_of_an_s3_root_import_no_torch_and_verify_only_after_the_root_answered(s3_moto):
    import torch

    from dcp_atomic import CheckpointManager

    options = s3_moto.options()
    with CheckpointManager(s3_moto.root, RUN, storage_options=options) as manager:
        manager.save(1, {"w": torch.arange(16.0), "n": 3})
    flag = ["--storage-options", json.dumps(options)]
    for argv in (["ls", s3_moto.root], ["ls", s3_moto.root, RUN], ["show", s3_moto.root, RUN, "1"],
                 ["--json", "show", s3_moto.root, RUN, "1"]):
        result = _probe(*argv, *flag)
        assert result["code"] == 0 and not result["torch"], (argv, result)
    verified = _probe("verify", s3_moto.root, RUN, "1", *flag)
    assert verified["code"] == 0 and "step 1: OK" in verified["out"], verified
    missing = _probe("verify", s3_moto.root, "no-such-run", *flag)  # answered by the root: nothing to unpickle
    assert missing["code"] != 0 and not missing["torch"], missing


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_an_unreachable_endpoint_fails_every_command_before_torch_is_imported(scheme):
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    if scheme == "s3":
        options = {"endpoint_url": endpoint, "key": "k", "secret": "s", "client_kwargs": {"region_name": "us-east-1"},
                   "dcp_atomic_retry_budget_s": 0.5, "dcp_atomic_backoff_s": 0.01}
    else:
        options = {"endpoint_url": endpoint, "token": "anon", "project": "test", "retries": 1,
                   "dcp_atomic_retry_budget_s": 0.5, "dcp_atomic_backoff_s": 0.01}
    # a retry budget of 0.5 s: the commands fail the same way (several attempts, refused) after 0.5 s instead of 2 s
    root = f"{scheme}://bucket/root"
    flag = ["--storage-options", json.dumps(options), "--timeout", "5"]
    for argv in (["ls", root], ["ls", root, RUN], ["show", root, RUN, "1"], ["verify", root, RUN, "1"],
                 ["verify", root, RUN]):
        result = _probe(*argv, *flag)
        assert result["code"] not in (0, None) and not result["torch"], (argv, result)
