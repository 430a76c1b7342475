"""``TransferKey``: the secret that producers and consumers of KV share.

Every side-channel message between two engines (a peer's agent metadata and cache
addresses, the claim of a request's blocks) is authenticated with HMAC-SHA256 under
this key, so a process that does not hold it learns nothing of an engine's memory and
can claim nothing.

Where the key comes from (``connector_options``):

- ``transfer_key_env``: the name of an environment variable holding it (any string of
  at least 16 characters, e.g. ``openssl rand -hex 32``); engines on several hosts share
  it this way (CLI: ``--kv-transfer-key-env NAME``);
- by default, a per-user key file, ``nixl-transfer.key`` in kvstep's cache directory
  (``$KVSTEP_CACHE_DIR`` or ``~/.cache/kvstep``): 32 random bytes, created ``0600`` on
  first use. Two engines of one user on one host thus share a key with no option at
  all; another user's engine, or another host's, does not have it. A key file that
  another user owns, that group or others can read, or that is a symlink, is refused.

The key's repr is ``<hidden>``; errors name the variable or the file, never the key.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

from connectors.secrets import secret_from_env
from pipeline.errors import InvalidConfigError

__all__ = ["KEY_FILE_NAME", "MIN_KEY_CHARS", "TransferKey", "default_key_path"]

KEY_FILE_NAME = "nixl-transfer.key"
"""The default key's file name in kvstep's cache directory."""
MIN_KEY_CHARS = 16
"""Shortest key accepted from an environment variable."""
_KEY_BYTES = 32


def default_key_path() -> Path:
    """``$KVSTEP_CACHE_DIR/nixl-transfer.key`` (else under ``~/.cache/kvstep``)."""
    root = os.environ.get("KVSTEP_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "kvstep") / KEY_FILE_NAME


class TransferKey:
    """An HMAC-SHA256 key; :meth:`sign` and :meth:`verify` are all it does.

    Build one with :meth:`from_env` or :meth:`default`. Thread-safe (immutable).
    """

    __slots__ = ("_key", "source")

    def __init__(self, key: bytes, source: str) -> None:
        self._key = key
        self.source = source  # where it came from ("env:NAME", "file:PATH"), not the key

    def __repr__(self) -> str:
        return f"TransferKey(<hidden>, source={self.source!r})"

    def sign(self, *parts: bytes) -> bytes:
        """The MAC of ``parts`` (length-prefixed: no two part lists sign alike)."""
        mac = hmac.new(self._key, digestmod=hashlib.sha256)
        for part in parts:
            mac.update(len(part).to_bytes(8, "big"))
            mac.update(part)
        return mac.digest()

    def verify(self, mac: bytes, *parts: bytes) -> bool:
        """Whether ``mac`` is :meth:`sign` of ``parts`` (constant time)."""
        return hmac.compare_digest(mac, self.sign(*parts))

    @classmethod
    def from_env(cls, option: str, name: object) -> TransferKey:
        """The key in the environment variable ``name``.

        Raises:
            InvalidConfigError: ``name`` is not a variable name, the variable is unset,
                or shorter than :data:`MIN_KEY_CHARS`; the message names the option and
                the variable, never the value.
        """
        secret = secret_from_env(option, name)
        value = secret.reveal()
        if len(value) < MIN_KEY_CHARS:
            raise InvalidConfigError(
                f"connector_options[{option!r}]",
                name,
                f"the key in ${name} must be at least {MIN_KEY_CHARS} characters",
            )
        return cls(hashlib.sha256(value.encode()).digest(), f"env:{name}")

    @classmethod
    def default(cls, path: Path | None = None) -> TransferKey:
        """This user's key file (:func:`default_key_path`), made if missing.

        Raises:
            InvalidConfigError: The file is a symlink, not a regular file, owned by
                another user, readable by group or others, or not 32 bytes; or it
                cannot be made.
        """
        path = default_key_path() if path is None else path
        field = "nixl transfer key file"
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            if not os.path.lexists(path):
                _create(path)
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as exc:
            raise InvalidConfigError(field, str(path), f"cannot be used ({exc})") from None
        with os.fdopen(fd, "rb") as src:
            info = os.fstat(src.fileno())
            key = src.read(_KEY_BYTES + 1)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            raise InvalidConfigError(field, str(path), "must be a regular file of this user")
        if info.st_mode & 0o077:
            raise InvalidConfigError(field, str(path), "must not be readable by group or others")
        if len(key) != _KEY_BYTES:
            raise InvalidConfigError(field, str(path), f"must hold {_KEY_BYTES} bytes")
        return cls(key, f"file:{path}")


def _create(path: Path) -> None:
    """Write a fresh key next to ``path`` and link it there: a concurrent first use
    finds either no file or a whole one, and the first link wins."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(secrets.token_bytes(_KEY_BYTES))
        with contextlib.suppress(FileExistsError):  # another first use linked first
            os.link(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
