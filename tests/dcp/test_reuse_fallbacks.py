"""Reuse (P15) when the base cannot serve, in one process: each case ends in a committed, exact step that stores the
bytes itself, and what is logged says what happened.  A copy the store refuses is reported as the store's reply, not
as a failed save; a base object deleted meanwhile is named, not the new step's; a base whose manifest is gone is
found by the coordinator at once, not waited for by every rank.  On S3 against moto through the recording proxy
(tests/s3_servers.py), on POSIX in a temp directory; the GCS case is in tests/stores/test_gcs.py."""

from __future__ import annotations

import logging
import os
import re

import torch

from tests.helpers.reuse_state import RUN, frozen

STABLE_KEY = re.compile(r"/step_(\d{10})/[^/]+/__(\d+)_s\d+\.distcp$")


def _state(step: int) -> dict:
    return {"base": frozen(), "adapter": torch.full((4, 4), float(step))}


def _save(root: str, step: int, options: dict | None = None) -> dict:
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageWriter

    writer = AtomicStorageWriter(root, RUN, step, reuse=True, timeout=20, storage_options=options)
    dcp.save(_state(step), storage_writer=writer)
    return writer.last_stats


def _loads(root: str, step: int, options: dict | None = None) -> bool:
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageReader

    out = {"base": torch.zeros_like(frozen()), "adapter": torch.zeros(4, 4)}
    dcp.load(out, storage_reader=AtomicStorageReader(root, RUN, step, timeout=20, storage_options=options))
    return all(torch.equal(out[k], v) for k, v in _state(step).items())


def _reuse_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("reuse:")]


def test_a_copy_the_store_refuses_is_logged_as_the_stores_reply_and_the_save_writes_the_file_and_commits(s3_moto,
                                                                                                      caplog):
    s3, options = s3_moto, s3_moto.options()
    _save(s3.root, 1, options)
    _save(s3.root, 2, options)
    s3.proxy.fail(op="PUT", header="x-amz-copy-source", status=501, code="NotImplemented",
                  message="CopyObject is not implemented by this store")
    with caplog.at_level(logging.INFO, logger="dcp_atomic.writer"):
        stats = _save(s3.root, 3, options)
    assert stats["bytes_reused"] == 0 and _loads(s3.root, 3, options)
    [line] = [m for m in _reuse_lines(caplog) if "could not link" in m]
    assert "HTTP 501 NotImplemented: CopyObject is not implemented by this store" in line, line
    assert "writing it instead" in line, line
    # the save commits: nothing in the line may say otherwise, nor send the user to an option about upload bodies
    assert "committed" not in line and "checksum" not in line, line


def test_a_base_object_deleted_before_its_copy_is_named_not_the_new_steps_object(s3_moto, caplog):
    s3, options = s3_moto, s3_moto.options()
    _save(s3.root, 1, options)
    _save(s3.root, 2, options)
    [base] = [k for k in s3.keys() if (m := STABLE_KEY.search("/" + k)) and m.group(1) == f"{2:010d}"]
    s3.client.delete_object(Bucket=s3.bucket, Key=f"{s3.prefix}/{base}")
    with caplog.at_level(logging.INFO, logger="dcp_atomic.writer"):
        stats = _save(s3.root, 3, options)
    assert stats["bytes_reused"] == 0 and _loads(s3.root, 3, options)
    [line] = [m for m in _reuse_lines(caplog) if "could not link" in m]
    assert f"{s3.bucket}/{s3.prefix}/{base}" in line and "the source of the copy" in line, line
    assert f"step_{3:010d}" not in line, line


def test_a_base_whose_manifest_is_gone_means_a_full_save_at_once_not_a_wait_on_every_rank(tmp_path, caplog):
    root = str(tmp_path)
    _save(root, 1)
    _save(root, 2)
    step_dir = os.path.join(root, RUN, f"step_{2:010d}")
    [attempt] = [d for d in os.listdir(step_dir) if os.path.isdir(os.path.join(step_dir, d))]
    os.unlink(os.path.join(step_dir, attempt, "manifest.json"))  # the marker stays valid
    with caplog.at_level(logging.INFO, logger="dcp_atomic.writer"):
        stats = _save(root, 3)
    assert stats["bytes_reused"] == 0 and _loads(root, 3)
    lines = _reuse_lines(caplog)
    # the coordinator read the base's manifest once and named no base ...
    assert any("no base step for step 3" in m and "manifest.json" in m for m in lines), lines
    # ... so no rank waited BASE_WAIT_SECONDS for it before giving up on the base
    assert not any("cannot use step 2" in m for m in lines), lines


def test_a_base_naming_one_item_twice_means_full_saves_said_in_a_warning_never_a_key_error(tmp_path, caplog):
    """A re-sealed base shard that lists one item twice (its digests recomputed: only the planner can see it): each
    later reused save writes in full, commits and loads exactly, and the log names the base and the key; before,
    every later ``reuse=True`` save failed with an untyped ``KeyError``."""
    from tests.helpers.sealed import Sealed

    root = str(tmp_path)
    _save(root, 1)
    _save(root, 2)
    sealed = Sealed(root, 2)
    entry = next(f for f in sealed.manifest["files"] if any(i["key"] == "base" for i in f["items"]))
    entry["items"].append(dict(next(i for i in entry["items"] if i["key"] == "base")))  # the frozen base, twice
    sealed.write_manifest()
    with caplog.at_level(logging.WARNING, logger="dcp_atomic"):
        for step in (3, 4):
            stats = _save(root, step)
            assert _loads(root, step), step
    assert any("names item(s)" in r.getMessage() and "more than once" in r.getMessage() for r in caplog.records), \
        [r.getMessage() for r in caplog.records]
