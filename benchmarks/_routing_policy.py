"""One policy of ``benchmarks/routing.py``: fresh replicas and a proxy in front of them,
the workload through the proxy, and what the replicas, the proxy and the client saw.

Every policy gets new ``kvstep serve`` processes (their caches start empty) and a new
``kvstep proxy``; all are stopped before the next policy starts, so no policy runs
beside another's processes or inherits their caches.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import attrs
import httpx
import numpy as np
from _routing_trace import launch_traced, summarize_trace
from _serve_client import (
    ClientRecord,
    RequestSpec,
    WorkloadRun,
    launch,
    run_workload,
    send_one,
)
from _serve_metrics import SAMPLE_QUANTILE, Scrape, histogram_quantile

MODEL = "builtin:tiny"
# Each replica binds its PUB and replay sockets on free loopback ports and names them
# in its /health, where the proxy finds them.
EVENTS = json.dumps({"endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"})
DECISION = "kvstep_proxy_route_decision_seconds"
READY_TIMEOUT_S = 30.0
START_TIMEOUT_S = 180.0


@attrs.frozen
class Scenario:
    """One workload of ``routing.py``, run under every policy.

    Attributes:
        name: Its ``--scenarios`` name.
        specs: Its requests, in the order sent.
        warmup: Prompts of :func:`warm_up` (sharing nothing with ``specs``).
        num_gpu_blocks: Each replica's KV cache, in blocks.
        clients: Closed-loop clients, or ``None`` (each request at its time).
        workload: Its parameters, for the JSON.
        hash_times: Seconds to tokenize and hash each prompt of ``specs`` here.
    """

    name: str
    specs: list[RequestSpec]
    warmup: list[RequestSpec]
    num_gpu_blocks: int
    clients: int | None
    workload: dict[str, Any]
    hash_times: list[float]


@attrs.frozen(kw_only=True)
class Setup:
    """The processes of one policy's run.

    Attributes:
        num_gpu_blocks: Each replica's KV cache, in blocks (``--num-gpu-blocks``).
        replicas: How many ``kvstep serve`` processes.
        threads: ``OMP_NUM_THREADS`` of every process started.
        warmup: Requests sent straight to each replica before the run (untimed; their
            prompts share nothing with the workload's).
        server_args: More ``kvstep serve`` flags.
        health_interval_s: The proxy's ``--health-interval``.
        clients: Send the workload from this many closed-loop clients (each sends its
            next request when its last one finished), or ``None``: each request at its
            ``send_at_s``.
        trace: Run the proxy under ``_routing_trace.py``: every decision and every event
            batch it applied go to ``proxy.trace.jsonl`` in the logs folder.
    """

    num_gpu_blocks: int
    replicas: int = 3
    threads: int = 1
    warmup: int = 2
    server_args: tuple[str, ...] = ()
    health_interval_s: float = 0.5
    clients: int | None = None
    trace: bool = False


@contextlib.contextmanager
def cluster(setup: Setup, policy: str, logs: Path) -> Iterator[tuple[str, list[str]]]:
    """Fresh replicas and a proxy with ``policy``, all started at once; yields the
    proxy's URL and the replicas' URLs (in ``--backend`` order) once every one answers
    ``/health``; all stopped on exit."""
    flags = ["--model", MODEL, "--dtype", "float32", "--device", "cpu"]
    flags += ["--kv-events-endpoint", EVENTS, "--num-gpu-blocks", str(setup.num_gpu_blocks)]
    flags += setup.server_args
    env = {"OMP_NUM_THREADS": str(setup.threads)}
    logs.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        replicas = [
            stack.enter_context(launch("serve", flags, logs / f"replica{i}.log", env))
            for i in range(setup.replicas)
        ]
        urls = [r.url for r in replicas]
        args = ["--backend", *urls, "--policy", policy, "--tokenizer", MODEL]
        args += ["--health-interval", str(setup.health_interval_s)]
        if setup.trace:
            args += ["--trace", str(logs / "proxy.trace.jsonl")]
            router = stack.enter_context(launch_traced(args, logs / "proxy.log", env))
        else:
            router = stack.enter_context(launch("proxy", args, logs / "proxy.log", env))
        deadline = time.monotonic() + START_TIMEOUT_S
        for started in (*replicas, router):
            started.wait_healthy(deadline)
        yield router.url, urls


def warm_up(
    setup: Setup, policy: str, url: str, replicas: Sequence[str], prompts: Sequence[RequestSpec]
) -> None:
    """Send ``setup.warmup`` of ``prompts`` straight to each replica (its first forwards
    are slow), then the first of them through the proxy; under ``kv-aware``, repeat that
    until the proxy routes it by a cached prefix (it follows the replicas' events).

    Raises:
        RuntimeError: A warm-up request failed, or the kv-aware proxy routed by no
            replica's blocks within ``READY_TIMEOUT_S``.
    """
    per = setup.warmup
    for i, replica in enumerate(replicas):
        anyio.run(_send_each, replica, prompts[i * per : (i + 1) * per])
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        anyio.run(_send_each, url, prompts[:1])
        if policy != "kv-aware" or _total(Scrape.of(url), "kvstep_proxy_routed_hit_blocks_total"):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"the kv-aware proxy routed by no cached block in {READY_TIMEOUT_S} s"
            )
        time.sleep(0.2)


async def _send_each(url: str, specs: Sequence[RequestSpec]) -> None:
    """Send ``specs`` one after the other; ``RuntimeError`` when one fails."""
    async with httpx.AsyncClient(base_url=url, timeout=600.0) as client:
        for spec in specs:
            record = ClientRecord(sent=time.perf_counter())
            await send_one(client, spec, record)
            if not record.ok:
                raise RuntimeError(f"a warm-up request to {url} failed: {record.error}")


def run_policy(
    setup: Setup,
    policy: str,
    specs: Sequence[RequestSpec],
    warmup: Sequence[RequestSpec],
    logs: Path,
) -> dict[str, Any]:
    """Start a cluster under ``policy``, warm it up, send ``specs`` through its proxy
    (each at its time) and stop it; the summary of :func:`summarize`."""
    with cluster(setup, policy, logs / policy) as (url, replicas):
        warm_up(setup, policy, url, replicas, warmup)
        before = [Scrape.of(r) for r in replicas], Scrape.of(url)
        load_before = os.getloadavg()[0]
        since = time.monotonic()
        if setup.clients is None:
            run = anyio.run(run_workload, url, specs)
        else:
            run = anyio.run(run_closed_loop, url, specs, setup.clients)
        after = [Scrape.of(r) for r in replicas], Scrape.of(url)
        load_after = os.getloadavg()[0]
    deltas = [a.since(b) for a, b in zip(after[0], before[0], strict=True)]
    proxied = after[1].since(before[1])
    result = summarize(policy, run, deltas, proxied)
    result["proxy_hit_estimate_per_replica"] = [
        _total(proxied, f"kvstep_proxy_routed_hit_blocks_total,backend={r}")
        / max(1.0, _total(proxied, f"kvstep_proxy_routed_prompt_blocks_total,backend={r}"))
        for r in replicas
    ]
    result["load_average_1m"] = [load_before, load_after]
    if setup.trace:
        trace = summarize_trace(logs / policy / "proxy.trace.jsonl", replicas, since)
        result["trace"] = trace
    return result


async def run_closed_loop(url: str, specs: Sequence[RequestSpec], clients: int) -> WorkloadRun:
    """Send ``specs`` in order from ``clients`` clients, each sending its next request
    once its last one finished (``send_at_s`` is ignored); return when all are done."""
    records: list[ClientRecord] = []
    queue = iter(specs)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)

    async def one_client(client: httpx.AsyncClient) -> None:
        for spec in queue:  # shared: each spec is taken by one client
            record = ClientRecord(sent=time.perf_counter())
            records.append(record)
            await send_one(client, spec, record)

    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600.0) as client:
        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for _ in range(clients):
                tg.start_soon(one_client, client)
    return WorkloadRun(records, start)


def summarize(
    policy: str, run: WorkloadRun, replicas: Sequence[Scrape], proxied: Scrape
) -> dict[str, Any]:
    """One policy's row: the replicas' prefix-cache hit rate (their ``/metrics``
    differences, summed), the client's TTFT, the proxy's decision time and its own
    hit estimate, and how many requests each replica finished."""
    records = run.records
    done = [r for r in records if r.ok]
    end = max((r.ended for r in done if r.ended is not None), default=run.started)
    ttft = [r.ttft_s for r in done]
    p50, p99 = np.quantile(ttft, [0.5, 0.99], method=SAMPLE_QUANTILE) if ttft else (math.nan,) * 2
    queries = sum(_total(s, "kvstep_prefix_cache_queries_total") for s in replicas)
    hits = sum(_total(s, "kvstep_prefix_cache_hits_total") for s in replicas)
    routed = _total(proxied, "kvstep_proxy_routed_prompt_blocks_total")
    routed_hits = _total(proxied, "kvstep_proxy_routed_hit_blocks_total")
    decisions = proxied.hist.get(DECISION, [])
    return {
        "policy": policy,
        "completed": len(done),
        "failed": len(records) - len(done),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "duration_s": end - run.started,
        "prompt_tokens": queries,
        "hit_tokens": hits,
        "hit_rate": hits / queries if queries else math.nan,
        "ttft_p50_s": float(p50),
        "ttft_p99_s": float(p99),
        "ttft_mean_s": float(np.mean(ttft)) if ttft else math.nan,
        "route_decisions": proxied.counts.get(DECISION, 0.0),
        "route_decision_p99_s": histogram_quantile(0.99, decisions),
        "route_decision_mean_s": proxied.mean(DECISION),
        "proxy_hit_estimate": routed_hits / routed if routed else math.nan,
        "requests_per_replica": [_total(s, "kvstep_requests_total") for s in replicas],
        "hit_rate_per_replica": [
            _total(s, "kvstep_prefix_cache_hits_total")
            / max(1.0, _total(s, "kvstep_prefix_cache_queries_total"))
            for s in replicas
        ],
    }


def _total(scrape: Scrape, name: str) -> float:
    """Counter ``name`` summed over its labels."""
    return sum(v for k, v in scrape.counters.items() if k == name or k.startswith(name + ","))
