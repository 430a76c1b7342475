"""Prometheus metrics of the proxy: requests per backend, upstream errors, healthy backends,
and for the kv-aware policy its decisions and each backend's KV events."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pipeline.proxy.pool import BackendPool

__all__ = ["BackendEvents", "ProxyMetrics"]


class BackendEvents(NamedTuple):
    """What the kv-aware policy knows of one backend's KV events, for the gauges.

    Attributes:
        indexed: Blocks its index holds for the backend.
        silent: Whether the backend is silent (:mod:`pipeline.proxy.event_watch`).
        age_s: Seconds since its last event batch (or since the proxy started).
        refused: Hashes it announced past the index's per-backend bound.
    """

    indexed: int
    silent: bool
    age_s: float
    refused: int


class ProxyMetrics:
    """The proxy's registry (one per app, never the global one); thread-safe."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.requests = Counter(
            "kvstep_proxy_upstream_requests",
            "Requests sent to a backend, by pool, backend and HTTP status (0: no answer)",
            ["pool", "backend", "status"],
            registry=reg,
        )
        self.errors = Counter(
            "kvstep_proxy_upstream_errors",
            "Upstream failures, by pool, backend and kind (connect, timeout, status, stream, "
            "response)",
            ["pool", "backend", "kind"],
            registry=reg,
        )
        self.healthy = Gauge(
            "kvstep_proxy_healthy_backends", "Backends in rotation, by pool", ["pool"], registry=reg
        )
        self.in_flight = Gauge(
            "kvstep_proxy_in_flight_requests",
            "Requests open on a backend through this proxy, by pool and backend",
            ["pool", "backend"],
            registry=reg,
        )

        self.route_seconds = Histogram(
            "kvstep_proxy_route_decision_seconds",
            "Time the kv-aware policy took to pick a backend (index lookup and scoring)",
            buckets=(1e-6, 3e-6, 1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1),
            registry=reg,
        )
        self.routed_blocks = Counter(
            "kvstep_proxy_routed_prompt_blocks",
            "Full prompt blocks of the requests the kv-aware policy sent to a backend",
            ["backend"],
            registry=reg,
        )
        self.routed_hit_blocks = Counter(
            "kvstep_proxy_routed_hit_blocks",
            "Of those, the blocks the backend held by its KV events (hit-rate estimate: "
            "this over kvstep_proxy_routed_prompt_blocks)",
            ["backend"],
            registry=reg,
        )
        self.indexed_blocks = Gauge(
            "kvstep_proxy_indexed_blocks",
            "Blocks the kv-aware policy's index holds for a backend (from its KV events)",
            ["backend"],
            registry=reg,
        )

        self.events_silent = Gauge(
            "kvstep_proxy_backend_events_silent",
            "1 while a kv-aware backend is silent: a request that should have stored blocks "
            "went to it and no KV event came since, for --kv-events-silent-after seconds",
            ["backend"],
            registry=reg,
        )
        self.last_event_age = Gauge(
            "kvstep_proxy_backend_last_event_age_seconds",
            "Seconds since a kv-aware backend's last KV event batch (or since the proxy "
            "started, when none came)",
            ["backend"],
            registry=reg,
        )
        self.refused_blocks = Gauge(
            "kvstep_proxy_index_refused_blocks",
            "Block hashes a backend announced past --max-backend-blocks (not indexed)",
            ["backend"],
            registry=reg,
        )
        self.transfer_params_dropped = Counter(
            "kvstep_proxy_client_transfer_params_dropped",
            "Client requests whose kv_transfer_params the proxy removed (only the proxy "
            "and the engines set them)",
            registry=reg,
        )
        self.transfers_released = Counter(
            "kvstep_proxy_kv_transfers_released",
            "Prefills whose held KV the proxy asked the producer to free at once because "
            "the consumer refused or failed the request, by the producer's answer "
            "(released, not_held, failed)",
            ["result"],
            registry=reg,
        )

    def render(
        self,
        pools: tuple[BackendPool, ...],
        events: Mapping[str, BackendEvents] | None = None,
    ) -> bytes:
        """The Prometheus text exposition, after refreshing the gauges: healthy and
        in-flight per backend, and the KV-event gauges of ``events`` (by backend URL)."""
        for pool in pools:
            self.healthy.labels(pool.name).set(pool.num_healthy)
            for backend in pool.backends:
                self.in_flight.labels(pool.name, backend.url).set(backend.in_flight)
        for url, known in (events or {}).items():
            self.indexed_blocks.labels(url).set(known.indexed)
            self.events_silent.labels(url).set(int(known.silent))
            self.last_event_age.labels(url).set(known.age_s)
            self.refused_blocks.labels(url).set(known.refused)
        return generate_latest(self.registry)
