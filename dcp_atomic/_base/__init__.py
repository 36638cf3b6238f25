"""Utilities every layer may use and that know nothing of checkpoints: fault points, retries and deadlines, the
collector pause, progress logs, argument checks, statistics records, and the one module that touches private names
of torch, s3fs and gcsfs (``internals``)."""
