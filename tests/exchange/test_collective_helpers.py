"""The typed collectives of ``exchange.collective`` in a world of one (their multi-rank use runs in the tier tests:
test_tiers.py, test_tier_worlds.py, test_tier_full_disk.py)."""

from __future__ import annotations

import pytest


def test_a_world_of_one_exchanges_nothing_and_a_phase_failure_is_every_ranks_typed_error():
    import torch.distributed as dist

    from dcp_atomic.errors import StorageError
    from dcp_atomic.exchange.collective import agreed_phase, from_rank0, gather
    from dcp_atomic.exchange.transport import PeerLost

    assert not dist.is_initialized()
    assert gather(None, {"mine": 1}, "a test") == [{"mine": 1}]
    assert from_rank0(None, ("rank 0's",), "a test") == ("rank 0's",)
    with agreed_phase(None, "copying step 3", "host:/nvme could not copy", then="Retry.", step=3):
        pass  # no failure: no error
    with pytest.raises(StorageError, match=r"copying step 3 failed: host:/nvme could not copy: disk gone\. Retry\.$") as e:
        with agreed_phase(None, "copying step 3", "host:/nvme could not copy", then="Retry.", step=3):
            raise OSError("disk gone")
    assert e.value.details["step"] == 3
    with pytest.raises(StorageError, match="found by hand"):
        with agreed_phase(None, "copying step 3", "unused", then="Retry.") as failures:
            failures.append("found by hand")
    with pytest.raises(PeerLost):  # the group is broken: raised at once, not agreed on
        with agreed_phase(None, "copying step 3", "unused", then="Retry."):
            raise PeerLost("rank 1 went silent", rank=0, silent="1")
