"""Checks of the statistics records against their documented schema (docs/statistics.md)."""

from __future__ import annotations

import os
import re


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = os.path.join(REPO, "docs", "statistics.md")


def _documented_tables() -> dict[str, dict[str, str]]:
    """{table heading: {field: type}} from docs/statistics.md."""
    tables: dict[str, dict[str, str]] = {}
    heading = None
    with open(DOC) as f:
        for line in f:
            if line.startswith("#"):
                heading = line.strip("# \n")
            match = re.match(r"\| `(\w+)` \| `(.+?)` \|", line)
            if match and heading:
                tables.setdefault(heading, {})[match.group(1)] = match.group(2).replace("\\|", "|")
    return tables


def _table(prefix: str) -> dict[str, str]:
    (fields,) = [t for heading, t in _documented_tables().items() if heading.startswith(prefix)]
    return fields


def _conforms(value, documented: str) -> bool:
    """Does ``value`` have the documented type (``int``, ``float | None``, ``list[RankSaveStats]``, ...)?"""
    options = [t.strip() for t in documented.split("|")]
    if len(options) > 1:
        return any(_conforms(value, t) for t in options)
    kind = options[0]
    if kind == "None":
        return value is None
    if kind.startswith("list[") and kind.endswith("]"):
        return isinstance(value, list) and all(_conforms(v, kind[5:-1]) for v in value)
    if kind == "RankSaveStats":
        return isinstance(value, dict) and not _schema_problems(value, _table("Per rank"))
    simple = {"int": int, "float": float, "str": str, "bool": bool}[kind]
    return isinstance(value, simple) and (simple is bool or not isinstance(value, bool))


def _schema_problems(stats: dict, documented: dict[str, str]) -> list[str]:
    problems = [f"missing {name}" for name in documented if name not in stats]
    problems += [f"undocumented {name}" for name in stats if name not in documented]
    problems += [f"{name}={stats[name]!r} is not {kind}" for name, kind in documented.items()
                 if name in stats and not _conforms(stats[name], kind)]
    return problems
