"""Every private name of torch, s3fs, gcsfs and CPython that dcp_atomic uses, in one place.

Each is a bet on a release's internals that no public API offers (why, at each name).  Gathered here, one file
shows what a new torch, s3fs or gcsfs can break, and ``tests/guards/test_internals.py`` pins each against the installed
releases (torch 2.13.0, 2.14.1 and 2.15.0 through ``scripts/test_torch_matrix.sh``; the s3fs and gcsfs that
``.ci/run`` installs), so a moved name fails there, named, instead of deep inside a save.  The rest of the package
imports these wrappers, never the private names themselves.

Names that only appear inside DCP's pickles (``_StorageInfo``, ``_MEM_FORMAT_ENCODING``, ``_get_layout``) are
also data: :mod:`dcp_atomic.format.safe_pickle` lists them as the globals a ``.metadata`` may name.
"""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch.distributed as dist

# torch is imported where its names are used, never at the top: the stores' wrappers below are imported by the
# command line on s3:// and gs:// roots, which answers without importing torch.

# --- torch.distributed.checkpoint -------------------------------------------------------------------------------

_TORCH_CONSTANTS = {
    #: (relative_path, offset, length) of an item, as DCP's ``.metadata`` records it: stock ``FileSystemReader``
    #: reads exactly this class, so attempts stay stock-readable.
    "StorageInfo": ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    #: The memory-format codes ``TensorProperties`` pickles.
    "MEM_FORMAT_ENCODING": ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
}


def __getattr__(name: str) -> Any:
    """``StorageInfo`` and ``MEM_FORMAT_ENCODING``, imported from torch when first used."""
    if name not in _TORCH_CONSTANTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    module, private = _TORCH_CONSTANTS[name]
    value = getattr(importlib.import_module(module), private)
    globals()[name] = value
    return value

#: What DCP's coordinator caches on ``SavePlanner`` (class attributes, keyed by planner class) in
#: ``create_global_plan`` under ``enable_plan_caching`` -- before the storage writer may still refuse the save.
_COORDINATOR_CACHES = ("_cached_all_plans", "_cached_global_plan", "_cached_metadata")


def caches_plans(planner: Any) -> bool:
    """Whether DCP replays this planner's cached plans (``DefaultSavePlanner(enable_plan_caching=True)``)."""
    return bool(getattr(planner, "_enable_plan_caching", False))


def plan_cache_key(planner: Any) -> str:
    """The key DCP files this planner's cached plans under: its class name."""
    return getattr(planner, "_cached_plans_key", type(planner).__name__)


def forget_pending_local_plan(planner: Any) -> None:
    """Drop the local plan DCP holds until ``finish_plan`` caches it: a save refused while planning never gets
    there, and the next save would cache the refused plan as written."""
    planner.__dict__.pop("_pending_local_plan", None)


def coordinator_plan_caches() -> dict[str, dict]:
    """A copy of DCP's coordinator caches, to put back if the save is refused (:func:`restore_coordinator_plan_caches`)."""
    from torch.distributed.checkpoint.planner import SavePlanner

    return {name: dict(getattr(SavePlanner, name)) for name in _COORDINATOR_CACHES}


def restore_coordinator_plan_caches(before: dict[str, dict]) -> None:
    """Put back, entry by entry, what :func:`coordinator_plan_caches` copied (DCP replaces an entry, never mutates
    one), leaving the dicts DCP holds in place."""
    from torch.distributed.checkpoint.planner import SavePlanner

    for name, entries in before.items():
        cache = getattr(SavePlanner, name)
        for key in cache.keys() - entries.keys():
            del cache[key]
        for key, value in entries.items():
            if cache.get(key) is not value:
                cache[key] = value


def load_state_dict_from_keys(**kwargs: Any) -> dict[str, Any]:
    """DCP's loader that builds the state dict from the checkpoint itself (no template): the only way to load a
    whole step without knowing its keys; public as ``_load_state_dict_from_keys`` only."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    return _load_state_dict_from_keys(**kwargs)


# --- torch.distributed ------------------------------------------------------------------------------------------


def default_store() -> dist.Store:
    """The default group's rendezvous store: a channel that works while collectives hang (liveness, blame)."""
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def dtensor_global_offset(value: Any) -> tuple[int, ...]:
    """Where a DTensor's local shard starts in its global tensor: what DCP itself records as the shard's chunk offset
    (no public API says it; the memory tier records it so a restore at another world size can reshard).  Asked for
    every leaf of every snapshot: one answer per (shape, mesh, placements) is computed once (8 ms -> 0.7 ms for 500
    DTensors)."""
    return _global_offset(tuple(value.shape), value.device_mesh, tuple(value.placements))


@functools.lru_cache(maxsize=4096)
def _global_offset(shape: tuple[int, ...], mesh: Any, placements: tuple) -> tuple[int, ...]:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return tuple(compute_local_shape_and_global_offset(shape, mesh, placements)[1])


# --- s3fs -------------------------------------------------------------------------------------------------------


async def s3_call(fs: Any, method: str, **kwargs: Any) -> Any:
    """One botocore call through s3fs's client, without s3fs's retry loop and translation of errors (ours bound,
    repeat and report each request)."""
    return await fs._call_s3(method, **kwargs)


def share_s3_session(fs: Any, session: Any) -> None:
    """Give an s3fs filesystem a shared botocore session it must not close when it is closed itself."""
    fs.session = session
    fs._session_is_owned = False


# --- gcsfs ------------------------------------------------------------------------------------------------------


def gcs_creates_exclusively(fs: Any) -> bool:
    """Whether this gcsfs can create an object only if absent (``_pipe_file(..., mode="create")``)."""
    return "mode" in inspect.signature(fs._pipe_file).parameters


def gcs_json_filesystem() -> type:
    """gcsfs's JSON-API filesystem (``gcsfs.core.GCSFileSystem``): ``gcsfs.GCSFileSystem`` may be the extended
    subclass (gcsfs >= 2025.x, ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT``) that looks each bucket's type up over gRPC."""
    from gcsfs.core import GCSFileSystem

    return GCSFileSystem


def gcs_location(fs: Any) -> str:
    """The endpoint URL gcsfs sends requests to (the fake server in tests)."""
    return fs._location


def gcs_route_requests(fs: Any, route: Callable[..., Any]) -> None:
    """Send every HTTP request of ``fs`` through ``route(once, method, path, *args, **kwargs)``, where ``once``
    makes exactly one attempt: ``_request`` is gcsfs's one HTTP function (reads, writes, listings, upload chunks),
    and its undecorated form skips gcsfs's own retry loop."""
    once = type(fs)._request.__wrapped__

    async def request(method, path, *args, **kwargs):
        return await route(lambda: once(fs, method, path, *args, **kwargs), method, path, *args, **kwargs)

    fs._request = request


# --- torch tensors ----------------------------------------------------------------------------------------------


def version_counter(tensor: Any) -> int:
    """The tensor's version counter: every in-place op on it or on a view of it adds one (views share it).  Bounded
    staging (:mod:`dcp_atomic.staging`) tells by it whether a live tensor changed while its bytes were read."""
    return tensor._version


# --- CPython ----------------------------------------------------------------------------------------------------


def before_thread_pools_stop(func: Callable[..., None], *args: Any) -> None:
    """Call ``func(*args)`` once the main thread has ended, before ``concurrent.futures`` refuses new work ("cannot
    schedule new futures after interpreter shutdown") and before every ``atexit`` handler.  An ``atexit`` handler
    runs too late to let a save in flight finish: the save's own thread pools refuse its writes by then.  CPython's
    hook for this is the one ``concurrent.futures`` registers its shutdown with (``threading._register_atexit``,
    3.9+; run last-registered first, so the pools' module is imported before ours is registered)."""
    import concurrent.futures.thread  # noqa: F401 - registers the pools' shutdown first: it then runs after ours
    import threading

    threading._register_atexit(func, *args)
