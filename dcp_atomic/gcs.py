"""Google Cloud Storage through gcsfs: the commit by generation preconditions.

GCS numbers every write of an object (its *generation*) and checks a
precondition on it in the same request, atomically, for every client:

* ``ifGenerationMatch=0`` writes only if the object does not exist (HTTP 412
  otherwise): the put-if-absent ``create_exclusive`` needs, so two jobs
  committing one step cannot both win (gcsfs: ``pipe_file(..., mode="create")``);
* ``ifGenerationMatch=<g>`` writes only if the object still is generation
  ``g``: the compare-and-swap with which an ``overwrite=True`` re-save replaces
  the marker it read.

gcsfs turns the 412 into ``FileExistsError`` and retries 5xx itself; a 412
after such a retry may be our own write, so the content is read back before
anyone is told they lost.  Everything else is :class:`FsspecStorage`: data
objects are single or resumable uploads, visible only once complete.
"""

from __future__ import annotations

import inspect
import json
import posixpath
from typing import Any
from urllib.parse import quote

from .errors import CommitConflictError, ConfigurationError
from .layout import MARKER
from .storage import FsspecStorage

#: a multipart/related upload (metadata, then the bytes): the one request that carries ifGenerationMatch
_BOUNDARY = "==dcp-atomic=="


class GCSStorage(FsspecStorage):
    """GCS via gcsfs, with the commit marker created and replaced under generation preconditions."""

    exclusive_create_is_atomic = True

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        # No shared instance and no listing cache: a reused filesystem would carry another save's state.
        super().__init__(url, {"skip_instance_cache": True, "use_listings_cache": False, **(storage_options or {})})
        if "mode" not in inspect.signature(self.fs._pipe_file).parameters:
            raise ConfigurationError(
                f"{url}: the installed gcsfs cannot create an object only if it is "
                "absent (pipe_file has no mode='create'), so two jobs could both commit one step. Upgrade: "
                "pip install -U 'gcsfs>=2025.2'", root=url)
        self._generations: dict[str, str] = {}  # marker path -> generation last read (what replace must still find)

    def _url(self, path: str) -> str:
        return f"gs://{path}"

    def read_file(self, path: str) -> bytes:
        """A marker is read together with its generation (one GET), for :meth:`replace`."""
        if posixpath.basename(path) != MARKER:
            return super().read_file(path)
        headers, data = self.fs.call("GET", self.fs.url(path))
        generation = headers.get("X-Goog-Generation")
        if generation:
            self._generations[path] = generation
        return data

    def create_exclusive(self, path: str, data: bytes) -> bool:
        try:
            self.fs.pipe_file(path, data, mode="create")
        except FileExistsError:
            return False  # possibly our own retried write: the commit protocol reads the marker back
        return True

    def replace(self, path: str, data: bytes) -> None:
        """Plain write, except for a commit marker: only over the generation last read (or none)."""
        if posixpath.basename(path) != MARKER:
            self.fs.pipe_file(path, data)
            return
        generation = self._generations.pop(path, None) or self._generation(path)
        try:
            self._upload_if_generation(path, data, generation)
        except FileExistsError:
            if self._current(path) == data:
                return  # an earlier attempt of this write went through; its reply was lost
            raise CommitConflictError(
                f"{self._url(path)}: the commit marker changed while this save was replacing it (write with "
                f"ifGenerationMatch={generation} failed): another job re-saved or removed this step at the same "
                "time. Nothing of this save is visible. Read the step again and re-save with overwrite=True if "
                "you still want to replace it.",
                path=self._url(path),
            ) from None

    def _generation(self, path: str) -> str:
        """The object's current generation; "0" (must not exist) if there is none."""
        try:
            return str(self.fs.info(path)["generation"])
        except FileNotFoundError:
            return "0"

    def _current(self, path: str) -> bytes | None:
        try:
            return self.fs.cat_file(path)
        except FileNotFoundError:
            return None

    def _upload_if_generation(self, path: str, data: bytes, generation: str) -> None:
        """One multipart upload with ``ifGenerationMatch`` (gcsfs offers only ``0``, as ``mode="create"``)."""
        bucket, key, _ = self.fs.split_path(path)
        head = (f"--{_BOUNDARY}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n{json.dumps({'name': key})}"
                f"\r\n--{_BOUNDARY}\r\nContent-Type: application/octet-stream\r\n\r\n")
        body = head.encode() + data + f"\r\n--{_BOUNDARY}--".encode()
        self.fs.call("POST", f"{self.fs._location}/upload/storage/v1/b/{quote(bucket)}/o", uploadType="multipart",
                     headers={"Content-Type": f'multipart/related; boundary="{_BOUNDARY}"'}, data=body,
                     json_out=True, ifGenerationMatch=generation)
        self.fs.invalidate_cache(path)
