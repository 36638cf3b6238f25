"""The S3 probe: before a save writes a byte, prove the store enforces the conditions its commit relies on.

Some S3-compatible stores accept ``If-None-Match`` / ``If-Match`` and silently
ignore them, which would turn the commit into last-writer-wins.  The first
control-file write of a root in a process therefore creates a throwaway key
twice with ``If-None-Match: *`` and replaces it with a mismatching ``If-Match``,
beside the path about to be written (under the run's prefix, where a scoped IAM
policy allows writes).  ``If-None-Match`` must hold for every save; ``If-Match``
only to replace a marker (``overwrite=True``).

Data objects may live elsewhere: under hashed prefixes ``<root>/_dXX/<run>/``
(see :mod:`dcp_atomic.format.layout`), which a policy scoped to ``<root>/<run>/*``
does not cover.  So a save also writes and deletes one plain probe object where
its data will go, and a refusal there names those prefixes and the IAM
resource pattern instead of failing on the first data PUT.

A probe that fails says why: credentials, permissions, KMS, the request
checksum mode, or conditional writes not implemented.  Functions here take the
:class:`~dcp_atomic.stores.s3.S3Storage` they probe; this module never imports it.
"""

from __future__ import annotations

import logging
import os
import posixpath
import secrets
import threading
from dataclasses import dataclass

from ..errors import CheckpointError, ConfigurationError, StorageError
from .object_retry import PreconditionFailed

log = logging.getLogger("dcp_atomic.s3_probe")  # the name users filter on

UNSAFE_SINGLE_WRITER = "dcp_atomic_unsafe_single_writer"
CHECKSUM_MODE = "dcp_atomic_checksum_mode"
PROBE_PREFIX = ".dcp-atomic-probe-"
AUTH_CODES = frozenset({"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
                        "TokenRefreshRequired", "AuthorizationHeaderMalformed", "InvalidSecurity"})
CHECKSUM_WORDS = ("checksum", "chunked", "trailer", "content-sha256", "content-md5", "baddigest",
                  "invaliddigest", "streaming")
IAM_ACTIONS = ("s3:PutObject, s3:GetObject, s3:DeleteObject, s3:ListBucket, s3:AbortMultipartUpload and "
               "s3:ListBucketMultipartUploads")


@dataclass(frozen=True)
class ProbeResult:
    """What the probe proved about a store: ``If-None-Match: *`` is always required, ``If-Match`` only to replace."""

    if_match: bool


_probed: dict[tuple[str, str], ProbeResult] = {}  # (endpoint, root) -> what the probe found, per process
_data_probed: set[tuple[str, str]] = set()  # (endpoint, a run's data directory) written once, per process
_probe_lock = threading.Lock()
_warned_unsafe: set[tuple[str, str]] = set()


def require_conditional_writes(storage, near: str, *, if_match: bool = False) -> None:
    """Probe once per (endpoint, root) per process that conditional writes are enforced.

    The probe object goes beside ``near`` (the path about to be written).  Fails
    closed with :class:`ConfigurationError`; skipped in unsafe single-writer mode.
    """
    key = (storage.endpoint, storage.root)
    if storage.unsafe_single_writer:
        if key not in _warned_unsafe:
            _warned_unsafe.add(key)
            log.warning(
                "%s: dcp_atomic_unsafe_single_writer=True: commit markers are written without conditional "
                "PUTs; two jobs writing this root at once could both commit one step", storage.describe())
        return
    with _probe_lock:
        result = _probed.get(key)
        if result is None:
            result = _probed[key] = _probe(storage, posixpath.dirname(near))
    if if_match and not result.if_match:
        raise ConfigurationError(
            f"S3 store at {storage.endpoint} enforces If-None-Match but not If-Match (probed under "
            f"{storage.describe()}): an overwrite=True save replaces a commit marker with If-Match, and without it "
            f"two jobs re-saving one step could both win. Save to a new step instead, or, if exactly one job "
            f"ever writes this root, pass storage_options={{'{UNSAFE_SINGLE_WRITER}': True}}.",
            endpoint=storage.endpoint, root=storage.root, missing="If-Match",
        )


def require_data_writes(storage, data_dir: str, prefixes_pattern: str) -> None:
    """Write and delete one plain object in ``data_dir`` (an attempt's directory under a hashed data prefix,
    where gc finds it if the delete is refused), once per run and process.

    A policy scoped to the run's prefix passes the conditional probe and would only fail at the first data
    PUT, rank by rank, with a generic error; this refuses the save before any data, naming the prefixes.
    """
    key = (storage.endpoint, posixpath.dirname(posixpath.dirname(data_dir)))  # once per run, not per save
    with _probe_lock:
        if key in _data_probed:
            return
        path = storage.join(data_dir, f"{PROBE_PREFIX}{os.getpid()}-{secrets.token_hex(6)}")
        try:
            storage._run(storage._put(path, b"probe-data"))
        except StorageError as e:
            failure = _probe_failure(storage, path, "data", e, data_prefixes=prefixes_pattern)
            raise failure from e
        _delete_quietly(storage, path)
        _data_probed.add(key)


def _probe(storage, directory: str) -> ProbeResult:
    path = storage.join(directory, f"{PROBE_PREFIX}{os.getpid()}-{secrets.token_hex(6)}")
    try:
        try:
            storage._run(storage._put(path, b"probe-1", IfNoneMatch="*"))
        except PreconditionFailed:
            pass  # the random key exists already: the condition is evidently enforced
        except StorageError as e:
            raise _probe_failure(storage, path, "If-None-Match: *", e) from e
        try:
            storage._run(storage._put(path, b"probe-2", IfNoneMatch="*"))
            raise ConfigurationError(
                f"S3 store at {storage.endpoint} ignores conditional writes: If-None-Match: * (a second create of "
                f"{storage._url(path)} succeeded). Refusing to write checkpoints to {storage.describe()}. "
                f"{_advice()}", endpoint=storage.endpoint, root=storage.root, cause="ignored",
            )
        except PreconditionFailed:
            pass
        if_match = False
        try:
            storage._run(storage._put(path, b"probe-3", IfMatch='"00000000000000000000000000000000"'))
        except (PreconditionFailed, FileNotFoundError):
            if_match = True
        except StorageError as e:
            failure = _probe_failure(storage, path, "If-Match", e)
            if not (isinstance(failure, ConfigurationError) and failure.details["cause"] == "not supported"):
                raise failure from e
        if not if_match:
            log.warning("S3 store at %s enforces If-None-Match but not If-Match: saves work, overwrite=True "
                        "saves under %s will be refused", storage.endpoint, storage.describe())
        return ProbeResult(if_match=if_match)
    finally:
        _delete_quietly(storage, path)


def _delete_quietly(storage, path: str) -> None:
    bucket, key = storage._split(path)
    try:
        storage._run(storage._call("DELETE", path, "delete_object", Bucket=bucket, Key=key))
    except Exception as e:  # noqa: BLE001 - a leftover probe object is harmless (gc removes its attempt)
        log.warning("could not delete the probe object %s (it is harmless; delete it by hand or let "
                    "gc remove it): %s", storage._url(path), e)


def rejects_request(error: StorageError) -> bool:
    """400 / 405 / 501: the store refused the request's form (a header, a checksum), not its state."""
    return error.details.get("status") in (400, 405, 501) or error.details.get("code") in (
        "NotImplemented", "InvalidArgument", "InvalidRequest")


def _failure_class(error: StorageError) -> str | None:
    """Which cause a failed probe request points to: auth, permissions, kms, checksum; None if unclear."""
    status, code = error.details.get("status"), error.details.get("code") or ""
    text = f"{code} {error.details.get('reply_message', '')}".lower()
    if code.startswith("KMS") or "kms" in text:
        return "kms"
    if code in AUTH_CODES or status == 401:
        return "auth"
    if status == 403 or code in ("AccessDenied", "AllAccessDisabled"):
        return "permissions"
    if rejects_request(error) and any(word in text for word in CHECKSUM_WORDS):
        return "checksum"
    return None


def _authenticates(storage, path: str) -> bool:
    """Whether a bodiless request (HEAD) with these credentials gets past authentication."""
    try:
        storage._head_etag(path)
    except StorageError:
        return False
    return True


def _advice() -> str:
    return (f"dcp_atomic commits a checkpoint on S3 with conditional PUTs (If-None-Match: * creates the commit "
            f"marker, If-Match replaces it); without them two jobs saving one step could both commit. Use a "
            f"store that enforces conditional writes (AWS S3, MinIO, SeaweedFS, Ceph RGW recent releases), or, "
            f"if exactly one job ever writes this root, pass storage_options={{'{UNSAFE_SINGLE_WRITER}': True}}.")


def data_prefix_advice(bucket: str, root_key: str, run: str, prefixes_pattern: str) -> str:
    """Where data objects go and the IAM resources that cover them (shared by the probe and a data PUT's 403)."""
    base = f"{bucket}/{root_key}/" if root_key else f"{bucket}/"
    return (f"Data objects go under hashed prefixes {base}{prefixes_pattern}/{run}/ (dcp_atomic_data_prefixes), "
            f"beside {base}{run}/ rather than under it: grant {IAM_ACTIONS} on arn:aws:s3:::{base}_d*/{run}/* as well "
            f"as arn:aws:s3:::{base}{run}/*, or pass storage_options={{'dcp_atomic_data_prefixes': 0}} to keep all "
            f"data under {base}{run}/.")


def _probe_failure(storage, path: str, header: str, error: StorageError, *,
                   data_prefixes: str | None = None) -> CheckpointError:
    """The true cause of a failed probe PUT, as a :class:`ConfigurationError` (or ``error`` if it is the
    store's state — throttling, 5xx, a missing bucket — rather than its setup)."""
    cause = _failure_class(error)
    if cause == "auth" and storage.checksum_mode != "when_required" and _authenticates(storage, path):
        cause = "checksum"  # the same credentials pass a HEAD: the store misreads the PUT's (chunked) form
    if cause is None and rejects_request(error) and data_prefixes is None:
        try:  # the condition, or anything in any PUT (a checksum header)? A plain PUT tells.
            storage._run(storage._put(path, b"probe-plain"))
            cause = "not supported"
        except StorageError as plain:
            cause = _failure_class(plain) or (
                "checksum" if rejects_request(plain) and storage.checksum_mode != "when_required" else None)
    reply = f"HTTP {error.details.get('status')} {error.details.get('code') or ''}".strip()
    what = "probe PUT" if data_prefixes is None else "probe PUT where this save's data goes"
    where = f"S3 store at {storage.endpoint} refused the {what} ({header}) of {storage._url(path)}: {reply}: " \
            f"{error.details.get('reply_message')}."
    if cause == "permissions" and data_prefixes is not None:
        bucket, key = storage._split(path)
        root_key = storage._split(storage.root)[1].strip("/")
        run = key[len(root_key):].strip("/").split("/")[1] if root_key else key.split("/")[1]
        permissions = f"These credentials may not write this save's data. " + data_prefix_advice(
            bucket, root_key, run, data_prefixes)
    else:
        permissions = (f"These credentials may not write under {storage._url(posixpath.dirname(path))}: grant "
                       f"{IAM_ACTIONS} on the checkpoint prefix.")
    advice = {
        "auth": "The credentials were not accepted: check key / secret / token in storage_options or the "
                "environment, and the endpoint and region they belong to.",
        "permissions": permissions,
        "kms": "The bucket encrypts with a KMS key these credentials cannot use: grant kms:GenerateDataKey and "
               "kms:Decrypt on it, or change the bucket's default encryption.",
        "checksum": f"The store rejects the request checksums botocore >= 1.36 sends by default (aws-chunked "
                    f"bodies with trailing checksums over https, x-amz-checksum-* headers): pass "
                    f"storage_options={{'{CHECKSUM_MODE}': 'when_required'}}.",
        "not supported": f"The store does not implement conditional writes ({header}). {_advice()}",
    }.get(cause)
    if advice is None:
        return error
    return ConfigurationError(f"{where} {advice}", endpoint=storage.endpoint, root=storage.root, cause=cause,
                              status=error.details.get("status"), code=error.details.get("code"))
