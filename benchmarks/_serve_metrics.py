"""The serving benchmark's server side: ``/metrics`` scrapes, their differences, and
quantiles from histogram buckets as Prometheus's ``histogram_quantile`` computes them;
``compare`` sets them beside the client's samples (see ``benchmarks/serve.py``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Final

import attrs
import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

TOLERANCE = 0.10
QUANTILES = (0.5, 0.99)
# The client's sample quantile: the empirical CDF interpolated linearly, rank q * n (Hyndman
# and Fan's type 4), the definition histogram_quantile applies to buckets; numpy's default
# (rank q * (n - 1)) puts p99 of 200 samples half a sample lower.
SAMPLE_QUANTILE: Final = "interpolated_inverted_cdf"


# -- the server's histograms --------------------------------------------------------------


Histogram = list[tuple[float, float]]  # (upper bound, cumulative count), ascending


@attrs.frozen
class Scrape:
    """The numbers of one ``/metrics`` text (or the difference of two).

    A key is the sample's name plus its labels but ``le``, e.g.
    ``kvstep_step_latency_seconds,kind=engine`` or
    ``kvstep_requests_total,finish_reason=length``.

    Attributes:
        hist: Each histogram's cumulative buckets.
        sums: Each histogram's ``_sum``.
        counts: Each histogram's ``_count``.
        counters: Each counter's ``_total``.
    """

    hist: dict[str, Histogram]
    sums: dict[str, float]
    counts: dict[str, float]
    counters: dict[str, float]

    @classmethod
    def of(cls, url: str) -> Scrape:
        """Scrape ``{url}/metrics`` now."""
        text = httpx.get(f"{url}/metrics", timeout=30).text
        hist: dict[str, dict[float, float]] = {}
        sums: dict[str, float] = {}
        counts: dict[str, float] = {}
        counters: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = sorted((k, v) for k, v in sample.labels.items() if k != "le")
                tail = "".join(f",{k}={v}" for k, v in labels)
                key = family.name + tail
                if family.type == "histogram":
                    if sample.name.endswith("_bucket"):
                        hist.setdefault(key, {})[float(sample.labels["le"])] = sample.value
                    elif sample.name.endswith("_sum"):
                        sums[key] = sample.value
                    elif sample.name.endswith("_count"):
                        counts[key] = sample.value
                elif family.type == "counter" and sample.name.endswith("_total"):
                    counters[sample.name + tail] = sample.value
        return cls({k: sorted(v.items()) for k, v in hist.items()}, sums, counts, counters)

    def since(self, before: Scrape) -> Scrape:
        """``self - before``, bucket by bucket and value by value."""
        hist = {}
        for key, buckets in self.hist.items():
            old = dict(before.hist.get(key, []))
            hist[key] = [(le, n - old.get(le, 0.0)) for le, n in buckets]

        def minus(now: dict[str, float], then: dict[str, float]) -> dict[str, float]:
            return {k: v - then.get(k, 0.0) for k, v in now.items()}

        return Scrape(
            hist,
            minus(self.sums, before.sums),
            minus(self.counts, before.counts),
            minus(self.counters, before.counters),
        )

    def mean(self, key: str) -> float:
        """A histogram's exact mean (``_sum / _count``); ``nan`` with no samples."""
        count = self.counts.get(key, 0.0)
        return self.sums.get(key, 0.0) / count if count else math.nan


def histogram_quantile(q: float, buckets: Histogram) -> float:
    """Prometheus's ``histogram_quantile``: find the bucket holding rank ``q * total``
    and interpolate linearly inside it (its lower bound is the previous bucket's upper
    bound, 0 for the first); ``nan`` with no samples; the highest finite bound when the
    rank falls in ``+Inf``."""
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return math.nan
    rank = q * total
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if math.isinf(upper):
                return lower
            if count == below:
                return upper
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    return lower


def bucketize(samples: Sequence[float], bounds: Sequence[float]) -> Histogram:
    """Cumulative bucket counts of ``samples`` over ``bounds`` (as the server keeps them)."""
    ordered = np.sort(np.asarray(samples, dtype=float))
    return [(b, float(np.searchsorted(ordered, b, side="right"))) for b in bounds]


# -- the report ---------------------------------------------------------------------------


def compare(name: str, client: Sequence[float], server_key: str, server: Scrape) -> dict[str, Any]:
    """One metric: client and server p50/p99 and means, relative differences, ok flags.

    ``client_bucketed_*`` runs the client's own samples through the server's buckets
    and ``histogram_quantile``; ``*_bucket_rel_diff`` is how far that moves them: the
    part of the client/server difference that the buckets alone would make.
    """
    buckets = server.hist.get(server_key, [])
    row: dict[str, Any] = {
        "metric": name,
        "server_metric": server_key,
        "client_samples": len(client),
        "server_samples": server.counts.get(server_key, 0.0),
        "client_mean_s": float(np.mean(client)) if len(client) else math.nan,
        "server_mean_s": server.mean(server_key),
    }
    row["mean_rel_diff"] = _rel(row["server_mean_s"], row["client_mean_s"])
    bounds = [le for le, _ in buckets]
    for q in QUANTILES:
        tag = f"p{round(q * 100)}"
        c = float(np.quantile(client, q, method=SAMPLE_QUANTILE)) if len(client) else math.nan
        s = histogram_quantile(q, buckets)
        rel = _rel(s, c)
        row[f"client_{tag}_s"] = c
        row[f"server_{tag}_s"] = s
        bucketed = histogram_quantile(q, bucketize(client, bounds)) if bounds else math.nan
        row[f"client_bucketed_{tag}_s"] = bucketed
        row[f"{tag}_bucket_rel_diff"] = _rel(bucketed, c)
        row[f"{tag}_rel_diff"] = rel
        row[f"{tag}_ok"] = bool(abs(rel) <= TOLERANCE) if not math.isnan(rel) else False
    return row


def _rel(server: float, client: float) -> float:
    if math.isnan(server) or math.isnan(client) or client == 0:
        return math.nan
    return (server - client) / client
