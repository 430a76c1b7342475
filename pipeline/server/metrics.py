"""Prometheus metrics of a served engine, fed by its step log, plus event-loop lag."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

import anyio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pipeline.kernel.report import StepReport
from pipeline.request import RequestOutput

__all__ = ["DEGRADED_AFTER_S", "KVLoadHealth", "LoopLagMonitor", "ServerMetrics"]

# Stage latencies: coarse buckets (one series per stage and kind).
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# Step and per-request latencies: Renard's R20 preferred numbers, 20 log-spaced bounds
# per decade from 0.1 ms to 112 s (then 120 s), each at most 14% above the last, so
# a quantile interpolated inside one bucket (Prometheus's histogram_quantile) is off by
# less than that; benchmarks/serve.py checks such quantiles against the client's.
_R20 = (1.0, 1.12, 1.25, 1.4, 1.6, 1.8, 2.0, 2.24, 2.5, 2.8, 3.15, 3.55, 4.0, 4.5, 5.0, 5.6,
        6.3, 7.1, 8.0, 9.0)  # fmt: skip
_FINE_BUCKETS = (*(round(m * 10.0**e, 6) for e in range(-4, 2) for m in _R20), 100.0, 112.0, 120.0)
#: A connector whose every KV load failed for this long (and at least one did) is
#: reported degraded by ``/health``.
DEGRADED_AFTER_S = 60.0


class LoopLagMonitor:
    """Measures how late the event loop wakes a sleeping task (its lag).

    Run :meth:`run` as a background task of the server's loop; it sleeps
    ``interval_s`` over and over and records the overshoot. Reading is cheap and
    safe from the loop's thread; cancelling :meth:`run` is always safe.
    """

    def __init__(self, interval_s: float = 0.01, window: int = 2000) -> None:
        self.interval_s = interval_s
        self.max_s = 0.0
        self._samples: collections.deque[float] = collections.deque(maxlen=window)

    async def run(self) -> None:
        """Sample forever (until cancelled)."""
        while True:
            start = time.perf_counter()
            await anyio.sleep(self.interval_s)
            lag = max(0.0, time.perf_counter() - start - self.interval_s)
            self._samples.append(lag)
            self.max_s = max(self.max_s, lag)

    def p99_s(self) -> float:
        """The 99th percentile lag of the recent window, in seconds (0 with no samples)."""
        if not self._samples:
            return 0.0
        ordered = sorted(self._samples)
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]

    def reset(self) -> None:
        """Forget the samples and the maximum (e.g. before a load test)."""
        self._samples.clear()
        self.max_s = 0.0

    def snapshot(self) -> dict[str, float]:
        """``{"max_ms", "p99_ms", "samples"}`` for ``/health``."""
        return {
            "max_ms": round(self.max_s * 1e3, 3),
            "p99_ms": round(self.p99_s() * 1e3, 3),
            "samples": len(self._samples),
        }


class KVLoadHealth:
    """Whether the connector's KV loads work: degraded when, over the last
    ``window_s`` seconds, some load failed and none succeeded.

    Fed once per engine step by :meth:`record` (from the step log's listener, on any
    thread; a lock guards the state); read by ``/health`` with :meth:`snapshot`. Never
    blocks. A step that loaded any token is a success: the connector is healthy again
    from then on.

    Args:
        window_s: The look-back window, seconds (:data:`DEGRADED_AFTER_S`).
        clock: ``time.monotonic`` (tests pass their own).
    """

    def __init__(
        self, window_s: float = DEGRADED_AFTER_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._failures: collections.deque[tuple[float, dict[str, int]]] = collections.deque()
        self._last_success: float | None = None

    def record(self, loaded_tokens: int, failures: dict[str, int]) -> None:
        """Account one engine step: the tokens it loaded, its failed blocks by cause."""
        if not loaded_tokens and not failures:
            return
        now = self._clock()
        with self._lock:
            if loaded_tokens:
                self._last_success = now
            if failures:
                self._failures.append((now, dict(failures)))
            self._prune(now)

    def _prune(self, now: float) -> None:
        horizon = now - self.window_s
        while self._failures and self._failures[0][0] < horizon:
            self._failures.popleft()

    def snapshot(self) -> dict[str, Any]:
        """``{"state": "ok" | "degraded", "failures_last_60s": blocks, "causes": {...}}``
        (the key names the window), with a ``reason`` when degraded."""
        now = self._clock()
        with self._lock:
            self._prune(now)
            causes: dict[str, int] = {}
            for _, counts in self._failures:
                for cause, n in counts.items():
                    causes[cause] = causes.get(cause, 0) + n
            succeeded = self._last_success is not None and (
                self._last_success >= now - self.window_s
            )
        total = sum(causes.values())
        window = f"{self.window_s:g}s"
        body: dict[str, Any] = {
            "state": "ok",
            f"failures_last_{window}": total,
            "causes": dict(sorted(causes.items())),
        }
        if total and not succeeded:
            listed = ", ".join(f"{c}: {n}" for c, n in sorted(causes.items()))
            body["state"] = "degraded"
            body["reason"] = (
                f"every KV load of the last {window} failed ({total} blocks; {listed}); "
                "requests are served by recomputing or fail, per load_failure_policy"
            )
        return body


class ServerMetrics:
    """The server's Prometheus registry (one per app, never the global one).

    :meth:`on_step` is a :class:`~pipeline.steplog.StepLog` listener: the engine and
    the workers call it once per step, possibly from worker threads; prometheus_client
    metrics are thread-safe, so it may run anywhere and never blocks.
    """

    def __init__(self, connector: str | None = None) -> None:
        self.connector = connector  # the kvstep_kv_{load,save}_failures_total label
        self.kv_health = KVLoadHealth()
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.steps = Counter("kvstep_steps", "Engine steps run", ["outcome"], registry=reg)
        self.step_latency = Histogram(
            "kvstep_step_latency_seconds",
            "Wall time of one step",
            ["kind"],
            buckets=_FINE_BUCKETS,
            registry=reg,
        )
        self.stage_latency = Histogram(
            "kvstep_stage_latency_seconds",
            "Wall time of one stage of one step",
            ["kind", "stage"],
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self.kv_loaded = Counter(
            "kvstep_kv_loaded_tokens", "Tokens of KV loaded by the connector", registry=reg
        )
        self.kv_saved = Counter(
            "kvstep_kv_saved_tokens", "Tokens of KV saved by the connector", registry=reg
        )
        self.kv_load_failures = Counter(
            "kvstep_kv_load_failures",
            "KV blocks that failed to load, by connector and cause (handshake, "
            "peer_mismatch, refused, read_error, read_timeout, missing, corrupt, unknown)",
            ["connector", "cause"],
            registry=reg,
        )
        self.kv_save_failures = Counter(
            "kvstep_kv_save_failures",
            "Save-side KV connector calls that raised (their step's blocks were not "
            "cached; its requests kept their tokens), by connector and cause "
            "(save_kv_layer, wait_for_save, get_finished, timeout)",
            ["connector", "cause"],
            registry=reg,
        )
        self.batch_tokens = Counter(
            "kvstep_scheduled_tokens", "Tokens scheduled over all steps", registry=reg
        )
        self.queue_depth = Gauge(
            "kvstep_queue_depth", "Requests admitted and not finished", registry=reg
        )
        self.requests = Counter(
            "kvstep_requests",
            "Requests finished, by finish reason",
            ["finish_reason"],
            registry=reg,
        )
        # Per-request latencies, observed once when a request finishes (observe_finished).
        self.ttft = Histogram(
            "kvstep_time_to_first_token_seconds",
            "Arrival to first generated token, per request",
            buckets=_FINE_BUCKETS,
            registry=reg,
        )
        self.itl = Histogram(
            "kvstep_inter_token_latency_seconds",
            "Time between two consecutive generated tokens of a request, per token",
            buckets=_FINE_BUCKETS,
            registry=reg,
        )
        self.tpot = Histogram(
            "kvstep_request_time_per_output_token_seconds",
            "Mean time per output token after the first ((E2E - TTFT) / (tokens - 1)), "
            "per request with two or more tokens",
            buckets=_FINE_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            "kvstep_e2e_request_latency_seconds",
            "Arrival to finish, per request",
            buckets=_FINE_BUCKETS,
            registry=reg,
        )
        self.queue_time = Histogram(
            "kvstep_request_queue_time_seconds",
            "Arrival to first scheduled step, per request",
            buckets=_FINE_BUCKETS,
            registry=reg,
        )
        self.prefix_queries = Counter(
            "kvstep_prefix_cache_queries",
            "Prompt tokens of finished requests (prefix-cache lookups, in tokens)",
            registry=reg,
        )
        self.prefix_hits = Counter(
            "kvstep_prefix_cache_hits",
            "Prompt tokens of finished requests served by the local prefix cache",
            registry=reg,
        )
        self.spec_drafts = Counter(
            "kvstep_spec_decode_num_drafts",
            "Speculative draft sequences verified (one per drafted request and step)",
            registry=reg,
        )
        self.spec_draft_tokens = Counter(
            "kvstep_spec_decode_num_draft_tokens",
            "Speculative draft tokens verified",
            registry=reg,
        )
        self.spec_accepted_tokens = Counter(
            "kvstep_spec_decode_num_accepted_tokens",
            "Speculative draft tokens kept",
            registry=reg,
        )
        self.spec_accepted_per_pos = Counter(
            "kvstep_spec_decode_num_accepted_tokens_per_pos",
            "Speculative draft tokens kept, by position after the request's token (0: first)",
            ["position"],
            registry=reg,
        )
        self.spec_without_drafts = Counter(
            "kvstep_spec_decode_requests_without_drafts",
            "Requests that decoded without speculative drafts, by reason (logits_adjusted, "
            "structured_outputs)",
            ["reason"],
            registry=reg,
        )
        self.spec_proposer_failures = Counter(
            "kvstep_spec_decode_proposer_failures",
            "Speculative proposer calls that raised (their requests went on without drafts)",
            registry=reg,
        )
        self.loop_lag_max = Gauge(
            "kvstep_event_loop_lag_max_seconds", "Largest event-loop lag seen", registry=reg
        )
        self.loop_lag_p99 = Gauge(
            "kvstep_event_loop_lag_p99_seconds", "p99 event-loop lag (recent)", registry=reg
        )
        self.forward_compiled = Gauge(
            "kvstep_forward_compiled",
            "1 when the forward passes run compiled (torch_compile), 0 when eager "
            "(off, or fallen back: torch_compile_fallback)",
            registry=reg,
        )

    def on_step(self, report: StepReport, kind: str, fields: dict[str, Any]) -> None:
        """Account one step report (a StepLog listener)."""
        self.step_latency.labels(kind).observe(report.duration_s)
        for record in report.stages:
            if record.outcome != "skipped":
                self.stage_latency.labels(kind, record.name).observe(record.duration_s)
        if kind != "engine":
            return
        self.steps.labels(report.outcome).inc()
        loaded = int(fields.get("loaded_tokens", 0) or 0)
        self.kv_loaded.inc(loaded)
        failures: dict[str, int] = fields.get("load_failures") or {}
        for cause, blocks in failures.items():
            self.kv_load_failures.labels(self.connector or "none", cause).inc(blocks)
        self.kv_health.record(loaded, failures)
        save_failures: dict[str, int] = fields.get("kv_save_failures") or {}
        for cause, calls in save_failures.items():
            self.kv_save_failures.labels(self.connector or "none", cause).inc(calls)
        self.kv_saved.inc(int(fields.get("saved_tokens", 0) or 0))
        self.batch_tokens.inc(int(fields.get("num_tokens", 0) or 0))
        if fields.get("spec_drafts"):
            self.spec_drafts.inc(int(fields["spec_drafts"]))
            self.spec_draft_tokens.inc(int(fields.get("spec_draft_tokens") or 0))
            self.spec_accepted_tokens.inc(int(fields.get("spec_accepted_tokens") or 0))
            for position, kept in enumerate(fields.get("spec_accepted_per_position") or ()):
                self.spec_accepted_per_pos.labels(str(position)).inc(int(kept))
        for reason, requests in (fields.get("spec_without_drafts") or {}).items():
            self.spec_without_drafts.labels(str(reason)).inc(int(requests))
        if fields.get("spec_proposer_failures"):
            self.spec_proposer_failures.inc(int(fields["spec_proposer_failures"]))

    def observe_finished(self, out: RequestOutput) -> None:
        """Account a request's last output as the route receives it: its finish reason
        and end-to-end latency (from arrival to now), and from its metrics the time
        per output token (its mean inter-token latency; one sample per request with
        two or more tokens), queue time and prefix-cache tokens."""
        self.requests.labels(out.finish_reason or "unknown").inc()
        m = out.metrics
        if m is None:
            return
        self.e2e.observe(max(0.0, time.monotonic() - m.arrival_time))
        for histogram, value in ((self.tpot, m.mean_itl_s), (self.queue_time, m.queue_time_s)):
            if value is not None:
                histogram.observe(max(0.0, value))
        if m.first_scheduled_time is not None:  # never looked up otherwise
            self.prefix_queries.inc(len(out.prompt_token_ids))
            self.prefix_hits.inc(m.num_cached_tokens)

    def observe_tokens(self, out: RequestOutput, previous: float | None) -> float | None:
        """Account an output as the route receives it, about to send it: with a
        request's first tokens, its time to first token (from arrival to now: the
        engine's TTFT plus delivery to the route); and the inter-token latency of
        ``out``'s new tokens, one sample per token after the first, the time since
        the request's previous token (``previous``, what the last call for this
        request returned) spread evenly over the tokens that arrived together.
        Returns the time of ``out``'s last token, to pass back with the request's
        next output."""
        m = out.metrics
        if m is None or m.last_token_time is None or not out.new_token_ids:
            return previous
        count = len(out.new_token_ids)
        if previous is None:
            self.ttft.observe(max(0.0, time.monotonic() - m.arrival_time))
            if count > 1 and m.first_token_time is not None:
                gap = max(0.0, m.last_token_time - m.first_token_time) / (count - 1)
                for _ in range(count - 1):
                    self.itl.observe(gap)
        else:
            gap = max(0.0, m.last_token_time - previous) / count
            for _ in range(count):
                self.itl.observe(gap)
        return m.last_token_time

    def render(self, *, queue_depth: int, lag: LoopLagMonitor, compiled: bool = False) -> bytes:
        """The Prometheus text exposition, after refreshing the gauges."""
        self.queue_depth.set(queue_depth)
        self.forward_compiled.set(int(compiled))
        self.loop_lag_max.set(lag.max_s)
        self.loop_lag_p99.set(lag.p99_s())
        return generate_latest(self.registry)
