"""``Staging``: how much host memory an asynchronous save or a snapshot may use to copy live tensors (P16).

Why an option and not DCP's stager: DCP's ``async_save`` stages a whole host copy of the rank's state before it
returns (host memory = the state), and its ``DefaultStager`` keeps that copy pinned for the job's life.  With
``Staging`` the live tensors are read window by window through a pool of ``pool_bytes``, after the call returns;
``CheckpointManager.wait_staged()`` says when they may change again (:mod:`.live_state`, :mod:`.stager`).

The rule of what is copied at the call (eagerly) rather than read later (lazily) is here and only here:
non-tensor items, tensors of at most ``eager_bytes`` (buffers that forward mutates: BatchNorm statistics, float8
amax histories), and tensors whose key starts with one of ``eager`` (a larger buffer mutated in forward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._base import arguments
from ..errors import ArgumentError


@dataclass(frozen=True)
class Staging:
    """Bounded staging for ``async_save``: the live tensors read through a pool after the call, not a host copy.

    Args:
        pool_bytes: host memory for the windows copies go through (pinned for device tensors); the staging's peak
            extra host memory, beside the eager copies.
        window_bytes: one window: a tensor larger than it is copied in several.  At most ``pool_bytes``.
        eager_bytes: tensors up to this size are copied at the call (default 1 MiB) while the pool has room for
            the copies (:mod:`.live_state`); one that finds none is read after the call, its version checked.
        eager: key prefixes (DCP's dotted keys, ``"model.bn"``) of tensors copied at the call whatever their size.
    """

    pool_bytes: int = 1 << 30
    window_bytes: int = 64 << 20
    eager_bytes: int = 1 << 20
    eager: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        arguments.count("Staging(pool_bytes=...)", self.pool_bytes, optional=False)
        arguments.count("Staging(window_bytes=...)", self.window_bytes, optional=False)
        arguments.count("Staging(eager_bytes=...)", self.eager_bytes, minimum=0, optional=False)
        if isinstance(self.eager, str) or not all(isinstance(prefix, str) for prefix in self.eager):
            raise arguments.refused("Staging(eager=...)", self.eager, "a tuple of key prefixes (str)",
                                    wrong_type=True)
        object.__setattr__(self, "eager", tuple(self.eager))
        if self.pool_bytes < self.window_bytes:
            raise ArgumentError(
                f"Staging(pool_bytes={self.pool_bytes}) is smaller than one window (window_bytes={self.window_bytes}):"
                " the pool must hold at least one window; raise pool_bytes or lower window_bytes",
                argument="Staging(pool_bytes=...)", pool_bytes=self.pool_bytes, window_bytes=self.window_bytes)

    @property
    def windows(self) -> int:
        """How many windows the pool holds."""
        return self.pool_bytes // self.window_bytes

    def copies_eagerly(self, key: str, value: Any, nbytes: int) -> bool:
        """Whether ``value`` (at ``key``, ``nbytes`` on this rank) is copied at the call rather than read lazily."""
        return nbytes <= self.eager_bytes or self.names_eagerly(key)

    def names_eagerly(self, key: str) -> bool:
        """Whether ``key`` is one of ``eager``'s prefixes (of whole key parts): copied at the call whatever it costs."""
        return any(key == p or key.startswith(p + ".") for p in self.eager)
