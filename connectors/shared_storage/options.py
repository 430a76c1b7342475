"""The shared_storage connector's options, validated once from ``connector_options``."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from pipeline.errors import InvalidConfigError

__all__ = ["SHARED_STORAGE_OPTIONS", "SharedStorageOptions"]

SHARED_STORAGE_OPTIONS = ("path", "max_bytes", "load_timeout_s", "stale_temp_s")
"""Every option the shared_storage connector accepts."""


def _positive(name: str, value: object, kind: type) -> Any:
    ok = isinstance(value, (int, float) if kind is float else int)
    if not ok or isinstance(value, bool) or value <= 0:  # type: ignore[operator]
        what = "a number > 0" if kind is float else "an integer > 0"
        raise InvalidConfigError(f"connector_options[{name!r}]", value, f"must be {what}")
    return kind(value)


@attrs.frozen(kw_only=True)
class SharedStorageOptions:
    """What the shared_storage connector was configured with.

    Attributes:
        path: The store's root directory (created if missing); may be shared by several
            engines, on one machine or a shared filesystem.
        max_bytes: Size cap of the whole store; past it, the least recently accessed
            values (file access time, refreshed on every load) are evicted after a
            step's writes. ``None``: no cap. Approximate when several engines write.
        load_timeout_s: Deadline of one step's loads, from ``start_load_kv``; blocks not
            loaded by then are load errors (recomputed) and the reader is abandoned.
        stale_temp_s: Temp files older than this (or of a dead process on this machine)
            are removed when a worker starts.
    """

    path: Path
    max_bytes: int | None = None
    load_timeout_s: float = 30.0
    stale_temp_s: float = 300.0

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> SharedStorageOptions:
        """Validate ``options`` (``EngineConfig.connector_options``).

        Raises:
            InvalidConfigError: An unknown option, no ``path``, or a bad value.
        """
        unknown = sorted(set(options) - set(SHARED_STORAGE_OPTIONS))
        if unknown:
            allowed = ", ".join(SHARED_STORAGE_OPTIONS)
            raise InvalidConfigError(
                "connector_options", unknown[0], f"shared_storage accepts {allowed}"
            )
        path = options.get("path")
        if not isinstance(path, (str, Path)) or not str(path):
            raise InvalidConfigError(
                "connector_options['path']", path, "shared_storage needs a directory path"
            )
        max_bytes = options.get("max_bytes")
        return cls(
            path=Path(path),
            max_bytes=None if max_bytes is None else _positive("max_bytes", max_bytes, int),
            load_timeout_s=_positive("load_timeout_s", options.get("load_timeout_s", 30.0), float),
            stale_temp_s=_positive("stale_temp_s", options.get("stale_temp_s", 300.0), float),
        )
