"""Disaggregated prefill/decode end to end: real ``kvstep serve --kv-role producer`` and
``--kv-role consumer`` processes (nixl connector) behind a real ``kvstep proxy``, against
a plain ``kvstep serve`` as the single-engine reference (examples/disaggregated.py)."""

from __future__ import annotations

import asyncio
import importlib.util
import random
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("nixl_cu12")
pytest.importorskip("zmq")
pytest.importorskip("openai")

import httpx
import openai

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "disaggregated.py"
LENGTHS = (16, 17, 31, 64, 129, 250, 333, 500)  # 8 concurrent requests, 0..31 blocks
MAX_TOKENS = 8


def _load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("example_disaggregated", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ex = _load_example()


@pytest.fixture(scope="module")
def procs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with ex.cluster(tmp_path_factory.mktemp("disaggregated")) as cluster:
        yield cluster


def prompts(seed: int) -> list[list[int]]:
    """One random prompt per length; a new seed gives prompts no engine has cached."""
    rng = random.Random(seed)
    return [[rng.randrange(1, 500) for _ in range(n)] for n in LENGTHS]


async def _one(url: str, prompt: list[int], stream: bool) -> list[int]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    async with client:
        kw: dict[str, Any] = {"model": ex.MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS}
        kw |= {"temperature": 0.0, "extra_body": {"ignore_eos": True}, "timeout": 60}
        if not stream:
            answer = await client.completions.create(**kw)
            return list(getattr(answer.choices[0], "token_ids", None) or [])
        ids: list[int] = []
        async for chunk in await client.completions.create(**kw, stream=True):
            for choice in chunk.choices:
                ids += getattr(choice, "token_ids", None) or []
        return ids


def generate(url: str, batch: list[list[int]], stream: bool) -> list[list[int]]:
    """Greedy token ids of every prompt, all requests in flight at once."""

    async def run() -> list[list[int]]:
        return list(await asyncio.gather(*(_one(url, p, stream) for p in batch)))

    return asyncio.run(run())


def assert_healthy(procs: Any) -> None:
    assert all(procs.alive().values()), procs.alive()
    for name in (*ex.ENGINES, "proxy"):
        assert httpx.get(f"{procs.urls[name]}/health", timeout=10).status_code == 200, name


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_proxy_answers_as_one_engine_with_the_prompt_read_over_nixl(
    procs: Any, stream: bool
) -> None:
    """8 concurrent greedy requests (16..500 prompt tokens) through the proxy give a
    single engine's tokens; the consumer computes all but the full prompt blocks it read
    from the producer; every process stays healthy."""
    batch = prompts(seed=int(stream))
    before = ex.scheduled(procs)
    proxied = generate(procs.urls["proxy"], batch, stream)
    reference = generate(procs.urls["reference"], batch, stream)
    assert [len(t) for t in proxied] == [MAX_TOKENS] * len(batch)
    assert proxied == reference
    after = ex.scheduled(procs)
    computed = {n: after[n] - before[n] for n in ex.ENGINES}
    assert computed["producer"] == sum(LENGTHS)
    loaded = sum((n - 1) // ex.BLOCK_SIZE * ex.BLOCK_SIZE for n in LENGTHS)
    assert computed["reference"] - computed["consumer"] == loaded, (computed, procs.log("consumer"))
    assert_healthy(procs)
