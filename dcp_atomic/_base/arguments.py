"""Arguments checked where they are given (P8: fail early, typed, say what to do).

A ``thread_count=0`` would otherwise stall a save, a negative ``timeout`` give up before any wait, and
``verify="no"`` (a non-empty string, so true) silently verify: each is an :class:`~.errors.ArgumentError`
naming the argument, raised by the constructor that was given it.
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import ArgumentError


def count(name: str, value: Any, *, minimum: int = 1, optional: bool = True) -> int | None:
    """An int of at least ``minimum`` (None allowed when ``optional``)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ArgumentError(f"{name} must be an int >= {minimum}{' or None' if optional else ''}, got {value!r}",
                            argument=name)
    return value


def seconds(name: str, value: Any) -> float:
    """A finite, positive duration."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ArgumentError(f"{name} must be a positive number of seconds, got {value!r}", argument=name)
    return float(value)


def flag(name: str, value: Any, *, optional: bool = False) -> bool | None:
    """True or False (None allowed when ``optional``: "decide for me"); a string or a number is refused, since
    ``"no"`` and ``"false"`` are true."""
    if value is None and optional:
        return None
    if not isinstance(value, bool):
        raise ArgumentError(f"{name} must be True or False{' or None' if optional else ''}, got {value!r}",
                            argument=name)
    return value
