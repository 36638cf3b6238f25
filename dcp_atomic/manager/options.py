"""What a user configures as a group: the local tier (:class:`LocalTierOptions`), the memory tier
(:class:`~dcp_atomic.memory.options.MemoryTier`, kept in the memory package beside the code that reads it and named
here too) and the statistics callbacks (:class:`Callbacks`).

``CheckpointManager`` took these as flat keywords; grouped, each group checks itself once, where it is built
(``__post_init__``), and the manager passes it on whole (the local tier reads :class:`LocalTierOptions`, the save,
load and drain reports read :class:`Callbacks`).  The flat keywords stay for one release (deprecated), turned into
the groups here (:func:`grouped`)."""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any, Callable

from .._base import arguments
from ..errors import ArgumentError, ConfigurationError
from ..memory.options import MemoryTier  # the memory tier's own options, beside the code that reads them

__all__ = ["Callbacks", "LocalTierOptions", "MemoryTier", "StatsCallback"]

StatsCallback = Callable[[dict[str, Any]], None]  # receives a stats.*.to_dict() (docs/statistics.md)

DEFAULT_DURABLE_EVERY = 1  # with a local tier: every save is also drained (in the background), as torchtitan's


class _Default:
    """The type of ``durable_every``'s "not given": an explicit value is refused where no drain can run, the default
    is dropped with a warning (:class:`~.two_tier.TwoTier`)."""

    def __repr__(self) -> str:
        return "<default>"


_DEFAULT = _Default()


@dataclasses.dataclass(frozen=True)
class LocalTierOptions:
    """The local tier (Concepts, "Two tiers"): saves go to ``local_root`` first.

    Args:
        local_root: this node's own storage (a local path; each rank passes its node's): saves go there first, with
            ``replicas`` copies of each rank's files on ranks of other failure domains, and ``load`` restores from
            the newest step assemblable from local roots, replicas or the durable root.
        replicas: copies of each rank's files on other failure domains.
        durable_every: every N-th local save is also drained to the durable root in the background
            (``save(durable=)`` decides per save), and ``close()`` drains the last local step if it was not (default
            1: every save, as torchtitan's integration; training never waits for it).  None: only saves with
            ``durable=True`` -- warned at construction, since node-local disks rarely outlive the allocation.
        keep_local: local steps kept per local root (a step being drained, or the newest one waiting for its drain,
            is kept besides).
        failure_domain: this rank's failure domain (default ``$DCP_ATOMIC_FAILURE_DOMAIN``, else the host name).
    """

    local_root: str | os.PathLike
    replicas: int = 1
    durable_every: int | None = _DEFAULT  # type: ignore[assignment]
    keep_local: int = 2
    failure_domain: str | None = None
    #: whether ``durable_every`` was given (an explicit one is refused where no drain can run)
    durable_every_given: bool = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = not isinstance(self.durable_every, _Default)
        object.__setattr__(self, "durable_every_given", given)
        object.__setattr__(self, "durable_every", arguments.count(
            "LocalTierOptions(durable_every=...)", self.durable_every if given else DEFAULT_DURABLE_EVERY))
        arguments.count("LocalTierOptions(keep_local=...)", self.keep_local, optional=False)
        arguments.location("LocalTierOptions(local_root=...)", self.local_root)
        arguments.count("LocalTierOptions(replicas=...)", self.replicas, minimum=0, optional=False)
        arguments.instance("LocalTierOptions(failure_domain=...)", self.failure_domain, str, "a string")


@dataclasses.dataclass(frozen=True)
class Callbacks:
    """Where the statistics of each operation go (fields: docs/statistics.md).  An exception in any callback is
    logged and counted in ``CheckpointManager.callback_failures``; the operation's outcome stands.

    Args:
        on_saved: a save's statistics (``stats.SaveStats`` as a dict; rank 0 only, once committed).
            ``stats["retention_error"]`` says retention failed after the commit (logged; the next save retries it).
        on_loaded: a load's statistics (``stats.LoadStats``; every rank, its own share).
        on_failed: a failed save's, load's or drain's statistics (``stats.FailureStats``: error class, message,
            ranks named); every rank that raises it, before it raises.
        on_drained: a drain's statistics (``stats.DrainStats``; rank 0, once the step is committed to the durable
            root).  A failed drain goes to ``on_failed`` (operation ``"drain"``) on every rank and is raised once by
            ``wait()`` / ``close()``.
        on_snapshot: a memory-committed snapshot's statistics (``stats.SnapshotStats``; every rank, its own share,
            from the memory tier's thread).
    """

    on_saved: StatsCallback | None = None
    on_loaded: StatsCallback | None = None
    on_failed: StatsCallback | None = None
    on_drained: StatsCallback | None = None
    on_snapshot: StatsCallback | None = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            arguments.callback(f"Callbacks({field.name}=...)", getattr(self, field.name))


# -- the deprecated flat keywords, folded into the options objects ------------------------------------------------

class _Unset:
    """The type of a deprecated flat keyword's "not given" (:data:`FLAT`)."""

    def __repr__(self) -> str:
        return "<not given>"


UNSET: Any = _Unset()

# the flat keywords of the options objects, deprecated (``CheckpointManager``'s until the release after next): keyword ->
# the options object that holds it now
FLAT = {**dict.fromkeys(("local_root", "replicas", "durable_every", "keep_local", "failure_domain"), "local"),
        **dict.fromkeys(("on_saved", "on_loaded", "on_failed", "on_drained"), "callbacks")}


def grouped(local: LocalTierOptions | None, callbacks: Callbacks | None,
             flat: dict[str, Any]) -> tuple[LocalTierOptions | None, Callbacks]:
    """The options objects, built from the deprecated flat keywords given (``flat``) where the caller passed those:
    each warns, naming the new form; a group given both ways is an ``ArgumentError``."""
    given = {name: value for name, value in flat.items() if value is not UNSET}
    for name, value in given.items():
        new = ("local=LocalTierOptions(...)" if FLAT[name] == "local" else "callbacks=Callbacks(...)")
        warnings.warn(f"CheckpointManager({name}=...) is deprecated and goes in the next minor release: pass "
                      f"{new} with {name}={value!r} in it", DeprecationWarning, stacklevel=3)
    groups = {"local": local, "callbacks": callbacks}
    for group, passed in groups.items():
        mixed = sorted(name for name in given if FLAT[name] == group)
        if passed is not None and mixed:
            raise ArgumentError(f"CheckpointManager got {group}= and the deprecated keyword(s) {', '.join(mixed)}: "
                                f"pass them in {group}= only", argument=group)
    local_flat = {name: value for name, value in given.items() if FLAT[name] == "local"}
    if local is None and local_flat:
        if local_flat.get("local_root") is not None:
            local = LocalTierOptions(**local_flat)
        else:  # no local tier: only the keywords that mean something without one are accepted (as before)
            extra = {name: value for name, value in local_flat.items()
                     if name != "local_root" and not (name == "durable_every" and value is None)}
            if "durable_every" in extra:
                raise ConfigurationError(f"durable_every={extra['durable_every']} needs local_root: without a local "
                                         "tier every save already goes to the durable root")
            if "keep_local" in extra:
                arguments.count("CheckpointManager(keep_local=...)", extra["keep_local"], optional=False)
    if callbacks is None:
        callbacks = Callbacks(**{name: value for name, value in given.items() if FLAT[name] == "callbacks"})
    return local, callbacks
