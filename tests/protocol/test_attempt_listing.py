"""A step directory's attempts are told from its control files in one place (``RunLayout.attempts``), and the
marker's name is spelled only in ``format/layout.py``: gc, ``rm`` and ``ls`` cannot disagree on what an attempt is."""

from __future__ import annotations

import ast
import pathlib

import dcp_atomic
from dcp_atomic.format.layout import COMMITS, LATEST, MARKER, RunLayout, step_dir_name

PACKAGE = pathlib.Path(dcp_atomic.__file__).parent
LAYOUT = PACKAGE / "format" / "layout.py"


def test_attempts_are_every_entry_but_the_marker_and_dot_files():
    save_id = "20250101T000000Z-0123abcd"
    entries = [MARKER, f".{MARKER}.123.9f.tmp", save_id, "stray-dir"]
    assert RunLayout.attempts(entries) == [save_id, "stray-dir"]  # a stray entry is judged by its lease, not kept
    assert RunLayout.attempts([MARKER]) == []


def test_a_run_directory_is_one_holding_a_step_latest_or_the_journal():
    for entries in ([step_dir_name(5)], [LATEST], [COMMITS], ["LINEAGE", LATEST]):
        assert RunLayout.holds_run(entries), entries
    for entries in ([], ["LINEAGE"], ["step_12"], [".incoming", "notes.txt"]):
        assert not RunLayout.holds_run(entries), entries


def _restatements(path: pathlib.Path) -> list[str]:
    """The marker's name as a literal, or an attempt told from the marker by comparing with it."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and node.value == MARKER:
            found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {MARKER!r}")
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops) and any(
                isinstance(side, ast.Name) and side.id == "MARKER" for side in (node.left, *node.comparators)):
            found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_only_the_layout_spells_the_marker_or_tells_attempts_from_it():
    found = [line for path in sorted(PACKAGE.rglob("*.py")) if path != LAYOUT for line in _restatements(path)]
    assert not found, ("the marker's name or the attempts rule restated outside format/layout.py (call "
                       f"RunLayout.attempts / use MARKER): {found}")
    assert _restatements(LAYOUT), "the checker no longer sees the layout's own definition: it checks nothing"
