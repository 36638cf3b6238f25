"""Reuse (P15) on S3 verifies a server-side copy by the store's checksum instead of downloading it:
each data object's CRC32, as the store reported it when the object was written (a PUT's, or a multipart object's
combined from its parts'), is recorded in the rank's manifest shard; the CopyObject asks for the copy's CRC32 and
compares.  On moto (which reports it) a reused save downloads not one byte of the frozen base and a base object
changed in the bucket is caught without a download; on SeaweedFS (which reports none) the copy is downloaded and
checked against its block digests, as before."""

from __future__ import annotations

import json
import re
import zlib

import pytest

from tests.harness import assert_all_ok, run_world
from tests.helpers.reuse_state import CHUNK, load_step_from_a_store as _load, save_steps_on_a_store as _save_steps

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STABLE_KEY = re.compile(r"/step_(\d{10})/[^/]+/__(\d+)_s\d+\.distcp$")


def _stable_bytes_read(proxy) -> int:
    return sum(r.reply_bytes for r in proxy.requests() if r.op not in ("PUT", "UPLOAD_PART", "HEAD")
               and STABLE_KEY.search("/" + r.key))


def _shard_checksums(s3, step: int) -> dict[str, str | None]:
    """Stable file name -> the checksum rank shards of ``step`` record for it."""
    out = {}
    for key in s3.keys():
        if f"/step_{step:010d}/" in "/" + key and re.search(r"/manifest\.\d+\.json$", key):
            for entry in json.loads(s3.get(key))["files"]:
                if re.fullmatch(r"__\d+_s\d+\.distcp", entry["name"]):
                    out[entry["name"]] = entry.get("checksum")
    return out


def test_on_moto_a_reused_save_verifies_each_copy_by_the_stores_checksum_and_downloads_none_of_it(s3_moto):
    s3 = s3_moto
    extra = {"storage_options": s3.options()}
    assert_all_ok(run_world(_save_steps, 2, s3.root, args=([1, 2],), extra=extra, timeout=180))
    recorded = _shard_checksums(s3, 2)
    assert sorted(recorded) == ["__0_s0.distcp", "__1_s0.distcp"], recorded
    for name, checksum in recorded.items():  # the CRC32 of the bytes in the bucket, as the store reported it
        [key] = [k for k in s3.keys() if f"/step_{2:010d}/" in "/" + k and k.endswith("/" + name)]
        assert checksum == f"crc32:{zlib.crc32(s3.get(key)):08x}", (name, checksum)
    s3.proxy.reset()
    assert_all_ok(run_world(_save_steps, 2, s3.root, args=([3, 4],), extra=extra, timeout=180))
    copies = [r for r in s3.proxy.requests("PUT") if "x-amz-copy-source" in r.headers]
    assert len(copies) == 4 and all(r.status == 200 for r in copies), [(r.key, r.status) for r in copies]
    assert _stable_bytes_read(s3.proxy) == 0  # not one byte of the frozen base came down to verify a copy
    assert _shard_checksums(s3, 4) == recorded  # a copy records its source's checksum
    assert assert_all_ok(run_world(_load, 2, s3.root, args=(4,), extra=extra, timeout=120)) == [True, True]


def test_on_moto_a_base_object_changed_in_the_bucket_is_caught_by_the_copys_checksum_and_uploaded(s3_moto):
    s3 = s3_moto
    extra = {"storage_options": s3.options()}
    assert_all_ok(run_world(_save_steps, 2, s3.root, args=([1, 2],), extra=extra, timeout=180))
    [key] = [k for k in s3.keys() if (m := STABLE_KEY.search("/" + k)) and m.group(1) == f"{2:010d}"
             and m.group(2) == "0"]
    data = bytearray(s3.get(key))
    data[1000] ^= 0x01  # rewritten by another client: the bucket's own checksum of it is then of these bytes
    s3.put(key, bytes(data))
    s3.proxy.reset()
    lines = assert_all_ok(run_world(_save_steps, 2, s3.root, args=([3],), extra=extra, timeout=180))
    assert any("has the store's checksum" in line and "changed or damaged" in line for line in lines[0]), lines[0]
    assert _stable_bytes_read(s3.proxy) == 0  # caught without a download
    uploads = [r for r in s3.proxy.requests() if r.op in ("PUT", "UPLOAD_PART") and "x-amz-copy-source" not in r.headers
               and (m := STABLE_KEY.search("/" + r.key)) and m.group(1) == f"{3:010d}"]
    assert {STABLE_KEY.search("/" + r.key).group(2) for r in uploads} == {"0"}  # rank 1's stayed a copy
    assert sum(r.request_bytes for r in uploads) >= CHUNK
    assert assert_all_ok(run_world(_load, 2, s3.root, args=(3,), extra=extra, timeout=120)) == [True, True]
    damaged = assert_all_ok(run_world(_load, 2, s3.root, args=(2,), extra=extra, timeout=120))
    assert damaged[0] == "CorruptCheckpointError", damaged


def test_on_seaweedfs_which_reports_no_copy_checksum_the_copy_is_downloaded_and_checked(s3_seaweedfs):
    s3 = s3_seaweedfs
    extra = {"storage_options": s3.options()}
    assert_all_ok(run_world(_save_steps, 2, s3.root, args=([1, 2],), extra=extra, timeout=180))
    s3.proxy.reset()
    assert_all_ok(run_world(_save_steps, 2, s3.root, args=([3],), extra=extra, timeout=180))
    assert _stable_bytes_read(s3.proxy) >= 2 * CHUNK  # verified by its block digests: downloaded
