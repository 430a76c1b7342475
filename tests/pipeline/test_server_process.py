"""``python -m pipeline.server`` as a real process: the openai client, disconnects, load."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from server_process import free_port

from pipeline import LLM, EngineConfig, SamplingParams

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

PROMPT = [1, 2, 3, 4, 5]
MAX_MODEL_LEN = 512


class Server:
    """A server process and its base URL."""

    def __init__(self, url: str, model: str, process: subprocess.Popen[bytes]) -> None:
        self.url = url
        self.model = model
        self.process = process

    def health(self) -> dict[str, Any]:
        body: dict[str, Any] = httpx.get(f"{self.url}/health", timeout=10).json()
        return body

    def metric(self, line_prefix: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith(line_prefix + " "):
                return float(line.split()[-1])
        return 0.0


@pytest.fixture(scope="module")
def server(llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One server process for the module, on a free loopback port."""
    port = free_port()
    log = (tmp_path_factory.mktemp("server") / "server.log").open("wb")
    cmd = [sys.executable, "-m", "pipeline.server", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--model", str(llama_path), "--dtype", "float32"]
    cmd += ["--max-model-len", str(MAX_MODEL_LEN)]
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"server exited with {process.returncode}; log: {log.name}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server did not come up in 90 s; log: {log.name}")
            time.sleep(0.2)
        yield Server(url, str(llama_path), process)
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def _wait_idle(server: Server, timeout_s: float = 20.0) -> dict[str, Any]:
    """Poll /health until no request and no block is held (bounded)."""
    deadline = time.monotonic() + timeout_s
    while True:
        health = server.health()
        leaks = {k: v for k, v in health["leaks"].items() if k != "cached_blocks" and v}
        if health["requests"] == 0 and not leaks:
            return health
        if time.monotonic() > deadline:
            raise AssertionError(f"server still holds state after {timeout_s} s: {health}")
        time.sleep(0.05)


class TestOpenAIClient:
    def test_stream_matches_llm_generate(self, server: Server, llama_path: Path) -> None:
        """The official client's stream has the same greedy tokens as LLM.generate."""
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        try:
            stream = client.completions.create(
                model=server.model,
                prompt=PROMPT,
                max_tokens=12,
                temperature=0.0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            chunks = list(stream)
        finally:
            client.close()
        usage_chunk, chunks = chunks[-1], chunks[:-1]  # OpenAI's last chunk: usage, no choices
        assert usage_chunk.choices == []
        got = [t for c in chunks for t in c.choices[0].model_extra["token_ids"]]
        text = "".join(c.choices[0].text for c in chunks)
        config = EngineConfig(model=str(llama_path), dtype="float32", max_model_len=MAX_MODEL_LEN)
        with LLM(config) as llm:
            [expected] = llm.generate(
                [PROMPT], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
            )
        assert got == list(expected.token_ids)
        assert text.split() == [str(t) for t in expected.token_ids]
        assert chunks[-1].choices[0].finish_reason == "length"
        assert usage_chunk.usage is not None
        assert usage_chunk.usage.completion_tokens == 12
        assert usage_chunk.usage.total_tokens == 12 + len(PROMPT)

    def test_models_route(self, server: Server) -> None:
        """The client lists the served model."""
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        try:
            ids = [m.id for m in client.models.list()]
        finally:
            client.close()
        assert ids == [server.model]


class TestDisconnect:
    def test_disconnect_mid_stream_frees_everything(self, server: Server) -> None:
        """A client gone after two chunks aborts its request; no request or block remains."""
        _wait_idle(server)
        aborted_before = server.metric('kvstep_requests_total{finish_reason="abort"}')
        steps_before = server.health()["steps"]
        body = {"prompt": PROMPT, "max_tokens": 400, "temperature": 0.0, "stream": True}
        body["ignore_eos"] = True
        data: list[str] = []
        url = f"{server.url}/v1/completions"
        with httpx.Client(timeout=30) as client, client.stream("POST", url, json=body) as resp:
            lines = resp.iter_lines()
            while len(data) < 2:
                line = next(lines)
                if line.startswith("data: "):
                    data.append(line)
        # leaving the block closed the connection mid-stream
        health = _wait_idle(server)
        assert health["steps"] < steps_before + 400
        aborted = server.metric('kvstep_requests_total{finish_reason="abort"}')
        assert aborted == aborted_before + 1
        assert json.loads(data[0][6:])["choices"][0]["finish_reason"] is None


class TestConcurrency:
    def test_200_concurrent_streams_complete(self, server: Server) -> None:
        """200 streaming clients at once all get their tokens and [DONE]; lag recorded."""
        n, max_tokens = 200, 6

        async def one(client: httpx.AsyncClient, i: int, results: dict[int, list[int]]) -> None:
            body = {"prompt": [1 + i % 200, 7, 9], "max_tokens": max_tokens, "temperature": 0.0}
            body |= {"stream": True, "ignore_eos": True}
            tokens: list[int] = []
            done = False
            async with client.stream("POST", f"{server.url}/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        tokens.extend(json.loads(line[6:])["choices"][0]["token_ids"])
            assert done
            results[i] = tokens

        async def main() -> dict[int, list[int]]:
            results: dict[int, list[int]] = {}
            limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
            client = httpx.AsyncClient(timeout=60, limits=limits)
            async with client, anyio.create_task_group() as tg:
                for i in range(n):
                    tg.start_soon(one, client, i, results)
            return results

        results = anyio.run(main)
        assert len(results) == n
        assert all(len(tokens) == max_tokens for tokens in results.values())
        health = _wait_idle(server)
        lag = health["loop_lag"]
        print(f"server event-loop lag under {n} streams: {lag}")
        # Measured on 2 CPU cores (client and server share them): p99 10-18 ms, max
        # 35-77 ms (220-260 ms before `serve` froze the start-up heap out of the cyclic
        # GC). The max on a shared 2-core machine is noisy, so the bound is on p99.
        assert lag["p99_ms"] < 100


def test_leak_check_helper(leak_check: Callable[[dict[str, int]], None]) -> None:
    """The conftest leak oracle accepts an idle report (sanity of _wait_idle's rule)."""
    leak_check({"blocks_in_use": 0, "cached_blocks": 3})
