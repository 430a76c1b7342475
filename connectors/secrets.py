"""Secrets of the connectors (a redis password, an HMAC key), read from the environment
or a file and never shown.

A :class:`Secret` holds the value; its ``repr``/``str`` are ``"<hidden>"``, so a secret
inside options, a connector, a log event or an error message prints as ``<hidden>``.
The value is only reachable through :meth:`Secret.reveal`, at the one place that sends it
(the redis client, the HMAC). Errors about a secret option name the option and the
variable or file, never the value.
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path

from connectors.options import option_name
from pipeline.errors import InvalidConfigError

__all__ = ["Secret", "option_name", "secret_from_env", "secret_from_file"]

_HIDDEN = "<hidden>"


class Secret:
    """A secret string; prints as ``<hidden>`` everywhere (repr, str, format).

    Two secrets compare equal when their values are equal (constant-time compare).
    """

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        """The value itself; call it only where the secret is used."""
        return self._value

    def __repr__(self) -> str:
        return _HIDDEN

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return _HIDDEN

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Secret):
            return NotImplemented
        return hmac.compare_digest(self._value.encode(), other._value.encode())

    def __hash__(self) -> int:
        return hash(Secret)

    def __reduce__(self) -> tuple[object, ...]:
        raise TypeError("a Secret is not pickled; pass the option (env var / file) instead")


def _env_name(option: str, name: object) -> str:
    if not isinstance(name, str) or not name or "=" in name or "\0" in name:
        raise InvalidConfigError(
            option_name(option), name, "must be the name of an environment variable"
        )
    return name


def secret_from_env(option: str, name: object) -> Secret:
    """The value of the environment variable ``name`` (option ``option`` names it).

    Raises:
        InvalidConfigError: ``name`` is not a variable name, or the variable is unset or
            empty. The message names the option and the variable, never a value.
    """
    var = _env_name(option, name)
    value = os.environ.get(var, "")
    if not value:
        raise InvalidConfigError(
            option_name(option), var, f"environment variable {var} is not set or empty"
        )
    return Secret(value)


def secret_from_file(option: str, path: object) -> Secret:
    """The content of the file at ``path`` (one trailing newline dropped).

    Raises:
        InvalidConfigError: Not a path, unreadable, not UTF-8, or empty. The message names
            the option and the path, never the content.
    """
    if not isinstance(path, (str, Path)) or not str(path):
        raise InvalidConfigError(option_name(option), path, "must be the path of a file")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = f"could not be read ({type(exc).__name__})"
        raise InvalidConfigError(option_name(option), str(path), reason) from None
    value = text[:-1] if text.endswith("\n") else text
    value = value[:-1] if value.endswith("\r") else value
    if not value:
        raise InvalidConfigError(option_name(option), str(path), "the file is empty")
    return Secret(value)
