"""Where every file of a checkpoint lives.

The layout is part of the contract (operators and tools rely on it)::

    <root>/<run_id>/{LATEST, COMMITS}
    <root>/<run_id>/step_0000001000/COMMITTED
    <root>/<run_id>/step_0000001000/<save_id>/{ATTEMPT, __<rank>_<k>.distcp, .metadata, manifest.json}

With reuse (P15), a rank's items unchanged since the base step are in ``__<rank>_s<j>.distcp`` (stable files, maybe
hard links to the base's, or server-side copies of them on object stores).

With hashed data prefixes (object stores, ``data_prefixes = P > 0`` in the manifest),
data objects alone move to ``<root>/_dXX/<run_id>/step_.../<save_id>/__<rank>_<k>.distcp``
(see :func:`data_prefix`); everything else keeps its place.

Every name a reader uses is built here from validated parts, so nothing read
from a manifest or marker can point outside the run directory.
"""

from __future__ import annotations

import os
import posixpath
import re
import secrets
import time
from collections.abc import Iterable

from .._base import arguments
from .._base.key_prefixes import DATA_PREFIX_PATTERN, MAX_DATA_PREFIXES, validate_data_prefixes  # noqa: F401
from .._base.key_prefixes import data_prefix as _key_prefix
from ..errors import ArgumentError, ConfigurationError

RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
SAVE_ID_PATTERN = re.compile(r"\d{8}T\d{6}Z-[0-9a-f]{8}")
STEP_DIR_PATTERN = re.compile(r"step_(\d{10,})")
DATA_FILE_PATTERN = re.compile(r"__(\d+)_(\d+)\.distcp")
STABLE_FILE_PATTERN = re.compile(r"__(\d+)_s(\d+)\.distcp")  # reuse (P15): a rank's items unchanged since the base
CHECKPOINT_ID_STEP_PATTERN = re.compile(r"step[_-](\d+)")  # ours (step_N) and torchtitan's (step-N)

MARKER = "COMMITTED"
LATEST = "LATEST"
COMMITS = "COMMITS"  # run-level journal of the steps retention keeps; a hint, every deletion re-reads its marker
MANIFEST = "manifest.json"
DCP_METADATA = ".metadata"
PARTIAL_SUFFIX = ".partial"  # beside a data file a tier restore copied in part (local roots only)
SPOOL_DIR = ".incoming"  # in a local root's run: files from peers wait there for verification (local roots only)
ATTEMPT = "ATTEMPT"  # written first by the coordinator: who started this attempt, when


def validate_run_id(run_id: str, name: str = "run_id") -> str:
    return arguments.text(name, run_id, RUN_ID_PATTERN, "a name matching " + RUN_ID_PATTERN.pattern + " (letters, "
                          "digits, '.', '_', '-'; no '/', no leading '.', at most 128 characters)")


def validate_step(step: int, name: str = "step") -> int:
    return arguments.count(name, step, minimum=0, optional=False)


def validate_save_id(save_id: str, name: str = "save_id") -> str:
    return arguments.text(name, save_id, SAVE_ID_PATTERN, f"a save id matching {SAVE_ID_PATTERN.pattern} "
                          "(`dcp-atomic show` prints a step's)")


def new_save_id() -> str:
    """Sortable by start time, unique without coordination (32 random bits)."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(4)


def step_dir_name(step: int) -> str:
    return f"step_{validate_step(step):010d}"


def parse_step_dir(name: str) -> int | None:
    match = STEP_DIR_PATTERN.fullmatch(name)
    return int(match.group(1)) if match else None


def parse_checkpoint_id(checkpoint_id: str | os.PathLike) -> tuple[str, str, int]:
    """``<root>/<run_id>/step_<N>`` or ``<root>/<run_id>/step-<N>`` -> (root, run_id, step).

    The id frameworks pass to ``dcp.save``/``dcp.load`` names a location, not a layout: the
    checkpoint still lands in ``step_{N:010d}/<save_id>/`` under that root and run.
    """
    text = arguments.location("checkpoint_id", checkpoint_id)
    head, last = posixpath.split(text.rstrip("/"))
    root, run_id = posixpath.split(head)
    match = CHECKPOINT_ID_STEP_PATTERN.fullmatch(last)
    scheme, _, bucket = root.partition("://")
    if not match or not root or not run_id or ("://" in text and not (bucket and scheme)):
        raise arguments.refused("checkpoint_id", text, "<root>/<run_id>/step_<N> (or torchtitan's "
                                "<root>/<run_id>/step-<N>): a root directory or URL, a run directory and a step part",
                                then="nothing was written or read")
    try:
        validate_run_id(run_id)
    except ArgumentError as e:
        raise arguments.refused("checkpoint_id", text, "<root>/<run_id>/step_<N> with a valid run_id",
                                then=f"{e.message}. Nothing was written or read") from None
    return root, run_id, int(match.group(1))


def root_key(root: str | os.PathLike) -> str:
    """A root as it compares: local paths absolute (``file://`` stripped), URLs without a trailing '/'."""
    text = os.fspath(root)
    if text.startswith("file://"):
        text = text[len("file://"):]
    return text.rstrip("/") if "://" in text else os.path.abspath(text)


def checked_checkpoint_id(checkpoint_id: str | os.PathLike, built_root: str | os.PathLike | None,
                          built_run_id: str | None, who: str) -> tuple[str, str, int]:
    """``parse_checkpoint_id``, refusing a root or run other than the ones ``who`` was built with."""
    root, run_id, step = parse_checkpoint_id(checkpoint_id)
    if built_root is not None and root_key(root) != root_key(built_root):
        raise ConfigurationError(
            f"checkpoint_id {os.fspath(checkpoint_id)!r} is under root {root!r}, but this {who} was built with root "
            f"{os.fspath(built_root)!r}: pass a checkpoint_id under that root, or build the {who} with root=None to "
            "follow the checkpoint_id. Nothing was written or read.",
            checkpoint_id=os.fspath(checkpoint_id), root=os.fspath(built_root),
        )
    if built_run_id is not None and run_id != built_run_id:
        raise ConfigurationError(
            f"checkpoint_id {os.fspath(checkpoint_id)!r} names run {run_id!r}, but this {who} was built with run_id "
            f"{built_run_id!r}: pass a checkpoint_id of that run, or build the {who} with run_id=None. "
            "Nothing was written or read.",
            checkpoint_id=os.fspath(checkpoint_id), run_id=built_run_id,
        )
    return root, run_id, step


def no_location_error(who: str) -> ConfigurationError:
    return ConfigurationError(
        f"this {who} has no location: build it with root, run_id (and step), or pass "
        "checkpoint_id='<root>/<run_id>/step_<N>' to dcp.save / dcp.load. Nothing was written or read."
    )


def data_file_name(rank: int, k: int) -> str:
    return f"__{rank}_{k}.distcp"


def stable_file_name(rank: int, j: int = 0) -> str:
    """With reuse (P15): the rank's ``j``-th file of items unchanged since the base step, in canonical order, that the
    next save can hard-link whole (:mod:`dcp_atomic.dcp.reuse`)."""
    return f"__{rank}_s{j}.distcp"


def validate_data_file_name(name: str) -> str:
    """Refuse anything a hostile manifest or .metadata could use to escape the attempt dir."""
    if not isinstance(name, str) or not (DATA_FILE_PATTERN.fullmatch(name) or STABLE_FILE_PATTERN.fullmatch(name)):
        raise ValueError(f"invalid data file name {name!r}: expected __<rank>_<k>.distcp or __<rank>_s<j>.distcp")
    return name


def data_prefix(save_id: str, name: str, prefixes: int) -> str:
    """``_dXX`` for one data file, from its save and name (:mod:`.._base.key_prefixes`)."""
    return _key_prefix(f"{save_id}/{name}", prefixes)


class RunLayout:
    """Paths of one run under one storage root; pure string work, no I/O."""

    def __init__(self, storage, run_id: str) -> None:
        self.storage = storage
        self.run_id = validate_run_id(run_id)
        self.run_dir = storage.join(storage.root, self.run_id)

    @staticmethod
    def attempts(entries: Iterable[str]) -> list[str]:
        """The attempts (save ids) among a step directory's entries: everything but the marker and dot-files (the
        temps of a control file being published).  Whatever else a step holds is an attempt, so gc and ``rm`` judge
        it by its lease rather than leave it forever."""
        return [entry for entry in entries if entry != MARKER and not entry.startswith(".")]

    @staticmethod
    def holds_run(entries: Iterable[str]) -> bool:
        """Whether a directory's entries are a run's: a step directory, ``LATEST`` or the ``COMMITS`` journal.  Hashed
        data prefixes, exports and stray files under a root hold none of them."""
        return any(parse_step_dir(entry) is not None or entry in (LATEST, COMMITS) for entry in entries)

    def step_dir(self, step: int) -> str:
        return self.storage.join(self.run_dir, step_dir_name(step))

    def marker(self, step: int) -> str:
        return self.storage.join(self.step_dir(step), MARKER)

    def latest(self) -> str:
        return self.storage.join(self.run_dir, LATEST)

    def attempt_dir(self, step: int, save_id: str) -> str:
        return self.storage.join(self.step_dir(step), validate_save_id(save_id))

    def attempt_file(self, step: int, save_id: str, name: str) -> str:
        return self.storage.join(self.attempt_dir(step, save_id), name)

    def data_file(self, step: int, save_id: str, name: str, prefixes: int = 0) -> str:
        """Where a data file lives: beside the manifest, or under its hashed prefix when the manifest says
        ``data_prefixes`` > 0 (a fact of the checkpoint, never of the reader's options)."""
        validate_data_file_name(name)
        if not prefixes:
            return self.attempt_file(step, save_id, name)
        return self.storage.join(self.storage.root, data_prefix(save_id, name, prefixes), self.run_id,
                                 step_dir_name(step), validate_save_id(save_id), name)

    def data_run_dir(self, prefix: str) -> str:
        """This run's data under one hashed prefix ``_dXX`` (gc looks under each, whatever P a save used)."""
        if not DATA_PREFIX_PATTERN.fullmatch(prefix):
            raise ValueError(f"invalid data prefix {prefix!r}: expected {DATA_PREFIX_PATTERN.pattern}")
        return self.storage.join(self.storage.root, prefix, self.run_id)

    def data_step_dir(self, prefix: str, step: int) -> str:
        return self.storage.join(self.data_run_dir(prefix), step_dir_name(step))
