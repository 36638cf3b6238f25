"""A package's face: the names other layers import from it, declared once in its ``__init__``.

The face is the package's ``__all__``, and each of its names can be imported from the package itself.  A module is
imported when one of its names is first asked for, not with the package: ``format`` and ``stores`` are on the way of
``dcp-atomic ls``, which must start without torch (``format.codec`` imports it), and importing one module of a
package must not run the others.  ``tests/guards/test_layers.py`` holds every import across packages to the faces.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable


def face(package: str, modules: dict[str, tuple[str, ...]]
         ) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """``__all__``, ``__getattr__`` and ``__dir__`` of ``package`` from ``{module: its names in the face}``; a module's
    own name among its names is the module itself (``from .._base import failpoints``)."""
    where: dict[str, str] = {}  # name -> its module
    whole = {name for module, names in modules.items() for name in names if name == module.rpartition(".")[2]}
    for module, names in modules.items():
        for name in names:
            if name in where:
                raise ValueError(f"{package}: {name!r} is in the face twice (modules {where[name]} and {module})")
            where[name] = module

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(f"{package}.{where[name]}")
        value = module if name in whole else getattr(module, name)
        setattr(sys.modules[package], name, value)  # asked once: later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(where))

    return sorted(where), __getattr__, __dir__
