"""The reference pages stay true to the code: every exported name and every keyword of the public signatures is in
docs/api.md, and every page the README links to exists."""

from __future__ import annotations

import inspect
import os
import re

import dcp_atomic

HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _read(*parts: str) -> str:
    with open(os.path.join(HERE, *parts)) as f:
        return f.read()


def _section(text: str, title: str) -> str:
    """The part of ``text`` under the ``## `title...`` heading, up to the next ``## ``."""
    match = re.search(rf"^## `{re.escape(title)}[(`].*?(?=^## |\Z)", text, re.M | re.S)
    assert match, f"docs/api.md has no section for {title}"
    return match.group(0)


def test_every_exported_name_and_every_keyword_is_in_the_api_reference():
    api = _read("docs", "api.md")
    missing = [name for name in dcp_atomic.__all__ if name != "__version__" and f"`{name}" not in api]
    assert not missing, f"exported but not in docs/api.md: {missing}"
    from dcp_atomic.integrations.accelerate import AcceleratorCheckpoint

    for cls in (dcp_atomic.AtomicStorageWriter, dcp_atomic.AtomicStorageReader, dcp_atomic.AtomicSavePlanner,
                dcp_atomic.AtomicLoadPlanner, dcp_atomic.CheckpointManager, dcp_atomic.Parallelism):
        section = _section(api, cls.__name__)
        keywords = [p for p in inspect.signature(cls).parameters.values()
                    if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        undocumented = [p.name for p in keywords if f"`{p.name}`" not in section and f"{p.name}=" not in section]
        assert not undocumented, f"{cls.__name__}: keywords not in its docs/api.md section: {undocumented}"
    for function in (dcp_atomic.list_steps, dcp_atomic.latest_step, dcp_atomic.resume_point,
                     AcceleratorCheckpoint.save, AcceleratorCheckpoint.load):
        shown = [p.name for p in inspect.signature(function).parameters.values() if p.name != "self"]
        starts = [m.start() for m in re.finditer(re.escape(f"`{function.__name__}("), api)]
        assert any(all(name in api[start:start + 200] for name in shown) for start in starts), \
            f"{function.__qualname__}{shown}: docs/api.md shows no signature with all of them"


def test_every_page_the_readme_links_to_exists():
    readme = _read("README.md")
    links = set(re.findall(r"\]\(((?:docs/)?[\w./-]+\.md)(?:#[\w.-]+)?\)", readme))
    assert "docs/api.md" in links
    missing = [link for link in links if not os.path.exists(os.path.join(HERE, link))]
    assert not missing, missing
