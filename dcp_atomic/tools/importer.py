"""Adopt a checkpoint written by stock DCP (``FileSystemWriter``) as a committed dcp_atomic step.

Stock DCP's data files already are what this library's ``stock_readable`` format
writes: ``__<rank>_<k>.distcp`` files of ``torch.save`` containers (tensors) and
raw pickles (other objects), described by a pickled ``.metadata``.  Importing
therefore copies (or hard-links) those files unchanged into a new attempt
directory, computes the block digests from the bytes placed there, records where
each tensor payload sits (so loads read it in place), and commits through the
normal protocol (:func:`dcp_atomic.protocol.commit.publish`): the step then loads,
verifies and reshards like any other.  Everything that can be refused — no or
undecodable ``.metadata``, foreign file names, stock extensions (compression),
a committed step — is refused before anything is written; the source directory
is only ever read (with ``link=True`` its data files are the step's, so they
become read-only as every committed data file: ``stores/storage.py``).
"""

from __future__ import annotations

import errno
import math
import os
import socket
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..protocol import commit
from ..protocol.catalog import DEFAULT_TIMEOUT
from ..format.container import LOCAL_HEADER, LOCAL_SIGNATURE, PREFIX_CAPTURE, find_payload
from ..errors import (CheckpointNotFoundError, CommitConflictError, ConfigurationError, CorruptCheckpointError,
                     StorageError)
from ..format.integrity import BLOCK_SIZE, BlockHasher, sha256_hex
from ..format.layout import DATA_FILE_PATTERN, DCP_METADATA, RunLayout, new_save_id, validate_step
from ..format.manifest import FileEntry, ItemExtent, Manifest, Marker, now
from .._base.retry import Deadline
from ..format.safe_pickle import load_dcp_metadata
from ..stores.backends import open_storage
from ..stores.storage import LocalStorage, Storage
from ..version import __version__

COPY_CHUNK = 8 << 20


def import_stock(source: str | os.PathLike, root: str | os.PathLike, run_id: str, step: int, *, link: bool = False,
                 timeout: float = DEFAULT_TIMEOUT, storage_options: dict[str, Any] | None = None) -> Marker:
    """Commit the stock DCP checkpoint in directory ``source`` as ``step`` of ``run_id`` under ``root``.

    ``link=True`` hard-links the data files instead of copying them (a local root on the same filesystem).
    The shared files are made read-only, so stock DCP re-saving into the source fails with ``PermissionError``
    instead of truncating them (as any user but root; ``verify`` reports what root damages).  Returns the
    commit marker.
    """
    source = os.path.abspath(os.fspath(source))
    validate_step(step)
    storage = open_storage(root, storage_options)
    layout = RunLayout(storage, run_id)
    metadata_bytes, metadata = _read_stock_metadata(source)
    files = _data_files(source, metadata)
    if link and not isinstance(storage, LocalStorage):
        raise ConfigurationError(f"--link needs a local root on the source's filesystem, not {storage.describe()}; "
                                 "import without --link to copy", path=str(root))
    _refuse_committed(layout, step)

    started = now()
    save_id = new_save_id()
    attempt = layout.attempt_dir(step, save_id)
    commit.claim_attempt(layout, step, save_id, started_at=started, imported_from=source)
    entries = []
    for name, items in files.items():
        path = storage.join(attempt, name)
        try:
            _place(os.path.join(source, name), path, storage, link)
        except OSError as e:
            raise _placing_error(e, os.path.join(source, name), path, link) from e
        entries.append(_describe_file(storage, path, name, items, metadata))
    ranks = sorted({entry.rank for entry in entries})
    world = max(ranks, default=0) + 1
    manifest = Manifest(
        run_id=layout.run_id,
        step=step,
        save_id=save_id,
        world_size=world,
        parallelism=None,  # stock DCP records no layout: layout checks are skipped for this step, with a log line
        ranks=[{"rank": r, "host": socket.gethostname(), "imported_from": source} for r in range(world)],
        files=sorted(entries, key=lambda f: (f.rank, f.name)),
        dcp_metadata={"name": DCP_METADATA, "size": len(metadata_bytes), "sha256": sha256_hex(metadata_bytes)},
        versions={"dcp_atomic": __version__, "torch": torch.__version__},
        started_at=started,
        written_at=now(),
        keys=_key_records(metadata),
        stored_dtypes={},  # items are stored as .metadata plans them (the payload offsets above assume it)
    )
    commit.write_shards(layout, manifest)  # each rank's items and digests, beside the data as a save writes them
    Manifest.from_json(manifest.to_json(), where=f"manifest of the import of {source}")  # what readers will parse
    return commit.publish(layout, manifest, metadata_bytes, overwrite=False, timeout=timeout)


def _read_stock_metadata(source: str):
    path = os.path.join(source, DCP_METADATA)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            f"{source} is not a stock DCP checkpoint: it has no {DCP_METADATA} (written last by "
            "FileSystemWriter, so the save may not have finished); nothing was imported", path=path) from None
    except NotADirectoryError:
        raise CheckpointNotFoundError(f"{source} is not a directory; nothing was imported", path=source) from None
    return data, load_dcp_metadata(data, where=path)


def _data_files(source: str, metadata) -> dict[str, list]:
    """``.metadata``'s items grouped by file, each checked to be importable as it is."""
    files: dict[str, list] = {}
    for index, info in (metadata.storage_data or {}).items():
        where = f"{os.path.join(source, DCP_METADATA)}: item {index.fqn!r}"
        if not DATA_FILE_PATTERN.fullmatch(str(info.relative_path)):
            raise ConfigurationError(
                f"{where} lies in {info.relative_path!r}; dcp_atomic's layout names data files "
                "__<rank>_<k>.distcp (as FileSystemWriter does). Re-save with FileSystemWriter, or rename the file "
                "and its entries in .metadata; nothing was imported", path=source, key=index.fqn)
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in (info.offset, info.length)):
            raise CorruptCheckpointError(f"{where}: offset {info.offset!r} / length {info.length!r} are not byte "
                                         "counts; nothing was imported", path=source, key=index.fqn)
        if getattr(info, "transform_descriptors", None):
            raise ConfigurationError(
                f"{where} was stored through DCP extensions {list(info.transform_descriptors)} (e.g. compression), "
                "which dcp_atomic does not read; re-save without extensions. Nothing was imported",
                path=source, key=index.fqn)
        if index.fqn not in metadata.state_dict_metadata:
            raise CorruptCheckpointError(f"{where} is stored but not described by .metadata", path=source)
        files.setdefault(info.relative_path, []).append((index, info))
    if not files:
        raise CorruptCheckpointError(f"{source}/{DCP_METADATA} names no stored item; nothing was imported",
                                     path=source)
    for name in files:
        if not os.path.isfile(os.path.join(source, name)):
            raise CorruptCheckpointError(f"{source}: data file {name} named by .metadata is missing; nothing was "
                                         "imported", path=os.path.join(source, name))
    return dict(sorted(files.items()))


def _refuse_committed(layout: RunLayout, step: int) -> None:
    try:
        marker = commit.read_marker(layout, step, Deadline(0), missing_ok=True)
    except FileNotFoundError:
        return
    raise CommitConflictError(
        f"step {step} of run {layout.run_id!r} is already committed (save {marker.save_id}); nothing was imported. "
        "Import as another step or run.", step=step, committed=marker.save_id)


def _place(source: str, path: str, storage: Storage, link: bool) -> None:
    if link:
        storage.link(source, path)  # the one inode, made read-only: the stock copy too
        return
    out = storage.open_write(path)
    try:
        with open(source, "rb") as f:
            while chunk := f.read(COPY_CHUNK):
                out.write(chunk)
    except BaseException:
        storage.abort_write(out)
        raise
    storage.close_write(out)


def _placing_error(e: OSError, source: str, path: str, link: bool) -> StorageError:
    hint = ("the stock directory and the root are on different filesystems: import without --link to copy"
            if link and e.errno == errno.EXDEV else
            "another user owns the stock files (a link shares them, made read-only): import without --link to copy"
            if link and e.errno == errno.EPERM else "check the storage (space, permissions) and import again")
    return StorageError(
        f"{'linking' if link else 'copying'} {source} to {path} failed: {e.strerror or e} (errno {e.errno}); {hint}. "
        "Nothing was committed; `dcp-atomic gc` collects the partial attempt.", path=path, errno=e.errno)


def _describe_file(storage: Storage, path: str, name: str, items: list, metadata) -> FileEntry:
    """The manifest entry of a placed file: every item's extent and block digests, hashed from the placed bytes."""
    with storage.open_reader(path) as reader:
        size = reader.size()
        extents = []
        for index, info in sorted(items, key=lambda pair: pair[1].offset):
            if info.offset + info.length > size:
                raise CorruptCheckpointError(f"{path}: item {index.fqn!r} at {info.offset} (+{info.length} bytes) "
                                             f"lies past the end of the {size}-byte file", path=path, key=index.fqn)
            extents.append(_extent(reader, path, index, info, metadata.state_dict_metadata[index.fqn]))
    return FileEntry(name=name, rank=int(DATA_FILE_PATTERN.fullmatch(name).group(1)), size=size, items=extents)


def _extent(reader, path: str, index, info, md) -> ItemExtent:
    hasher = BlockHasher(BLOCK_SIZE)
    for start in range(info.offset, info.offset + info.length, BLOCK_SIZE):
        hasher.update(reader.read_range(start, min(BLOCK_SIZE, info.offset + info.length - start)))
    tensor = isinstance(md, TensorStorageMetadata)
    payload = None
    if tensor:
        head = reader.read_range(info.offset, min(info.length, PREFIX_CAPTURE))
        if not head.startswith(LOCAL_SIGNATURE):
            raise ConfigurationError(
                f"{path}: tensor item {index.fqn!r} is not a torch.save container (saved with another DCP "
                "serialization format?); dcp_atomic imports FileSystemWriter's default format only", path=path,
                key=index.fqn)
        chunk = next((c for c in md.chunks if tuple(c.offsets) == tuple(index.offset or ())), None)
        if chunk is not None:
            payload = _payload_offset(head, math.prod(chunk.sizes) * md.properties.dtype.itemsize)
    return ItemExtent(key=index.fqn, chunk_offset=list(index.offset) if tensor else None,
                      kind="tensor" if tensor else "bytes", format="torch_save" if tensor else "raw",
                      pos=info.offset, length=info.length, checksums=hasher.finish(), block_size=BLOCK_SIZE,
                      payload=payload)


def _payload_offset(head: bytes, nbytes: int) -> int | None:
    """Where the zip entry ``<archive>/data/0`` starts, proven as the writer proves it (:func:`find_payload`)."""
    start = head.find(LOCAL_SIGNATURE)
    while 0 <= start <= len(head) - LOCAL_HEADER.size:
        fields = LOCAL_HEADER.unpack_from(head, start)
        offset = start + LOCAL_HEADER.size + fields[9] + fields[10]
        if find_payload(head, [(offset, nbytes)], nbytes) == offset:
            return offset
        start = head.find(LOCAL_SIGNATURE, start + 1)
    return None


def _key_records(metadata) -> dict[str, dict[str, Any]]:
    """Per-key records for the load-time checks (global shape and dtype, as the writer records them)."""
    records: dict[str, dict[str, Any]] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            records[fqn] = {"kind": "object"}
            continue
        whole = len(md.chunks) == 1 and list(md.chunks[0].sizes) == list(md.size)
        records[fqn] = {"kind": "plain" if whole else "sharded", "shape": list(md.size),
                        "dtype": str(md.properties.dtype), "layout_dependent": False}
    return records
