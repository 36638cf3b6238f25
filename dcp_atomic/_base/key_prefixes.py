"""Hashed key prefixes (``_d00`` .. ``_dff``): where object stores spread a save's data keys so that S3 splits one
save's PUTs over partitions.  The layout places data files under them and the S3 store lists them; neither owns
the other, so the names live here, below both."""

from __future__ import annotations

import hashlib
import re

DATA_PREFIX_PATTERN = re.compile(r"_d[0-9a-f]{2}")  # '_' never starts a run id: never listed as a run
MAX_DATA_PREFIXES = 256  # two hex digits


def validate_data_prefixes(prefixes: int) -> int:
    if isinstance(prefixes, bool) or not isinstance(prefixes, int) or not 0 <= prefixes <= MAX_DATA_PREFIXES:
        raise ValueError(f"invalid data_prefixes {prefixes!r}: an integer from 0 (off) to {MAX_DATA_PREFIXES}")
    return prefixes


def data_prefix(key: str, prefixes: int) -> str:
    """``_dXX`` for one key: a hash of it, so one save's files (every rank's, and each rank's several) spread over
    all ``prefixes``, and the same ``prefixes`` names serve every save (S3 splits a hot prefix once and keeps the
    split)."""
    digest = hashlib.sha256(key.encode()).digest()
    return f"_d{int.from_bytes(digest[:4], 'big') % validate_data_prefixes(prefixes):02x}"
