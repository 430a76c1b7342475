"""The library's logger: kvstep's events, routed to whatever logging the application set up.

kvstep never configures logging (it never calls ``structlog.configure()`` nor adds a
handler other than a :class:`logging.NullHandler`). Each event goes, decided per call:

* through **structlog** (``structlog.get_logger("kvstep")``) when the application has
  configured structlog (``structlog.is_configured()``); its processors and level filter
  apply;
* otherwise through the **standard library** logger ``logging.getLogger("kvstep")``, which
  carries a ``NullHandler``: an application that configured nothing sees nothing on stdout
  or stderr, one that called ``logging.basicConfig(level=logging.WARNING)`` sees kvstep's
  warnings and errors under the logger name ``kvstep``. The message is
  ``event key='value' ...`` (structlog's contextvars, such as ``step_id`` and ``rank``,
  first); the fields are also on the record as ``record.kvstep`` (a dict with ``event``).
  Nothing is rendered unless the logger is enabled for the level.

Worker processes of the multiproc executor configure nothing either (their events go
nowhere, their failures reach the engine as step errors) unless ``KVSTEP_LOG_LEVEL`` is
set in their environment, as the CLI does (see :func:`configure_cli_logging`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

import structlog

__all__ = [
    "LOGGER_NAME",
    "LOG_LEVEL_ENV",
    "KvstepLogger",
    "cli_logging",
    "configure_cli_logging",
    "debug_enabled",
    "get_logger",
    "std_logger",
]

LOGGER_NAME = "kvstep"
LOG_LEVEL_ENV = "KVSTEP_LOG_LEVEL"
"""Set by the CLI, read by worker processes: the level of their stderr output."""

_STD = logging.getLogger(LOGGER_NAME)
_STD.addHandler(logging.NullHandler())
_is_configured = structlog.is_configured
_get_contextvars = structlog.contextvars.get_contextvars


def std_logger() -> logging.Logger:
    """``logging.getLogger("kvstep")`` (with kvstep's ``NullHandler``)."""
    return _STD


def debug_enabled() -> bool:
    """Whether a debug event would go anywhere (cheap: checked per step on the hot path)."""
    return _is_configured() or _STD.isEnabledFor(logging.DEBUG)


def _render(event: str, data: dict[str, Any]) -> str:
    if not data:
        return event
    return event + " " + " ".join(f"{key}={value!r}" for key, value in data.items())


def _to_stdlib(level: int, event: str, fields: dict[str, Any], exc_info: bool = False) -> None:
    context = _get_contextvars()
    data = {**context, **fields} if context else fields
    _STD.log(
        level,
        _render(event, data),
        exc_info=exc_info,
        stacklevel=4,  # the caller of KvstepLogger's method (through _emit)
        extra={"kvstep": {"event": event, **data}},
    )


class KvstepLogger:
    """kvstep's logger: structlog's ``kvstep`` logger if configured, else stdlib's."""

    __slots__ = ("_log",)

    def __init__(self) -> None:
        self._log = structlog.get_logger(LOGGER_NAME)

    def debug(self, event: str, **fields: Any) -> None:
        self._emit(logging.DEBUG, "debug", event, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._emit(logging.INFO, "info", event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._emit(logging.WARNING, "warning", event, fields)

    def error(self, event: str, **fields: Any) -> None:
        self._emit(logging.ERROR, "error", event, fields)

    def exception(self, event: str, **fields: Any) -> None:
        self._emit(logging.ERROR, "exception", event, fields, exc_info=True)

    def _emit(
        self, level: int, method: str, event: str, fields: dict[str, Any], exc_info: bool = False
    ) -> None:
        if _is_configured():
            getattr(self._log, method)(event, **fields)
        elif _STD.isEnabledFor(level):
            _to_stdlib(level, event, fields, exc_info)


def get_logger() -> KvstepLogger:
    """The ``kvstep`` logger (safe to call at import time; nothing is configured)."""
    return KvstepLogger()


def configure_cli_logging(level: int = logging.INFO, *, prefix: str = "kvstep") -> None:
    """The CLI's readable output: ``kvstep`` events at ``level`` and above on stderr.

    For kvstep's own programs only (``kvstep run``/``serve``, worker processes), never
    called by library code. Adds one stderr handler to the ``kvstep`` logger (not the root
    logger; idempotent) and exports ``KVSTEP_LOG_LEVEL`` so that worker processes started
    afterwards do the same. Leaves structlog unconfigured (where an embedding program
    configured structlog, events go there instead, as everywhere).
    """
    os.environ[LOG_LEVEL_ENV] = logging.getLevelName(level)
    _STD.setLevel(level)
    if any(getattr(h, "_kvstep_cli", False) for h in _STD.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s %(levelname)s {prefix}: %(message)s", "%H:%M:%S")
    )
    handler._kvstep_cli = True  # type: ignore[attr-defined]
    _STD.addHandler(handler)


@contextlib.contextmanager
def cli_logging(level: int = logging.INFO) -> Iterator[None]:
    """:func:`configure_cli_logging` for the block, then the previous state is restored.

    The CLI's commands run inside it, so calling ``kvstep.cli.main`` in-process (tests,
    scripts) leaves the caller's logging as it was.
    """
    handlers, was_level = list(_STD.handlers), _STD.level
    was_env = os.environ.get(LOG_LEVEL_ENV)
    try:
        configure_cli_logging(level)
        yield
    finally:
        for handler in _STD.handlers:
            if handler not in handlers:
                _STD.removeHandler(handler)
        _STD.setLevel(was_level)
        if was_env is None:
            os.environ.pop(LOG_LEVEL_ENV, None)
        else:
            os.environ[LOG_LEVEL_ENV] = was_env
