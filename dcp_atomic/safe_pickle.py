"""Decode DCP's pickled ``.metadata`` without letting it run code.

DCP stores its ``Metadata`` as a pickle, and ``pickle.load`` on a crafted file
executes arbitrary code.  Two layers keep that from happening: the reader only
opens a ``.metadata`` whose sha256 matches the committed manifest, and it decodes
it with this unpickler, which resolves only the handful of classes DCP's
metadata is made of.  Anything else is refused by name.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from .errors import CorruptCheckpointError

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
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: not part of DCP metadata")


def load_dcp_metadata(data: bytes, *, where: str):
    """Unpickle DCP ``Metadata`` with the allow-list; any refusal is corruption."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        metadata = _AllowListUnpickler(io.BytesIO(data)).load()
    except Exception as e:
        raise CorruptCheckpointError(f"{where}: cannot decode DCP metadata safely ({e})", path=where) from None
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpointError(f"{where}: decoded {type(metadata).__name__}, not DCP Metadata", path=where)
    return metadata
