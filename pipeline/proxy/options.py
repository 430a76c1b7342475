"""``ProxyOptions``: the backends of ``kvstep proxy`` and its upstream limits, checked once."""

from __future__ import annotations

import math
from typing import Any
from urllib.parse import urlsplit

import attrs

from pipeline.checks import check_float, check_int
from pipeline.errors import InvalidConfigError

__all__ = ["ProxyOptions"]

_MIB = 1024 * 1024


def _urls(instance: Any, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, tuple) or not value:
        raise InvalidConfigError(attribute.name, value, "must list at least one backend URL")
    for url in value:
        parts = urlsplit(url) if isinstance(url, str) else None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidConfigError(attribute.name, url, "must be an http:// or https:// URL")
        if parts.query or parts.fragment or parts.username or parts.password:
            raise InvalidConfigError(
                attribute.name, "<url>", "must not carry a query, fragment or credentials"
            )
    if len(set(value)) != len(value):
        raise InvalidConfigError(attribute.name, value, "must not list a URL twice")


def _seconds(instance: Any, attribute: attrs.Attribute[Any], value: object) -> None:
    check_float(attribute.name, value, InvalidConfigError, lo=0.0, hi=math.inf, lo_open=True)


def _bytes(instance: Any, attribute: attrs.Attribute[Any], value: object) -> None:
    check_int(attribute.name, value, InvalidConfigError, lo=1024)


def _url_tuple(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(u.rstrip("/") if isinstance(u, str) else u for u in value)
    return value


@attrs.frozen(kw_only=True)
class ProxyOptions:
    """Where ``kvstep proxy`` sends requests and how long it waits; immutable.

    Attributes:
        prefill: Base URLs of the producer (prefill) servers (``http://host:port``).
        decode: Base URLs of the consumer (decode) servers.
        health_interval_s: Seconds between two polls of every backend's ``/health``.
        health_timeout_s: The longest one ``/health`` poll may take (then it failed).
        connect_timeout_s: The longest a connection to a backend may take to open; a
            request whose connection fails is retried once on another backend.
        upstream_timeout_s: The longest a backend may stay silent while answering (the
            producer's whole answer; each chunk of the consumer's).
        max_response_bytes: The largest producer answer (and non-streamed consumer
            answer) the proxy reads; past it the request fails with 502.
    """

    prefill: tuple[str, ...] = attrs.field(converter=_url_tuple, validator=_urls)
    decode: tuple[str, ...] = attrs.field(converter=_url_tuple, validator=_urls)
    health_interval_s: float = attrs.field(default=5.0, validator=_seconds)
    health_timeout_s: float = attrs.field(default=2.0, validator=_seconds)
    connect_timeout_s: float = attrs.field(default=5.0, validator=_seconds)
    upstream_timeout_s: float = attrs.field(default=600.0, validator=_seconds)
    max_response_bytes: int = attrs.field(default=16 * _MIB, validator=_bytes)
