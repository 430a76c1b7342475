"""Disaggregated prefill/decode end to end: real ``kvstep serve --kv-role producer`` and
``--kv-role consumer`` processes (nixl connector) behind a real ``kvstep proxy``, against
a plain ``kvstep serve`` as the single-engine reference (examples/disaggregated.py), with
one rank each side and with two worker processes each side (multiproc)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("nixl_cu12")
pytest.importorskip("zmq")
pytest.importorskip("openai")

import httpx
from example_modules import load_example

LENGTHS = (16, 17, 31, 64, 129, 250, 333, 500)  # 8 concurrent requests, 0..31 blocks
MAX_TOKENS = 8

ex = load_example("disaggregated.py", "example_disaggregated")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The URL of a plain single-engine server, shared by the clusters."""
    with ex.reference_server(tmp_path_factory.mktemp("reference")) as server:
        yield server.urls["reference"]


@pytest.fixture(scope="module")
def procs(tmp_path_factory: pytest.TempPathFactory, reference: str) -> Iterator[Any]:
    with ex.cluster(tmp_path_factory.mktemp("disaggregated"), reference=reference) as cluster:
        yield cluster


@pytest.fixture
def split(tmp_path_factory: pytest.TempPathFactory, reference: str) -> Iterator[Any]:
    """Producer and consumer of two worker processes each (stopped after its test)."""
    logs = tmp_path_factory.mktemp("disaggregated_tp2")
    with ex.cluster(logs, world_size=2, reference=reference) as cluster:
        yield cluster


def prompts(seed: int) -> list[list[int]]:
    """One random prompt per length; a new seed gives prompts no engine has cached."""
    rng = random.Random(seed)
    return [[rng.randrange(1, 500) for _ in range(n)] for n in LENGTHS]


def assert_healthy(procs: Any) -> None:
    assert all(procs.alive().values()), procs.alive()
    for name in (*ex.ENGINES, "proxy"):
        assert httpx.get(f"{procs.urls[name]}/health", timeout=10).status_code == 200, name


def assert_disaggregated(procs: Any, seed: int, stream: bool) -> None:
    """8 concurrent requests through the proxy give the reference's greedy tokens; the
    consumer loads every whole prompt block (kvstep_kv_loaded_tokens) and computes
    the rest; the producer computes every prompt token; every process stays healthy."""
    result = ex.check(procs, prompts(seed), MAX_TOKENS, stream)  # asserts the first two
    assert result["computed_producer"] == sum(LENGTHS), result
    assert result["loaded_consumer"] == sum(ex.full_blocks(n) for n in LENGTHS), result
    assert_healthy(procs)


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_proxy_answers_as_one_engine_with_the_prompt_read_over_nixl(
    procs: Any, stream: bool
) -> None:
    """8 concurrent greedy requests (16..500 prompt tokens) through the proxy give a
    single engine's tokens; the consumer loads the full prompt blocks from the producer
    (its /metrics say so) and computes the rest; every process stays healthy."""
    assert_disaggregated(procs, seed=int(stream), stream=stream)


@pytest.mark.slow
def test_two_worker_processes_each_side_answer_as_one_engine(split: Any) -> None:
    """The same with world_size 2 (multiproc) on both sides: each consumer rank reads
    its shard from the producer's rank; the prompt tokens are counted loaded once."""
    assert_disaggregated(split, seed=2, stream=False)
