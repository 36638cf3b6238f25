"""Every control-file field is type- and range-checked when parsed: a re-sealed marker or manifest with a field of
the wrong kind, or a world of 2**40 ranks, is a CorruptCheckpointError naming the file, in bounded time and memory
(before: a TypeError from a comparison, or a MemoryError building a list of 2**40 ranks)."""

from __future__ import annotations

import json
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_atomic import AtomicStorageReader, AtomicStorageWriter, CorruptCheckpointError
from tests.helpers.sealed import RUN, Sealed, seal


def _committed(root: str) -> Sealed:
    dcp.save({"w": torch.arange(8.0)}, storage_writer=AtomicStorageWriter(root, RUN, 1), no_dist=True)
    return Sealed(root, 1)


@pytest.mark.parametrize("field, value", [("manifest_sha256", 123), ("manifest_sha256", "ab" * 10),
                                          ("library_version", ["0.1"]), ("drain", 1), ("lineage", 7),
                                          ("provisional_for", 7), ("provisional_for", ""),
                                          ("sequence", -1), ("committed_at", "yesterday")])
def test_a_marker_field_of_the_wrong_kind_is_a_typed_error_naming_the_marker(tmp_path, field, value):
    sealed = _committed(str(tmp_path))
    with open(sealed.marker_path, "wb") as f:
        f.write(seal({**sealed.marker, field: value}))
    with pytest.raises(CorruptCheckpointError) as refused:
        AtomicStorageReader(str(tmp_path), RUN, 1, timeout=2).resolve()
    assert sealed.marker_path in str(refused.value) and field in str(refused.value), refused.value


@pytest.mark.parametrize("world_size", [2 ** 40, 0, True, "2"])
def test_a_manifest_world_size_out_of_range_is_refused_at_once(tmp_path, world_size):
    sealed = _committed(str(tmp_path))
    body = json.loads(sealed.manifest_bytes)
    body["world_size"] = world_size
    sealed.write_manifest(json.dumps(body).encode())
    started = time.monotonic()
    with pytest.raises(CorruptCheckpointError) as refused:
        AtomicStorageReader(str(tmp_path), RUN, 1, timeout=2).resolve()
    assert time.monotonic() - started < 5 and "world_size" in str(refused.value), refused.value
