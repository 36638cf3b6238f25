"""What to install for an optional part of dcp-atomic (an extra: ``plot``, ``s3``, ``gcs``...), said one way by every
message that needs it.

dcp-atomic is not on PyPI, so ``pip install 'dcp-atomic[plot]'`` finds nothing: the advice names the packages the
extra brings (read from the installed package's own metadata, so it follows ``pyproject.toml``), which install
anywhere, and how to take the extra from a clone or a wheel.  A command that lacks an extra exits
:data:`MISSING_EXTRA_EXIT`, whichever extra it is.
"""

from __future__ import annotations

import re
import shlex

MISSING_EXTRA_EXIT = 3  # 1: a failure, 2: a usage error


def extra_requirements(extra: str) -> list[str]:
    """The requirements dcp-atomic's ``extra`` brings (empty where the metadata cannot be read)."""
    try:
        from importlib.metadata import PackageNotFoundError, requires

        listed = requires("dcp-atomic") or []
    except (ImportError, PackageNotFoundError):
        return []
    marker = re.compile(r"""extra\s*==\s*['"]""" + re.escape(extra) + r"""['"]""")
    return [entry.split(";", 1)[0].strip().replace(" ", "") for entry in listed
            if ";" in entry and marker.search(entry.split(";", 1)[1])]


def install_advice(extra: str) -> str:
    """How to install what the ``extra`` brings: by package names, and as the extra from a clone or a wheel."""
    packages = extra_requirements(extra)
    direct = f"pip install {' '.join(shlex.quote(p) for p in packages)}; " if packages else ""
    return (f"{direct}or install dcp-atomic with its [{extra}] extra: pip install -e '.[{extra}]' in a clone, "
            f"pip install 'dcp_atomic-<version>-py3-none-any.whl[{extra}]' from a wheel")
