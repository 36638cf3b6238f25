"""Which :class:`~dcp_atomic.storage.Storage` serves a root: one table, one function.

Backends sit below this module and never import it (``storage.py`` holds the
primitives, each backend module builds on them), so there is no import cycle,
and a new backend is one module plus one line in :data:`BACKENDS`.  Entries are
imported lazily: an optional SDK (s3fs, gcsfs) is needed only by the roots that
use it.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

from ..errors import ConfigurationError
from .storage import FsspecStorage, LocalStorage, Storage

#: URL scheme -> "module:class" of its backend, built as ``cls(root, storage_options)``.
#: Plain paths are POSIX; a scheme not listed goes through fsspec (:class:`FsspecStorage`).
BACKENDS = {
    "file": "dcp_atomic.stores.backends:_file_url",
    "s3": "dcp_atomic.stores.s3:S3Storage",
    "s3a": "dcp_atomic.stores.s3:S3Storage",
    "gs": "dcp_atomic.stores.gcs:GCSStorage",
    "gcs": "dcp_atomic.stores.gcs:GCSStorage",
}

#: fsspec options that only tune fsspec's own caching or directory creation: the POSIX path honours them
_LOCAL_OPTIONS = {"auto_mkdir", "skip_instance_cache", "use_listings_cache", "listings_expiry_time"}


def open_storage(root: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> Storage:
    """Pick the backend once, from the root's form; callers never ask which it is."""
    if isinstance(root, os.PathLike):
        root = os.fspath(root)
    if not isinstance(root, str) or not root:
        raise ValueError(f"root must be a non-empty path or URL, got {root!r}")
    if "://" not in root:
        return LocalStorage(root)
    entry = BACKENDS.get(root.split("://", 1)[0])
    if entry is None:
        return FsspecStorage(root, storage_options)
    module, _, name = entry.partition(":")
    return getattr(importlib.import_module(module), name)(root, storage_options)


def _file_url(root: str, storage_options: dict[str, Any] | None) -> LocalStorage:
    """``file://``: the direct POSIX path (fsync, ``link()``), which fsspec would lose; options it cannot honour are refused."""
    unsupported = sorted(set(storage_options or {}) - _LOCAL_OPTIONS)
    if unsupported:
        raise ConfigurationError(
            f"{root}: storage_options {unsupported} cannot be honoured on the direct POSIX path (fsync, link()), "
            f"and routing a file:// root through fsspec would lose both; drop them (accepted: "
            f"{sorted(_LOCAL_OPTIONS)})",
            root=root,
        )
    return LocalStorage(root[len("file://") :])
