"""The nixl connector between two engines in one process: prefill on a producer, decode
on a consumer, outputs identical to a single engine's."""

from __future__ import annotations

import random
import time
from typing import Any

import pytest

pytest.importorskip("nixl_cu12")
pytest.importorskip("zmq")

from ports import free_port

from pipeline import LLM, EngineConfig, SamplingParams

BS = 16
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PREFILL = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
DECODE = {"do_remote_decode": True}


def prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(1, 200) for _ in range(n)] for n in (40, 17, 33, 5)]


def config(role: str | None, **options: Any) -> EngineConfig:
    fields = ("load_failure_policy", "block_size", "world_size")
    extra = {k: options.pop(k) for k in fields if k in options}
    if role is None:
        return EngineConfig(model="builtin:tiny", **extra)
    return EngineConfig(
        model="builtin:tiny",
        connector="nixl",
        connector_options={"role": role, "host": "127.0.0.1", **options},
        **extra,
    )


def wait_idle(llm: LLM, timeout: float = 10.0) -> dict[str, int]:
    end = time.monotonic() + timeout
    while True:
        report = llm.leak_report()
        if not any(report.values()) or time.monotonic() > end:
            return report
        time.sleep(0.02)


@pytest.fixture(scope="module")
def reference() -> list[tuple[int, ...]]:
    with LLM(config(None)) as llm:
        return [o.token_ids for o in llm.generate(prompts(), PARAMS)]


@pytest.fixture
def producer():
    with LLM(config("producer", port=free_port(), lease_s=30.0)) as llm:
        yield llm


def prefill(producer: LLM, batch: list[list[int]]) -> list[dict[str, Any]]:
    outs = producer.generate(batch, PREFILL, kv_transfer_params=[DECODE] * len(batch))
    params = [o.kv_transfer_params for o in outs]
    assert all(p is not None and p["do_remote_prefill"] for p in params), params
    return params  # type: ignore[return-value]


class TestDisaggregated:
    def test_consumer_decodes_what_one_engine_decodes_without_computing_the_prompt(
        self, reference, producer
    ) -> None:
        """The consumer loads every full prompt block but the last token's from the
        producer, decodes the same greedy tokens, and both engines end with no leak."""
        batch = prompts()
        params = prefill(producer, batch)
        with LLM(config("consumer", port=free_port())) as consumer:
            outs = consumer.generate(batch, PARAMS, kv_transfer_params=params)
            assert [o.token_ids for o in outs] == reference
            loaded = [o.metrics.num_external_tokens for o in outs]
            assert loaded == [(len(p) - 1) // BS * BS for p in batch]
            assert not any(wait_idle(consumer).values())
        assert not any(wait_idle(producer).values())  # freed by the notifications

    def test_the_producer_frees_held_blocks_when_the_lease_expires(self) -> None:
        """No consumer ever reads: the held blocks are freed after lease_s."""
        with LLM(config("producer", port=free_port(), lease_s=0.3)) as producer:
            prefill(producer, prompts()[:2])
            assert not any(wait_idle(producer, 10.0).values())

    def test_a_closed_producer_fails_the_consumer_request_alone(self, reference) -> None:
        """The producer is gone before the read: that request ends with "error"; the
        consumer keeps serving the others, and leaks nothing."""
        batch = prompts()
        with LLM(config("producer", port=free_port(), lease_s=0.3)) as producer:
            params = prefill(producer, batch[:1])
            assert not any(wait_idle(producer).values())  # lease over, then closed
        consumer_cfg = config(
            "consumer", port=free_port(), handshake_timeout_s=0.5, load_failure_policy="fail"
        )
        with LLM(consumer_cfg) as consumer:
            (dead,) = consumer.generate(batch[:1], PARAMS, kv_transfer_params=params)
            assert dead.finish_reason == "error"
            alive = consumer.generate(batch[1:], PARAMS)
            assert [o.token_ids for o in alive] == reference[1:]
            assert not any(wait_idle(consumer).values())

    def test_a_producer_of_another_block_size_is_refused(self) -> None:
        """KV of another block size is never loaded: under load_failure_policy="fail"
        the request fails alone (test_nixl_failures: recompute); the producer frees its
        blocks when its lease runs out."""
        with LLM(config("producer", port=free_port(), lease_s=0.3)) as producer:
            params = prefill(producer, prompts()[:1])
            cfg = config("consumer", port=free_port(), block_size=8, load_failure_policy="fail")
            with LLM(cfg) as consumer:
                (out,) = consumer.generate(prompts()[:1], PARAMS, kv_transfer_params=params)
                assert out.finish_reason == "error"
                assert not any(wait_idle(consumer).values())
            assert not any(wait_idle(producer).values())

    def test_two_ranks_read_from_the_two_producer_ranks(self, reference) -> None:
        """world_size=2 on both sides: rank r reads from the producer's rank r; the
        consumer decodes what one engine decodes, and nothing leaks."""
        batch = prompts()[:2]
        with LLM(config("producer", port=free_port(2), world_size=2)) as producer:
            params = prefill(producer, batch)
            assert {p["tp_size"] for p in params} == {2}
            with LLM(config("consumer", port=free_port(2), world_size=2)) as consumer:
                outs = consumer.generate(batch, PARAMS, kv_transfer_params=params)
                assert [o.token_ids for o in outs] == reference[:2]
                assert [o.metrics.num_external_tokens for o in outs] == [32, 16]
                assert not any(wait_idle(consumer).values())
            assert not any(wait_idle(producer).values())


def _listening_addresses(pid: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp* shows them) of ``pid``'s listening
    TCP sockets."""
    import os

    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # LISTEN, ours
                    found.add(fields[1].rsplit(":", 1)[0])
    return found


def test_ucx_and_the_side_channel_listen_on_loopback_only() -> None:
    """With default options an engine's sockets (the side channel, UCX's) listen on
    loopback only, not on every interface (UCX_NET_DEVICES=lo while its agent starts)."""
    import os

    loopback = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1
    with LLM(config("producer", port=free_port(), lease_s=0.3)) as producer:
        prefill(producer, prompts()[:1])
        addresses = _listening_addresses(os.getpid())
        assert addresses and addresses <= loopback, addresses
        assert not any(wait_idle(producer).values())
