"""Strict value checks shared by :class:`~pipeline.config.EngineConfig` and
:class:`~pipeline.config.SamplingParams`.

Each check takes the field's name, the value and the error class to raise
(:class:`~pipeline.errors.InvalidConfigError` or
:class:`~pipeline.errors.InvalidRequestError`), and returns the value normalised to the
builtin type the field holds: a number that passes is a real ``int`` (never a ``bool``)
in a 64-bit range, or a finite ``float``, so that msgspec encodes it and the worker's
typed decoder accepts it, and ``float()`` of it can never overflow later.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any, Literal, overload

__all__ = [
    "INT64_MAX",
    "INT64_MIN",
    "SECRET_KEY",
    "check_float",
    "check_int",
    "check_plain",
    "int_range",
    "redact",
]

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1

#: Option keys whose values are secrets: never shown by ``repr`` or an error message.
SECRET_KEY = re.compile(
    r"pass(word|wd|phrase)?|secret|token|api[_-]?key|auth|credential|private[_-]?key|"
    r"access[_-]?key|session[_-]?key|cookie",
    re.IGNORECASE,
)
_URL_USERINFO = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)[^/@\s]*@", re.IGNORECASE)
_PLAIN_DEPTH = 16

ErrorType = Callable[[str, object, str], Exception]


def int_range(lo: int = INT64_MIN, hi: int = INT64_MAX) -> str:
    """The integers in ``[lo, hi]`` in words: ``"a positive integer"``, ``"an integer >=
    0"`` (no upper bound but the 64-bit one), or ``"an integer in [lo, hi]"``."""
    if hi == INT64_MAX and lo != INT64_MIN:
        return "a positive integer" if lo == 1 else f"an integer >= {lo}"
    return f"an integer in [{lo}, {hi}]"


@overload
def check_int(
    name: str,
    value: object,
    error: ErrorType,
    *,
    lo: int = ...,
    hi: int = ...,
    optional: Literal[False] = ...,
) -> int: ...


@overload
def check_int(
    name: str, value: object, error: ErrorType, *, lo: int = ..., hi: int = ..., optional: bool
) -> int | None: ...


def check_int(
    name: str,
    value: object,
    error: ErrorType,
    *,
    lo: int = INT64_MIN,
    hi: int = INT64_MAX,
    optional: bool = False,
) -> int | None:
    """``value`` as a builtin ``int`` in ``[lo, hi]`` (``None`` passes when ``optional``).

    The one integer check of kvstep: ``check_int("block_size", v, InvalidConfigError,
    lo=1)`` is the positive-integer check, with the message ``"must be a positive
    integer"`` (see :func:`int_range`).

    Raises:
        error: ``value`` is a ``bool``, not an ``int``, or out of range; the message
            names what is allowed.
    """
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        allowed = int_range(lo, hi)
        raise error(name, value, f"must be {'None or ' if optional else ''}{allowed}")
    return int(value)


def check_float(
    name: str,
    value: object,
    error: ErrorType,
    *,
    lo: float,
    hi: float,
    lo_open: bool = False,
    allow_inf: bool = False,
) -> float:
    """``value`` (an ``int`` or a ``float``, never a ``bool``) as a builtin ``float``.

    Args:
        lo: Smallest value allowed (excluded when ``lo_open``).
        hi: Largest value allowed (included).
        allow_inf: Whether ``math.inf`` is allowed (``hi`` must then be ``math.inf``).

    Raises:
        error: A ``bool``, another type, an ``int`` too large for a float, NaN, an
            infinity (unless ``allow_inf``), or a value out of range.
    """
    kind = "number" if allow_inf else "finite number"
    if hi == math.inf:
        allowed = f"must be a {kind} {'>' if lo_open else '>='} {lo:g}"
    else:
        allowed = f"must be a {kind} in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise error(name, value, allowed)
    try:
        number = float(value)
    except OverflowError:
        raise error(name, value, allowed) from None
    if math.isnan(number) or (math.isinf(number) and not allow_inf):
        raise error(name, value, allowed)
    if number < lo or (lo_open and number == lo) or number > hi:
        raise error(name, value, allowed)
    return number


def check_plain(name: str, value: object, error: ErrorType, _depth: int = 0) -> None:
    """Check that ``value`` is plain data the wire carries: ``None``, ``bool``, a 64-bit
    ``int``, ``float``, ``str``, or lists/tuples/dicts (``str`` keys) of those.

    Raises:
        error: Anything else (the value is named by ``name``, a dotted path).
    """
    if _depth > _PLAIN_DEPTH:
        raise error(name, "...", f"nests deeper than {_PLAIN_DEPTH} levels")
    if value is None or isinstance(value, bool | float | str):
        return
    if isinstance(value, int):
        check_int(name, value, error)
        return
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            check_plain(f"{name}[{i}]", item, error, _depth + 1)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise error(name, key, "keys must be strings")
            check_plain(f"{name}.{key}", item, error, _depth + 1)
        return
    raise error(
        name,
        type(value).__name__,
        "must be plain data (None, bool, int, float, str, list, dict with str keys)",
    )


def redact(value: Any, key: str = "") -> Any:
    """``value`` with secrets replaced by ``"***"``: the values of secret-looking keys
    (:data:`SECRET_KEY`, at any depth) and the user info of URLs (``redis://:pw@host``)."""
    if key and SECRET_KEY.search(key):
        return "***"
    if isinstance(value, Mapping):
        return {k: redact(v, str(k)) for k, v in value.items()}
    if isinstance(value, list | tuple):
        items = [redact(v) for v in value]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, str):
        return _URL_USERINFO.sub(r"\g<scheme>***@", value)
    return value
