"""The redis connector's options, validated once from ``EngineConfig.connector_options``."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import attrs

from connectors.integrity import FrameSigner
from connectors.secrets import Secret, secret_from_env, secret_from_file
from pipeline.checks import check_float, check_int
from pipeline.errors import InvalidConfigError

__all__ = ["REDIS_OPTIONS", "RedisOptions"]

REDIS_OPTIONS = (
    "url",
    "password_env",
    "password_file",
    "tls",
    "key_prefix",
    "ttl_s",
    "pool_size",
    "timeout_s",
    "load_timeout_s",
    "hmac_key_env",
)
"""Every option the redis connector accepts."""

DEFAULT_TTL_S: float | None = 86400.0
"""The default ``ttl_s``: a day. A stored block reveals its prompt to whoever can read
the server, and a server without an eviction policy would fill up, so values expire
unless ``ttl_s=None`` is asked for (then bound the server with ``maxmemory`` and
``maxmemory-policy allkeys-lru``)."""

_SCHEMES = ("redis://", "rediss://", "unix://")


def _name(option: str) -> str:
    return f"connector_options[{option!r}]"


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


def _password(options: Mapping[str, Any]) -> Secret | None:
    """The password from ``password_env`` or ``password_file`` (at most one)."""
    if "password" in options:
        raise InvalidConfigError(
            _name("password"),
            "<hidden>",
            "a password is never given literally (it would show in configs and logs): "
            "use password_env (an environment variable's name) or password_file (a path)",
        )
    env, path = options.get("password_env"), options.get("password_file")
    if env is not None and path is not None:
        raise InvalidConfigError(
            _name("password_file"), path, "give password_env or password_file, not both"
        )
    if env is not None:
        return secret_from_env("password_env", env)
    if path is not None:
        return secret_from_file("password_file", path)
    return None


def _number(option: str, value: object) -> float:
    return check_float(
        _name(option), value, InvalidConfigError, lo=0.0, hi=math.inf, lo_open=True, allow_inf=True
    )


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

    url: str
    password_env: str | None = None
    password_file: str | None = None
    password: Secret | None = attrs.field(default=None, eq=False)
    tls: bool = False
    key_prefix: str = "kvstep:"
    ttl_s: float | None = DEFAULT_TTL_S
    pool_size: int = 8
    timeout_s: float = 0.1
    load_timeout_s: float = 5.0
    hmac_key_env: str | None = None
    signer: FrameSigner | None = attrs.field(default=None, eq=False)

    @property
    def client_url(self) -> str:
        """``url`` with the ``rediss://`` scheme when ``tls`` is set."""
        if self.tls and self.url.startswith("redis://"):
            return "rediss://" + self.url[len("redis://") :]
        return self.url

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> RedisOptions:
        """Validate ``options`` (``EngineConfig.connector_options``).

        Raises:
            InvalidConfigError: An unknown option, a missing or malformed ``url``, a
                password in the URL or as ``password``, an unset or empty
                ``password_env``/``hmac_key_env`` variable, an unreadable
                ``password_file``, or a value of the wrong type or range; the message
                names the option, never a secret.
        """
        unknown = sorted(set(options) - set(REDIS_OPTIONS) - {"password"})
        if unknown:
            raise InvalidConfigError(
                "connector_options", unknown[0], f"redis accepts {', '.join(REDIS_OPTIONS)}"
            )
        url = options.get("url")
        if not isinstance(url, str) or not url.startswith(_SCHEMES):
            shown = _redacted(url) if isinstance(url, str) else url
            raise InvalidConfigError(
                _name("url"), shown, "required: a URL starting with " + " | ".join(_SCHEMES)
            )
        if _redacted(url) != url:
            raise InvalidConfigError(
                _name("url"), _redacted(url), "no password in the URL: use password_env"
            )
        password = _password(options)
        key_env = options.get("hmac_key_env")
        signer = None if key_env is None else FrameSigner.from_env("hmac_key_env", key_env)
        tls = options.get("tls", False)
        if not isinstance(tls, bool):
            raise InvalidConfigError(_name("tls"), tls, "must be true or false")
        if tls and url.startswith("unix://"):
            raise InvalidConfigError(_name("tls"), tls, "needs a redis:// or rediss:// url")
        prefix = options.get("key_prefix", "kvstep:")
        if not isinstance(prefix, str):
            raise InvalidConfigError(_name("key_prefix"), prefix, "must be a string")
        ttl = options.get("ttl_s", DEFAULT_TTL_S)
        pool_size = check_int(
            _name("pool_size"), options.get("pool_size", 8), InvalidConfigError, lo=1
        )
        return cls(
            url=url,
            password_env=options.get("password_env"),
            password_file=None
            if options.get("password_file") is None
            else str(options["password_file"]),
            password=password,
            tls=tls or url.startswith("rediss://"),
            key_prefix=prefix,
            ttl_s=None if ttl is None else _number("ttl_s", ttl),
            pool_size=pool_size,
            timeout_s=_number("timeout_s", options.get("timeout_s", 0.1)),
            load_timeout_s=_number("load_timeout_s", options.get("load_timeout_s", 5.0)),
            hmac_key_env=key_env,
            signer=signer,
        )
