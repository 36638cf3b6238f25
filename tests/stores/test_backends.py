"""Backend selection: one module maps a root to its Storage; nothing imports upward."""

from __future__ import annotations

import ast
import json
import os
import pathlib
import uuid

import pytest

import dcp_atomic
from dcp_atomic import ConfigurationError
from dcp_atomic.stores import backends
from dcp_atomic.stores.backends import BACKENDS, missing_backend_message, open_storage, register_backend
from dcp_atomic.stores.storage import FsspecStorage, LocalStorage, Storage

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
    from dcp_atomic.stores.gcs import GCSStorage
    from dcp_atomic.stores.s3 import S3Storage

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
    """A stand-in third-party backend: what one register_backend call must be enough for."""

    def __init__(self, url: str, storage_options: dict | None = None) -> None:
        super().__init__(url.split("://", 1)[1])
        self.options = storage_options


@pytest.fixture
def registry(monkeypatch):
    """The backend table as the test finds it, restored after: registering is process-wide."""
    monkeypatch.setattr(backends, "BACKENDS", dict(BACKENDS))
    return backends.BACKENDS


def test_a_new_backend_is_one_line(registry, root):
    register_backend("tagged", f"{__name__}:_TaggedStorage")
    storage = open_storage("tagged://" + root, {"x": 1})
    assert type(storage) is _TaggedStorage and storage.root == os.path.abspath(root)
    assert storage.options == {"x": 1} and isinstance(storage, Storage)


class _TeamStore(FsspecStorage):
    """A user's own backend: ``team://BUCKET/PATH`` kept in fsspec's in-memory filesystem."""

    opened: list[str] = []

    def __init__(self, url: str, storage_options: dict | None = None) -> None:
        super().__init__("memory://" + url.split("://", 1)[1], storage_options)
        _TeamStore.opened.append(url)


def test_a_user_backend_registered_by_scheme_saves_loads_and_is_listed_by_the_cli(registry, capsys):
    import torch
    import torch.distributed.checkpoint as dcp

    from dcp_atomic import AtomicStorageReader, AtomicStorageWriter
    from dcp_atomic.tools.cli import main

    register_backend("team", f"{__name__}:_TeamStore")
    root = f"team://bucket-{uuid.uuid4().hex}/ckpt"
    weights = torch.randn(16, 16)
    dcp.save({"w": weights}, storage_writer=AtomicStorageWriter(root, "exp", 3))
    loaded = {"w": torch.zeros(16, 16)}
    dcp.load(loaded, storage_reader=AtomicStorageReader(root, "exp", 3))
    assert torch.equal(loaded["w"], weights)
    assert any(url.startswith(root) for url in _TeamStore.opened), "the registered class was never built"
    assert main(["--json", "ls", root, "exp"]) == 0
    assert [row["step"] for row in json.loads(capsys.readouterr().out)["steps"]] == [3]


def test_a_backend_whose_module_cannot_be_imported_names_the_extra_that_brings_it(registry, capsys):
    from dcp_atomic.tools.cli import main

    register_backend("teamx", "no_such_team_sdk_module:Store", extra="s3")
    with pytest.raises(ImportError):
        open_storage("teamx://bucket/ckpt")
    assert main(["ls", "teamx://bucket/ckpt"]) == 3  # a missing extra, whichever command
    err = capsys.readouterr().err.strip()
    assert err.startswith("dcp-atomic: MissingDependency: teamx://bucket/ckpt") and "no_such_team_sdk_module" in err
    assert "pip install 's3fs>=2023.1'" in err and "pip install -e '.[s3]' in a clone" in err, err
    register_backend("teamy", "no_such_team_sdk_module:Store")  # no extra: the module to satisfy is named instead
    assert "install what no_such_team_sdk_module imports" in missing_backend_message(
        "teamy://bucket", ModuleNotFoundError("No module named 'no_such_team_sdk_module'"))


def test_a_scheme_taken_by_another_backend_is_refused_unless_clobbered(registry):
    register_backend("s3", "dcp_atomic.stores.s3:S3Storage", extra="s3")  # the same entry again: a no-op
    with pytest.raises(ValueError, match=r"s3:// is already served by dcp_atomic.stores.s3:S3Storage.*clobber=True"):
        register_backend("s3", f"{__name__}:_TeamStore")
    register_backend("s3", f"{__name__}:_TeamStore", clobber=True)
    assert registry["s3"].target == f"{__name__}:_TeamStore" and registry["s3"].extra is None
    for scheme, target in (("s3://", "m:C"), ("", "m:C"), ("x", "no_colon")):
        with pytest.raises(ValueError, match="register_backend"):
            register_backend(scheme, target)
