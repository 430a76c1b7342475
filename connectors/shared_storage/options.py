"""The shared_storage connector's options, validated once from ``connector_options``."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from connectors.integrity import FrameSigner
from pipeline.checks import check_float, check_int
from pipeline.errors import InvalidConfigError

__all__ = ["SHARED_STORAGE_OPTIONS", "SharedStorageOptions"]

SHARED_STORAGE_OPTIONS = (
    "path",
    "max_bytes",
    "load_timeout_s",
    "stale_temp_s",
    "allow_shared",
    "hmac_key_env",
)
"""Every option the shared_storage connector accepts."""


def _positive(name: str, value: object, kind: type) -> Any:
    field = f"connector_options[{name!r}]"
    if kind is int:
        return check_int(field, value, InvalidConfigError, lo=1)
    return check_float(
        field, value, InvalidConfigError, lo=0.0, hi=math.inf, lo_open=True, allow_inf=True
    )


@attrs.frozen(kw_only=True)
class SharedStorageOptions:
    """What the shared_storage connector was configured with.

    **Security.** The KV of a prompt reveals the prompt, and a file's name reveals which
    prompt prefix it holds to anyone who can compute the chained block hash:

    - The store is private by default: directories ``0700``, files ``0600``; a root
      another user owns or that group/others may write is refused unless
      ``allow_shared``.
    - Keys (file names) are the chained hashes of the token ids from
      ``EngineConfig.hash_seed``. With the default, public seed ``0`` anyone who can
      list the directory can test whether some prompt was sent (hash it and look for
      the file). A **secret** ``hash_seed`` (a random 64-bit integer, the same on every
      engine sharing the store, kept out of logs like a password) makes the keys
      unguessable.
    - Anyone who can write to the store can plant well-formed KV (CRC32 detects
      corruption, not forgery). With ``hmac_key_env`` every value is signed with
      HMAC-SHA256 (:mod:`connectors.integrity`) and an unsigned or forged value is a
      load error (recomputed).

    Attributes:
        path: The store's root directory (created if missing); may be shared by several
            engines, on one machine or a shared filesystem.
        max_bytes: Size cap of the whole store; past it, the least recently accessed
            values (file access time, refreshed on every load) are evicted after a
            step's writes. ``None``: no cap. Approximate when several engines write.
        load_timeout_s: Deadline of one step's loads, from ``start_load_kv``; blocks not
            loaded by then are load errors (recomputed) and the reader is abandoned.
        stale_temp_s: Temp files older than this (or of a dead process on this machine)
            are removed when a worker starts; another host's temp files by age only.
        allow_shared: Accept a root owned by another user or writable by group/others,
            and create group-accessible directories (``0770``) and files (``0660``).
            Default ``False``.
        hmac_key_env: The name of an environment variable holding the HMAC key (use
            32 random bytes or more, e.g. ``openssl rand -hex 32``; the same on every
            engine sharing the store). ``None`` (default): CRC32 only.
        signer: The signer of that key (never shown in a repr).
    """

    path: Path
    max_bytes: int | None = None
    load_timeout_s: float = 30.0
    stale_temp_s: float = 300.0
    allow_shared: bool = False
    hmac_key_env: str | None = None
    signer: FrameSigner | None = attrs.field(default=None, eq=False)

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> SharedStorageOptions:
        """Validate ``options`` (``EngineConfig.connector_options``).

        Raises:
            InvalidConfigError: An unknown option, no ``path``, a bad value, or an
                ``hmac_key_env`` variable that is unset or empty.
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
        allow_shared = options.get("allow_shared", False)
        if not isinstance(allow_shared, bool):
            raise InvalidConfigError(
                "connector_options['allow_shared']", allow_shared, "must be true or false"
            )
        key_env = options.get("hmac_key_env")
        signer = None if key_env is None else FrameSigner.from_env("hmac_key_env", key_env)
        return cls(
            path=Path(path),
            max_bytes=None if max_bytes is None else _positive("max_bytes", max_bytes, int),
            load_timeout_s=_positive("load_timeout_s", options.get("load_timeout_s", 30.0), float),
            stale_temp_s=_positive("stale_temp_s", options.get("stale_temp_s", 300.0), float),
            allow_shared=allow_shared,
            hmac_key_env=key_env,
            signer=signer,
        )
