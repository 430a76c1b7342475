"""The redis connector's options, validated once from ``EngineConfig.connector_options``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from pipeline.errors import InvalidConfigError

__all__ = ["REDIS_OPTIONS", "RedisOptions"]

REDIS_OPTIONS = (
    "url",
    "password",
    "tls",
    "key_prefix",
    "ttl_s",
    "pool_size",
    "timeout_s",
    "load_timeout_s",
)
"""Every option the redis connector accepts."""

_SCHEMES = ("redis://", "rediss://", "unix://")


def _name(option: str) -> str:
    return f"connector_options[{option!r}]"


def _number(option: str, value: object) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
        raise InvalidConfigError(_name(option), value, "must be a number > 0")
    return float(value)


@attrs.frozen(kw_only=True)
class RedisOptions:
    """What the redis connector was configured with.

    Attributes:
        url: The server, ``redis://host:port/db`` (``rediss://`` for TLS, ``unix://``).
        password: Sent with AUTH when set (overrides a password in the URL).
        tls: Connect with TLS (``rediss://`` implies it).
        key_prefix: Prepended to every key (``prefix + fingerprint + ":" + hash hex``).
        ttl_s: Expiry of every stored value in seconds, or ``None`` (never expires).
        pool_size: Connections per client (each half has one client).
        timeout_s: Socket timeout of the scheduler half's lookups. They run on the event
            loop thread, so keep it short: a slow or dead server is a miss.
        load_timeout_s: Socket timeout of the worker half's reads and writes, and the
            longest a step's forward pass waits for its loads before they count as
            failed (and are recomputed).
    """

    url: str
    password: str | None = None
    tls: bool = False
    key_prefix: str = "kvstep:"
    ttl_s: float | None = None
    pool_size: int = 8
    timeout_s: float = 0.1
    load_timeout_s: float = 5.0

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
            InvalidConfigError: An unknown option, a missing or malformed ``url``, or a
                value of the wrong type or range; the message names the option.
        """
        unknown = sorted(set(options) - set(REDIS_OPTIONS))
        if unknown:
            raise InvalidConfigError(
                "connector_options", unknown[0], f"redis accepts {', '.join(REDIS_OPTIONS)}"
            )
        url = options.get("url")
        if not isinstance(url, str) or not url.startswith(_SCHEMES):
            raise InvalidConfigError(
                _name("url"), url, "required: a URL starting with " + " | ".join(_SCHEMES)
            )
        password = options.get("password")
        if password is not None and not isinstance(password, str):
            raise InvalidConfigError(_name("password"), password, "must be a string or None")
        tls = options.get("tls", False)
        if not isinstance(tls, bool):
            raise InvalidConfigError(_name("tls"), tls, "must be true or false")
        if tls and url.startswith("unix://"):
            raise InvalidConfigError(_name("tls"), tls, "needs a redis:// or rediss:// url")
        prefix = options.get("key_prefix", "kvstep:")
        if not isinstance(prefix, str):
            raise InvalidConfigError(_name("key_prefix"), prefix, "must be a string")
        ttl = options.get("ttl_s")
        pool_size = options.get("pool_size", 8)
        if not isinstance(pool_size, int) or isinstance(pool_size, bool) or pool_size < 1:
            raise InvalidConfigError(_name("pool_size"), pool_size, "must be an integer > 0")
        return cls(
            url=url,
            password=password,
            tls=tls or url.startswith("rediss://"),
            key_prefix=prefix,
            ttl_s=None if ttl is None else _number("ttl_s", ttl),
            pool_size=pool_size,
            timeout_s=_number("timeout_s", options.get("timeout_s", 0.1)),
            load_timeout_s=_number("load_timeout_s", options.get("load_timeout_s", 5.0)),
        )
