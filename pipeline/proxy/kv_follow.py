"""Following each replica's KV events into the router's :class:`PrefixIndex`.

One task per replica: it finds the replica's event endpoints (given with
``--kv-events``, else the ``kv_events`` entry of its ``/health``, whose wildcard host is
replaced by the replica's), subscribes, replays what the replica still buffers (a late
joiner starts from its history), and applies each batch to the index on the event loop
(an index update is a few dict operations per block). The blocking socket calls run on
a worker thread, one short poll at a time.

Topology: a kvstep replica binds its event sockets (loopback by default) and the proxy
connects to what the replica's ``/health`` advertises (or to ``--kv-events``); a replica
whose publisher connects to a forwarder (``"bound": false``) must be given with
``--kv-events`` (the forwarder's subscriber side), since its ``/health`` endpoint is not
one to subscribe to.

What the index cannot trust is forgotten: a gap in the sequence numbers that replay could
not fill, a replica taken out of rotation (dead, or restarted: its cache is empty), or
a subscription that failed. The replica's entries are then cleared and its events
followed again from its current history, so the index under-estimates for a while but
never routes on blocks a replica no longer has.

A replica is not trusted with the proxy's memory or its shutdown: its ``/health`` is
read up to :data:`MAX_HEALTH_BYTES`, each event frame, the messages waiting and a
replay are capped by the :class:`~pipeline.kv_events.KVEventSubscriber`, the index
credits it with at most ``max_backend_blocks`` hashes, and every blocking call on the
worker thread returns within a few seconds (a poll :data:`_POLL_S`, a replay
:data:`_REPLAY_S` in all), so cancelling :func:`follow` never waits on a replica longer.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from urllib.parse import urlsplit

import anyio
import anyio.to_thread
import httpx

from pipeline.errors import TransportError
from pipeline.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventSubscriber,
    SequencedBatch,
)
from pipeline.logger import get_logger
from pipeline.proxy.event_watch import EventWatch
from pipeline.proxy.pool import Backend
from pipeline.proxy.prefix_index import PrefixIndex
from pipeline.proxy.upstream import read_capped

__all__ = ["MAX_HEALTH_BYTES", "EventSource", "apply_batches", "discover", "follow"]

MAX_HEALTH_BYTES = 64 * 1024
"""The most of a replica's ``/health`` answer read to find its event endpoints."""

_log = get_logger()
_POLL_S = 0.2  # one blocking poll on the worker thread
_REPLAY_S = 2.0  # the longest a replay may take
_RETRY_S = 1.0  # between two attempts to find or subscribe to a replica's events
_WILDCARDS = ("*", "0.0.0.0", "::", "[::]")
_DEVICE = (MEDIUM_GPU, None)  # the media the index follows


class EventSource:
    """Where a replica publishes: ``endpoint``, ``replay_endpoint`` (or ``None``), ``topic``."""

    __slots__ = ("endpoint", "replay_endpoint", "topic")

    def __init__(self, endpoint: str, replay_endpoint: str | None, topic: str = "") -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic

    def __repr__(self) -> str:
        return f"EventSource({self.endpoint!r}, replay={self.replay_endpoint!r})"


def _host_of(endpoint: str, url: str) -> str:
    """``endpoint`` with a wildcard host (what a bind reads back as) replaced by
    ``url``'s host."""
    scheme, sep, rest = endpoint.partition("://")
    host, colon, port = rest.rpartition(":")
    if scheme != "tcp" or not sep or not colon or host not in _WILDCARDS:
        return endpoint
    replica = urlsplit(url).hostname or "127.0.0.1"
    return f"tcp://{replica}:{port}"


async def discover(client: httpx.AsyncClient, url: str, timeout_s: float) -> EventSource | None:
    """The event endpoints ``url``'s ``/health`` advertises, or ``None`` (no events,
    not reachable, a publisher that connects rather than binds, or an answer that is
    not what a kvstep replica sends). Reads at most :data:`MAX_HEALTH_BYTES`, within
    ``timeout_s``."""
    try:
        with anyio.fail_after(timeout_s):
            async with client.stream("GET", f"{url}/health", timeout=timeout_s) as response:
                if response.status_code != 200:
                    return None
                body = await read_capped(response, MAX_HEALTH_BYTES)
        entry = json.loads(body).get("kv_events")
    except (httpx.HTTPError, TimeoutError, ValueError, AttributeError, RecursionError):
        return None
    if not isinstance(entry, dict) or not isinstance(entry.get("endpoint"), str):
        return None
    if entry.get("bound") is False:  # a forwarder's address: --kv-events must say where
        return None
    replay = entry.get("replay_endpoint")
    topic = entry.get("topic", "")
    return EventSource(
        _host_of(entry["endpoint"], url),
        _host_of(replay, url) if isinstance(replay, str) else None,
        topic if isinstance(topic, str) else "",
    )


def apply_batches(index: PrefixIndex, url: str, batches: Sequence[SequencedBatch]) -> None:
    """Apply ``batches`` (in sequence order) of replica ``url`` to ``index``: the device
    tier's blocks (medium ``GPU``, or none named), what a request reuses at no cost; a
    connector tier's (``CPU``, ...) would have to be loaded first, and its removals
    must not clear what the device tier still holds."""
    for item in batches:
        for event in item.batch.events:
            if isinstance(event, BlockStored) and event.medium in _DEVICE:
                index.stored(url, event.block_hashes)
            elif isinstance(event, BlockRemoved) and event.medium in _DEVICE:
                index.removed(url, event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                index.cleared(url)


async def follow(
    index: PrefixIndex,
    backend: Backend,
    client: httpx.AsyncClient,
    given: EventSource | None,
    timeout_s: float,
    watch: EventWatch | None = None,
) -> None:
    """Keep ``index`` in step with ``backend``'s events until cancelled (see the module);
    each batch applied is reported to ``watch``."""
    url = backend.url
    while True:
        source = given if given is not None else await discover(client, url, timeout_s)
        if source is None or not backend.healthy:
            await anyio.sleep(_RETRY_S)
            continue
        try:
            await _subscribed(index, backend, source, watch)
        except Exception as exc:  # lost events, a replay timeout, a zmq error: retry
            _log.warning("kv_events_lost", backend=url, error=repr(exc)[:200])
        index.cleared(url)
        await anyio.sleep(_RETRY_S)


async def _subscribed(
    index: PrefixIndex, backend: Backend, source: EventSource, watch: EventWatch | None
) -> None:
    """Follow one subscription until the replica leaves the rotation or events are lost."""
    # Connecting does not block (ZeroMQ connects in its own thread).
    sub = KVEventSubscriber(source.endpoint, source.replay_endpoint, topic=source.topic)
    url = backend.url
    refused = index.refused[url]

    def applied(batches: Sequence[SequencedBatch]) -> None:
        nonlocal refused
        apply_batches(index, url, batches)
        if batches and watch is not None:
            watch.heard(url)
        if index.refused[url] > refused and not refused:
            _log.warning(
                "kv_events_index_full", backend=url, max_backend_blocks=index.max_blocks_per_replica
            )
        refused = index.refused[url]

    try:
        # What a replica stored before the first batch this subscription sees is not
        # known (the index under-estimates it), never wrong: that first gap is fine.
        joined = source.replay_endpoint is not None
        if joined:  # a late joiner starts from the history the replica still buffers
            applied(await anyio.to_thread.run_sync(sub.catch_up, _REPLAY_S))
            sub.gaps.clear()
        while backend.healthy:
            batches = await anyio.to_thread.run_sync(sub.poll, _POLL_S)
            if batches and not joined:
                sub.gaps.clear()
                joined = True
            if sub.gaps:  # lost for good: what the index holds of it may be stale
                raise TransportError(f"KV events lost: {sub.gaps[:3]}")
            applied(batches)
    finally:  # a cancelled poll returns once its thread is done: the socket is free
        sub.close()
