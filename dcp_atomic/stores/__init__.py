"""Where bytes live: the ``Storage`` interface and its backends (POSIX/NFS, fsspec, S3, GCS), with their retries
and conditional writes.  Stores move bytes by path; the checkpoint's meaning is the layers above."""

from .._base.faces import face

# The face: what the other layers import from here (tests/guards/test_layers.py holds them to it), by module.
__all__, __getattr__, __dir__ = face(__name__, {
    "backends": ("missing_backend_message", "open_storage"),
    "storage": ("LocalRangeReader", "LocalStorage", "publish_stream", "RangeReader", "Storage"),
})
