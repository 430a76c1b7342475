"""The redis connector's options, validated once from ``EngineConfig.connector_options``."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import attrs

from connectors.integrity import FrameSigner
from connectors.options import (
    derived,
    flag,
    option,
    option_name,
    option_names,
    optional,
    parse_options,
    positive_int,
    positive_number,
    string,
)
from connectors.secrets import Secret, secret_from_env, secret_from_file
from pipeline.errors import InvalidConfigError

__all__ = ["REDIS_OPTIONS", "RedisOptions"]

DEFAULT_TTL_S: float | None = 86400.0
"""The default ``ttl_s``: a day. A stored block reveals its prompt to whoever can read
the server, and a server without an eviction policy would fill up, so values expire
unless ``ttl_s=None`` is asked for (then bound the server with ``maxmemory`` and
``maxmemory-policy allkeys-lru``)."""

_SCHEMES = ("redis://", "rediss://", "unix://")


def _redacted(url: str) -> str:
    """``url`` with the password of its userinfo (if any) replaced by ``***``."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        user = parts.username or ""
        host = parts.netloc.rpartition("@")[2]
        return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))
    except ValueError:
        return "<unparsable url>"


def _url(name: str, value: object) -> str:
    if not isinstance(value, str) or not value.startswith(_SCHEMES):
        shown = _redacted(value) if isinstance(value, str) else value
        raise InvalidConfigError(
            name, shown, "required: a URL starting with " + " | ".join(_SCHEMES)
        )
    if _redacted(value) != value:
        raise InvalidConfigError(name, _redacted(value), "no password in the URL: use password_env")
    return value


def _env_var(name: str, value: object) -> object:
    """Kept as given: :func:`~connectors.secrets.secret_from_env` checks the name when the
    derived field reads the variable."""
    return value


def _file_path(name: str, value: object) -> str:
    if not isinstance(value, str | Path) or not str(value):
        raise InvalidConfigError(name, value, "must be the path of a file")
    return str(value)


def _password(options: RedisOptions) -> Secret | None:
    """The password from ``password_env`` or ``password_file`` (at most one)."""
    env, path = options.password_env, options.password_file
    if env is not None and path is not None:
        raise InvalidConfigError(
            option_name("password_file"), path, "give password_env or password_file, not both"
        )
    if env is not None:
        return secret_from_env("password_env", env)
    if path is not None:
        return secret_from_file("password_file", path)
    return None


def _tls(name: str, value: object, options: RedisOptions) -> bool:
    """``tls``; a ``rediss://`` URL turns it on, a ``unix://`` one refuses it."""
    tls = flag(name, value)
    if tls and options.url.startswith("unix://"):
        raise InvalidConfigError(name, tls, "needs a redis:// or rediss:// url")
    return tls or options.url.startswith("rediss://")


def _signer(options: RedisOptions) -> FrameSigner | None:
    key_env = options.hmac_key_env
    return None if key_env is None else FrameSigner.from_env("hmac_key_env", key_env)


@attrs.frozen(kw_only=True)
class RedisOptions:
    """What the redis connector was configured with.

    **Secrets.** The password is never an option value (it would show in configs, logs
    and ``/health``): ``password_env`` names an environment variable and
    ``password_file`` a file (its content, one trailing newline dropped) holding it; a
    literal ``password`` option, or a password inside ``url``, is refused. The password
    is held as a :class:`~connectors.secrets.Secret` (prints as ``<hidden>``) and sent
    only to the server (AUTH). ``hmac_key_env`` likewise names the variable of an HMAC
    key that signs every value (:mod:`connectors.integrity`): then anyone who can write
    to the server without the key cannot plant KV; an unsigned or forged value is a load
    error (recomputed).

    Attributes:
        url: The server, ``redis://[user@]host:port/db`` (``rediss://`` for TLS,
            ``unix://``); no password in it.
        password_env: The name of the environment variable holding the password
            (AUTH), or ``None``.
        password_file: The path of a file holding the password, or ``None``.
        password: The password read from either (prints as ``<hidden>``), or ``None``.
        tls: Connect with TLS (``rediss://`` implies it).
        key_prefix: Prepended to every key (``prefix + fingerprint + ":" + hash hex``).
        ttl_s: Expiry of every stored value in seconds. Default :data:`DEFAULT_TTL_S`
            (a day); ``None``: values never expire (bound the server's memory with
            ``maxmemory`` and ``maxmemory-policy allkeys-lru``).
        pool_size: Connections per client (each half has one client).
        timeout_s: Socket timeout of the scheduler half's lookups. They run on the event
            loop thread, so keep it short: a slow or dead server is a miss.
        load_timeout_s: Socket timeout of the worker half's reads and writes, and the
            longest a step's forward pass waits for its loads before they count as
            failed (and are recomputed).
        hmac_key_env: The name of the environment variable holding the HMAC key, or
            ``None`` (default: CRC32 only).
        signer: The signer of that key (prints as ``FrameSigner(<hidden>)``).
    """

    url: str = option(_url)
    password_env: str | None = option(_env_var, default=None)
    password_file: str | None = option(optional(_file_path), default=None)
    password: Secret | None = derived(_password, eq=False)
    tls: bool = option(_tls, default=False, takes_self=True)
    key_prefix: str = option(string, default="kvstep:")
    ttl_s: float | None = option(optional(positive_number), default=DEFAULT_TTL_S)
    pool_size: int = option(positive_int, default=8)
    timeout_s: float = option(positive_number, default=0.1)
    load_timeout_s: float = option(positive_number, default=5.0)
    hmac_key_env: str | None = option(_env_var, default=None)
    signer: FrameSigner | None = derived(_signer, eq=False)

    @property
    def client_url(self) -> str:
        """``url`` with the ``rediss://`` scheme when ``tls`` is set."""
        if self.tls and self.url.startswith("redis://"):
            return "rediss://" + self.url[len("redis://") :]
        return self.url

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> RedisOptions:
        """Validate ``options`` (``EngineConfig.connector_options``); once, when a half
        is built.

        Raises:
            InvalidConfigError: An unknown option, a missing or malformed ``url``, a
                password in the URL or as ``password``, an unset or empty
                ``password_env``/``hmac_key_env`` variable, an unreadable
                ``password_file``, or a value of the wrong type or range; the message
                names the option, never a secret.
        """
        if isinstance(options, Mapping) and "password" in options:
            raise InvalidConfigError(
                option_name("password"),
                "<hidden>",
                "a password is never given literally (it would show in configs and logs): "
                "use password_env (an environment variable's name) or password_file (a path)",
            )
        return parse_options(cls, options, connector="redis")


REDIS_OPTIONS = option_names(RedisOptions)
"""Every option the redis connector accepts."""
