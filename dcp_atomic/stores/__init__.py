"""Where bytes live: the ``Storage`` interface and its backends (POSIX/NFS, fsspec, S3, GCS), with their retries
and conditional writes.  Stores move bytes by path; the checkpoint's meaning is the layers above."""
