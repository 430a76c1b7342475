"""The README's multi-engine command blocks, run verbatim (``tests/readme_commands.py``):
P/D disaggregation and KV-aware routing on one host with default options.

One file, so that the blocks (which name fixed ports, as the README does) never run at
the same time under pytest-xdist (``--dist loadfile``).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from readme_commands import readme_block, run_block

_ROUTING_URLS = ("http://127.0.0.1:8101", "http://127.0.0.1:8102", "http://127.0.0.1:8103")
_PROXY_URL = "http://127.0.0.1:8000"


def _routed_tokens(url: str, prompt: list[int]) -> list[int]:
    """Greedy token ids of ``prompt`` from ``url``'s ``/v1/completions``."""
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return list(response.json()["choices"][0]["token_ids"])


def _labelled_sum(url: str, name: str) -> float:
    """The sum over labels of a labelled metric of ``url``'s ``/metrics``."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    found = re.findall(rf"^{re.escape(name)}{{[^}}]*}} ([0-9.e+-]+)$", text, re.MULTILINE)
    return sum(float(value) for value in found)


@pytest.fixture(scope="class")
def routing_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The README's routing block running (three replicas, the kv-aware proxy), prompts
    with shared prefixes sent through the proxy once it follows the replicas' events,
    and the same prompts sent to one replica directly."""
    pytest.importorskip("zmq")
    tmp = tmp_path_factory.mktemp("routing")
    text = readme_block("--policy kv-aware")
    systems = [[7 + (s * 13 + j * 5) % 200 for j in range(64)] for s in range(2)]
    prompts = [systems[i % 2] + [210 + i, 220 + i, 230 + i] for i in range(8)]
    with run_block(text, tmp) as block:
        for url in (*_ROUTING_URLS, _PROXY_URL):
            block.wait_healthy(url)
        # The proxy subscribes once it has read each replica's /health; batches sent
        # before it joined are not replayed (no replay socket): warm up until some arrive.
        deadline = time.monotonic() + 60
        warm = 0
        while _labelled_sum(_PROXY_URL, "kvstep_proxy_indexed_blocks") == 0:
            assert time.monotonic() < deadline, f"no KV event reached the proxy: {block.tail()}"
            _routed_tokens(_PROXY_URL, [240 - warm % 30] * 40)
            warm += 1
            time.sleep(0.2)
        via_proxy = [_routed_tokens(_PROXY_URL, p) for p in prompts]
        yield {
            "block": block,
            "indexed": _labelled_sum(_PROXY_URL, "kvstep_proxy_indexed_blocks"),
            "hit_blocks": _labelled_sum(_PROXY_URL, "kvstep_proxy_routed_hit_blocks_total"),
            "via_proxy": via_proxy,
            "alone": [_routed_tokens(_ROUTING_URLS[0], p) for p in prompts],
        }


class TestRoutingCommands:
    """The README's routing block (three replicas with plain loopback event endpoints,
    the kv-aware proxy), typed as is, on one host."""

    def test_events_arrive_at_the_proxy(self, routing_run: dict[str, Any]) -> None:
        """The proxy indexes the replicas' blocks and routes prompts onto cached prefixes."""
        assert routing_run["indexed"] > 0, routing_run["block"].tail()
        assert routing_run["hit_blocks"] > 0, routing_run["block"].tail()

    def test_tokens_equal_a_single_servers(self, routing_run: dict[str, Any]) -> None:
        """Greedy token ids through the proxy are one replica's, asked directly."""
        assert routing_run["via_proxy"] == routing_run["alone"]
