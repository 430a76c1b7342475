"""``ProxyOptions``: the backends of ``kvstep proxy`` and its upstream limits, checked once."""

from __future__ import annotations

import math
from typing import Any
from urllib.parse import urlsplit

import attrs

from pipeline.checks import INT64_MAX, INT64_MIN, check_float, check_int
from pipeline.errors import InvalidConfigError

__all__ = ["ProxyOptions"]

_MIB = 1024 * 1024


def _urls(instance: Any, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, tuple):
        raise InvalidConfigError(attribute.name, value, "must be a tuple of backend URLs")
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


def _positive(instance: Any, attribute: attrs.Attribute[Any], value: object) -> None:
    check_int(attribute.name, value, InvalidConfigError, lo=1, hi=1 << 31)


def _int64(instance: Any, attribute: attrs.Attribute[Any], value: object) -> None:
    check_int(attribute.name, value, InvalidConfigError, lo=INT64_MIN, hi=INT64_MAX)


def _weight(instance: Any, attribute: attrs.Attribute[Any], value: object) -> None:
    check_float(attribute.name, value, InvalidConfigError, lo=0.0, hi=1e9)


def _hash_format(instance: Any, attribute: attrs.Attribute[Any], value: object) -> None:
    if value not in ("int", "bytes"):
        raise InvalidConfigError(attribute.name, value, "int | bytes")


def _key(instance: Any, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None:
        return
    if (
        not isinstance(value, str)
        or not value
        or len(value) > 512
        or not value.isascii()
        or not value.isprintable()
        or " " in value
    ):  # the value itself is never shown
        raise InvalidConfigError(
            attribute.name, "<hidden>", "must be 1 to 512 printable ASCII characters, no space"
        )


def _url_tuple(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(u.rstrip("/") if isinstance(u, str) else u for u in value)
    return value


#: The routing policies, by their ``--policy`` name.
POLICIES = ("round-robin", "least-loaded", "kv-aware")


def _policy(instance: Any, attribute: attrs.Attribute[Any], value: object) -> None:
    if value not in POLICIES:
        raise InvalidConfigError(attribute.name, value, " | ".join(POLICIES))


@attrs.frozen(kw_only=True)
class ProxyOptions:
    """Where ``kvstep proxy`` sends requests and how long it waits; immutable.

    Either ``backend`` (replicas that serve whole requests) or both ``prefill`` and
    ``decode`` (disaggregated serving), never both.

    Attributes:
        backend: Base URLs of servers that each serve whole requests
            (``http://host:port``): every request goes to one of them.
        prefill: Base URLs of the producer (prefill) servers.
        decode: Base URLs of the consumer (decode) servers.
        policy: How a pool picks among its healthy backends: ``round-robin`` in turn,
            ``least-loaded`` the one with the fewest requests open through this proxy,
            ``kv-aware`` the one that holds the longest prefix of the prompt by its KV
            events, less a load term (:mod:`pipeline.proxy.kv_aware`).
        tokenizer: The model's directory (its ``tokenizer.json``) for the kv-aware
            policy to hash text prompts and chat messages; ``None``: only token-id
            prompts are hashed, the rest routed by load.
        block_size: The replicas' ``block_size`` (kv-aware).
        hash_seed: The replicas' ``hash_seed`` (kv-aware); never in a repr.
        hash_format: The replicas' ``kv_events`` hash format, ``"int"`` or ``"bytes"``.
        load_weight: Blocks of prefill work one request open on a replica counts as
            (kv-aware).
        max_index_blocks: The most block hashes the kv-aware index keeps.
        max_backend_blocks: The most block hashes the index credits one backend with
            (a real replica's cache holds fewer; past it a broken or hostile replica's
            further announcements are not indexed, and a warning says so).
        events_silent_s: Seconds after which a kv-aware backend that was sent a
            request that should have stored blocks, and sent no KV event since, counts
            as silent (one warning, ``kvstep_proxy_backend_events_silent``, ``/health``;
            :mod:`pipeline.proxy.event_watch`).
        backend_api_key: The bearer key sent to every backend (requests and ``/health``
            polls), or ``None`` for none; the client's own ``Authorization`` is never
            passed on. Never in a repr.
        kv_events: Event endpoints (``tcp://host:port``), one per ``backend`` in the
            same order, or ``()`` to read them from each backend's ``/health``.
        health_interval_s: Seconds between two polls of every backend's ``/health``.
        health_timeout_s: The longest one ``/health`` poll may take (then it failed).
        connect_timeout_s: The longest a connection to a backend may take to open; a
            request whose connection fails is retried once on another backend.
        upstream_timeout_s: The longest a backend may stay silent while answering (the
            producer's whole answer; each chunk of the consumer's).
        max_response_bytes: The largest producer answer (and non-streamed consumer
            answer) the proxy reads; past it the request fails with 502.
    """

    backend: tuple[str, ...] = attrs.field(default=(), converter=_url_tuple, validator=_urls)
    prefill: tuple[str, ...] = attrs.field(default=(), converter=_url_tuple, validator=_urls)
    decode: tuple[str, ...] = attrs.field(default=(), converter=_url_tuple, validator=_urls)
    policy: str = attrs.field(default="round-robin", validator=_policy)
    tokenizer: str | None = attrs.field(default=None)
    block_size: int = attrs.field(default=16, validator=_positive)
    hash_seed: int = attrs.field(default=0, validator=_int64, repr=False)
    hash_format: str = attrs.field(default="int", validator=_hash_format)
    load_weight: float = attrs.field(default=8.0, validator=_weight)
    max_index_blocks: int = attrs.field(default=1 << 20, validator=_positive)
    max_backend_blocks: int = attrs.field(default=1 << 18, validator=_positive)
    events_silent_s: float = attrs.field(default=30.0, validator=_seconds)
    backend_api_key: str | None = attrs.field(default=None, validator=_key, repr=False)
    kv_events: tuple[str, ...] = attrs.field(default=(), converter=_url_tuple)
    health_interval_s: float = attrs.field(default=5.0, validator=_seconds)
    health_timeout_s: float = attrs.field(default=2.0, validator=_seconds)
    connect_timeout_s: float = attrs.field(default=5.0, validator=_seconds)
    upstream_timeout_s: float = attrs.field(default=600.0, validator=_seconds)
    max_response_bytes: int = attrs.field(default=16 * _MIB, validator=_bytes)

    def __attrs_post_init__(self) -> None:
        if self.kv_events and len(self.kv_events) != len(self.backend):
            raise InvalidConfigError(
                "kv_events",
                self.kv_events,
                f"must give one endpoint per backend ({len(self.backend)})",
            )
        if any(not e.startswith("tcp://") for e in self.kv_events):
            raise InvalidConfigError(
                "kv_events", self.kv_events, "must be tcp://HOST:PORT endpoints"
            )
        if self.backend:
            for name in ("prefill", "decode"):
                if getattr(self, name):
                    raise InvalidConfigError(
                        name, getattr(self, name), "must be empty when backend is given"
                    )
            return
        for name in ("prefill", "decode"):
            if not getattr(self, name):
                raise InvalidConfigError(
                    name, (), "must list at least one backend URL (or give backend instead)"
                )

    @property
    def disaggregated(self) -> bool:
        """Whether requests go through a producer and a consumer (else one backend)."""
        return not self.backend
