"""A replica killed mid-run behind ``kvstep proxy --policy kv-aware``: real processes.

Three ``kvstep serve`` replicas (``builtin:tiny``, KV events on) and a ``kvstep proxy``
on loopback. Each replica first gets one tenant's long prompt prefix straight, so the
router (``--load-weight 0``: the cached prefix alone decides) sends every request of
tenant ``k`` to replica ``k``; which replica a request is on is then known from its
tenant. Six clients (two per tenant) stream requests back to back; while one of the
victim's tenant is open, the victim is SIGKILLed (the kill's time: once it is reaped);
the clients go on for a few seconds.
"""

from __future__ import annotations

import contextlib
import json
import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("zmq")
pytest.importorskip("uvicorn")

import anyio
import anyio.to_thread
import attrs
import httpx
from server_process import ServerProcess, launch

from pipeline.kv_events import prompt_block_hashes

TENANTS = 3
VICTIM = 1
CLIENTS_PER_TENANT = 2
PREFIX_TOKENS = 256  # 16 blocks: each tenant's prefix, cached on its own replica only
MAX_TOKENS = 24
BEFORE_KILL_S = 2.0
AFTER_KILL_S = 4.0
EVENTS = json.dumps({"endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*"})
ENV = {"OMP_NUM_THREADS": "1"}


@attrs.define
class Sent:
    """One request as the client saw it (``perf_counter`` seconds)."""

    tenant: int
    sent: float
    ended: float = 0.0
    error: str | None = None


@contextlib.contextmanager
def cluster(logs: Path) -> Iterator[tuple[ServerProcess, list[ServerProcess]]]:
    """Three replicas and a kv-aware proxy, started at once; ready on entry."""
    flags = ["--model", "builtin:tiny", "--dtype", "float32", "--device", "cpu"]
    flags += ["--kv-events-endpoint", EVENTS, "--num-gpu-blocks", "256"]
    with contextlib.ExitStack() as stack:
        replicas = [
            stack.enter_context(launch("serve", flags, logs / f"replica{i}.log", ENV))
            for i in range(TENANTS)
        ]
        args = ["--backend", *(r.url for r in replicas), "--policy", "kv-aware"]
        args += ["--load-weight", "0", "--health-interval", "0.5", "--health-timeout", "1"]
        proxy = stack.enter_context(launch("proxy", args, logs / "proxy.log", ENV))
        deadline = time.monotonic() + 120
        for process in (*replicas, proxy):
            process.wait_healthy(deadline)
        yield proxy, replicas


def complete(url: str, prompt: list[int], max_tokens: int = 1) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text


def routed_hits(proxy: ServerProcess, url: str) -> float:
    """The proxy's ``kvstep_proxy_routed_hit_blocks_total`` of backend ``url``."""
    text = httpx.get(f"{proxy.url}/metrics", timeout=10).text
    want = f'kvstep_proxy_routed_hit_blocks_total{{backend="{url}"}}'
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(want))


def indexed_blocks(proxy: ServerProcess, url: str) -> float:
    """The proxy's ``kvstep_proxy_indexed_blocks`` of backend ``url`` (0 before any)."""
    text = httpx.get(f"{proxy.url}/metrics", timeout=10).text
    want = f'kvstep_proxy_indexed_blocks{{backend="{url}"}}'
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(want))


def seed_tenants(
    proxy: ServerProcess, replicas: list[ServerProcess], rng: random.Random
) -> list[list[int]]:
    """Each tenant's prefix, cached on its own replica only; returns once the proxy routes
    a request of each tenant to that replica by its cached blocks.

    Nothing goes through the proxy before its index holds every replica's prefix (its
    ``kvstep_proxy_indexed_blocks``): a request routed before the events arrived would
    land anywhere and cache its tenant's prefix on a second replica too, and the tenants'
    requests would then split between the two."""
    prefixes = [[rng.randrange(1, 500) for _ in range(PREFIX_TOKENS)] for _ in range(TENANTS)]
    assert len(prompt_block_hashes(prefixes[0], 16)) == PREFIX_TOKENS // 16
    for prefix, replica in zip(prefixes, replicas, strict=True):
        complete(replica.url, prefix)
    deadline = time.monotonic() + 20
    while any(indexed_blocks(proxy, r.url) < PREFIX_TOKENS // 16 for r in replicas):
        assert time.monotonic() < deadline, "the proxy never indexed the replicas' events"
        time.sleep(0.1)
    for prefix, replica in zip(prefixes, replicas, strict=True):
        deadline = time.monotonic() + 20
        while routed_hits(proxy, replica.url) < PREFIX_TOKENS // 16:
            assert time.monotonic() < deadline, "the proxy never routed by the replica's events"
            complete(proxy.url, [*prefix, 1, 2, 3])
            time.sleep(0.1)
    return prefixes


async def stream(client: httpx.AsyncClient, prompt: list[int], record: Sent) -> None:
    """One streamed completion; a non-200, an error event or a missing ``[DONE]`` is an
    error in ``record``."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return
            done = False
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: ") and "error" in json.loads(line[6:]):
                    record.error = line[:200]
            if not done and record.error is None:
                record.error = "no [DONE]"
    except httpx.HTTPError as exc:
        record.error = repr(exc)[:200]
    finally:
        record.ended = time.perf_counter()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_killed_replica_fails_only_what_was_in_flight_on_it(tmp_path: Path) -> None:
    """SIGKILL one replica mid-stream: every request sent after the kill succeeds (on the
    other two), and the only failures are requests that were open on the dead one."""
    rng = random.Random(0)
    records: list[Sent] = []
    killed_at: list[float] = []  # when the victim was reaped
    signalled: list[float] = []  # when SIGKILL was sent
    with cluster(tmp_path) as (proxy, replicas):
        prefixes = seed_tenants(proxy, replicas, rng)

        async def client_loop(tenant: int, http: httpx.AsyncClient, until: list[float]) -> None:
            while time.perf_counter() < until[0]:
                record = Sent(tenant, time.perf_counter())
                records.append(record)
                prompt = [*prefixes[tenant], *(rng.randrange(1, 500) for _ in range(8))]
                await stream(http, prompt, record)

        async def kill_when_busy(until: list[float]) -> None:
            await anyio.sleep(BEFORE_KILL_S)
            while True:  # one of the victim's requests open for 50 ms at least
                now = time.perf_counter()
                if any(r.tenant == VICTIM and not r.ended and now - r.sent > 0.05 for r in records):
                    break
                await anyio.sleep(0.01)
            signalled.append(time.perf_counter())
            replicas[VICTIM].process.kill()
            # dead from here on: a request that reached it while it was dying was in
            # flight on it
            await anyio.to_thread.run_sync(replicas[VICTIM].process.wait)
            killed_at.append(time.perf_counter())
            until[0] = killed_at[0] + AFTER_KILL_S

        async def run() -> None:
            until = [time.perf_counter() + 60.0]
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
            async with (
                httpx.AsyncClient(base_url=proxy.url, timeout=60, limits=limits) as http,
                anyio.create_task_group() as group,
            ):
                group.start_soon(kill_when_busy, until)
                for tenant in range(TENANTS):
                    for _ in range(CLIENTS_PER_TENANT):
                        group.start_soon(client_loop, tenant, http, until)

        anyio.run(run)
        health = httpx.get(f"{proxy.url}/health", timeout=10)
        metrics = httpx.get(f"{proxy.url}/metrics", timeout=10).text

    kill = killed_at[0]
    # open on the victim while it died: sent before it was reaped, ended after the signal
    in_flight = [
        r for r in records if r.tenant == VICTIM and r.sent < kill and r.ended > signalled[0]
    ]
    failed = [r for r in records if r.error is not None]
    after = [r for r in records if r.sent > kill]
    assert in_flight, "the kill found nothing open on the victim"
    assert all(r in in_flight for r in failed), [(r.tenant, r.error) for r in failed]
    assert len(failed) <= len(in_flight)
    assert not [r.error for r in after if r.error]
    assert sum(r.tenant == VICTIM for r in after) >= 2, "the victim's tenant stopped sending"
    assert health.status_code == 200, health.text
    assert 'kvstep_proxy_healthy_backends{pool="backend"} 2.0' in metrics
