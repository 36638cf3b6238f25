"""Re-read a committed checkpoint end to end and check every recorded digest.

Used by ``dcp-atomic verify``: an operator's answer to "is this checkpoint
still good?" after a disk incident or before promoting it.  Every data file is
read once, block by block, in parallel; each problem names the file.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from .commit import read_committed
from .errors import CheckpointError
from .integrity import sha256_hex, verify_blocks
from .layout import DCP_METADATA, RunLayout
from .manifest import FileEntry
from .retry import Deadline

READ_CHUNK_BLOCKS = 16  # read 16 blocks (64 MiB with 4 MiB blocks) per request


@dataclass
class AuditReport:
    step: int
    save_id: str | None
    files: int
    bytes: int
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems


def audit_step(layout: RunLayout, step: int, *, threads: int = 4, timeout: float = 10.0,
               progress: Callable[[int], None] | None = None) -> AuditReport:
    try:
        committed = read_committed(layout, step, Deadline(timeout))
    except CheckpointError as e:
        return AuditReport(step, None, 0, 0, [str(e)])
    manifest = committed.manifest
    problems: list[str] = []
    meta_path = layout.attempt_file(step, committed.save_id, DCP_METADATA)
    try:
        if sha256_hex(layout.storage.read_file(meta_path)) != manifest.dcp_metadata["sha256"]:
            problems.append(f"{meta_path}: sha256 does not match the manifest")
    except FileNotFoundError:
        problems.append(f"{meta_path}: missing")

    def check(entry: FileEntry) -> list[str]:
        path = layout.data_file(step, committed.save_id, entry.name)
        found = []
        try:
            actual = layout.storage.size(path)
        except FileNotFoundError:
            return [f"{path}: missing"]
        if actual != entry.size:
            found.append(f"{path}: size {actual}, manifest says {entry.size}")
        for item in entry.items:
            span = READ_CHUNK_BLOCKS * item.block_size
            for start in range(0, max(item.length, 1), span):
                length = min(span, item.length - start)
                data = layout.storage.read_range(path, item.pos + start, length)
                if len(data) != length:
                    found.append(f"{path}: item {item.key!r} truncated at byte {item.pos + start + len(data)}")
                    break
                try:
                    verify_blocks(data, item.checksums, item.block_size, what=f"{path} item {item.key!r}",
                                  first_block=start // item.block_size)
                except CheckpointError as e:
                    found.append(e.message)
                    break
                if progress:
                    progress(length)
        return found

    with ThreadPoolExecutor(max_workers=threads) as pool:
        for found in pool.map(check, manifest.files):
            problems.extend(found)
    return AuditReport(step, committed.save_id, len(manifest.files), manifest.total_bytes, problems)
