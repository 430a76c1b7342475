"""Tests of ``kvstep proxy --policy kv-aware``: routing by the replicas' KV events.

The replicas are fake Starlette apps whose ``/health`` advertises a real
:class:`ZmqEventPublisher` on loopback; the test publishes on it what a replica's block
pool would (the prompt's block hashes), and the proxy follows the events as it follows
real replicas'.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("zmq")

import httpx
from proxy_fakes import Fake, Servers
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pipeline.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventsConfig,
    ZmqEventPublisher,
    prompt_block_hashes,
)
from pipeline.proxy import BackendPool, ProxyMetrics, ProxyOptions, create_proxy_app
from pipeline.proxy.kv_aware import KVAwareRouter
from pipeline.tokenizer import load_tokenizer
from stages.model.builtin import tokenizer_dir

BS = 4
SEED = 7
PROMPT = list(range(100, 117))  # 4 full blocks and a partial one


def stored(tokens: list[int]) -> BlockStored:
    hashes = prompt_block_hashes(tokens, BS, hash_seed=SEED)
    usable = tokens[: len(hashes) * BS]
    return BlockStored(hashes, None, usable, BS, None, "GPU")


class Replica(Fake):
    """A fake replica whose ``/health`` advertises its KV event publisher."""

    def __init__(self, name: str) -> None:
        config = KVEventsConfig(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
        self.publisher = ZmqEventPublisher(config)
        super().__init__(name)

    async def _health(self, request: Request) -> Response:
        if not self.healthy:
            return JSONResponse({"ok": False}, status_code=503)
        entry = self.publisher.describe()
        entry["endpoint"] = str(entry["endpoint"]).replace("127.0.0.1", "0.0.0.0")  # a bind
        return JSONResponse({"status": "ok", "kv_events": entry})


class Cluster:
    def __init__(self, serve: Servers, count: int = 3, **options: Any) -> None:
        self.replicas = [Replica(f"r{i}") for i in range(count)]
        self.urls = [serve(r.app).url for r in self.replicas]
        proxy = ProxyOptions(
            backend=tuple(self.urls),
            policy="kv-aware",
            block_size=BS,
            hash_seed=SEED,
            health_interval_s=0.1,
            health_timeout_s=1.0,
            **options,
        )
        self.app = create_proxy_app(proxy)
        self.proxy = serve(self.app)
        self.client = httpx.Client(base_url=self.proxy.url, timeout=10)
        serve.clients.append(self.client)

    @property
    def router(self) -> KVAwareRouter:
        routers: tuple[KVAwareRouter, ...] = self.app.state.kvstep.routers
        return routers[0]

    def held(self, replica: int) -> int:
        return self.router.index.num_blocks(self.urls[replica])

    def post(self, prompt: list[int]) -> str:
        response = self.client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        assert response.status_code == 200, response.text
        return str(response.json()["id"])

    def close(self) -> None:
        for replica in self.replicas:
            replica.publisher.close()


@pytest.fixture
def cluster(serve: Servers) -> Iterator[Cluster]:
    made = Cluster(serve)
    yield made
    made.close()


def _wait(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


class TestRouting:
    def test_a_prompt_goes_where_its_prefix_is(self, cluster: Cluster) -> None:
        """Replica 1 published the prompt's blocks: every request of it goes there; a
        longer cached prefix beats a shorter one; another prompt goes where the
        prefixes routed lately take the fewest blocks, and its repeats follow it before
        any event announces it."""
        cluster.replicas[1].publisher.publish([stored(PROMPT)])
        _wait(lambda: cluster.held(1) == 4)
        assert {cluster.post(PROMPT) for _ in range(4)} == {"r1"}
        cluster.replicas[2].publisher.publish([stored([9, 9, 9, 9, 8, 8, 8, 8])])
        cluster.replicas[0].publisher.publish([stored(PROMPT[:8])])
        _wait(lambda: cluster.held(0) == 2 and cluster.held(2) == 2)
        assert cluster.post(PROMPT) == "r1"  # 4 blocks held against 2
        assert cluster.post([9, 9, 9, 9, 8, 8, 8, 8, 1]) == "r2"
        assert [cluster.post([5] * 12) for _ in range(3)] == ["r0"] * 3  # r0: none sent
        metrics = cluster.client.get("/metrics").text
        assert (
            f'kvstep_proxy_routed_hit_blocks_total{{backend="{cluster.urls[1]}"}} 20.0' in metrics
        )
        assert "kvstep_proxy_route_decision_seconds_count 9.0" in metrics
        for n, blocks in ((0, 2), (1, 4), (2, 2)):
            want = f'kvstep_proxy_indexed_blocks{{backend="{cluster.urls[n]}"}} {blocks}.0'
            assert want in metrics, want

    def test_removed_and_cleared_blocks_stop_attracting(self, cluster: Cluster) -> None:
        """Without its first block a replica holds no prefix of the prompt, whatever it
        holds of the rest: the prompt is spread again. Another tier's events (medium CPU)
        change nothing. AllBlocksCleared empties it."""
        publisher = cluster.replicas[1].publisher
        publisher.publish([stored(PROMPT)])
        _wait(lambda: cluster.held(1) == 4)
        hashes = prompt_block_hashes(PROMPT, BS, hash_seed=SEED)
        publisher.publish([BlockRemoved(hashes[:1], "CPU")])  # another tier's: no change
        publisher.publish([BlockStored(hashes, None, [], BS, None, "CPU")])
        publisher.publish([BlockRemoved(hashes[:1], "GPU")])  # the first block: no prefix
        _wait(lambda: cluster.held(1) == 3)
        assert len({cluster.post(PROMPT) for _ in range(3)}) == 1  # the first's replica
        metrics = cluster.client.get("/metrics").text
        assert "kvstep_proxy_routed_hit_blocks_total" in metrics
        assert not [
            line
            for line in metrics.splitlines()
            if line.startswith("kvstep_proxy_routed_hit_blocks_total") and not line.endswith(" 0.0")
        ], "a replica without the first block was credited with a hit"
        publisher.publish([stored(PROMPT), AllBlocksCleared()])
        _wait(lambda: cluster.held(1) == 0)  # stored again, then all cleared

    def test_a_late_router_replays_and_a_dead_replica_is_forgotten(self, serve: Servers) -> None:
        """Blocks published before the proxy subscribed arrive by replay; a replica that
        fails its health check leaves the index, and comes back with its events."""
        cluster = Cluster(serve, count=2)
        try:
            cluster.replicas[0].publisher.publish([stored(PROMPT)])  # maybe before joining
            _wait(lambda: cluster.held(0) == 4)
            assert cluster.post(PROMPT) == "r0"
            cluster.replicas[0].healthy = False
            _wait(lambda: cluster.held(0) == 0)
            assert {cluster.post(PROMPT) for _ in range(2)} == {"r1"}
            cluster.replicas[0].healthy = True
            _wait(lambda: cluster.held(0) == 4)  # replayed from its buffer again
        finally:
            cluster.close()


class TestRouter:
    def router(
        self,
        tokenizer: Any = None,
        load_weight: float = 8.0,
        urls: tuple[str, ...] = ("http://a", "http://b"),
        clock: Callable[[], float] = time.monotonic,
    ) -> KVAwareRouter:
        pool = BackendPool("backend", urls, "kv-aware")
        return KVAwareRouter(
            pool,
            clock=clock,
            tokenizer=tokenizer,
            block_size=BS,
            hash_seed=SEED,
            hash_format="int",
            load_weight=load_weight,
            max_blocks=1000,
            metrics=ProxyMetrics(),
        )

    def test_load_outweighs_a_short_prefix_only(self) -> None:
        """Cost = blocks to compute + load_weight per open request: a hit of 4 blocks on
        a replica with one open request (weight 2) beats none on an idle one; with
        weight 8 the idle one wins."""
        hashes = prompt_block_hashes(PROMPT, BS, hash_seed=SEED)
        for weight, expected in ((2.0, "http://a"), (8.0, "http://b")):
            router = self.router(load_weight=weight)
            a, b = router.pool.backends
            router.index.stored("http://a", hashes)
            a.in_flight = 1
            assert router.choose([a, b], hashes).url == expected

    def test_an_unannounced_prefix_follows_its_first_request(self) -> None:
        """Routed, not yet announced: a repeat goes where the first went (without that it
        looked like a miss everywhere and was sent to the next replica in turn), until
        ``pending_s`` passes with no event confirming it; then it is a miss again."""
        now = [0.0]
        router = self.router(urls=("http://a", "http://b", "http://c"), clock=lambda: now[0])
        hashes = prompt_block_hashes(PROMPT, BS, hash_seed=SEED)
        backends = router.pool.backends
        first = router.choose(backends, hashes)
        assert first.url == "http://a"
        turned = backends[1:] + backends[:1]  # the pool's next turn starts elsewhere
        assert [router.choose(turned, hashes).url for _ in range(3)] == ["http://a"] * 3
        assert router.index.expected["http://a"] == 4
        now[0] = router.pending_s + 1.0  # never announced: forgotten
        other = router.choose(turned, hashes)
        assert other.url == "http://b"  # a miss everywhere: the least recent blocks, in turn

    def test_a_new_prefix_goes_where_it_evicts_nothing(self) -> None:
        """Replica a's cache (8 blocks: it evicted, so the index knows) holds two recent
        prefixes of 4 blocks; b holds one. A third prefix goes to b, though a comes first
        in turn and both are idle; with room on both, the one whose recent prefixes take
        fewer blocks wins; and a's own prefix still goes to a."""
        router = self.router()
        a, b = router.pool.backends
        prompts = [[t] * 17 for t in (10, 20, 30, 40)]
        hashes = [prompt_block_hashes(p, BS, hash_seed=SEED) for p in prompts]
        router.index.stored("http://a", [bytes(8)])  # a warm-up block, evicted later
        router.index.stored("http://a", [*hashes[0], *hashes[1]])
        router.index.removed("http://a", [bytes(8)])
        router.index.stored("http://b", hashes[2])
        for prompt_hashes in hashes[:2]:
            assert router.choose([a, b], prompt_hashes) is a
        assert router.index.capacity("http://a") == 9
        assert router.choose([a, b], hashes[2]) is b
        assert router.choose([a, b], hashes[3]) is b  # would evict 3 of a's blocks
        assert router.footprint.prefixes("http://b") == 2
        assert router.choose([a, b], hashes[0]) is a  # a hit: nothing to compute

    @pytest.mark.anyio
    async def test_text_and_chat_hash_as_the_replica_encodes(self) -> None:
        """A text prompt is encoded, and chat messages rendered with the chat template
        and encoded, with the model's own tokenizer; a batch routes by its first prompt;
        what cannot be hashed gives no hashes."""
        tokenizer = load_tokenizer(tokenizer_dir("builtin:tiny"))
        assert tokenizer is not None
        router = self.router(tokenizer)

        def expect(text: str) -> list[Any]:
            return prompt_block_hashes(tokenizer.encode(text), BS, hash_seed=SEED)

        text = "the quick brown fox jumps over the lazy dog " * 3
        got = await router.prompt_hashes("/v1/completions", {"prompt": text})
        assert got == expect(text) and len(got) >= 4
        assert await router.prompt_hashes("/v1/completions", {"prompt": [text, "x"]}) == got
        ids = await router.prompt_hashes("/v1/completions", {"prompt": [PROMPT, [1]]})
        assert ids == prompt_block_hashes(PROMPT, BS, hash_seed=SEED)
        long = list(range(3, 1003))  # hashed on a worker thread
        ids = await router.prompt_hashes("/v1/completions", {"prompt": long})
        assert ids == prompt_block_hashes(long, BS, hash_seed=SEED) and len(ids) == 250
        messages = [{"role": "user", "content": text}]
        from pipeline.server.chat_template import render_chat

        chat = await router.prompt_hashes("/v1/chat/completions", {"messages": messages})
        assert chat == expect(render_chat(tokenizer, messages))
        for bad in ({"prompt": 3}, {"prompt": [True, 1]}, {"messages": "hi"}, {}):
            path = "/v1/chat/completions" if "messages" in bad else "/v1/completions"
            assert await router.prompt_hashes(path, bad) == []
        assert await self.router().prompt_hashes("/v1/completions", {"prompt": text}) == []

    def test_the_seed_stays_out_of_reprs(self) -> None:
        options = ProxyOptions(backend=("http://a",), policy="kv-aware", hash_seed=123456789)
        assert "123456789" not in repr(options) and "123456789" not in repr(self.router())


class TestFlags:
    def test_kv_aware_flags(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """The seed comes from --hash-seed, else $KVSTEP_HASH_SEED; one event endpoint
        per backend; a bad variable's value is not shown."""
        import argparse

        from pipeline.errors import InvalidConfigError
        from pipeline.proxy import add_proxy_flags, proxy_options

        parser = argparse.ArgumentParser()
        add_proxy_flags(parser)
        flags = ["--backend", "http://a:1", "http://b:2", "--policy", "kv-aware"]
        monkeypatch.setenv("KVSTEP_HASH_SEED", "42")
        options = proxy_options(parser.parse_args([*flags, "--block-size", "32"]))
        assert (options.hash_seed, options.block_size, options.kv_events) == (42, 32, ())
        given = ["--hash-seed", "5", "--kv-events", "tcp://a:9", "tcp://b:9"]
        options = proxy_options(parser.parse_args([*flags, *given]))
        assert options.hash_seed == 5 and options.kv_events == ("tcp://a:9", "tcp://b:9")
        with pytest.raises(InvalidConfigError, match="one endpoint per backend"):
            proxy_options(parser.parse_args([*flags, "--kv-events", "tcp://a:9"]))
        monkeypatch.setenv("KVSTEP_HASH_SEED", "secret-value")
        with pytest.raises(InvalidConfigError) as info:
            proxy_options(parser.parse_args(flags))
        assert "secret-value" not in str(info.value)
