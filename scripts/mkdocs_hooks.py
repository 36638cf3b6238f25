"""MkDocs hooks (``hooks:`` in mkdocs.yml): what the docstrings' reStructuredText roles become on the site.

The docstrings name code with Sphinx's roles (``:class:`~dcp_atomic.staging.Staging```), which Python's ``help()``
and editors show as they are; mkdocstrings renders the Markdown around them, so a role would stay as its literal
prefix beside the code.  This keeps the code and drops the prefix (and the ``~`` that means "show the last part").
"""

from __future__ import annotations

import re

_ROLE = re.compile(r":(?:class|func|meth|attr|exc|mod|data|obj):<code>(?:~[\w.]*\.)?([^<]*)</code>")


def on_page_content(html: str, **_: object) -> str:
    return _ROLE.sub(r"<code>\1</code>", html)
