"""The package's layers: the import contracts hold (layers, and no import circles), and every module's old flat
path still imports as the same module object (so ``mock.patch`` and ``monkeypatch`` of an old path reach the code
that runs)."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import os
import re
import subprocess
import sys

import pytest

import dcp_atomic

HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
    for name, text in _code_and_docs():
        if name == os.path.join("tests", "guards", "test_layers.py"):
            continue  # the one test of the old paths
        found = (_old_path_imports(text) if name.endswith(".py")
                 else [m.group(0).strip() for m in in_docs.finditer(text)] if name.endswith(".md") else [])
        offenders += [f"{name}: {line}" for line in found]
    assert not offenders, ("old module paths (dcp_atomic._MOVED) in use; import from the new path, "
                           "e.g. `from dcp_atomic.tiers import drain`:\n" + "\n".join(offenders))


def _files(top: str) -> list[str]:
    if os.path.isfile(top):
        return [top]
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(top) for f in fs if f.endswith((".py", ".md")))


def _code_and_docs() -> list[tuple[str, str]]:
    """(path from the repository root, text) of every Python and Markdown file a user or a rank process reads: the
    package, tests, benchmarks, examples, the testbed and scripts, the README and docs."""
    found = []
    for top in ("dcp_atomic", "tests", "benchmarks", "examples", "testbed", "scripts", "docs", "README.md"):
        for path in _files(os.path.join(HERE, top)):
            with open(path, encoding="utf-8") as f:
                found.append((os.path.relpath(path, HERE), f.read()))
    return found


# -- the manager's deprecated flat keywords -------------------------------------------------------------------------

PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
INLINE_MANAGER_CALL = re.compile(r"`((?<![\w.])CheckpointManager\([^`]*)`")  # not AtomicCheckpointManager.Config(


def _flat_keywords() -> set[str]:
    """The deprecated flat keywords of ``CheckpointManager``: the fields of the options objects that replace them."""
    from dcp_atomic import Callbacks, LocalTierOptions

    return {field.name for group in (LocalTierOptions, Callbacks) for field in dataclasses.fields(group) if field.init}


def _callee(call: ast.Call) -> str | None:
    return call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", None)


def _keywords_passed(call: ast.Call) -> set[str]:
    """The keywords a call passes, those of a literal ``**{...}`` or ``**dict(...)`` included."""
    names = set()
    for keyword in call.keywords:
        if keyword.arg is not None:
            names.add(keyword.arg)
        elif isinstance(keyword.value, ast.Dict):
            names |= {key.value for key in keyword.value.keys if isinstance(key, ast.Constant)}
        elif isinstance(keyword.value, ast.Call) and _callee(keyword.value) == "dict":
            names |= {k.arg for k in keyword.value.keywords if k.arg}
    return names


class _ManagerBuilders:
    """The functions (a class: by its ``__init__``) that hand their ``**kwargs`` to ``CheckpointManager`` or to another
    such builder, with the keywords each declares itself (it handles those: no flat keyword).  A call's name resolves
    to the functions of that name in its own file, else in the file it imports the name from."""

    def __init__(self, trees: dict[str, ast.AST]) -> None:
        self.defined = {path: self._functions(tree) for path, tree in trees.items()}  # path -> name -> functions
        self.imported = {path: {alias.asname or alias.name: node.module.replace(".", os.sep) + ".py"
                                for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
                                and not node.level for alias in node.names} for path, tree in trees.items()}
        self.declared: dict[int, set[str]] = {}  # id(builder) -> the keywords it declares
        grew = True
        while grew:
            grew = False
            for path, functions in self.defined.items():
                for function in (f for group in functions.values() for f in group):
                    if id(function) not in self.declared and self._forwards_its_kwargs(path, function):
                        arguments = function.args
                        self.declared[id(function)] = {
                            a.arg for a in arguments.posonlyargs + arguments.args + arguments.kwonlyargs}
                        grew = True

    @staticmethod
    def _functions(tree: ast.AST) -> dict[str, list[ast.FunctionDef]]:
        functions: dict[str, list[ast.FunctionDef]] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                functions.setdefault(node.name, []).extend(
                    f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name != "__init__":
                functions.setdefault(node.name, []).append(node)
        return functions

    def handled(self, path: str, call: ast.Call) -> set[str] | None:
        """The keywords that the builder a call reaches declares (all of its namesakes), or None: no builder."""
        name = _callee(call)
        if name == "CheckpointManager":
            return set()
        if name not in self.defined.get(path, {}):
            path = self.imported.get(path, {}).get(name)
        sets = [self.declared[id(f)] for f in self.defined.get(path, {}).get(name, []) if id(f) in self.declared]
        return set.intersection(*sets) if sets else None

    def _forwards_its_kwargs(self, path: str, function: ast.FunctionDef) -> bool:
        rest = function.args.kwarg
        return rest is not None and any(
            isinstance(call, ast.Call) and self.handled(path, call) is not None
            and any(k.arg is None and isinstance(k.value, ast.Name) and k.value.id == rest.arg for k in call.keywords)
            for call in ast.walk(function))


def _flat_manager_calls(path: str, tree: ast.AST, builders: _ManagerBuilders) -> list[str]:
    flat = _flat_keywords()
    found = []
    for call in ast.walk(tree):
        handled = builders.handled(path, call) if isinstance(call, ast.Call) else None
        passed = sorted(_keywords_passed(call) & flat - handled) if handled is not None else []
        if passed:
            found.append(f"line {call.lineno}: {_callee(call)}({', '.join(f'{name}=' for name in passed)})")
    return found


def test_no_caller_passes_the_managers_deprecated_flat_keywords():
    """``CheckpointManager(local_root=..., on_saved=...)`` warns, and the suite's filter makes that an error, but not
    in the ranks' processes where most manager tests run: so this reads the calls, direct ones and those through a
    helper that hands its ``**kwargs`` on (``AcceleratorCheckpoint``, the tests' ``_manager``), in the code and in
    the docs' Python blocks and inline calls."""
    deprecated_form = os.path.join("tests", "manager", "test_manager_options.py")  # the tests of the deprecated form
    sources = [(name, text) for name, text in _code_and_docs() if name != deprecated_form]
    trees = {name: ast.parse(text) for name, text in sources if name.endswith(".py")}
    trees.update({f"{name}, python block {number}": ast.parse(block) for name, text in sources if name.endswith(".md")
                  for number, block in enumerate(PYTHON_BLOCK.findall(text))})
    builders = _ManagerBuilders(trees)
    offenders = [f"{name}: {line}" for name, tree in trees.items()
                 for line in _flat_manager_calls(name, tree, builders)]
    flat = "|".join(sorted(_flat_keywords()))
    offenders += [f"{name}: `{span}`" for name, text in sources if name.endswith(".md")
                  for span in INLINE_MANAGER_CALL.findall(text) if re.search(rf"\b(?:{flat})=", span)]
    assert not offenders, ("CheckpointManager's flat keywords are deprecated: pass local=LocalTierOptions(local_root, "
                           "replicas=..., ...) and callbacks=Callbacks(on_saved=..., ...):\n" + "\n".join(offenders))


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


def _private_reaches_through_modules() -> list[str]:
    """Every ``module._name`` in dcp_atomic where ``module`` was imported from another subpackage (``from
    ..protocol import commit`` then ``commit._read_once(...)``): a private reach the import check cannot see."""
    found = []
    by_file: dict[str, set[str]] = {}
    for path, _line, _package, name in _imports_across_packages():
        by_file.setdefault(path, set()).add(name)
    for name, imported in by_file.items():
        with open(os.path.join(HERE, name), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        aliases = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                   for alias in node.names if alias.name in imported}
        found += [f"{name}:{node.lineno}: {node.value.id}.{node.attr}" for node in ast.walk(tree)
                  if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                  and node.value.id in aliases and node.attr.startswith("_") and not node.attr.startswith("__")]
    return found


def test_no_module_reaches_a_private_name_through_a_module_of_another_subpackage():
    """``from ..protocol import commit`` then ``commit._read_once()`` is the same private reach as importing the
    name, written so that the import check misses it."""
    wrong = _private_reaches_through_modules()
    assert not wrong, "make the name public (and add it to the face), or keep the caller inside:\n" + "\n".join(wrong)


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


def test_every_module_over_500_lines_says_why_it_is_one_module_and_its_note_gives_its_size():
    """A large module is a decision, written where it is read: "Why one module of about N lines: ..." in its
    docstring, N within 15% of its length (a note that no longer says the size it excuses is a stale one)."""
    package = os.path.join(HERE, "dcp_atomic")
    problems = []
    for folder, _, files in os.walk(package):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            with open(path) as f:
                text = f.read()
            lines = text.count("\n")
            if lines <= 500:
                continue
            note = re.search(r"Why one module of about ([\d,]+) lines", text)
            where = os.path.relpath(path, HERE)
            if note is None:
                problems.append(f"{where} ({lines} lines): no 'Why one module of about N lines' note")
            elif abs(int(note.group(1).replace(",", "")) - lines) > 0.15 * lines:
                problems.append(f"{where} ({lines} lines): its note says about {note.group(1)}")
    assert not problems, problems


def test_every_module_a_docstring_names_with_mod_exists():
    """``:mod:`` references (relative to the module, or absolute) resolve: a module moved to another package left
    31 of them pointing nowhere, which the docs site renders as plain text without a word."""
    import importlib.util

    stale = []
    for folder, _, files in os.walk(os.path.join(HERE, "dcp_atomic")):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            module = os.path.relpath(path, HERE)[:-3].replace(os.sep, ".")
            package = module.removesuffix(".__init__") if name == "__init__.py" else module.rpartition(".")[0]
            with open(path) as f:
                refs = re.findall(r":mod:`~?([^`<]+?)`", f.read())
            for ref in refs:
                target = ref.strip()
                if target.startswith("."):
                    up = len(target) - len(target.lstrip(".")) - 1
                    parts = package.split(".")
                    target = ".".join(parts[:len(parts) - up] + [p for p in [target.lstrip(".")] if p])
                try:
                    found = importlib.util.find_spec(target) is not None
                except (ImportError, ValueError):
                    found = False
                if not found:
                    stale.append(f"{os.path.relpath(path, HERE)}: :mod:`{ref}`")
    assert not stale, stale
