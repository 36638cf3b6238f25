"""Where a writer or reader points, and how DCP's ``checkpoint_id`` moves it.

Frameworks (torchtitan, Lightning) build one writer and pass ``checkpoint_id=<root>/<run_id>/step_<N>`` to
every ``dcp.save``; DCP hands it to ``reset``.  A writer or reader built with a root and run keeps them and
accepts only ids under them (:func:`.layout.checked_checkpoint_id`); one built without follows the ids.  The
open storage is reused while the root stays the same, so a reused writer keeps one client.
"""

from __future__ import annotations

import os

from ..stores.backends import open_storage
from ..errors import ConfigurationError
from ..format.layout import RunLayout, parse_checkpoint_id, root_key, validate_run_id
from ..stores.storage import Storage


def open_location(root: str | os.PathLike | None, run_id: str | None,
                  storage_options: dict | None) -> tuple[Storage | None, RunLayout | None]:
    """(storage, layout) for what the object was built with; None where it was built without a location."""
    if run_id is not None:
        validate_run_id(run_id)
    storage = None if root is None else open_storage(root, storage_options)
    layout = None if storage is None or run_id is None else RunLayout(storage, run_id)
    return storage, layout


def retarget(storage: Storage | None, layout: RunLayout | None, root: str, run_id: str,
             storage_options: dict | None) -> tuple[Storage, RunLayout]:
    """(storage, layout) for ``root``/``run_id``, reusing the open storage while the root stays the same."""
    if storage is None or root_key(storage_root(storage)) != root_key(root):
        storage = open_storage(root, storage_options)
    elif layout is not None and layout.run_id == run_id:
        return storage, layout
    return storage, RunLayout(storage, run_id)


def storage_root(storage: Storage) -> str:
    """The root a storage was opened with, as a user would write it (URLs keep their scheme)."""
    return getattr(storage, "url", None) or storage.root


def is_checkpoint_id(checkpoint_id: str | os.PathLike) -> bool:
    """Whether ``checkpoint_id`` has a form writers and readers accept (DCP's ``validate_checkpoint_id``)."""
    try:
        parse_checkpoint_id(checkpoint_id)
    except ConfigurationError:
        return False
    return True
