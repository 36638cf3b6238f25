"""Decode DCP's pickled ``.metadata`` and non-tensor items without letting them run code (P11).

DCP stores its ``Metadata`` as a pickle, and ``pickle.load`` on a crafted file
executes arbitrary code.  Two layers keep that from happening: the reader only
opens a ``.metadata`` whose sha256 matches the committed manifest, and it decodes
it with this unpickler, which resolves only the handful of classes DCP's
metadata is made of.  Anything else is refused by name.

DCP's classes change between torch releases while checkpoints outlive them: torch
2.15's ``TensorProperties`` pickles a ``strides`` field that 2.13's
``__setstate__`` cannot unpack.  :class:`_TensorPropertiesAnyTorch` reads the
states of every release it knows; ``strides`` is harmless here because our
writer always stores a chunk's logical bytes contiguously (whatever the source
tensor's strides), so it is kept as an attribute and not needed to read.  A
state this torch cannot place is refused as :class:`TorchVersionError` naming
both torch versions — never as corruption: the bytes are intact.

Non-tensor items (optimizer ``param_groups``, RNG and dataloader state), which
DCP's planners would ``torch.load(weights_only=False)``, are decoded by
:func:`safe_byte_item` with torch's weights-only allow-list instead; users
extend it with ``torch.serialization.add_safe_globals``.
"""

from __future__ import annotations

import functools
import io
import pickle
import threading
from typing import Any

import torch

from torch.distributed.checkpoint.metadata import TensorProperties

from .._base.internals import MEM_FORMAT_ENCODING
from ..errors import CheckpointError, CorruptCheckpointError, TorchVersionError, UnsafeItemError


class _UnknownState(Exception):
    """Raised inside unpickling; :func:`load_dcp_metadata` turns it into a :class:`TorchVersionError`."""


_MEMORY_FORMATS = {
    MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT: torch.contiguous_format,
    MEM_FORMAT_ENCODING.TORCH_CHANNELS_LAST: torch.channels_last,
    MEM_FORMAT_ENCODING.TORCH_PRESERVE_FORMAT: torch.preserve_format,
}


def _is_strides(value: Any) -> bool:
    return value is None or (isinstance(value, (tuple, list)) and all(type(v) is int for v in value))


class _TensorPropertiesAnyTorch(TensorProperties):
    """Unpickles the ``TensorProperties`` of any torch we know into this torch's own class.

    This torch's ``__setstate__`` is tried first (the common case costs one call).  Otherwise the state is read
    by the type of each entry — the five fields every release since 2.0 pickles, plus ``strides`` (2.15) — so a
    field added in another position is still placed, and anything else is refused by name, never guessed.
    """

    def __setstate__(self, state: Any) -> None:
        try:
            if isinstance(state, dict):  # never unpacked positionally: a dict of five names would "fit"
                raise TypeError
            TensorProperties.__setstate__(self, state)
            # 2.15's own __setstate__ unpacks any six entries by position: a state that puts strides elsewhere
            # "fits" with pin_memory=(3, 1), strides=False.  Placed by type below instead.
            if type(self.requires_grad) is not bool or type(self.pin_memory) is not bool \
                    or not _is_strides(getattr(self, "strides", None)):
                raise TypeError
        except (ValueError, TypeError, RuntimeError):
            self.__dict__.update(_read_properties(state))
        self.__class__ = TensorProperties  # what DCP and its users compare and re-pickle


def _read_properties(state: Any) -> dict[str, Any]:
    if isinstance(state, dict):  # a release that pickles the fields by name
        fields = dict(state)
        encoding = fields.pop("mem_format_encoding", None)
        if encoding is not None:
            fields["memory_format"] = _MEMORY_FORMATS.get(encoding)
    elif isinstance(state, tuple) and len(state) >= 5:
        dtype, layout, requires_grad, encoding, *rest = state
        flags = [v for v in rest if type(v) is bool]
        others = [v for v in rest if type(v) is not bool]
        if len(flags) != 1 or len(others) > 1 or (others and not _is_strides(others[0])):
            raise _UnknownState(f"TensorProperties state {state!r}")
        fields = {"dtype": dtype, "layout": layout, "requires_grad": requires_grad,
                  "memory_format": _MEMORY_FORMATS.get(encoding), "pin_memory": flags[0]}
        if others:
            fields["strides"] = others[0]
    else:
        raise _UnknownState(f"TensorProperties state {state!r}")
    known = {"dtype", "layout", "requires_grad", "memory_format", "pin_memory", "strides"}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise _UnknownState(f"TensorProperties field(s) {unknown}")
    if not isinstance(fields.get("dtype"), torch.dtype) or fields.get("memory_format") is None \
            or not _is_strides(fields.get("strides")):
        raise _UnknownState(f"TensorProperties state {state!r}")
    defaults = {"layout": torch.strided, "requires_grad": False, "pin_memory": False}
    return {**defaults, **fields}

_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "TensorStorageMetadata",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _AllowListUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch.distributed.checkpoint.metadata" and name == "TensorProperties":
            return _TensorPropertiesAnyTorch
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: not part of DCP metadata")


def load_dcp_metadata(data: bytes, *, where: str, written_by: str | None = None):
    """Unpickle DCP ``Metadata`` with the allow-list.  A state from a torch release this one cannot read raises
    :class:`TorchVersionError` (``written_by``: the torch version the manifest records); any other refusal is
    corruption."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        metadata = _AllowListUnpickler(io.BytesIO(data)).load()
    except _UnknownState as e:
        writer = f"torch {written_by}" if written_by else "a torch release that was not recorded"
        raise TorchVersionError(
            f"{where}: DCP metadata written by {writer} holds {e}, which torch {torch.__version__} cannot read. "
            "The checkpoint's bytes are intact (verify checks them): load it with the torch that wrote it, or a "
            "newer one, or upgrade dcp_atomic if it knows that release",
            path=where, written_by=written_by, running=torch.__version__,
        ) from None
    except Exception as e:
        raise CorruptCheckpointError(f"{where}: cannot decode DCP metadata safely ({e})", path=where) from None
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpointError(f"{where}: decoded {type(metadata).__name__}, not DCP Metadata", path=where)
    return metadata


# -- non-tensor items (DCP's BYTE_IO: optimizer param_groups, RNG and dataloader state) ---------------------------

_decode_lock = threading.Lock()  # safe_globals() edits torch's process-wide allow-list


@functools.cache
def _dcp_state_globals() -> list:
    """What DCP state dicts hold beyond torch's weights-only defaults: numpy RNG state and scalars, module extra state."""
    extras: list = [frozenset, io.BytesIO]  # BytesIO: a module's opaque ``_extra_state`` (Transformer Engine)
    try:
        import numpy
    except ImportError:
        return extras
    multiarray = numpy.core.multiarray if not hasattr(numpy, "_core") else numpy._core.multiarray
    for name in ("_reconstruct", "scalar"):  # pickles name the module of the numpy that wrote them
        function = getattr(multiarray, name)
        extras += [(function, f"numpy.core.multiarray.{name}"), (function, f"numpy._core.multiarray.{name}")]
    extras += [numpy.ndarray, numpy.dtype]
    extras += [getattr(numpy.dtypes, n) for n in getattr(numpy.dtypes, "__all__", ())]
    return extras


def safe_byte_item(data: bytes, *, key: str, where: str) -> io.BytesIO:
    """Decode a non-tensor item without running code (P11); return a stream for ``planner.load_bytes``.

    DCP's planners decode these items with ``torch.load(weights_only=False)``,
    so a crafted item (every digest recomputed) would run code.  This decodes
    them with torch's weights-only unpickler, which honours the user's
    ``torch.serialization.add_safe_globals`` / ``safe_globals`` (the opt-in for
    their own classes), plus what DCP state dicts hold.  The returned stream
    is the decoded object saved again, so the planner's unpickler only ever
    sees bytes this process wrote, never the stored ones.
    """
    value = decode_item(data, key=key, where=where)
    stream = io.BytesIO()
    torch.save(value, stream)
    stream.seek(0)
    return stream


SAVE_CHECK_MAX_BYTES = 16 << 20  # larger non-tensor items are not decoded at save (their cost is the save's)


def load_refusal(data: bytes | memoryview, *, key: str) -> str | None:
    """Why the load of a non-tensor item being saved will refuse it (:func:`safe_byte_item`'s allow-list, as
    this process has it now), or None: a save warns instead of leaving the surprise to the load."""
    if len(data) > SAVE_CHECK_MAX_BYTES:
        return None
    try:
        decode_item(bytes(data), key=key, where="the item being saved")
    except UnsafeItemError as e:
        return e.message
    except CheckpointError:
        return None  # not a torch.save archive: a planner's own bytes, nothing to predict
    return None


def decode_item(data: bytes, *, key: str, where: str) -> Any:
    """A non-tensor item's value, decoded by the allow-list (P11): the one decoder of stored objects (a load's
    items through :func:`safe_byte_item`, a memory slot's directly)."""
    with _decode_lock:
        missing = [g for g in _dcp_state_globals() if g not in torch.serialization.get_safe_globals()]
        try:
            with torch.serialization.safe_globals(missing):
                value = torch.load(io.BytesIO(data), weights_only=True)
        except pickle.UnpicklingError as e:  # the policy refuses a type; the stored bytes are intact
            raise UnsafeItemError(
                f"{where}: refusing to decode non-tensor item {key!r}: {_refusal(e)}. Decoding it in full could run "
                "code, so it was not loaded. If you trust this checkpoint and the type, allow it with "
                "torch.serialization.add_safe_globals([...]) or the torch.serialization.safe_globals([...]) "
                "context manager around the load",
                key=key, path=where,
            ) from None
        except Exception as e:  # not a torch.save archive, truncated, a device this host lacks
            raise CorruptCheckpointError(f"{where}: cannot decode non-tensor item {key!r} ({e})",
                                         key=key, path=where) from None
    return value


_BOILERPLATE = ("Weights only load failed", "Please file an issue", "Check the documentation", "(1)", "(2)")


def _refusal(error: Exception) -> str:
    """The line of torch's message that says what was refused, without its advice to load unsafely."""
    lines = [line.strip().removeprefix("WeightsUnpickler error:").strip() for line in str(error).splitlines()]
    relevant = [line for line in lines if line and not line.startswith(_BOILERPLATE)]
    return (relevant or [type(error).__name__])[0].rstrip(".")
