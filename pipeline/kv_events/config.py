"""``KVEventsConfig``: where a replica publishes its KV cache events (off by default).

``EngineConfig(kv_events=...)`` takes a :class:`KVEventsConfig`, ``None`` (off), an
endpoint string (``"tcp://127.0.0.1:5557"``: publish there, no replay socket) or a dict
of the fields (what a JSON flag or the engine→worker wire gives back).

**Topology.** The replica binds its sockets and subscribers connect: the PUB socket is
bound to whatever ``tcp://HOST:PORT``, ``ipc://PATH`` or ``inproc://NAME`` it is given
(``tcp://127.0.0.1:5557`` by default: loopback only; a wildcard host ``*``, ``0.0.0.0``
or ``[::]`` binds every interface, and only when asked), so the endpoint a replica's
``/health`` advertises is one a router can connect to. vLLM binds only a wildcard and
connects to any other address; its way of publishing into an external forwarder that
binds (an XSUB/XPUB proxy) is kept as ``connect=True`` (``"connect": true``). The replay
socket is always bound.
"""

from __future__ import annotations

from typing import Any

import attrs

from pipeline.checks import check_int
from pipeline.errors import InvalidConfigError
from pipeline.kv_events.events import HASH_FORMATS

__all__ = ["DEFAULT_ENDPOINT", "KVEventsConfig", "kv_events_config"]

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"
"""Where a replica publishes unless told otherwise: loopback, port 5557."""

_SCHEMES = ("tcp://", "ipc://", "inproc://")
_MAX_ENDPOINT = 1024
MAX_BUFFER_STEPS = 1_000_000
MAX_QUEUE = 1_000_000


def _endpoint(inst: object, attribute: attrs.Attribute[Any], value: str | None) -> None:
    name = f"kv_events.{attribute.name}"
    if value is None and attribute.name == "replay_endpoint":
        return
    if (
        not isinstance(value, str)
        or not value.startswith(_SCHEMES)
        or len(value) > _MAX_ENDPOINT
        or len(value) <= len(value.split("://", 1)[0]) + 3
        or any(c.isspace() for c in value)
    ):
        allowed = (
            "a ZeroMQ endpoint: tcp://HOST:PORT (tcp://HOST:* picks a free port; "
            "HOST * binds every interface), ipc://PATH or inproc://NAME"
        )
        if attribute.name == "replay_endpoint":
            allowed += ", or None (no replay socket)"
        raise InvalidConfigError(name, value, f"must be {allowed}")


def _topic(inst: object, attribute: attrs.Attribute[Any], value: str) -> None:
    if not isinstance(value, str) or len(value.encode()) > 255:
        raise InvalidConfigError("kv_events.topic", value, "must be a str of at most 255 bytes")


def _bounded(limit: int) -> Any:
    def check(inst: object, attribute: attrs.Attribute[Any], value: int) -> None:
        check_int(f"kv_events.{attribute.name}", value, InvalidConfigError, lo=1, hi=limit)

    return check


def _bool(inst: object, attribute: attrs.Attribute[Any], value: bool) -> None:
    if not isinstance(value, bool):
        raise InvalidConfigError(f"kv_events.{attribute.name}", value, "must be true or false")


def _hash_format(inst: object, attribute: attrs.Attribute[Any], value: str) -> None:
    if not isinstance(value, str) or value not in HASH_FORMATS:
        raise InvalidConfigError(
            "kv_events.hash_format", value, f"must be one of {', '.join(HASH_FORMATS)}"
        )


@attrs.frozen(kw_only=True)
class KVEventsConfig:
    """Where and how KV cache events are published (vLLM's ``KVEventsConfig`` fields).

    Attributes:
        endpoint: The PUB socket, bound (see the module for the topology):
            ``tcp://127.0.0.1:5557`` by default, ``tcp://127.0.0.1:*`` for a free port,
            ``tcp://*:5557`` for every interface (explicitly only), ``ipc://PATH``.
        replay_endpoint: The ROUTER socket that serves recent batches again by sequence
            number (always bound), or ``None`` for none. Requests are capped in size
            and rate (see :mod:`pipeline.kv_events.publisher`).
        connect: Connect the PUB socket to ``endpoint`` instead of binding it (an
            external forwarder that binds, as vLLM connects to a non-wildcard
            endpoint); the replica's ``/health`` then says ``"bound": false`` and a
            router must be told where to subscribe.
        include_token_ids: Put each stored block's token ids in ``BlockStored``
            (``token_ids``); off by default: hashes are all a router needs, and token
            ids are the users' prompts in clear.
        topic: The first frame of every published message; subscribers filter on it.
        buffer_steps: How many recent batches the replay socket can serve.
        max_queue_size: Batches waiting for the publisher thread; when full, the oldest
            is dropped (counted and logged; subscribers see the gap in sequence numbers).
        hash_format: ``"int"`` (low 64 bits of each digest, vLLM's default) or
            ``"bytes"`` (the 32-byte digest).
    """

    endpoint: str = attrs.field(default=DEFAULT_ENDPOINT, validator=_endpoint)
    replay_endpoint: str | None = attrs.field(default=None, validator=_endpoint)
    connect: bool = attrs.field(default=False, validator=_bool)
    include_token_ids: bool = attrs.field(default=False, validator=_bool)
    topic: str = attrs.field(default="", validator=_topic)
    buffer_steps: int = attrs.field(default=10_000, validator=_bounded(MAX_BUFFER_STEPS))
    max_queue_size: int = attrs.field(default=100_000, validator=_bounded(MAX_QUEUE))
    hash_format: str = attrs.field(default="int", validator=_hash_format)


def kv_events_config(value: object) -> KVEventsConfig | None:
    """``EngineConfig.kv_events`` from what a caller may give: a :class:`KVEventsConfig`,
    ``None``, an endpoint string, or a dict of the fields.

    Raises:
        InvalidConfigError: Any other value, a dict with unknown keys, or a bad field
            (the error names ``kv_events.<field>``).
    """
    if value is None or isinstance(value, KVEventsConfig):
        return value
    if isinstance(value, str):
        return KVEventsConfig(endpoint=value)
    if isinstance(value, dict):
        names = {f.name for f in attrs.fields(KVEventsConfig)}
        unknown = sorted(str(k) for k in value if k not in names)
        if unknown:
            raise InvalidConfigError(
                "kv_events", unknown, f"unknown fields; allowed: {', '.join(sorted(names))}"
            )
        return KVEventsConfig(**value)
    raise InvalidConfigError(
        "kv_events", value, "must be None, an endpoint, a KVEventsConfig or a dict of its fields"
    )
