"""Arguments checked where they are given (P8: fail early, typed, say what to do).

A ``thread_count=0`` would otherwise stall a save, a negative ``timeout`` give up before any wait, and
``verify="no"`` (a non-empty string, so true) silently verify.  Every argument the public API checks is checked
here, so every refusal is one type with one wording: an :class:`~.errors.ArgumentError` naming the argument, what it
got and what it accepts (:class:`~.errors.ArgumentTypeError`, also a ``TypeError``, for a value of the wrong type),
raised by the call that was given it.  The rules themselves (a run id's pattern, a step's range) stay with what they
describe; they call these.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Collection
from typing import Any

from ..errors import ArgumentError, ArgumentTypeError, shorten


def refused(name: str, value: Any, accepts: str, *, wrong_type: bool = False, then: str = "") -> ArgumentError:
    """The error for argument ``name`` given ``value``: the one wording of every refusal (``then``: what follows)."""
    kind = ArgumentTypeError if wrong_type else ArgumentError
    return kind(f"{name} must be {accepts}, got {shorten(repr(value), 200)}" + (f"; {then}" if then else ""),
                argument=name)


def count(name: str, value: Any, *, minimum: int = 1, optional: bool = True) -> int | None:
    """An int of at least ``minimum`` (None allowed when ``optional``)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise refused(name, value, f"an int >= {minimum}{' or None' if optional else ''}",
                      wrong_type=isinstance(value, bool) or not isinstance(value, int))
    return value


def seconds(name: str, value: Any) -> float:
    """A finite, positive duration."""
    number = not isinstance(value, bool) and isinstance(value, (int, float))
    if not number or not math.isfinite(value) or value <= 0:
        raise refused(name, value, "a positive number of seconds", wrong_type=not number)
    return float(value)


def flag(name: str, value: Any, *, optional: bool = False) -> bool | None:
    """True or False (None allowed when ``optional``: "decide for me"); a string or a number is refused, since
    ``"no"`` and ``"false"`` are true."""
    if value is None and optional:
        return None
    if not isinstance(value, bool):
        raise refused(name, value, f"True or False{' or None' if optional else ''}", wrong_type=True)
    return value


def choice(name: str, value: Any, choices: Collection[Any]) -> Any:
    """One of ``choices`` (a compression, a tier)."""
    if value not in choices:
        raise refused(name, value, "one of " + ", ".join(map(repr, choices)))
    return value


def instance(name: str, value: Any, kind: type, accepts: str, *, optional: bool = True) -> Any:
    """An instance of ``kind`` (None allowed when ``optional``); ``accepts`` says it as the user writes it."""
    if (value is None and optional) or isinstance(value, kind):
        return value
    raise refused(name, value, accepts + (" or None" if optional else ""), wrong_type=True)


def callback(name: str, value: Any) -> Any:
    """A callable or None."""
    if value is not None and not callable(value):
        raise refused(name, value, "a callable or None", wrong_type=True)
    return value


def text(name: str, value: Any, pattern: re.Pattern[str], accepts: str) -> str:
    """A string that ``pattern`` matches whole (a run id, a save id)."""
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise refused(name, value, accepts, wrong_type=not isinstance(value, str))
    return value


RESERVED_METADATA_PREFIX = "dcp_atomic."  # keys the library itself writes into a step's metadata


def user_metadata(name: str, value: Any) -> Any:
    """A save's ``metadata`` from a user: its keys may not start with ``dcp_atomic.`` (the library's own, such as the
    order of a memory snapshot's durable copy: a re-saved step's metadata must not reorder the tiers)."""
    reserved = sorted(k for k in value if isinstance(k, str) and k.startswith(RESERVED_METADATA_PREFIX)) \
        if isinstance(value, dict) else []
    if reserved:
        raise refused(name, reserved, f"a dict without keys starting with {RESERVED_METADATA_PREFIX!r}",
                      then="those keys are dcp_atomic's own (copied from another step's metadata?): drop them")
    return value


def location(name: str, value: Any) -> str:
    """A non-empty path or URL (a str or an ``os.PathLike``), as a str."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value:
        raise refused(name, value, "a non-empty path or URL", wrong_type=not isinstance(value, str))
    return value
