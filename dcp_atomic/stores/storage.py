"""The few storage primitives every other module speaks.

Writer, reader, commit protocol, manager and CLI never touch ``os`` or a cloud
SDK for checkpoint data: they call one :class:`Storage` object built once from
``root`` + ``storage_options`` by :func:`dcp_atomic.stores.backends.open_storage`
(backends build on this module; it never imports them).  The variation point is
small and explicit — how to publish a small control file:

* ``publish``: make a complete file visible under its final name at once
  (POSIX: write a temp file, fsync, ``rename``, fsync the directory; object
  stores: one PUT);
* ``create_exclusive``: the same, but only if the name does not exist yet
  (POSIX: ``link()`` of a fully written temp file — ``O_EXCL`` followed by a
  write would expose an empty file; ``link`` stays exclusive across NFS
  clients, ``rename`` does not);
* ``replace``: publish over an existing name (POSIX: ``rename`` over it).

Plain paths and ``file://`` URLs take the direct POSIX path (:class:`LocalStorage`;
``storage_options`` it cannot honour are refused, not silently dropped); any
other protocol, including a user's own fsspec filesystem, goes through the
fsspec object (:class:`FsspecStorage`), with a warning naming what is lost
(fsync, exclusive ``link()``) when that filesystem is a local-style one.

Every file :class:`LocalStorage` completes is read-only (its write bits dropped before the fsync that makes it
durable, :func:`make_read_only`): a checkpoint's files are never edited in place, only created, renamed over and
removed, none of which needs write permission on the file itself (rename and unlink need it on the directory).
So a stray writer that is not root (a ``torch.save`` or any tool opening a committed file for writing) is refused
with ``EACCES`` instead of truncating a file that several hard-linked steps may share (reuse, P15).  Set by the
process that wrote the file, when it closes it, not at the commit: no rank ever holds a writable file of a
committed step, and the commit needs no pass over every rank's files (P12).

Why one module of about 530 lines: the protocol and its two implementations that need no SDK (POSIX, any fsspec
filesystem) side by side, so each rule (publish, link, exclusive create) reads once per backend; the object stores
live in modules of their own.
"""

from __future__ import annotations

import abc
import errno
import os
import posixpath
import secrets
import shutil
import stat
import warnings
from typing import IO, Any, Callable

from ..errors import ConfigurationError

WRITE_BUFFER = 1 << 20
_WRITE_BITS = stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH


def _temp_name(path: str) -> str:
    head, tail = os.path.split(path)
    return os.path.join(head, f".{tail}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def make_read_only(file: int | str) -> None:
    """Drop every write bit of a complete file (an open descriptor or a path), keeping its read bits as the umask
    left them: the module docstring says why.  A file already read-only is left alone (no write to its inode)."""
    mode = stat.S_IMODE(os.stat(file).st_mode)
    if mode & _WRITE_BITS:
        os.chmod(file, mode & ~_WRITE_BITS)


class Storage(abc.ABC):
    """The primitives every backend provides; see the module docstring for their semantics.

    Abstract methods carry only their contract; the few with a body are
    defaults that backends may improve on.
    """

    root: str
    #: True where create_exclusive is a real put-if-absent shared by all clients.
    exclusive_create_is_atomic: bool = True
    #: How :meth:`link` gives a new name the bytes of an existing file without sending them through this process
    #: (reuse, P15): "hard link" (POSIX: one file, two names), "server-side copy" (object stores: the store copies
    #: the object); None where it cannot.
    link_kind: str | None = None

    @property
    def hard_links(self) -> bool:
        """Whether two steps' names can be one physical file (then a damaged byte is in every step naming it)."""
        return self.link_kind == "hard link"

    @abc.abstractmethod
    def join(self, *parts: str) -> str:
        """Join path parts with this backend's separator."""

    @abc.abstractmethod
    def makedirs(self, path: str) -> None:
        """Create ``path`` and its parents; existing is fine (object stores: nothing to do)."""

    @abc.abstractmethod
    def open_write(self, path: str) -> IO[bytes]:
        """A new file for streaming writes; :meth:`close_write` makes it durable."""

    @abc.abstractmethod
    def close_write(self, stream: IO[bytes]) -> str | None:
        """Make everything written to ``stream`` durable (fsync / complete the upload), then close it.  Returns the
        store's own checksum of the object where the store reports one (S3: :mod:`.object_checksum`), else None."""

    def abort_write(self, stream: IO[bytes]) -> None:
        """Give up on a stream after an error: never publish what was written so far."""
        stream.close()

    @abc.abstractmethod
    def read_file(self, path: str) -> bytes:
        """The whole file; ``FileNotFoundError`` if it does not exist (yet, for this client)."""

    @abc.abstractmethod
    def read_range(self, path: str, offset: int, length: int) -> bytes:
        """``length`` bytes from ``offset`` (fewer only at end of file)."""

    def readinto_range(self, path: str, offset: int, buffer: memoryview) -> int:
        """Fill ``buffer`` from ``offset`` (no intermediate copy where the backend allows)."""
        data = self.read_range(path, offset, len(buffer))
        buffer[: len(data)] = data
        return len(data)

    @abc.abstractmethod
    def size(self, path: str) -> int:
        """Size in bytes; ``FileNotFoundError`` if missing."""

    def open_reader(self, path: str) -> "RangeReader":
        """One handle for many ranged reads of ``path`` (one open, not one per item).

        The default delegates to the path-based methods, which is right for
        object stores (every ranged GET stands alone); ``LocalStorage`` keeps
        one descriptor.  ``FileNotFoundError`` if missing, here or at first use.
        """
        return RangeReader(self, path)

    def modified(self, path: str) -> float | None:
        """Last modification time (epoch seconds), or None if unknown or missing."""
        return None

    @abc.abstractmethod
    def publish(self, path: str, data: bytes) -> None:
        """Make ``data`` visible at ``path`` whole or not at all (temp + rename, or one PUT)."""

    @abc.abstractmethod
    def create_exclusive(self, path: str, data: bytes) -> bool:
        """Publish ``data`` at ``path`` unless it exists; False if it already did."""

    @abc.abstractmethod
    def replace(self, path: str, data: bytes) -> None:
        """Publish ``data`` over ``path``, whatever is there (rename-over, or one PUT)."""

    def read_versioned(self, path: str) -> tuple[bytes, str | None]:
        """The whole file and the version it was read at, for :meth:`replace_if_unchanged` (None where the store
        keeps no versions: POSIX, plain fsspec)."""
        return self.read_file(path), None

    def replace_if_unchanged(self, path: str, data: bytes, version: str | None) -> None:
        """Publish ``data`` over ``path`` only if it is still the version :meth:`read_versioned` returned, else
        :class:`CommitConflictError`: no silent last-writer-wins where the store can tell (object stores).  A store
        without versions replaces (one job per run is what it can offer; the commit warns of it)."""
        self.replace(path, data)

    def sync_dir(self, path: str) -> None:
        """Make directory entries durable (the default: backends without directories need nothing)."""

    def link(self, source: str, target: str) -> str | None:
        """``target`` with the bytes of the existing file ``source``, none of them sent through this process (see
        ``link_kind``), durable when this returns; ``OSError`` if it cannot be made (no hard links, another
        filesystem, ``source`` gone), or the store's typed error.  Only where ``link_kind`` is set.  Returns the
        store's checksum of the new object where it reports one (compared with the source's recorded checksum:
        :mod:`.object_checksum`), else None."""
        raise OSError(errno.ENOTSUP, f"{type(self).__name__} cannot link or copy files in place", target)

    def file_version(self, path: str) -> tuple | None:
        """What changes whenever the file's bytes are rewritten through the filesystem (POSIX: device, inode, size,
        mtime), for "verified once per process"; None where unknown."""
        return None

    def check_commit_support(self, directory: str, *, overwrite: bool = False) -> None:
        """Refuse, before any data is written, a store the commit cannot work on (default: nothing to probe).

        ``overwrite``: the commit will replace an existing marker (object stores need ``If-Match`` for it).
        """

    def is_dir(self, path: str) -> bool:
        """Whether ``path`` exists as a directory (object stores: whether anything lies under the prefix)."""
        return bool(self.list_dir(path))

    @abc.abstractmethod
    def list_dir(self, path: str) -> list[str]:
        """Names directly under ``path``; empty if it does not exist."""

    @abc.abstractmethod
    def remove(self, path: str) -> None:
        """Remove a file or a whole tree; missing is fine."""

    def describe(self) -> str:
        return self.root


class RangeReader:
    """Ranged reads of one file through its storage's path-based methods (see ``Storage.open_reader``)."""

    def __init__(self, storage: Storage, path: str) -> None:
        self.storage, self.path = storage, path

    def read_range(self, offset: int, length: int) -> bytes:
        """``length`` bytes from ``offset`` (fewer only at end of file)."""
        return self.storage.read_range(self.path, offset, length) if length else b""

    def readinto_range(self, offset: int, buffer: memoryview) -> int:
        """Fill ``buffer`` from ``offset``; returns bytes read (short only at end of file)."""
        return self.storage.readinto_range(self.path, offset, buffer) if len(buffer) else 0

    def size(self) -> int:
        return self.storage.size(self.path)

    def close(self) -> None:
        """Nothing to release here: every read goes through the storage's path-based methods."""

    def __enter__(self) -> "RangeReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalRangeReader(RangeReader):
    """One descriptor for all reads of a file: on NFS every open is a server round trip."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)

    def read_range(self, offset: int, length: int) -> bytes:
        buffer = bytearray(length)
        return bytes(buffer[: self.readinto_range(offset, memoryview(buffer))])

    def readinto_range(self, offset: int, buffer: memoryview) -> int:
        done = 0
        while done < len(buffer):
            n = os.preadv(self.fd, [buffer[done:]], offset + done)
            if n == 0:
                break
            done += n
        return done

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class LocalStorage(Storage):
    """POSIX files: local disks and NFS mounts."""

    link_kind = "hard link"

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self._links_supported: set[int] = set()  # st_dev of filesystems whose link() probe passed

    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    def makedirs(self, path: str) -> None:
        """``mkdir -p``, then fsync the parent of each directory created, so the marker never outlives its dirs."""
        created = []
        head = os.path.abspath(path)
        while not os.path.isdir(head):
            created.append(head)
            head = os.path.dirname(head)
        os.makedirs(path, exist_ok=True)
        for directory in reversed(created):
            self.sync_dir(os.path.dirname(directory))

    def is_dir(self, path: str) -> bool:
        return os.path.isdir(path)

    def check_commit_support(self, directory: str, *, overwrite: bool = False) -> None:
        """Probe ``link()`` once per filesystem: without hard links the commit would fail after all data is written."""
        device = os.stat(directory).st_dev
        if device in self._links_supported:
            return
        probe, linked = _temp_name(os.path.join(directory, "link-probe")), _temp_name(os.path.join(directory, "linked"))
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        try:
            os.link(probe, linked)
        except OSError as e:
            if e.errno not in _NO_LINK_ERRNOS:
                raise
            raise ConfigurationError(
                f"{directory}: this filesystem does not support hard links (link() failed: {e.strerror}), which "
                "dcp_atomic's commit needs (the marker is published by link(), exclusive across clients). Object "
                "storage mounts (gcsfuse, blobfuse) and some CIFS shares lack them: use a POSIX filesystem (local "
                "disk, NFS) or the object store's URL (s3://...) as root",
                path=directory,
            ) from None
        finally:
            _unlink_quietly(probe)
            _unlink_quietly(linked)
        self._links_supported.add(device)

    def open_write(self, path: str) -> IO[bytes]:
        # "x": a data file is always new (P1), never truncates anything that exists.
        return open(path, "xb", buffering=WRITE_BUFFER)

    def close_write(self, stream: IO[bytes]) -> None:
        try:
            stream.flush()
            make_read_only(stream.fileno())  # before the fsync, which makes the mode durable with the bytes
            os.fsync(stream.fileno())
        finally:
            stream.close()

    def read_file(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        with open(path, "rb", buffering=0) as f:
            return os.pread(f.fileno(), length, offset) if length else b""

    def readinto_range(self, path: str, offset: int, buffer: memoryview) -> int:
        """Fill ``buffer`` from ``offset``; returns bytes read (short only at EOF)."""
        done = 0
        fd = os.open(path, os.O_RDONLY)
        try:
            while done < len(buffer):
                n = os.preadv(fd, [buffer[done:]], offset + done)
                if n == 0:
                    break
                done += n
        finally:
            os.close(fd)
        return done

    def size(self, path: str) -> int:
        return os.stat(path).st_size

    def open_reader(self, path: str) -> RangeReader:
        return LocalRangeReader(path)

    def modified(self, path: str) -> float | None:
        try:
            return os.stat(path).st_mtime
        except FileNotFoundError:
            return None

    def _write_temp(self, path: str, data: bytes) -> str:
        tmp = _temp_name(path)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            make_read_only(fd)
            os.fsync(fd)
        except BaseException:  # ENOSPC and friends: leave no debris behind
            os.close(fd)
            _unlink_quietly(tmp)
            raise
        os.close(fd)
        return tmp

    def publish(self, path: str, data: bytes) -> None:
        self.replace(path, data)

    def replace(self, path: str, data: bytes) -> None:
        tmp = self._write_temp(path, data)
        try:
            os.rename(tmp, path)
        except BaseException:
            _unlink_quietly(tmp)
            raise
        self.sync_dir(os.path.dirname(path))

    def create_exclusive(self, path: str, data: bytes) -> bool:
        tmp = self._write_temp(path, data)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        finally:
            _unlink_quietly(tmp)
        self.sync_dir(os.path.dirname(path))
        return True

    def link(self, source: str, target: str) -> None:
        """A hard link: the new name shares the source's inode, so its mode too; a source written before files were
        made read-only (an older dcp_atomic, a stock DCP import) is made read-only with it, so the new step is."""
        if not stat.S_ISREG(os.lstat(source).st_mode):  # link() of a symlink names the link, not a file of the run
            raise OSError(errno.EINVAL, "not a regular file", source)
        os.link(source, target)
        try:
            make_read_only(target)  # EPERM where another user owns it: then this step writes its own file
            self.sync_dir(os.path.dirname(target))
        except OSError:
            _unlink_quietly(target)  # a writable name, or one that may not survive a crash: none, the caller writes
            raise

    def adopt(self, complete: str, path: str) -> None:
        """Publish under ``path`` a complete, fsynced file written elsewhere on this filesystem (a spooled transfer):
        read-only as every file completed here, renamed over ``path``, the directory fsynced."""
        make_read_only(complete)
        os.replace(complete, path)
        self.sync_dir(os.path.dirname(path))

    def file_version(self, path: str) -> tuple | None:
        st = os.stat(path)
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def sync_dir(self, path: str) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        except OSError as e:  # some network filesystems refuse fsync on directories
            if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
                raise
        finally:
            os.close(fd)

    def list_dir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except FileNotFoundError:
            return []

    def remove(self, path: str) -> None:
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        except FileNotFoundError:
            pass


_NO_LINK_ERRNOS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EXDEV}


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def publish_stream(path: str, write: Callable[[IO[bytes]], None], *, read_only: bool = False) -> None:
    """Publish a local file too large or too structured for one ``bytes`` (an export, Lightning's file, a partial
    copy): ``write(file)`` fills a temp file beside ``path`` (opened for reading too, so ``write`` may append to what
    it wrote, as a zip archive does), which is fsynced, renamed over ``path``, and the directory fsynced, so
    ``path`` is the old file or the whole new one, across a crash too.  A failure leaves no temp file.
    ``read_only``: a file of a checkpoint (a partial copy), read-only as :class:`LocalStorage`'s are; an export is
    the user's file to overwrite."""
    tmp = _temp_name(path)
    try:
        with open(tmp, "x+b") as f:
            write(f)
            f.flush()
            if read_only:
                make_read_only(f.fileno())
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    LocalStorage(os.path.dirname(path)).sync_dir(os.path.dirname(path))


class FsspecStorage(Storage):
    """Any fsspec filesystem.  Object stores have no rename: publish is one PUT.

    A generic fsspec filesystem offers no put-if-absent, so ``create_exclusive``
    here is check-then-put: correct for one committing process (which the
    protocol guarantees, P2) but not a guard against two independent jobs.
    """

    exclusive_create_is_atomic = False

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, fs_class: type | None = None) -> None:
        """``fs_class``: this filesystem class instead of the one fsspec registers for the URL's scheme."""
        import fsspec

        from fsspec.implementations.local import LocalFileSystem

        if fs_class is None:
            fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
        else:
            fs, path = fs_class(**(storage_options or {})), fs_class._strip_protocol(url)
        if isinstance(fs, LocalFileSystem):
            warnings.warn(
                f"{url}: {type(fs).__name__} is a local-style fsspec filesystem, so it goes through fsspec like any "
                "other: data files and directories are not fsync()ed before the commit (a power loss can leave a "
                "committed step with missing or empty files), and the marker is created by check-then-put instead "
                "of an exclusive link() (not safe against two jobs committing the same step). Use a plain path or a "
                "file:// URL for local disks and NFS",
                stacklevel=3,
            )
        self.fs = fs
        self.protocol = fs.protocol[0] if isinstance(fs.protocol, (tuple, list)) else fs.protocol
        self.root = path.rstrip("/") or path
        self.url = url

    def join(self, *parts: str) -> str:
        return posixpath.join(*parts)

    def makedirs(self, path: str) -> None:
        self.fs.makedirs(path, exist_ok=True)

    def open_write(self, path: str) -> IO[bytes]:
        return self.fs.open(path, "wb")

    def close_write(self, stream: IO[bytes]) -> None:
        stream.close()

    def abort_write(self, stream: IO[bytes]) -> None:
        # On object stores close() would *complete* the upload and publish a truncated object.
        discard = getattr(stream, "discard", None)
        if discard is not None:
            discard()
        else:
            stream.close()

    def read_file(self, path: str) -> bytes:
        return self.fs.cat_file(path)

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        if length == 0:
            return b""
        return self.fs.cat_file(path, start=offset, end=offset + length)

    def size(self, path: str) -> int:
        return int(self.fs.info(path)["size"])

    def modified(self, path: str) -> float | None:
        try:
            stamp = self.fs.modified(path)
        except (FileNotFoundError, NotImplementedError, OSError):
            return None
        return stamp.timestamp() if hasattr(stamp, "timestamp") else None

    def publish(self, path: str, data: bytes) -> None:
        self.fs.pipe_file(path, data)

    def replace(self, path: str, data: bytes) -> None:
        self.fs.pipe_file(path, data)

    def create_exclusive(self, path: str, data: bytes) -> bool:
        if self.fs.exists(path):
            return False
        self.fs.pipe_file(path, data)
        return True

    def list_dir(self, path: str) -> list[str]:
        try:
            entries = self.fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
        return sorted(posixpath.basename(str(e).rstrip("/")) for e in entries)

    def remove(self, path: str) -> None:
        try:
            self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass

    def describe(self) -> str:
        return self.url

