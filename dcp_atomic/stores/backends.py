"""Which :class:`~dcp_atomic.stores.storage.Storage` serves a root: one table, one function.

Backends sit below this module and never import it (``storage.py`` holds the
primitives, each backend module builds on them), so there is no import cycle,
and a new backend is one module plus one :func:`register_backend` call, ours or
a user's, as fsspec's ``register_implementation`` is.  Entries are imported
lazily: an optional SDK (s3fs, gcsfs) is needed only by the roots that use it,
and the pip extra beside each entry is what a missing one's message tells the
operator to install (:func:`missing_backend_message`).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._base import arguments
from .._base.extras import install_advice
from ..errors import ArgumentError, ConfigurationError
from .storage import FsspecStorage, LocalStorage, Storage


@dataclass(frozen=True)
class Backend:
    """One URL scheme's backend: ``target`` ("module:Class", built as ``Class(root, storage_options)``) and the pip
    extra of dcp-atomic that brings the SDK it imports (None: it needs none beyond dcp-atomic's own)."""

    target: str
    extra: str | None = None


#: URL scheme -> its :class:`Backend` (fill it with :func:`register_backend`).
#: Plain paths are POSIX; a scheme not listed goes through fsspec (:class:`FsspecStorage`).
BACKENDS: dict[str, Backend] = {}


def register_backend(scheme: str, target: str, *, extra: str | None = None, clobber: bool = False) -> None:
    """Serve ``scheme://`` roots with ``target`` ("module:Class"; imported on first use, so registering costs no SDK
    import).  ``extra``: the dcp-atomic pip extra that brings its SDK, named when the import fails.  A scheme that
    already has another backend is refused unless ``clobber`` (replacing ``s3`` by accident would route every S3
    save through another class)."""
    if not isinstance(scheme, str) or not scheme or "://" in scheme or "/" in scheme:
        raise arguments.refused("register_backend(scheme=...)", scheme, "a bare URL scheme such as 's3'",
                                wrong_type=not isinstance(scheme, str))
    module, sep, name = target.partition(":") if isinstance(target, str) else ("", "", "")
    if not (module and sep and name):
        raise arguments.refused(f"register_backend({scheme!r}, target=...)", target, "'module:Class'",
                                wrong_type=not isinstance(target, str))
    backend = Backend(target, extra)
    if not clobber and BACKENDS.get(scheme, backend) != backend:
        raise ArgumentError(f"register_backend: {scheme}:// is already served by {BACKENDS[scheme].target}; pass "
                            f"clobber=True to replace it with {target}", argument="register_backend(clobber=...)")
    BACKENDS[scheme] = backend


register_backend("file", "dcp_atomic.stores.backends:_file_url")
register_backend("s3", "dcp_atomic.stores.s3:S3Storage", extra="s3")
register_backend("s3a", "dcp_atomic.stores.s3:S3Storage", extra="s3")
register_backend("gs", "dcp_atomic.stores.gcs:GCSStorage", extra="gcs")
register_backend("gcs", "dcp_atomic.stores.gcs:GCSStorage", extra="gcs")

#: fsspec options that only tune fsspec's own caching or directory creation: the POSIX path honours them
_LOCAL_OPTIONS = {"auto_mkdir", "skip_instance_cache", "use_listings_cache", "listings_expiry_time"}


def open_storage(root: str | os.PathLike, storage_options: dict[str, Any] | None = None) -> Storage:
    """Pick the backend once, from the root's form; callers never ask which it is."""
    root = arguments.location("root", root)
    arguments.instance("storage_options", storage_options, Mapping, "a dict of fsspec options")
    if "://" not in root:
        return LocalStorage(root)
    backend = BACKENDS.get(root.split("://", 1)[0])
    if backend is None:
        return FsspecStorage(root, storage_options)
    module, _, name = backend.target.partition(":")
    return getattr(importlib.import_module(module), name)(root, storage_options)


def missing_backend_message(root: str, error: ImportError) -> str:
    """What to install when ``root``'s backend (or its SDK) cannot be imported: the extra its entry names."""
    scheme = root.split("://", 1)[0] if "://" in root else ""
    backend = BACKENDS.get(scheme)
    if backend is not None and backend.extra:
        fix = install_advice(backend.extra)
    elif backend is not None:
        fix = f"install what {backend.target.partition(':')[0]} imports"
    else:
        fix = f"install the fsspec implementation of {scheme}:// (see fsspec's list of known implementations)"
    return f"{root}: the {scheme}:// backend cannot be imported ({error}); {fix}"


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
