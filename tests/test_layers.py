"""The package's layers: the import contracts hold (layers, and no import circles), and every module's old flat
path still imports as the same module object (so ``mock.patch`` and ``monkeypatch`` of an old path reach the code
that runs)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest

import dcp_atomic

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_old_module_path_is_the_moved_module_itself():
    for old, package in dcp_atomic._MOVED.items():
        moved = importlib.import_module(f"dcp_atomic.{package}.{old}")
        assert importlib.import_module(f"dcp_atomic.{old}") is moved, old
    from dcp_atomic import drain, failpoints  # the form the tests and users write

    assert drain.__name__ == "dcp_atomic.tiers.drain" and failpoints.__name__ == "dcp_atomic._base.failpoints"


def test_an_old_module_path_says_where_the_module_went():
    sys.modules.pop("dcp_atomic.retention", None)  # the first import under the old name is the one that tells
    with pytest.warns(DeprecationWarning, match=r"dcp_atomic\.retention moved to dcp_atomic\.protocol\.retention"):
        import dcp_atomic.retention  # noqa: F401
    assert sys.modules["dcp_atomic.retention"] is sys.modules["dcp_atomic.protocol.retention"]


def test_the_import_contract_holds_and_at_most_a_handful_of_modules_stay_at_the_top():
    lint = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    done = subprocess.run([lint], cwd=HERE, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    top = sorted(f for f in os.listdir(os.path.join(HERE, "dcp_atomic")) if f.endswith(".py"))
    assert top == ["__init__.py", "__main__.py", "errors.py", "version.py"], top
