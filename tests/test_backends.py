"""Backend selection: one module maps a root to its Storage; nothing imports upward."""

from __future__ import annotations

import ast
import os
import pathlib
import uuid

import pytest

import dcp_atomic
from dcp_atomic import ConfigurationError
from dcp_atomic.backends import BACKENDS, open_storage
from dcp_atomic.storage import FsspecStorage, LocalStorage, Storage

PACKAGE = pathlib.Path(dcp_atomic.__file__).parent
BACKEND_MODULES = {"storage", "s3", "gcs"}  # the primitives and the backends built on them


def _imported_modules(module: str) -> set[str]:
    """Every dcp_atomic module ``module`` imports, at module level or inside a function."""
    tree = ast.parse((PACKAGE / "stores" / f"{module}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found.add((node.module or "").split(".")[0])
            if not node.module:
                found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dcp_atomic."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("dcp_atomic."))
    return found


def test_backends_never_import_upward():
    storage_imports = _imported_modules("storage")
    assert not storage_imports & {"s3", "gcs", "backends"}, f"storage.py imports {storage_imports}"
    for module in BACKEND_MODULES:
        assert "backends" not in _imported_modules(module), f"{module}.py imports the backend table"


def test_every_caller_opens_storage_through_the_backend_table():
    callers = [p.stem for p in PACKAGE.rglob("*.py") if "open_storage(" in p.read_text() and p.stem != "backends"]
    assert callers, "nothing opens storage?"
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and any(a.name == "open_storage" for a in node.names):
                assert (node.module or "").endswith("backends"), f"{path.name} imports open_storage from {node.module}"


def test_each_root_form_gets_its_backend(root):
    from dcp_atomic.gcs import GCSStorage
    from dcp_atomic.s3 import S3Storage

    s3_options = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}}
    assert type(open_storage(root)) is LocalStorage
    assert type(open_storage(pathlib.Path(root))) is LocalStorage
    assert type(open_storage("file://" + root, {"auto_mkdir": True})) is LocalStorage
    assert type(open_storage("s3://bucket/prefix", s3_options)) is S3Storage
    assert type(open_storage("s3a://bucket/prefix", s3_options)) is S3Storage
    assert type(open_storage("gs://bucket/prefix", {"token": "anon"})) is GCSStorage
    assert type(open_storage("gcs://bucket/prefix", {"token": "anon"})) is GCSStorage
    assert type(open_storage(f"memory://dcp-{uuid.uuid4().hex}")) is FsspecStorage
    with pytest.raises(ConfigurationError, match="fsync"):
        open_storage("file://" + root, {"block_size": 1024})
    with pytest.raises(ValueError, match="non-empty"):
        open_storage("")


class _TaggedStorage(LocalStorage):
    """A stand-in third-party backend: what one line in BACKENDS must be enough for."""

    def __init__(self, url: str, storage_options: dict | None = None) -> None:
        super().__init__(url.split("://", 1)[1])
        self.options = storage_options


def test_a_new_backend_is_one_line(monkeypatch, root):
    monkeypatch.setitem(BACKENDS, "tagged", f"{__name__}:_TaggedStorage")
    storage = open_storage("tagged://" + root, {"x": 1})
    assert type(storage) is _TaggedStorage and storage.root == os.path.abspath(root)
    assert storage.options == {"x": 1} and isinstance(storage, Storage)
