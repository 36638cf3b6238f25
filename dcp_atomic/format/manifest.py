"""The manifest, its per-rank shards, the commit marker and LATEST: plain data, JSON on disk.

Kept apart from all I/O (as torchsnapshot does) so they can be read with
``cat``, built in tests, and validated strictly: every field read back from
storage is type-checked, and the two small control files carry their own
sha256 so a torn or half-cached read is detected rather than trusted.
Nothing here is ever unpickled.

Schema 2 (P12): ``manifest.json`` holds O(world + keys) — identities, layout,
per-key records, the file list and one ``ShardRef`` (name, size, sha256) per
rank — and each rank's own ``manifest.<rank>.json`` holds its items and block
digests, so a loading rank reads the top manifest plus the shards of the files
it reads.  Schema 1 (every item inline in ``manifest.json``) is still read.  Since schema 5 a manifest names the
features a reader needs (``requires``: ``data_prefixes``, ``stable_files``) and an unknown one is refused by name;
schemas 2-4 are read by their old meaning (:data:`OLD_SCHEMA_FEATURES`, the one place that says it).

Why one module of about 800 lines: the on-disk records and their strict parsers side by side, so a field's writer
and its validator are a screen apart; plain data, no I/O.
"""

from __future__ import annotations

import functools
import json
import re
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ..errors import CorruptCheckpointError
from .integrity import sha256_hex
from ..version import __version__
from .layout import (DCP_METADATA, MANIFEST, STABLE_FILE_PATTERN, validate_data_file_name, validate_data_prefixes,
                     validate_run_id, validate_save_id, validate_step)
from .parallelism import Parallelism

# Schema 5 is the last number a feature needs: from 5 on ``requires`` names each feature a step uses that a reader
# must know to read it, and a reader refuses a name it does not know ("this step needs X: upgrade"), as it refuses
# a number above 5.  Before 5 a number stood for a feature, so an older dcp_atomic refused such a step as newer
# instead of misreading it; 5 itself is such a number (older readers refuse it as they refused 3 and 4).
MANIFEST_SCHEMA = 5
# data under hashed prefixes (layout.data_prefix, ``data_prefixes`` > 0): a reader that looks beside the manifest
# would wait out a "missing" data file instead of answering "upgrade"
DATA_PREFIXES = "data_prefixes"
# stable files (``__<rank>_s<j>.distcp``: reuse, P15): a reader that does not know the name calls it corrupt
STABLE_FILES = "stable_files"
FEATURES = (DATA_PREFIXES, STABLE_FILES)  # what this dcp_atomic reads, by name
INLINE_ITEMS = "inline_items"  # schema 1's shape, never written now: every item in manifest.json, no shards
# The one place the numbers before 5 are read: the features each one meant, and those it allowed beside them
# (schema 4 recorded ``data_prefixes`` where an object store's reuse put the data under hashed prefixes).
OLD_SCHEMA_FEATURES: dict[int, tuple[frozenset[str], frozenset[str]]] = {
    1: (frozenset({INLINE_ITEMS}), frozenset()),
    2: (frozenset(), frozenset()),
    3: (frozenset({DATA_PREFIXES}), frozenset()),
    4: (frozenset({STABLE_FILES}), frozenset({DATA_PREFIXES})),
}
READABLE_SCHEMAS = (*OLD_SCHEMA_FEATURES, MANIFEST_SCHEMA)
SHARD_SCHEMA = 2  # manifest.<rank>.json: unchanged since shards arrived (manifest schema 2)
CONTROL_SCHEMA = 1  # COMMITTED and LATEST: unchanged by manifest shards, so older tools still list and order steps
SHARD_PATTERN = re.compile(r"manifest\.(\d+)\.json")
MAX_BYTES = 1 << 50  # anything larger is a hostile or garbled size, not a real file


@dataclass
class ItemExtent:
    """Where one DCP item's bytes lie in a data file, and their block digests."""

    key: str  # fully-qualified name in the state dict
    chunk_offset: list[int] | None  # offset of this chunk in the global tensor; None for bytes
    kind: str  # "tensor" | "bytes"
    format: str  # "torch_save" (torch.load-able container) | "raw"
    pos: int  # byte offset in the file
    length: int
    checksums: list[str]
    block_size: int
    payload: int | None = None  # offset of raw tensor bytes inside a torch_save item (see container.py)
    codec: str = "none"  # raw items: "none" | "zstd" (see codec.py)
    planes: int = 1  # raw+zstd items: bytes per element split into planes
    logical_length: int | None = None  # raw items: tensor bytes before compression
    frames: list[int] | None = None  # raw+zstd items: stored length of each block's frame
    dtype: str | None = None  # element dtype actually stored, when a planner resolved another than .metadata's
    # written with reuse on (P15): the chunk's sizes, part of the identity the next save compares (older readers
    # ignore the field); None: not recorded
    chunk_sizes: list[int] | None = None

    @property
    def logical(self) -> int:
        return self.length if self.logical_length is None else self.logical_length

    @property
    def ident(self) -> tuple[str, tuple[int, ...] | None]:
        """DCP's identity of the item, (key, chunk offset): what ``.metadata``'s storage entries key it by."""
        return self.key, None if self.chunk_offset is None else tuple(self.chunk_offset)

    def blocks(self) -> list[tuple[int, int]]:
        """``(start, end)``, item-relative, of every stored block: one per digest, in order.

        The one definition every reader of stored bytes uses (:mod:`.blocks`): a compressed item's blocks are its
        frames, an uncompressed item's are ``block_size`` cuts of its bytes, an empty item is one empty block.
        Refused (typed) when the count disagrees with the digests, so no consumer can pair a block with another
        block's digest.
        """
        if self.frames is not None:
            sizes = self.frames
        else:
            sizes = [min(self.block_size, self.length - i) for i in range(0, self.length, self.block_size)] or [0]
        bounds, start = [], 0
        for size in sizes:
            bounds.append((start, start + size))
            start += size
        if len(bounds) != len(self.checksums) or start != self.length:
            raise CorruptCheckpointError(f"item {self.key!r}: {len(bounds)} stored block(s) of {start} bytes for "
                                         f"{len(self.checksums)} digest(s) and {self.length} bytes", key=self.key)
        return bounds


@dataclass
class FileEntry:
    name: str
    rank: int
    size: int
    items: list[ItemExtent] = field(default_factory=list)  # schema 2: in the rank's shard, not in manifest.json
    # the store's own checksum of the object, as it reported it when the object was written (S3: "crc32:<hex>",
    # GCS: "crc32c:<hex>", stores/object_checksum.py): a server-side copy of it is verified by the copy's checksum, not by a download.
    # In the rank's shard only, absent when None (older readers ignore it).
    checksum: str | None = None


def shard_name(rank: int) -> str:
    return f"manifest.{rank}.json"


@dataclass
class ShardRef:
    """How ``manifest.json`` names one rank's shard: the link marker -> manifest -> shard -> blocks."""

    rank: int
    name: str
    size: int
    sha256: str


@dataclass
class ManifestShard:
    """One rank's record of what it wrote (``manifest.<rank>.json``): its files, every item's extent and digests.

    Written, fsynced and digested by the rank itself, so the coordinator handles
    only its digest.  Items are rows that omit default fields, block digests one
    string of fixed-width hex: 10,000 items encode in ~1.3 MB and parse in ~40 ms.
    """

    run_id: str
    step: int
    save_id: str
    rank: int
    files: list[FileEntry]
    kind: str = "dcp_atomic.manifest_shard"
    schema_version: int = SHARD_SCHEMA

    def to_json(self) -> bytes:
        body = {k: getattr(self, k) for k in ("run_id", "step", "save_id", "rank", "kind", "schema_version")}
        body["files"] = [{"name": f.name, "size": f.size, "items": [_encode_extent(i) for i in f.items],
                          **({"checksum": f.checksum} if f.checksum is not None else {})}
                         for f in self.files]
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes, *, where: str) -> "ManifestShard":
        raw = _load_json(data, where)
        _expect(raw.get("kind") == "dcp_atomic.manifest_shard", where, "not a dcp_atomic manifest shard")
        _expect(raw.get("schema_version") == SHARD_SCHEMA, where,
                f"shard schema_version {raw.get('schema_version')!r} is not {SHARD_SCHEMA}")
        try:
            rank = _nonneg(raw["rank"])
            files = [FileEntry(name=validate_data_file_name(f["name"]), rank=rank, size=_nonneg(f["size"]),
                               items=[_parse_extent(_decode_extent(i), f["size"]) for i in _list(f["items"])],
                               checksum=_checksum(f.get("checksum")))
                     for f in _list(raw["files"])]
            return cls(run_id=validate_run_id(raw["run_id"]), step=validate_step(raw["step"]),
                       save_id=validate_save_id(raw["save_id"]), rank=rank, files=files)
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpointError(f"{where}: malformed manifest shard ({type(e).__name__}: {e})",
                                         path=where) from None


def _checksum(value: Any) -> str | None:
    """A file's recorded store checksum: absent, or ``crc32:``/``crc32c:`` and 8 hex digits (else malformed)."""
    if value is not None and not (isinstance(value, str) and re.fullmatch(r"crc32c?:[0-9a-f]{8}", value)):
        raise ValueError(f"file checksum {value!r} is not crc32:<8 hex digits> or crc32c:<8 hex digits>")
    return value


_EXTENT_DEFAULTS = {"payload": None, "codec": "none", "planes": 1, "logical_length": None, "frames": None,
                    "dtype": None, "chunk_sizes": None}
_DIGEST_HEX = 16  # xxh3-64 block digests, fixed width


_EXTENT_FIELDS = tuple(f.name for f in fields(ItemExtent))


def _encode_extent(item: ItemExtent) -> dict:
    """One item as a row: its fields by name (not ``asdict``, whose deep copies cost ~80 us an item), defaults
    left out."""
    row = {k: v for k in _EXTENT_FIELDS if _EXTENT_DEFAULTS.get(k, ...) != (v := getattr(item, k))}
    row["checksums"] = "".join(item.checksums)
    if item.chunk_offset is not None:
        row["chunk_offset"] = list(item.chunk_offset)
    if item.frames is not None:
        row["frames"] = list(item.frames)
    if item.chunk_sizes is not None:
        row["chunk_sizes"] = list(item.chunk_sizes)
    return row


def _decode_extent(row: Any) -> dict:
    row = dict(_dict(row))
    digests = _str(row["checksums"])
    if len(digests) % _DIGEST_HEX:
        raise ValueError(f"block digests of {row.get('key')!r} are not whole {_DIGEST_HEX}-hex digests")
    row["checksums"] = [digests[i : i + _DIGEST_HEX] for i in range(0, len(digests), _DIGEST_HEX)]
    return row


@dataclass
class Manifest:
    run_id: str
    step: int
    save_id: str
    world_size: int
    parallelism: dict[str, Any] | None
    ranks: list[dict[str, Any]]
    files: list[FileEntry]
    dcp_metadata: dict[str, Any]  # {"name", "size", "sha256"}
    versions: dict[str, str]
    started_at: float
    written_at: float
    stats: list[dict[str, Any]] = field(default_factory=list)
    keys: dict[str, Any] = field(default_factory=dict)
    shards: list[ShardRef] = field(default_factory=list)  # schema 2: one per rank; schema 1: none, items inline
    data_prefixes: int = 0  # hashed data prefixes the data lives under (layout.data_prefix); 0: beside the manifest
    # {"name", "size", "sha256"} of ranks.json, which then holds ``ranks`` and ``stats`` (empty in the JSON): loaders
    # never need them, and at 4,096 ranks they were half of what every loading rank read.  None: inline (older).
    ranks_file: dict[str, Any] | None = None
    # what the user attached to this checkpoint (``save(..., metadata=...)``): small JSON, sealed with the rest;
    # absent when None, so older readers (which ignore unknown fields) read such manifests unchanged
    user_metadata: dict[str, Any] | None = None
    # key -> every dtype its chunks are stored as, for the keys a planner cast ("save as bf16"); every other
    # chunk is stored as .metadata plans it.  A load refuses a shard item whose dtype this does not allow (a
    # relabel after the commit would load reinterpreted bytes).  None: written before it was recorded, unchecked.
    stored_dtypes: dict[str, list[str]] | None = None
    # a memory tier's durable copy: the commit sequence of the snapshot whose bytes this step holds, which a memory
    # restore orders it by (protocol.commit.memory_order).  Absent when None: a reader that ignores it only loses that
    # ordering, so no ``requires``.  Before it, the order was the key ``dcp_atomic.copy_of_memory_sequence`` of
    # ``user_metadata`` (still read there)
    copy_of_sequence: int | None = None
    schema_version: int = MANIFEST_SCHEMA  # a manifest read keeps its own number, and writes it back (``show``)
    kind: str = "dcp_atomic.manifest"

    def to_json(self) -> bytes:
        if self.requires(INLINE_ITEMS):
            body = asdict(self)
            del body["shards"]
        else:  # field by field: asdict would deep-copy every item of every shard
            body = {f.name: getattr(self, f.name) for f in fields(self)}
            body["files"] = [{"name": f.name, "rank": f.rank, "size": f.size} for f in self.files]
            body["shards"] = [asdict(ref) for ref in self.shards]
        if self.ranks_file is None:
            del body["ranks_file"]
        else:  # in ranks.json
            body["ranks"], body["stats"] = [], []
        if self.user_metadata is None:
            del body["user_metadata"]
        if self.stored_dtypes is None:
            del body["stored_dtypes"]
        if self.copy_of_sequence is None:
            del body["copy_of_sequence"]
        if not self.data_prefixes:
            del body["data_prefixes"]  # absent = 0: the classic layout
        if self.schema_version == MANIFEST_SCHEMA:  # an older number implies its features (OLD_SCHEMA_FEATURES)
            body["requires"] = sorted(self.required_features())
        return _readable_json(body)

    def requires(self, feature: str) -> bool:
        """Whether a reader must know ``feature`` (:data:`FEATURES`, or schema 1's :data:`INLINE_ITEMS`) to read
        this step: what code asks instead of comparing schema numbers."""
        return feature in self.required_features()

    def required_features(self) -> frozenset[str]:
        """The features this step uses, found in what it records: what a schema 5 manifest's ``requires`` lists
        (:meth:`from_json` refuses one that lists others)."""
        meant, _ = OLD_SCHEMA_FEATURES.get(self.schema_version, (frozenset(), frozenset()))
        used = meant & {INLINE_ITEMS}  # a shape, not a record: only schema 1's number tells it
        if self.data_prefixes:
            used |= {DATA_PREFIXES}
        if any(STABLE_FILE_PATTERN.fullmatch(f.name) for f in self.files):
            used |= {STABLE_FILES}
        return used

    def shard_of(self, rank: int) -> ShardRef | None:
        return next((s for s in self.shards if s.rank == rank), None)

    def control_files(self) -> list[tuple[str, int, str]]:
        """(name, size, sha256) of each file besides the shards that the manifest seals and a reader needs to open
        the step: ``.metadata``, and ``ranks.json`` where the ranks' records live there.  Every copy of a step (the
        drain, a replica root, a restore) checks and copies these; the manifest itself is sealed by the marker."""
        refs = [self.dcp_metadata] + ([self.ranks_file] if self.ranks_file is not None else [])
        return [(ref["name"], ref["size"], ref["sha256"]) for ref in refs]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def extent_index(self, names: set[str] | None = None) -> dict[tuple[str, tuple[int, ...] | None], tuple[str, ItemExtent]]:
        """Every item (of the files ``names``, default all) by its DCP identity (key, chunk offset) -> (file, extent).

        Not by (file, offset): a zero-element chunk shares its offset with the
        item after it.  Two items with one identity raise ``ValueError``.
        """
        index = {}
        for f in self.files if names is None else (f for f in self.files if f.name in names):
            for item in f.items:
                ident = item.ident
                if ident in index:
                    raise ValueError(f"two items for key {item.key!r} at chunk offset {item.chunk_offset}")
                index[ident] = (f.name, item)
        return index

    @classmethod
    def from_json(cls, data: bytes, *, where: str) -> "Manifest":
        raw = _load_json(data, where)
        _expect(raw.get("kind") == "dcp_atomic.manifest", where, "not a dcp_atomic manifest")
        _check_schema(raw, where, READABLE_SCHEMAS)
        declared, allowed = _declared_features(raw, where)
        inline = INLINE_ITEMS in declared
        try:
            files = [
                FileEntry(
                    name=validate_data_file_name(f["name"]),
                    rank=_nonneg(f["rank"]),
                    size=_nonneg(f["size"]),
                    items=[_parse_extent(i, f["size"]) for i in f["items"]] if inline else [],
                )
                for f in raw["files"]
            ]
            shards = [] if inline else [_shard_ref(s) for s in _list(raw["shards"])]
            meta = _dict(raw["dcp_metadata"])
            _expect(meta["name"] == DCP_METADATA, where, f"dcp_metadata.name must be {DCP_METADATA}")
            _nonneg(meta["size"])
            _expect(isinstance(meta["sha256"], str) and len(meta["sha256"]) == 64, where, "bad sha256")
            manifest = cls(
                run_id=validate_run_id(raw["run_id"]),
                step=validate_step(raw["step"]),
                save_id=validate_save_id(raw["save_id"]),
                world_size=_world_size(raw["world_size"]),
                parallelism=_parallelism(raw.get("parallelism")),
                ranks=_rank_records(raw["ranks"]),
                files=files,
                dcp_metadata=meta,
                versions={str(k): _str(v) for k, v in _dict(raw["versions"]).items()},
                started_at=_number(raw["started_at"]),
                written_at=_number(raw["written_at"]),
                stats=_stats_records(raw.get("stats", [])),
                keys={str(k): _key_record(v) for k, v in _dict(raw.get("keys", {})).items()},
                shards=shards,
                data_prefixes=_data_prefixes(raw),
                ranks_file=None if raw.get("ranks_file") is None else _file_ref(raw["ranks_file"], RANKS_FILE),
                user_metadata=None if raw.get("user_metadata") is None else _dict(raw["user_metadata"]),
                stored_dtypes=_stored_dtypes(raw.get("stored_dtypes")),
                copy_of_sequence=_copy_of_sequence(raw),
                schema_version=raw["schema_version"],
            )
            manifest.extent_index()  # one item per (key, chunk offset)
            used = manifest.required_features()
            if not declared <= used <= declared | allowed:
                raise ValueError(f"its records use features {sorted(used)}, its schema {raw['schema_version']} says "
                                 f"{sorted(declared)}" + (f" (and allows {sorted(allowed)})" if allowed else ""))
            if not inline:
                _check_shard_refs(manifest)
            return manifest
        except CorruptCheckpointError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpointError(f"{where}: malformed manifest ({type(e).__name__}: {e})", path=where) from None


RANKS_FILE = "ranks.json"
MAX_USER_METADATA_BYTES = 64 * 1024  # every loading rank reads the manifest: metadata is for notes, not payloads


def check_user_metadata(metadata: Any) -> dict[str, Any] | None:
    """``metadata`` as the manifest will hold it, or ValueError saying what is wrong (before a byte is written)."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or not all(isinstance(k, str) for k in metadata):
        raise ValueError(f"metadata must be a dict with str keys, got {type(metadata).__name__}")
    try:
        encoded = json.dumps(metadata, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"metadata must be JSON (str, numbers, bools, None, lists, dicts): {e}") from None
    if len(encoded) > MAX_USER_METADATA_BYTES:
        raise ValueError(f"metadata is {len(encoded)} bytes as JSON, more than {MAX_USER_METADATA_BYTES}: keep "
                         "notes in it, and save data as state-dict items")
    return json.loads(encoded)  # a copy: later changes by the caller do not reach the checkpoint


@dataclass
class RankRecords:
    """``ranks.json``: who took part in a save (identities) and what each rank wrote (statistics).

    People read these (``dcp-atomic show``), loaders never do, so they live beside ``manifest.json``, named
    there by size and sha256, and the manifest every loading rank reads stays O(files + keys).
    """

    ranks: list[dict[str, Any]]
    stats: list[dict[str, Any]]
    kind: str = "dcp_atomic.ranks"

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes, *, where: str) -> "RankRecords":
        raw = _load_json(data, where)
        _expect(raw.get("kind") == "dcp_atomic.ranks", where, "not a dcp_atomic ranks file")
        try:
            return cls(ranks=_rank_records(raw["ranks"]), stats=_stats_records(raw["stats"]))
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpointError(f"{where}: malformed ranks file ({type(e).__name__}: {e})", path=where) from None


def _rank_records(value: Any) -> list[dict[str, Any]]:
    return [_record(r, host=str) for r in _list(value)]


def _stats_records(value: Any) -> list[dict[str, Any]]:
    return [_record(s, rank=int, bytes=int, items=int, write_seconds=float, fsync_seconds=float) for s in _list(value)]


def _file_ref(value: Any, name: str) -> dict[str, Any]:
    """{"name", "size", "sha256"} of a side file the manifest seals."""
    raw = _dict(value)
    if raw.get("name") != name or not re.fullmatch(r"[0-9a-f]{64}", _str(raw["sha256"])):
        raise ValueError(f"side file record {raw!r} is not {name} with a sha256")
    return {"name": name, "size": _nonneg(raw["size"]), "sha256": raw["sha256"]}


def _declared_features(raw: dict, where: str) -> tuple[frozenset[str], frozenset[str]]:
    """(the features a manifest says it uses, those it may use beside them): its ``requires`` from schema 5 on, the
    meaning of its number before.  A name this dcp_atomic does not know is refused by name, before the rest is
    read: such a step is newer, not corrupt."""
    version = raw["schema_version"]
    if version in OLD_SCHEMA_FEATURES:
        return OLD_SCHEMA_FEATURES[version]
    names = raw.get("requires")
    _expect(isinstance(names, list) and all(isinstance(n, str) for n in names) and len(set(names)) == len(names),
            where, f"requires {names!r} is not a list of distinct feature names")
    unknown = [n for n in names if n not in FEATURES]
    _expect(not unknown, where, f"this step needs {', '.join(unknown)}, which this dcp_atomic does not know (it "
            f"reads {', '.join(FEATURES)}); upgrade dcp_atomic to read it")
    return frozenset(names), frozenset()


def _copy_of_sequence(raw: dict) -> int | None:
    """A commit sequence (> 0) where present; absent is None (never written as null)."""
    if "copy_of_sequence" not in raw:
        return None
    sequence = raw["copy_of_sequence"]
    if isinstance(sequence, bool) or not isinstance(sequence, int) or sequence < 1:
        raise ValueError(f"copy_of_sequence {sequence!r} is not a commit sequence (an integer >= 1)")
    return sequence


def _data_prefixes(raw: dict) -> int:
    """Present and > 0 where the data lies under hashed prefixes, absent (0) everywhere else; which schemas may
    record it is :data:`OLD_SCHEMA_FEATURES`' and ``requires``' to say."""
    if "data_prefixes" not in raw:
        return 0
    prefixes = validate_data_prefixes(raw["data_prefixes"])
    if not prefixes:
        raise ValueError("data_prefixes 0 (0 is written by leaving it out)")
    return prefixes


def _shard_ref(value: Any) -> ShardRef:
    raw = _dict(value)
    ref = ShardRef(rank=_nonneg(raw["rank"]), name=_str(raw["name"]), size=_nonneg(raw["size"]),
                   sha256=_str(raw["sha256"]))
    if ref.name != shard_name(ref.rank) or not re.fullmatch(r"[0-9a-f]{64}", ref.sha256):
        raise ValueError(f"shard record {raw!r} is not manifest.<rank>.json with a sha256")
    return ref


MAX_WORLD = 1 << 20  # ranks: far above any job; a larger world_size is garbled, and would cost memory per rank


def _world_size(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_WORLD:
        raise ValueError(f"world_size {value!r} is not between 1 and {MAX_WORLD}")
    return value


def _check_shard_refs(manifest: "Manifest") -> None:
    """One shard per rank of the world, and every file owned by a rank that has one."""
    ranks = [s.rank for s in manifest.shards]
    if len(ranks) != manifest.world_size or sorted(ranks) != list(range(len(ranks))):
        raise ValueError(f"shards of ranks {sorted(ranks)[:8]} for a world of {manifest.world_size}")
    for f in manifest.files:
        if f.rank >= manifest.world_size or f"__{f.rank}_" != f.name[: len(f"__{f.rank}_")]:
            raise ValueError(f"file {f.name} recorded for rank {f.rank} of a world of {manifest.world_size}")


def _parse_extent(raw: dict, file_size: int) -> ItemExtent:
    item = ItemExtent(
        key=_str(raw["key"]),
        chunk_offset=None if raw["chunk_offset"] is None else [_nonneg(x) for x in _list(raw["chunk_offset"])],
        kind=raw["kind"],
        format=raw["format"],
        pos=_nonneg(raw["pos"]),
        length=_nonneg(raw["length"]),
        checksums=[_str(c) for c in _list(raw["checksums"])],
        block_size=_nonneg(raw["block_size"]),
        payload=None if raw.get("payload") is None else _nonneg(raw["payload"]),
        codec=raw.get("codec", "none"),
        planes=_nonneg(raw.get("planes", 1)),
        logical_length=None if raw.get("logical_length") is None else _nonneg(raw["logical_length"]),
        frames=None if raw.get("frames") is None else [_nonneg(x) for x in _list(raw["frames"])],
        dtype=None if raw.get("dtype") is None else _str(raw["dtype"]),
        chunk_sizes=None if raw.get("chunk_sizes") is None else [_nonneg(x) for x in _list(raw["chunk_sizes"])],
    )
    if item.kind not in ("tensor", "bytes") or item.format not in ("torch_save", "raw"):
        raise ValueError(f"unknown item kind/format {item.kind}/{item.format}")
    if (item.kind == "tensor") != (item.chunk_offset is not None) or (item.kind == "bytes" and item.dtype is not None):
        raise ValueError(f"{item.kind} item {item.key!r} with chunk offset {item.chunk_offset} / dtype {item.dtype}")
    if item.chunk_sizes is not None and (item.kind != "tensor" or len(item.chunk_sizes) != len(item.chunk_offset)):
        raise ValueError(f"chunk sizes {item.chunk_sizes} of {item.key!r} do not match its chunk offset")
    if item.dtype is not None and not _DTYPE_NAME.fullmatch(item.dtype):
        raise ValueError(f"stored dtype {item.dtype!r} of {item.key!r} is not a torch dtype name")
    if item.block_size <= 0 or item.pos + item.length > file_size:
        raise ValueError(f"extent of {item.key!r} lies outside its file")
    if item.payload is not None and item.payload > item.length:
        raise ValueError(f"payload offset of {item.key!r} lies outside the item")
    if item.codec not in ("none", "zstd") or item.planes not in (1, 2, 4, 8):
        raise ValueError(f"unknown codec {item.codec!r} / planes {item.planes} for {item.key!r}")
    if len(item.checksums) != max(1, -(-item.logical // item.block_size)):
        raise ValueError(f"wrong number of checksums for {item.key!r}")
    if item.frames is not None and (len(item.frames) != len(item.checksums) or sum(item.frames) != item.length):
        raise ValueError(f"frames of {item.key!r} do not add up to its stored length")
    if item.codec == "none" and item.logical != item.length:
        raise ValueError(f"uncompressed item {item.key!r} with differing stored and logical lengths")
    if item.codec == "none" and item.frames is not None:
        raise ValueError(f"uncompressed item {item.key!r} with frame sizes (only compressed items have frames)")
    if item.format == "torch_save" and item.codec != "none":
        raise ValueError(f"torch_save item {item.key!r} with codec {item.codec!r} (only raw items are compressed)")
    if item.codec == "zstd" and (item.logical_length is None or item.frames is None):
        raise ValueError(f"compressed item {item.key!r} lacks its logical length or frame sizes")
    if item.codec == "zstd" and (item.logical % item.planes or item.block_size % item.planes):
        raise ValueError(f"compressed item {item.key!r}: lengths are not whole elements of {item.planes} planes")
    return item


@dataclass
class Marker:
    """``COMMITTED``: the one file whose existence makes a step visible."""

    run_id: str
    step: int
    save_id: str
    manifest: str  # path relative to the step directory: "<save_id>/manifest.json"
    manifest_sha256: str
    committed_at: float  # rank 0's wall clock: informative only (P10)
    library_version: str
    kind: str = "dcp_atomic.commit"
    schema_version: int = CONTROL_SCHEMA
    # Commit order (P10): the previous commit's number + 1.  None in markers written before it existed; readers
    # of that version ignore the field (they pick the fields they know), so the schema version stays 1.
    sequence: int | None = None
    # Local markers only (the two tiers): the save asked for a durable copy, so the step stays on the local tier
    # until one exists, across restarts (manager: local retention keeps it, the next save queues it again).
    drain: bool | None = None
    # Local markers only: the lineage of the durable run the step was saved for (``lineage.py``): node-local disks
    # outlive jobs, and a job restores only local steps of its own lineage.  None: written before lineages existed,
    # or by a job that could not reach LINEAGE; only a job without a lineage takes it (local_tier.of_lineage).
    lineage: str | None = None
    # Local markers only: the durable root (its ``storage.describe()``) this step's lineage is provisional for: its
    # ``LINEAGE`` could not be created when the step was saved (full, read-only).  A later job of that root and run
    # that finds no ``LINEAGE`` adopts the lineage instead of starting a new one (lineage.py).
    provisional_for: str | None = None

    @classmethod
    def for_manifest(cls, run_id: str, manifest: "Manifest", manifest_sha256: str, sequence: int | None,
                     **extra: Any) -> "Marker":
        """The marker of ``manifest`` (whose bytes hash to ``manifest_sha256``), committed now by this library: the
        one way every committer (a save, the drain, a local commit) names the attempt it commits.  ``extra``: the
        local markers' fields (``drain``, ``lineage``, ``provisional_for``)."""
        return cls(run_id=run_id, step=manifest.step, save_id=manifest.save_id,
                   manifest=f"{manifest.save_id}/{MANIFEST}", manifest_sha256=manifest_sha256,
                   committed_at=now(), library_version=__version__, sequence=sequence, **extra)

    def record(self) -> dict:
        """The fields as stored; ``drain``, ``lineage`` and ``provisional_for`` only when set, so durable markers and
        the ``COMMITS`` journal stay as earlier versions wrote them (their readers take every stored field)."""
        record = asdict(self)
        for optional in ("drain", "lineage", "provisional_for"):
            if record.get(optional, 0) is None:
                del record[optional]
        return record

    def to_json(self) -> bytes:
        return sealed_json(self.record())

    @classmethod
    def from_json(cls, data: bytes, *, where: str) -> "Marker":
        raw = unseal(data, where, "dcp_atomic.commit")
        try:
            marker = cls(**_known_fields(cls, raw))
            validate_run_id(marker.run_id)
            validate_step(marker.step)
            validate_save_id(marker.save_id)
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpointError(f"{where}: malformed commit marker ({e})", path=where) from None
        _expect(marker.manifest == f"{marker.save_id}/{MANIFEST}", where, "marker names a foreign manifest path")
        return marker


@dataclass
class Latest:
    """``LATEST``: which step was committed most recently (a hint; the marker is the truth)."""

    run_id: str
    step: int
    save_id: str
    committed_at: float
    kind: str = "dcp_atomic.latest"
    schema_version: int = CONTROL_SCHEMA
    sequence: int | None = None  # the marker's (see Marker.sequence)

    def to_json(self) -> bytes:
        return sealed_json(asdict(self))

    @classmethod
    def from_json(cls, data: bytes, *, where: str) -> "Latest":
        raw = unseal(data, where, "dcp_atomic.latest")
        try:
            latest = cls(**_known_fields(cls, raw))
            validate_run_id(latest.run_id)
            validate_step(latest.step)
            validate_save_id(latest.save_id)
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpointError(f"{where}: malformed LATEST ({e})", path=where) from None
        return latest


def now() -> float:
    return time.time()


def _known_fields(cls, raw: dict) -> dict:
    """The record's fields from ``raw``: unknown ones (a newer minor version's) ignored, ``sequence`` and ``drain``
    optional (records written before they existed).

    The fields commits are ordered by are type-checked: sorting must not fail on an edited record.
    """
    optional = {"sequence", "drain", "lineage", "provisional_for"}
    fields = {k: raw[k] for k in cls.__dataclass_fields__ if k not in optional}
    if isinstance(fields["committed_at"], bool) or not isinstance(fields["committed_at"], (int, float)):
        raise ValueError(f"committed_at {fields['committed_at']!r} is not a time")
    for name in ("manifest", "library_version"):  # kind and schema: unseal; run_id, step, save_id: the caller
        if name in fields and not isinstance(fields[name], str):
            raise ValueError(f"{name} {fields[name]!r} is not a string")
    digest = fields.get("manifest_sha256", "0" * 64)
    if not (isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest)):
        raise ValueError(f"manifest_sha256 {digest!r} is not a sha256")
    sequence = raw.get("sequence")
    if sequence is not None and (isinstance(sequence, bool) or not isinstance(sequence, int)
                                 or not 0 <= sequence < MAX_BYTES):
        raise ValueError(f"sequence {sequence!r} is not a commit number")
    fields["sequence"] = sequence
    if "drain" in cls.__dataclass_fields__:
        if not (raw.get("drain") is None or isinstance(raw.get("drain"), bool)):
            raise ValueError(f"drain {raw['drain']!r} is not a boolean")
        fields["drain"] = raw.get("drain")
    if "lineage" in cls.__dataclass_fields__:
        lineage = raw.get("lineage")
        if lineage is not None and not (isinstance(lineage, str) and re.fullmatch(r"[0-9a-f]{32}", lineage)):
            raise ValueError(f"lineage {lineage!r} is not a lineage id")
        fields["lineage"] = lineage
    if "provisional_for" in cls.__dataclass_fields__:
        root = raw.get("provisional_for")
        if root is not None and not (isinstance(root, str) and root and fields["lineage"] is not None):
            raise ValueError(f"provisional_for {root!r} is not a durable root a lineage is provisional for")
        fields["provisional_for"] = root
    return fields


def _readable_json(body: dict[str, Any]) -> bytes:
    """JSON laid out one line per top-level field and per element of a top-level dict or list (the per-key
    records, files, shards), each element compact: still read with ``cat``, and written by json's C encoder.
    ``indent=`` selects the pure-Python encoder, which took 0.3-1 s on the records of 20k keys."""
    compact = functools.partial(json.dumps, sort_keys=True, separators=(",", ":"))
    lines = []
    for name in sorted(body):
        value = body[name]
        if isinstance(value, dict) and value:
            text = "{\n  " + ",\n  ".join(f"{compact(str(k))}:{compact(v)}" for k, v in sorted(value.items())) + "\n }"
        elif isinstance(value, list) and value:
            text = "[\n  " + ",\n  ".join(compact(v) for v in value) + "\n ]"
        else:
            text = compact(value)
        lines.append(f" {compact(name)}: {text}")
    return ("{\n" + ",\n".join(lines) + "\n}").encode()


def sealed_json(body: dict) -> bytes:
    """``body`` as JSON carrying its own checksum, so that a torn, stale or edited copy cannot pass for it."""
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return json.dumps({**body, "checksum": sha256_hex(canonical.encode())}, sort_keys=True, indent=1).encode() + b"\n"


def unseal(data: bytes, where: str, kind: str, schemas: tuple[int, ...] = (CONTROL_SCHEMA,)) -> dict:
    """The record :func:`sealed_json` wrote, once its checksum, ``kind`` and schema (one of ``schemas``) hold (else a
    :class:`CorruptCheckpointError` naming ``where``)."""
    raw = _load_json(data, where)
    claimed = raw.pop("checksum", None)
    canonical = json.dumps(raw, sort_keys=True, separators=(",", ":")).encode()
    if claimed != sha256_hex(canonical):
        raise CorruptCheckpointError(
            f"{where}: self-checksum mismatch (torn, stale or edited file)", path=where, torn=True
        )
    _expect(raw.get("kind") == kind, where, f"expected a {kind} record")
    _check_schema(raw, where, schemas)
    return raw


def _load_json(data: bytes, where: str) -> dict:
    try:
        raw = json.loads(data)
    except (UnicodeDecodeError, ValueError) as e:
        raise CorruptCheckpointError(f"{where}: not valid JSON ({e})", path=where, torn=True) from None
    _expect(isinstance(raw, dict), where, "expected a JSON object")
    return raw


def _check_schema(raw: dict, where: str, readable: tuple[int, ...]) -> None:
    version = raw.get("schema_version")
    _expect(
        type(version) is int and version in readable,
        where,
        f"schema_version {version!r} is not supported (this dcp_atomic reads {', '.join(map(str, readable))}); "
        "upgrade dcp_atomic to read it",
    )


def _expect(condition: bool, where: str, problem: str) -> None:
    if not condition:
        raise CorruptCheckpointError(f"{where}: {problem}", path=where)


_DTYPE_NAME = re.compile(r"torch\.[a-z][a-z0-9_]*")


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {value!r}")
    return value


def _list(value: Any) -> list:
    if not isinstance(value, list):
        raise TypeError(f"expected a list, got {value!r}")
    return value


def _dict(value: Any) -> dict:
    if not isinstance(value, dict):
        raise TypeError(f"expected an object, got {value!r}")
    return value


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"expected a number, got {value!r}")
    return float(value)


def _record(value: Any, **types: type) -> dict:
    """A JSON object whose named fields have the types their readers (``show``, stats) rely on."""
    record = _dict(value)
    for name, kind in types.items():
        field_value = record[name]
        if kind is str:
            _str(field_value)
        elif kind is int:
            _nonneg(field_value)
        else:
            _number(field_value)
    return record


def _key_record(value: Any) -> dict:
    """A per-key record of the load-time checks (see reshard.LoadContext.check_keys)."""
    record = _dict(value)
    for n in _list(record["shape"]) if record.get("shape") is not None else ():
        _nonneg(n)
    if record.get("dtype") is not None:
        _str(record["dtype"])
    return record


def _stored_dtypes(value: Any) -> dict[str, list[str]] | None:
    if value is None:
        return None
    recorded = {}
    for key, dtypes in _dict(value).items():
        names = [_str(name) for name in _list(dtypes)]
        if not names or not all(_DTYPE_NAME.fullmatch(name) for name in names):
            raise ValueError(f"stored dtypes {names!r} of {key!r} are not torch dtype names")
        recorded[str(key)] = names
    return recorded


def _parallelism(value: Any) -> dict | None:
    if value is not None:
        Parallelism.from_dict(_dict(value))  # raises ValueError / TypeError if it does not describe a layout
    return value


def _nonneg(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_BYTES:
        raise ValueError(f"expected a non-negative integer below 2**50, got {value!r}")
    return value
