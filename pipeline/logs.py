"""The library's logger: structlog's ``kvstep`` logger, never configured by kvstep.

structlog, left unconfigured, prints every level to stdout. A library must not decide
an application's logging, so kvstep does not configure structlog; instead its
*debug* events (per request, per step) are emitted only once the application has
configured structlog, where its own level filter then applies. Info and above always go
through, rendered however the application (or structlog's default) renders them.
"""

from __future__ import annotations

from typing import Any

import structlog

__all__ = ["KvstepLogger", "get_logger"]

LOGGER_NAME = "kvstep"


class KvstepLogger:
    """A thin view of ``structlog.get_logger("kvstep")`` with a quiet ``debug``."""

    __slots__ = ("_log",)

    def __init__(self) -> None:
        self._log = structlog.get_logger(LOGGER_NAME)

    def debug(self, event: str, **fields: Any) -> None:
        if structlog.is_configured():
            self._log.debug(event, **fields)

    def info(self, event: str, **fields: Any) -> None:
        self._log.info(event, **fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._log.warning(event, **fields)

    def error(self, event: str, **fields: Any) -> None:
        self._log.error(event, **fields)

    def exception(self, event: str, **fields: Any) -> None:
        self._log.exception(event, **fields)


def get_logger() -> KvstepLogger:
    """The ``kvstep`` logger (safe to call at import time; nothing is configured)."""
    return KvstepLogger()
