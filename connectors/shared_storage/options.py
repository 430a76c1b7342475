"""The shared_storage connector's options, validated once from ``connector_options``."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from connectors.integrity import FrameSigner
from connectors.options import (
    derived,
    flag,
    option,
    option_names,
    optional,
    parse_options,
    positive_int,
    positive_number,
)
from pipeline.errors import InvalidConfigError

__all__ = ["SHARED_STORAGE_OPTIONS", "SharedStorageOptions"]


def _directory(name: str, value: object) -> Path:
    if not isinstance(value, str | Path) or not str(value):
        raise InvalidConfigError(name, value, "shared_storage needs a directory path")
    return Path(value)


def _key_env(name: str, value: object) -> object:
    """Kept as given: :meth:`~connectors.integrity.FrameSigner.from_env` checks it."""
    return value


def _signer(options: SharedStorageOptions) -> FrameSigner | None:
    key_env = options.hmac_key_env
    return None if key_env is None else FrameSigner.from_env("hmac_key_env", key_env)


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

    path: Path = option(_directory)
    max_bytes: int | None = option(optional(positive_int), default=None)
    load_timeout_s: float = option(positive_number, default=30.0)
    stale_temp_s: float = option(positive_number, default=300.0)
    allow_shared: bool = option(flag, default=False)
    hmac_key_env: str | None = option(_key_env, default=None)
    signer: FrameSigner | None = derived(_signer, eq=False)

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> SharedStorageOptions:
        """Validate ``options`` (``EngineConfig.connector_options``); once, when a half
        is built.

        Raises:
            InvalidConfigError: An unknown option, no ``path``, a bad value, or an
                ``hmac_key_env`` variable that is unset or empty.
        """
        return parse_options(cls, options, connector="shared_storage")


SHARED_STORAGE_OPTIONS = option_names(SharedStorageOptions)
"""Every option the shared_storage connector accepts."""
