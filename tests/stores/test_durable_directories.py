"""Durable directories and the stores under them: fsynced parents, POSIX paths behind file URLs, what a local-style
fsspec filesystem loses, and filesystems without hard links refused before any data."""

from __future__ import annotations

import os
import stat

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from dcp_atomic.errors import ConfigurationError
from dcp_atomic.stores.backends import open_storage
from dcp_atomic.stores.storage import FsspecStorage, LocalStorage
from tests.helpers.steps import _save

def test_makedirs_fsyncs_the_parent_of_every_directory_it_creates(root, monkeypatch):
    synced: list[str] = []
    real_fsync = os.fsync

    def counting_fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    storage = LocalStorage(root)
    storage.makedirs(os.path.join(root, "run", "step_1", "attempt"))
    assert sorted(synced) == sorted([root, os.path.join(root, "run"), os.path.join(root, "run", "step_1")])
    synced.clear()
    storage.makedirs(os.path.join(root, "run", "step_1", "attempt"))
    assert synced == [], "nothing created, nothing to sync"


def test_file_url_with_storage_options_keeps_the_posix_path(root):
    assert isinstance(open_storage("file://" + root, {"auto_mkdir": True}), LocalStorage)
    with pytest.raises(ConfigurationError, match="fsync"):
        open_storage("file://" + root, {"block_size": 1024})


def test_local_style_fsspec_filesystem_warns_what_it_loses(root):
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    class MyLocal(LocalFileSystem):
        protocol = ("mylocal",)

    fsspec.register_implementation("mylocal", MyLocal, clobber=True)
    with pytest.warns(UserWarning, match="fsync") as record:
        storage = open_storage("mylocal://" + root)
    assert isinstance(storage, FsspecStorage)
    assert "link()" in str(record[0].message) and "MyLocal" in str(record[0].message)


def _count_links(monkeypatch):
    """A spy on ``os.link`` (the real call runs): the destinations the probe tried."""
    calls, real_link = [], os.link

    def link(src, dst, *args, **kwargs):
        calls.append(os.fspath(dst))
        return real_link(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "link", link)
    return calls


def test_commit_support_probe_refuses_a_filesystem_without_hard_links(root, fat_volume, monkeypatch):
    calls = _count_links(monkeypatch)
    storage = LocalStorage(root)
    storage.check_commit_support(root)  # a real hard-link-capable filesystem: fine
    assert os.listdir(root) == [], "the probe leaves nothing behind"
    assert len(calls) == 1
    fresh = LocalStorage(fat_volume)  # a real FAT volume: link() fails with EPERM
    with pytest.raises(ConfigurationError) as info:
        fresh.check_commit_support(fat_volume)
    assert "hard link" in str(info.value) and fat_volume in str(info.value)
    assert os.listdir(fat_volume) == [], "nor on the refused filesystem"
    assert len(calls) == 2 and calls[1].startswith(fat_volume), calls
    storage.check_commit_support(root)  # cached per filesystem: a passed probe is not repeated
    assert len(calls) == 2, calls


def test_save_onto_a_filesystem_without_hard_links_fails_before_any_data(fat_volume):
    """End to end on a real FAT volume (needs the writer's prepare_global_plan to call check_commit_support)."""
    with pytest.raises(CheckpointException) as info:
        _save(fat_volume, 1)
    assert "hard link" in str(info.value)
    written = [f for _, _, files in os.walk(fat_volume) for f in files if f.endswith(".distcp")]
    assert written == [], "no data may be written before the probe"
