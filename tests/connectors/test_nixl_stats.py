"""The nixl worker's KV stats: a consumer reports the tokens and bytes of the reads that
completed, a failed read counts nothing (two workers on CPU caches, then two engines in
one process, as in test_nixl_engine.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import attrs
import pytest

pytest.importorskip("nixl_cu12")
pytest.importorskip("zmq")

from nixl_peer import SHAPE, filled_cache
from test_nixl_engine import BS, PARAMS, config, free_port, prefill, prompts, wait_idle

from connectors.base import ConnectorContext, KVConnectorRole, ModelFingerprint
from connectors.nixl import NixlMetadata, TransferError
from connectors.nixl.metadata import HeldSend, RemoteRead
from connectors.nixl.worker import NixlWorker
from pipeline import LLM, EngineConfig
from stages.model.builtin import TINY_CONFIG

# builtin:tiny, float32: K and V of every layer, every KV head, per token.
TINY_BYTES_PER_TOKEN = (
    2 * TINY_CONFIG["num_hidden_layers"] * TINY_CONFIG["num_key_value_heads"]
) * (TINY_CONFIG["head_dim"] * 4)
# The CPU cache of nixl_peer: [2, num_blocks, block_size, kv_heads, head_dim], 2 layers.
PEER_LAYERS = 2
PEER_BLOCK_BYTES = SHAPE[2] * SHAPE[3] * SHAPE[4] * 4  # one block of K (or V), one layer


def worker(role: str, port: int, rank: int, **options: Any) -> NixlWorker:
    """Rank ``rank`` of two (its producer serves on ``port + rank``)."""
    fingerprint = ModelFingerprint(
        architecture="A", weights_id="w", dtype="float32", block_size=SHAPE[2]
    )
    ctx = ConnectorContext(
        role=KVConnectorRole.WORKER,
        options={"role": role, "host": "127.0.0.1", "port": port, **options},
        block_size=SHAPE[2],
        fingerprint=fingerprint,
        rank=rank,
        world_size=2,
    )
    return NixlWorker(ctx)


@pytest.fixture(params=[0], ids=["rank0"])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[NixlWorker, NixlWorker]]:
    """Rank ``request.param``'s producer and consumer workers."""
    rank = request.param
    producer = worker("producer", free_port(2), rank, engine_id="prod")
    consumer = worker("consumer", free_port(2), rank, engine_id="cons")
    producer.register_kv_caches(filled_cache(PEER_LAYERS))
    consumer.register_kv_caches([t.zero_() for t in filled_cache(PEER_LAYERS)])
    yield producer, consumer
    anyio.run(consumer.aclose)
    anyio.run(producer.aclose)


def read(producer: NixlWorker, remote: tuple[int, ...], local: tuple[int, ...]) -> RemoteRead:
    """The read of ``remote`` blocks, which the producer now holds (so the consumer's
    claim of them is granted)."""
    anyio.run(step, producer, hold(remote))
    return spec_of(producer, remote, local)


def hold(remote: tuple[int, ...]) -> NixlMetadata:
    """The producer's metadata that holds request p1's ``remote`` blocks (ticket t1)."""
    return NixlMetadata(sends=(HeldSend("p1", "t1", remote),))


def spec_of(producer: NixlWorker, remote: tuple[int, ...], local: tuple[int, ...]) -> RemoteRead:
    opts = producer.options
    return RemoteRead("r1", opts.engine_id, opts.host, opts.port, "p1", remote, local, "", "t1")


async def step(w: NixlWorker, meta: NixlMetadata) -> tuple[frozenset[str], tuple[int, ...]]:
    """One step's connector calls: start the loads, then (recving, stats)."""
    w.bind_connector_metadata(meta)
    ctx = SimpleNamespace(scheduler_output=SimpleNamespace(requests=[object()]))
    await w.start_load_kv(ctx)  # type: ignore[arg-type]
    finished = await w.get_finished(frozenset())
    stats = w.get_kv_stats()
    w.clear_connector_metadata()
    return frozenset(finished.recving), stats


async def until_received(w: NixlWorker, first: RemoteRead) -> list[tuple[int, ...]]:
    """Steps (the first starts ``first``) until it is reported; each step's stats."""
    meta = NixlMetadata(reads=(first,))
    stats: list[tuple[int, ...]] = []
    end = time.monotonic() + 10.0
    while True:
        recving, step_stats = await step(w, meta)
        stats.append(step_stats)
        if first.req_id in recving:
            return stats
        assert time.monotonic() < end, "the read never ended"
        meta = NixlMetadata()
        await anyio.sleep(0.001)


class TestWorkerStats:
    def test_a_completed_read_counts_its_blocks_once_in_the_step_that_reports_it(
        self, pair: tuple[NixlWorker, NixlWorker]
    ) -> None:
        """3 blocks read: 3 * block_size tokens and K+V of every layer of 3 blocks, in the
        step whose recving names it; no step before or after counts anything."""
        producer, consumer = pair
        stats = anyio.run(until_received, consumer, read(producer, (1, 2, 5), (0, 3, 4)))
        blocks_bytes = 3 * 2 * PEER_LAYERS * PEER_BLOCK_BYTES
        assert stats[-1] == (3 * SHAPE[2], blocks_bytes, 0, 0)
        assert all(s == (0, 0, 0, 0) for s in stats[:-1])
        assert consumer.get_kv_stats() == stats[-1]  # a query: asking again changes nothing
        assert anyio.run(step, consumer, NixlMetadata()) == (frozenset(), (0, 0, 0, 0))

    @pytest.mark.parametrize("pair", [1], ids=["rank1"], indirect=True)
    def test_another_rank_counts_the_bytes_it_read_and_no_tokens(
        self, pair: tuple[NixlWorker, NixlWorker]
    ) -> None:
        """Ranks finish a read in different steps: only rank 0 counts its tokens (so
        fan-in, which takes one step's largest, counts them once); each rank its bytes."""
        producer, consumer = pair
        stats = anyio.run(until_received, consumer, read(producer, (1, 2), (0, 3)))
        assert stats[-1] == (0, 2 * 2 * PEER_LAYERS * PEER_BLOCK_BYTES, 0, 0)

    def test_a_read_refused_at_its_start_counts_nothing(
        self, pair: tuple[NixlWorker, NixlWorker]
    ) -> None:
        """Remote block ids out of range: the read fails (load errors), no traffic."""
        producer, consumer = pair
        stats = anyio.run(until_received, consumer, read(producer, (1, 99), (0, 3)))
        assert set(stats) == {(0, 0, 0, 0)}
        assert consumer.get_block_ids_with_load_errors() == {0, 3}

    def test_a_read_that_fails_in_flight_counts_nothing(
        self, pair: tuple[NixlWorker, NixlWorker], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The transfer fails when polled (a dead peer, its deadline): no traffic."""
        producer, consumer = pair
        assert consumer.agent is not None
        real_poll = consumer.agent.poll

        def failed(handle: Any) -> bool:
            if not real_poll(handle):  # done: the handle is released
                return False
            raise TransferError("prod", "transfer state ERR")

        monkeypatch.setattr(consumer.agent, "poll", failed)
        stats = anyio.run(until_received, consumer, read(producer, (1, 2), (0, 3)))
        assert set(stats) == {(0, 0, 0, 0)}
        assert consumer.get_block_ids_with_load_errors() == {0, 3}

    def test_the_producer_counts_no_load_and_no_save(
        self, pair: tuple[NixlWorker, NixlWorker]
    ) -> None:
        """A consumer's notification does not say how many blocks it read: the producer
        releases the send and reports no traffic."""
        producer, consumer = pair

        async def run() -> list[tuple[int, ...]]:
            await step(producer, hold((1, 2)))
            await until_received(consumer, spec_of(producer, (1, 2), (0, 3)))
            stats: list[tuple[int, ...]] = []
            end = time.monotonic() + 10.0
            while True:
                producer.bind_connector_metadata(NixlMetadata())
                await producer.start_load_kv(
                    SimpleNamespace(scheduler_output=SimpleNamespace(requests=[]))  # type: ignore[arg-type]
                )
                finished = await producer.get_finished(frozenset())
                stats.append(producer.get_kv_stats())
                producer.clear_connector_metadata()
                if "p1" in finished.sending:
                    return stats
                assert time.monotonic() < end, "the notification never arrived"

        assert set(anyio.run(run)) == {(0, 0, 0, 0)}


def totals(step_log: Path) -> dict[str, int]:
    """The engine steps' KV stats of a step log, summed."""
    keys = ("loaded_tokens", "loaded_bytes", "saved_tokens", "saved_bytes")
    sums = dict.fromkeys(keys, 0)
    for line in step_log.read_text().splitlines():
        record = json.loads(line)
        if record.get("event") == "step" and record.get("kind") == "engine":
            for key in keys:
                sums[key] += int(record.get(key) or 0)
    return sums


def logged(cfg: EngineConfig, path: Path) -> EngineConfig:
    return attrs.evolve(cfg, step_log=str(path))


class TestEngineStats:
    def test_the_consumer_reports_exactly_the_prompt_blocks_it_read(self, tmp_path: Path) -> None:
        """After a remote prefill, the consumer's engine steps loaded every full prompt
        block but the last token's (tokens and bytes of K and V of every layer), saved
        nothing; the producer loaded and saved nothing."""
        batch = prompts()
        expected = sum((len(p) - 1) // BS * BS for p in batch)
        producer_cfg = logged(config("producer", port=free_port()), tmp_path / "p.jsonl")
        with LLM(producer_cfg) as producer:
            params = prefill(producer, batch)
            consumer_cfg = logged(config("consumer", port=free_port()), tmp_path / "c.jsonl")
            with LLM(consumer_cfg) as consumer:
                outs = consumer.generate(batch, PARAMS, kv_transfer_params=params)
                assert [o.finish_reason for o in outs] == ["length"] * len(batch)
                assert not any(wait_idle(consumer).values())
            assert not any(wait_idle(producer).values())
        assert totals(tmp_path / "c.jsonl") == {
            "loaded_tokens": expected,
            "loaded_bytes": expected * TINY_BYTES_PER_TOKEN,
            "saved_tokens": 0,
            "saved_bytes": 0,
        }
        assert set(totals(tmp_path / "p.jsonl").values()) == {0}

    def test_a_failed_read_counts_nothing(self, tmp_path: Path) -> None:
        """The producer is gone before the read: the consumer recomputes the prompt and
        its steps report no KV loaded."""
        batch = prompts()[:1]
        with LLM(config("producer", port=free_port(), lease_s=0.3)) as producer:
            params = prefill(producer, batch)
            assert not any(wait_idle(producer).values())  # lease over, then closed
        consumer_cfg = config("consumer", port=free_port(), handshake_timeout_s=0.5)
        with LLM(logged(consumer_cfg, tmp_path / "c.jsonl")) as consumer:
            (out,) = consumer.generate(batch, PARAMS, kv_transfer_params=params)
            assert out.finish_reason == "length"
            assert not any(wait_idle(consumer).values())
        assert set(totals(tmp_path / "c.jsonl").values()) == {0}

    def test_two_ranks_count_the_tokens_once_and_the_bytes_of_both(self, tmp_path: Path) -> None:
        """world_size=2 on both sides: the prompt tokens read are counted once over the
        steps; the bytes are both ranks' (in-process ranks each hold the whole cache)."""
        batch = prompts()[:2]
        expected = sum((len(p) - 1) // BS * BS for p in batch)
        with LLM(config("producer", port=free_port(2), world_size=2)) as producer:
            params = prefill(producer, batch)
            consumer_cfg = config("consumer", port=free_port(2), world_size=2)
            with LLM(logged(consumer_cfg, tmp_path / "c.jsonl")) as consumer:
                outs = consumer.generate(batch, PARAMS, kv_transfer_params=params)
                assert [o.finish_reason for o in outs] == ["length"] * len(batch)
                assert not any(wait_idle(consumer).values())
            assert not any(wait_idle(producer).values())
        stats = totals(tmp_path / "c.jsonl")
        assert (stats["loaded_tokens"], stats["loaded_bytes"]) == (
            expected,
            2 * expected * TINY_BYTES_PER_TOKEN,
        )
