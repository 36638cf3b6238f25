"""Which filesystem holds a path, from the kernel's mount table: the one reader of it.

Two rules depend on it: the memory tier's path should be RAM-backed (:data:`RAM_FILESYSTEMS`), and a reader may
wait for a step directory another node is writing only where a cache can hide it (NFS, FUSE): on a filesystem
that is local to this machine (:data:`LOCAL_FILESYSTEMS`) a name that is not there is not there.
"""

from __future__ import annotations

import os
import re

RAM_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})
# no client cache between this process and the truth: a missing name is missing for every process of this machine
LOCAL_FILESYSTEMS = RAM_FILESYSTEMS | {"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "zfs", "overlay", "jfs",
                                       "reiserfs", "vfat", "exfat", "ntfs3", "bcachefs"}
_ESCAPE = re.compile(r"\\([0-7]{3})")  # the table writes a space as \040


def filesystem_type(path: str | os.PathLike) -> str | None:
    """The type of the filesystem ``path`` lies on (the deepest mount holding it; the later of two on one point), or
    None where the mount table cannot be read (not Linux)."""
    path, kind, longest = os.path.realpath(path), None, -1
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return None
    for fields in mounts:
        if len(fields) < 3:
            continue
        point = _ESCAPE.sub(lambda m: chr(int(m[1], 8)), fields[1])
        if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) >= longest:
            kind, longest = fields[2], len(point)
    return kind


def ram_backed(path: str | os.PathLike) -> bool | None:
    """Whether ``path`` lies on a RAM-backed filesystem (None: unknown)."""
    kind = filesystem_type(path)
    return None if kind is None else kind in RAM_FILESYSTEMS


def local_filesystem(path: str | os.PathLike) -> bool:
    """Whether ``path`` lies on a filesystem of this machine, where no cache can hide a name another process made."""
    return filesystem_type(path) in LOCAL_FILESYSTEMS
