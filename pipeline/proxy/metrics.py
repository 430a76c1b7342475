"""Prometheus metrics of the proxy: requests per backend, upstream errors, healthy backends."""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pipeline.proxy.pool import BackendPool

__all__ = ["ProxyMetrics"]


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

    def render(
        self, pools: tuple[BackendPool, ...], indexed: Mapping[str, int] | None = None
    ) -> bytes:
        """The Prometheus text exposition, after refreshing the gauges: healthy and
        in-flight per backend, and ``indexed`` (blocks indexed per backend URL)."""
        for pool in pools:
            self.healthy.labels(pool.name).set(pool.num_healthy)
            for backend in pool.backends:
                self.in_flight.labels(pool.name, backend.url).set(backend.in_flight)
        for url, blocks in (indexed or {}).items():
            self.indexed_blocks.labels(url).set(blocks)
        return generate_latest(self.registry)
