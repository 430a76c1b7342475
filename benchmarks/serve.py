"""Serving: a real ``kvstep serve`` process under a Poisson workload, its latencies seen
from the client and from the server's ``/metrics``, side by side.

    python benchmarks/serve.py [--num-requests 200] [--request-rate 1.5] [--json PATH]

The server is ``python -m pipeline.cli serve`` on a free loopback port (``--model``,
``builtin:tiny`` by default, plus any ``--server-arg``), started here and stopped at the
end. After ``--warmup`` untimed requests, ``/metrics`` is scraped, the workload runs, and
it is scraped again; the server's side is the difference of the two scrapes.

Workload (all drawn from ``--seed``): ``--num-requests`` streaming ``/v1/completions``
requests whose send times are a Poisson process of ``--request-rate`` requests/s
(exponential gaps; a request is sent at its time whether or not earlier ones are done).
Each prompt is one of ``--num-prefixes`` shared prefixes (lengths drawn from
``--prefix-words``) followed by a unique random suffix (``--suffix-words``), in common
English words (about 2.3 tokens each with ``builtin:tiny``'s tokenizer; the report gives
the real token counts from ``usage``). Each request asks for ``max_tokens`` drawn from
``--output-tokens`` with ``ignore_eos``, so every output length is known and checked.
The default rate is sized for ``builtin:tiny`` on a small shared CPU box (busy, not
falling behind); raise it on a GPU.

What each side measures, per request:

========  ====================================  ==========================================
metric    client (httpx, this process)          server (``/metrics`` histogram)
========  ====================================  ==========================================
TTFT      send -> first chunk with a token      ``kvstep_time_to_first_token_seconds``:
                                                engine arrival -> first token sampled
TPOT      (E2E - TTFT) / (tokens - 1)           ``kvstep_request_time_per_output_token_
                                                seconds``: the server's per-request mean
                                                gap, (last - first token time) /
                                                (tokens - 1)
ITL       every gap between two token chunks    ``kvstep_inter_token_latency_seconds``:
          (one sample per gap)                  every gap between two sampled tokens of a
                                                request (one sample per token after the
                                                first)
E2E       send -> end of the stream             ``kvstep_e2e_request_latency_seconds``:
                                                engine arrival -> finished
========  ====================================  ==========================================

The server's quantiles come from the bucket deltas by linear interpolation inside the
bucket that holds rank ``q * count``, as Prometheus's ``histogram_quantile`` does; the
client's are sample quantiles of the same definition (the empirical CDF interpolated
linearly, Hyndman and Fan's type 4). A comparison is ``ok`` when ``|server - client| <=
10%`` of the client's value; ``all_ok`` covers all four.
The histograms' ``_sum``/``_count`` give exact means (no bucket error), printed beside
the quantiles, and the ``buckets`` columns put the client's own samples through the
server's buckets: the share of a difference that the buckets alone make.

Why the two sides differ, and which way:

* **Span.** The client's clock starts before the HTTP request is written and stops when
  the chunk has been read; the server's starts when the engine admits the request (after
  the body is read and parsed and the prompt tokenized) and stops when the token is
  sampled (before the chunk is detokenized, serialized and written). So the client's
  TTFT and E2E are longer by that HTTP/SSE work plus any wait for the server's event
  loop, which also runs the engine's step loop (scheduling and stages on the loop, the
  forward in a thread that competes for the same cores and the GIL), so a request that
  arrives mid-step may be parsed only after it; and, on the client, any wait for this
  process's own event loop. The exact means show it: in the recorded run (200 requests
  at 1.5/s, ``builtin:tiny`` on 2 CPUs shared with other work, load average ~8) the
  client's mean TTFT was 43 ms (5%) above the server's and its mean E2E 41 ms above,
  while the mean TPOT agreed to 0.03% (a difference of two times on each side cancels
  the offset). The offset is a large fraction only of a small TTFT.
* **Buckets.** Interpolation assumes the samples spread evenly over the bucket that holds
  the rank. The server's step and request histograms use Renard's R20 bounds, 20 per
  decade, at most 14% apart, so a quantile's bucket error is under that and usually a
  few percent (the ``buckets`` columns); a p99 of 200 samples rests on the two or three
  largest, so it moves more than a p50 (+8.5% for TPOT p99 in the recorded run, all of
  it bucket error).
* **ITL.** Both sides count one sample per token after the first. The server's gap is
  between two sampling times; the client's between two chunk arrivals, which adds the
  jitter of delivery (a chunk written late makes one gap longer and the next shorter),
  so the client's distribution is a little wider: its p99 above the server's, its p50
  at or below. The sums agree (both add up to last minus first token time).

JSON goes to ``benchmarks/results/serve.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Final

import anyio
import attrs
import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).resolve().parent.parent
TOLERANCE = 0.10
QUANTILES = (0.5, 0.99)
# The client's sample quantile: the empirical CDF interpolated linearly, rank q * n (Hyndman
# and Fan's type 4), the definition histogram_quantile applies to buckets; numpy's default
# (rank q * (n - 1)) puts p99 of 200 samples half a sample lower.
SAMPLE_QUANTILE: Final = "interpolated_inverted_cdf"

# Plain English words the builtin tokenizer knows well (it was trained on such text).
_VOCABULARY = (
    "the a of and to in is it that for on with as was he she they we you this be at by "
    "from or an but not what all were when your can said there use each which do how "
    "their if will up other about out many then them these so some her would make like "
    "him into time has look two more write go see number no way could people my than "
    "first water been call who oil its now find long down day did get come made may part "
    "model token cache block prompt request server reply bread river town morning sea "
    "green bird tree spring story question answer kind brief correct light small warm"
)
WORDS = tuple(_VOCABULARY.split())

# Server metric families (their names as the text exposition gives them).
TTFT = "kvstep_time_to_first_token_seconds"
TPOT = "kvstep_request_time_per_output_token_seconds"
ITL = "kvstep_inter_token_latency_seconds"
E2E = "kvstep_e2e_request_latency_seconds"
QUEUE = "kvstep_request_queue_time_seconds"
STEP = "kvstep_step_latency_seconds"


# -- the server ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def serve(model: str, extra: Sequence[str], log: Path, timeout_s: float = 180.0) -> Iterator[str]:
    """Start ``kvstep serve`` from this repository, wait for ``/health``; yield its URL.

    The process is terminated (then killed after 30 s) on exit, whatever happened.
    """
    port = free_port()
    cmd = [sys.executable, "-m", "pipeline.cli", "serve", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--model", model, *extra]
    env = {**os.environ}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    url = f"http://127.0.0.1:{port}"
    with log.open("wb") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                if process.poll() is not None:
                    tail = log.read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"server exited with {process.returncode}:\n{tail}")
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    tail = log.read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"server did not come up in {timeout_s} s:\n{tail}")
                time.sleep(0.2)
            yield url
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


# -- the workload -------------------------------------------------------------------------


@attrs.frozen
class RequestSpec:
    """One request of the workload.

    Attributes:
        send_at_s: When to send it, seconds after the workload starts.
        prompt: The prompt text (a shared prefix + a unique suffix).
        prefix: Which shared prefix it starts with.
        max_tokens: Tokens to generate (``ignore_eos``: exactly this many).
    """

    send_at_s: float
    prompt: str
    prefix: int
    max_tokens: int


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def build_workload(args: argparse.Namespace, count: int, seed: int) -> list[RequestSpec]:
    """``count`` requests with Poisson send times (seeded, same for the same flags)."""
    rng = random.Random(seed)
    prefixes = [
        _words(rng, rng.randint(*args.prefix_words)) + "." for _ in range(args.num_prefixes)
    ]
    specs = []
    at = 0.0
    for _ in range(count):
        at += rng.expovariate(args.request_rate)
        which = rng.randrange(len(prefixes))
        suffix = _words(rng, rng.randint(*args.suffix_words))
        specs.append(
            RequestSpec(at, f"{prefixes[which]} {suffix}", which, rng.randint(*args.output_tokens))
        )
    return specs


@attrs.define
class ClientRecord:
    """What the client saw of one request (``perf_counter`` seconds).

    Attributes:
        sent: When the request was sent.
        chunk_times: Arrival time of each chunk that carried tokens.
        chunk_tokens: Tokens in each of those chunks.
        ended: When the stream ended (``[DONE]`` read), or ``None``.
        prompt_tokens: From the final ``usage`` chunk.
        completion_tokens: From the final ``usage`` chunk.
        error: Why the request failed, or ``None``.
    """

    sent: float
    chunk_times: list[float] = attrs.field(factory=list)
    chunk_tokens: list[int] = attrs.field(factory=list)
    ended: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.ended is not None and bool(self.chunk_times)

    @property
    def ttft_s(self) -> float:
        return self.chunk_times[0] - self.sent

    @property
    def e2e_s(self) -> float:
        assert self.ended is not None
        return self.ended - self.sent

    @property
    def tpot_s(self) -> float | None:
        if self.completion_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)

    @property
    def itls_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]


async def send_one(client: httpx.AsyncClient, spec: RequestSpec, record: ClientRecord) -> None:
    """Stream one completion into ``record``; a failure is recorded, never raised."""
    body = {
        "prompt": spec.prompt,
        "max_tokens": spec.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                record.error = f"HTTP {response.status_code}: {response.text[:200]}"
                return
            async for line in response.aiter_lines():
                now = time.perf_counter()
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    record.ended = now
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    record.error = str(chunk["error"])[:200]
                    return
                tokens = sum(len(c.get("token_ids") or ()) for c in chunk["choices"])
                if tokens:
                    record.chunk_times.append(now)
                    record.chunk_tokens.append(tokens)
                if chunk.get("usage"):
                    record.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    record.completion_tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"


@attrs.frozen
class WorkloadRun:
    """What :func:`run_workload` saw.

    Attributes:
        records: One per request, in the order sent.
        started: ``perf_counter`` time the workload started (send times count from it).
    """

    records: list[ClientRecord]
    started: float


async def run_workload(url: str, specs: Sequence[RequestSpec]) -> WorkloadRun:
    """Send each request at its time, not waiting for earlier ones to finish; return
    when every request has finished or failed."""
    records: list[ClientRecord] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(600.0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for spec in specs:
                delay = start + spec.send_at_s - time.perf_counter()
                if delay > 0:
                    await anyio.sleep(delay)
                record = ClientRecord(sent=time.perf_counter())
                records.append(record)
                tg.start_soon(send_one, client, spec, record)
    return WorkloadRun(records, start)


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


def summarize(
    args: argparse.Namespace,
    specs: Sequence[RequestSpec],
    run: WorkloadRun,
    server: Scrape,
) -> dict[str, Any]:
    """The JSON result: workload, throughput, and one :func:`compare` row per metric."""
    records, start = run.records, run.started
    done = [r for r in records if r.ok]
    end = max((r.ended for r in done if r.ended is not None), default=start)
    window = max(end - start, 1e-9)
    output_tokens = sum(r.completion_tokens for r in done)
    prompt_tokens = sum(r.prompt_tokens for r in done)
    expected = sum(s.max_tokens for s, r in zip(specs, records, strict=True) if r.ok)
    finished = {
        k.split("finish_reason=")[1]: v
        for k, v in server.counters.items()
        if k.startswith("kvstep_requests_total,") and v
    }
    queries = server.counters.get("kvstep_prefix_cache_queries_total", 0.0)
    hits = server.counters.get("kvstep_prefix_cache_hits_total", 0.0)
    rows = [
        compare("TTFT", [r.ttft_s for r in done], TTFT, server),
        compare("TPOT", [t for r in done if (t := r.tpot_s) is not None], TPOT, server),
        compare("ITL", [g for r in done for g in r.itls_s], ITL, server),
        compare("E2E", [r.e2e_s for r in done], E2E, server),
    ]
    queue = server.hist.get(QUEUE, [])
    steps = sum(v for k, v in server.counters.items() if k.startswith("kvstep_steps_total"))
    return {
        "model": args.model,
        "num_requests": len(specs),
        "request_rate": args.request_rate,
        "seed": args.seed,
        "num_prefixes": args.num_prefixes,
        "prefix_words": list(args.prefix_words),
        "suffix_words": list(args.suffix_words),
        "output_tokens": list(args.output_tokens),
        "server_args": list(args.server_arg),
        "completed": len(done),
        "failed": len(records) - len(done),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "duration_s": window,
        "prompt_tokens": prompt_tokens,
        "mean_prompt_tokens": prompt_tokens / len(done) if done else 0.0,
        "output_tokens_total": output_tokens,
        "output_tokens_expected": expected,
        "multi_token_chunks": sum(n > 1 for r in done for n in r.chunk_tokens),
        "request_throughput": len(done) / window,
        "output_throughput": output_tokens / window,
        "total_token_throughput": (prompt_tokens + output_tokens) / window,
        "server_finished": finished,
        "server_request_throughput": sum(finished.values()) / window,
        "server_prefix_cache_hit_rate": hits / queries if queries else 0.0,
        "server_queue_p50_s": histogram_quantile(0.5, queue),
        "server_queue_p99_s": histogram_quantile(0.99, queue),
        "server_engine_steps": steps,
        "server_mean_step_latency_s": server.mean(f"{STEP},kind=engine"),
        "server_mean_step_period_s": window / steps if steps else math.nan,
        "tolerance": TOLERANCE,
        "metrics": rows,
        "all_ok": all(r["p50_ok"] and r["p99_ok"] for r in rows),
    }


def print_report(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=150)
    title = (
        f"kvstep serve, {result['model']}: {result['completed']}/{result['num_requests']} "
        f"requests at {result['request_rate']:g} req/s (Poisson), "
        f"{result['duration_s']:.1f} s"
    )
    table = Table(title=title)
    table.add_column("metric")
    for tag in ("p50", "p99"):
        for name in (f"client {tag}", f"server {tag}", "diff", "buckets"):
            table.add_column(name, justify="right")
    table.add_column("mean c/s", justify="right")
    table.add_column("within 10%")
    for row in result["metrics"]:
        cells = [row["metric"]]
        for tag in ("p50", "p99"):
            cells += [
                _ms(row[f"client_{tag}_s"]),
                _ms(row[f"server_{tag}_s"]),
                _pct(row[f"{tag}_rel_diff"]),
                _pct(row[f"{tag}_bucket_rel_diff"]),
            ]
        cells.append(f"{_ms(row['client_mean_s'])}/{_ms(row['server_mean_s'])}")
        verdict = {True: "ok", False: "NOT"}
        cells.append(f"p50 {verdict[row['p50_ok']]}, p99 {verdict[row['p99_ok']]}")
        table.add_row(*cells)
    console.print(table)
    console.print(
        f"throughput: {result['request_throughput']:.2f} req/s, "
        f"{result['output_throughput']:.1f} output tok/s, "
        f"{result['total_token_throughput']:.1f} total tok/s (client); "
        f"server finished {sum(result['server_finished'].values()):.0f} "
        f"({result['server_request_throughput']:.2f} req/s)"
    )
    console.print(
        f"tokens: {result['mean_prompt_tokens']:.0f} prompt tokens/request on average, "
        f"{result['output_tokens_total']} output (expected {result['output_tokens_expected']}); "
        f"prefix-cache hit rate {result['server_prefix_cache_hit_rate']:.0%}; "
        f"server queue p50/p99 {_ms(result['server_queue_p50_s'])}/"
        f"{_ms(result['server_queue_p99_s'])} ms; failed {result['failed']}"
    )
    console.print(
        f"engine steps: {result['server_engine_steps']:.0f}, mean step "
        f"{_ms(result['server_mean_step_latency_s'])} ms of a mean period (window / steps) "
        f"of {_ms(result['server_mean_step_period_s'])} ms; all comparisons within "
        f"10%: {'yes' if result['all_ok'] else 'NO'}"
    )
    load = result.get("load_average_1m")
    if load:
        console.print(
            f"machine: {result['cpu_count']} CPUs, 1-min load average {load[0]:.1f} before "
            f"the run and {load[1]:.1f} after (client and server included)"
        )
    console.print(
        "ms; diff = (server - client) / client; buckets = the same for the client's own "
        "samples put in the server's buckets (the part of diff the buckets alone make)"
    )


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1e3:.1f}"


def _pct(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:+.1%}"


def _range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(",")
    pair = (int(low), int(high or low))
    if not 0 < pair[0] <= pair[1]:
        raise argparse.ArgumentTypeError(f"want LOW,HIGH with 0 < LOW <= HIGH, got {text!r}")
    return pair


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--num-requests", type=int, default=200)
    parser.add_argument("--request-rate", type=float, default=1.5, help="requests/s (Poisson)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-prefixes", type=int, default=4, help="shared prompt prefixes")
    parser.add_argument("--prefix-words", type=_range, default=(16, 128), help="LOW,HIGH")
    parser.add_argument("--suffix-words", type=_range, default=(4, 64), help="LOW,HIGH")
    parser.add_argument("--output-tokens", type=_range, default=(8, 40), help="LOW,HIGH")
    parser.add_argument("--warmup", type=int, default=4, help="untimed requests first")
    parser.add_argument(
        "--server-arg", action="append", default=[], help="passed to kvstep serve (repeat)"
    )
    parser.add_argument("--json", type=Path, default=RESULTS / "serve.json")
    args = parser.parse_args(argv)

    specs = build_workload(args, args.num_requests, args.seed)
    warmup = build_workload(args, args.warmup, args.seed + 1)
    with (
        tempfile.TemporaryDirectory() as tmp,
        serve(args.model, args.server_arg, Path(tmp) / "server.log") as url,
    ):
        anyio.run(run_workload, url, [attrs.evolve(s, send_at_s=0.0) for s in warmup])
        before = Scrape.of(url)
        load_before = os.getloadavg()[0]
        run = anyio.run(run_workload, url, specs)
        after = Scrape.of(url)
    result = summarize(args, specs, run, after.since(before))
    result["load_average_1m"] = [load_before, os.getloadavg()[0]]  # was the machine shared?
    result["cpu_count"] = os.cpu_count()
    print_report(result)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
