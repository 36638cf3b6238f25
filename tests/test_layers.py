"""The package's layers: the import contracts hold (layers, and no import circles), and every module's old flat
path still imports as the same module object (so ``mock.patch`` and ``monkeypatch`` of an old path reach the code
that runs)."""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys

import pytest

import dcp_atomic

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_old_module_path_is_the_moved_module_itself_and_says_where_it_went():
    """The one test that imports the old paths: everywhere else the suite's filter makes their warning an error."""
    for old, package in dcp_atomic._MOVED.items():
        moved = importlib.import_module(f"dcp_atomic.{package}.{old}")
        sys.modules.pop(f"dcp_atomic.{old}", None)  # the first import under the old name is the one that tells
        with pytest.warns(DeprecationWarning, match=rf"dcp_atomic\.{old} moved to dcp_atomic\.{package}\.{old}\b"):
            assert importlib.import_module(f"dcp_atomic.{old}") is moved, old
    for old in ("drain", "failpoints"):
        sys.modules.pop(f"dcp_atomic.{old}", None)
        vars(dcp_atomic).pop(old, None)
    with pytest.warns(DeprecationWarning, match="moved to"):
        from dcp_atomic import drain, failpoints  # the form the tests and users write
    assert drain.__name__ == "dcp_atomic.tiers.drain" and failpoints.__name__ == "dcp_atomic._base.failpoints"


def _old_path_imports(source: str) -> list[str]:
    """What in a Python file's source reaches a module through its old path: imports, and the dotted names in strings
    that ``mock.patch`` / ``monkeypatch`` / ``python -c`` take (a logger's name is the bare old path, on purpose)."""
    old = "|".join(sorted(dcp_atomic._MOVED, key=len, reverse=True))
    old_module = re.compile(rf"dcp_atomic\.(?:{old})(?:\.|$)")
    in_text = re.compile(rf"\bdcp_atomic\.(?:{old})\.\w|\b(?:from|import)\s+dcp_atomic\.(?:{old})\b"
                         rf"|\bfrom\s+dcp_atomic\s+import\s+[^\n]*\b(?:{old})\b")
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "dcp_atomic":
            found += [f"line {node.lineno}: from dcp_atomic import {a.name}" for a in node.names
                      if a.name in dcp_atomic._MOVED]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and old_module.match(node.module or ""):
            found.append(f"line {node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names if old_module.match(a.name)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and in_text.search(node.value):
            found.append(f"line {node.lineno}: {in_text.search(node.value).group(0)!r}")
    return found


def test_no_code_and_no_documented_example_imports_an_old_module_path():
    """The suite's warning filter misses the ranks' processes (forkserver children), so this reads the code itself:
    the package, tests, benchmarks, examples, the testbed and scripts, and the README's and docs' code."""
    old = "|".join(sorted(dcp_atomic._MOVED, key=len, reverse=True))
    in_docs = re.compile(rf"^\s*(?:from\s+dcp_atomic\s+import\s+.*\b(?:{old})\b|(?:from|import)\s+dcp_atomic\."
                         rf"(?:{old})\b).*", re.MULTILINE)
    offenders = []
    for top in ("dcp_atomic", "tests", "benchmarks", "examples", "testbed", "scripts", "docs", "README.md"):
        for path in _files(os.path.join(HERE, top)):
            name = os.path.relpath(path, HERE)
            if name == os.path.join("tests", "test_layers.py"):
                continue  # the one test of the old paths
            with open(path, encoding="utf-8") as f:
                text = f.read()
            found = (_old_path_imports(text) if path.endswith(".py")
                     else [m.group(0).strip() for m in in_docs.finditer(text)] if path.endswith(".md") else [])
            offenders += [f"{name}: {line}" for line in found]
    assert not offenders, ("old module paths (dcp_atomic._MOVED) in use; import from the new path, "
                           "e.g. `from dcp_atomic.tiers import drain`:\n" + "\n".join(offenders))


def _files(top: str) -> list[str]:
    if os.path.isfile(top):
        return [top]
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(top) for f in fs if f.endswith((".py", ".md")))


PACKAGES = sorted(d for d in os.listdir(os.path.join(HERE, "dcp_atomic"))
                  if os.path.isfile(os.path.join(HERE, "dcp_atomic", d, "__init__.py")))


def _imports_across_packages() -> list[tuple[str, int, str, str]]:
    """Every ``from <another subpackage>[.module] import name`` in dcp_atomic: (file, line, subpackage, name)."""
    found = []
    for path in _files(os.path.join(HERE, "dcp_atomic")):
        if not path.endswith(".py"):
            continue
        name = os.path.relpath(path, HERE)
        module = name[:-3].replace(os.sep, ".").removesuffix(".__init__")
        package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
        own = package.split(".")[1] if package.count(".") else None  # None: the top-level modules
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package.split(".")[: package.count(".") + 2 - node.level]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            parts = target.split(".")
            if parts[0] == "dcp_atomic" and len(parts) > 1 and parts[1] in PACKAGES and parts[1] != own:
                found += [(name, node.lineno, parts[1], alias.name) for alias in node.names]
    return found


def test_each_subpackage_declares_its_face_and_every_name_in_it_imports():
    for package in PACKAGES:
        module = importlib.import_module(f"dcp_atomic.{package}")
        assert isinstance(getattr(module, "__all__", None), list), f"dcp_atomic/{package}/__init__.py: no __all__"
        missing = [name for name in module.__all__ if not hasattr(module, name)]
        assert not missing, f"dcp_atomic.{package}.__all__ names what it does not have: {missing}"


def test_no_module_imports_a_private_name_or_one_outside_the_face_of_another_subpackage():
    """An import contract cannot see this (``lint-imports`` passes a ``_private`` reach), so the test reads the
    imports: across subpackages, only names in the other subpackage's ``__all__``, and never one starting with _."""
    faces = {package: set(importlib.import_module(f"dcp_atomic.{package}").__all__) for package in PACKAGES}
    wrong = [f"{path}:{line}: {name} from dcp_atomic.{package} "
             + ("is private" if name.startswith("_") else f"is not in dcp_atomic/{package}/__init__.py's __all__")
             for path, line, package, name in _imports_across_packages()
             if name.startswith("_") or name not in faces[package]]
    assert not wrong, ("make the name public and add it to the face, or keep the caller inside the subpackage:\n"
                       + "\n".join(wrong))


def test_the_import_contract_holds_and_at_most_a_handful_of_modules_stay_at_the_top():
    lint = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    done = subprocess.run([lint], cwd=HERE, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    top = sorted(f for f in os.listdir(os.path.join(HERE, "dcp_atomic")) if f.endswith(".py"))
    assert top == ["__init__.py", "__main__.py", "errors.py", "version.py"], top
