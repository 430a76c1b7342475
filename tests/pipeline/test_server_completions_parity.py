"""Completions parity with OpenAI / vLLM: batches, context 400, usage chunk, (de)tokenize."""

from __future__ import annotations

import json
import random
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

pytest.importorskip("starlette")

from server_process import ServerProcess, run_server
from starlette.applications import Starlette

from pipeline import AsyncEngine, EngineConfig, SamplingParams
from pipeline.engine.async_engine import RequestStream
from pipeline.errors import EngineDeadError
from pipeline.server import ServerOptions, create_app
from pipeline.server.prompt_field import MAX_PROMPTS
from pipeline.server.tokenize import MAX_DETOKENIZE_TOKENS
from pipeline.tokenizer import load_tokenizer
from stages.model.builtin import tokenizer_dir

MAX_MODEL_LEN = 128
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10]]


@asynccontextmanager
async def client_for(app: Starlette, **headers: str) -> AsyncIterator[httpx.AsyncClient]:
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://kvstep", headers=headers
        ) as client:
            yield client


@pytest.fixture
def config(llama_path: Path) -> EngineConfig:
    return EngineConfig(model=str(llama_path), dtype="float32", max_model_len=MAX_MODEL_LEN)


@pytest.fixture
def tiny() -> EngineConfig:
    return EngineConfig(model="builtin:tiny", dtype="float32", max_model_len=256)


def _body(**fields: Any) -> dict[str, Any]:
    return {"prompt": PROMPTS, "max_tokens": 5, "temperature": 0.0, "ignore_eos": True, **fields}


def _events(resp: httpx.Response) -> list[Any]:
    data = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


async def _alone(engine: AsyncEngine, prompt: list[int], max_tokens: int = 5) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    got: list[int] = []
    async for out in engine.generate(prompt, params):
        got.extend(out.new_token_ids)
    return got


class TestBatchedPrompts:
    @pytest.mark.anyio
    async def test_batch_equals_each_alone(
        self, config: EngineConfig, leak_check: Callable[[dict[str, int]], None]
    ) -> None:
        """A batch of greedy token prompts gives each prompt's tokens alone, in index order."""
        async with AsyncEngine(config) as engine:
            alone = [await _alone(engine, p) for p in PROMPTS]
            async with client_for(create_app(engine)) as client:
                resp = await client.post("/v1/completions", json=_body())
            leak_check(engine.leak_report())
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert [c["index"] for c in body["choices"]] == [0, 1, 2]
        assert [c["token_ids"] for c in body["choices"]] == alone
        prompt_tokens = sum(len(p) for p in PROMPTS)
        assert body["usage"] == {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 15,
            "total_tokens": prompt_tokens + 15,
        }

    @pytest.mark.anyio
    async def test_batch_stream_interleaves_by_index(self, config: EngineConfig) -> None:
        """Streamed batch chunks carry their index; per index they add up to the tokens alone."""
        async with AsyncEngine(config) as engine:
            alone = [await _alone(engine, p) for p in PROMPTS]
            async with client_for(create_app(engine)) as client:
                resp = await client.post("/v1/completions", json=_body(stream=True))
        chunks = _events(resp)
        got: dict[int, list[int]] = {0: [], 1: [], 2: []}
        finish: dict[int, str] = {}
        for chunk in chunks:
            [choice] = chunk["choices"]
            got[choice["index"]].extend(choice["token_ids"])
            if choice["finish_reason"] is not None:
                finish[choice["index"]] = choice["finish_reason"]
            assert "usage" not in chunk
        assert [got[i] for i in range(3)] == alone
        assert finish == {0: "length", 1: "length", 2: "length"}
        assert len({c["id"] for c in chunks}) == 1

    @pytest.mark.anyio
    async def test_batch_of_strings(self, tiny: EngineConfig) -> None:
        """A list of strings is a batch of text prompts, each encoded as it would be alone."""
        async with client_for(create_app(tiny)) as client:
            batch = await client.post("/v1/completions", json=_body(prompt=["hello", "a b c"]))
            one = await client.post("/v1/completions", json=_body(prompt="a b c"))
        assert batch.status_code == 200, batch.text
        assert batch.json()["choices"][1]["token_ids"] == one.json()["choices"][0]["token_ids"]
        assert len(batch.json()["choices"]) == 2

    @pytest.mark.anyio
    @pytest.mark.parametrize(
        ("prompt", "needle"),
        [
            ([[1, 2]] * (MAX_PROMPTS + 1), f"at most {MAX_PROMPTS}"),
            ([[1, 2], []], "prompt[1]"),
            ([[1, 2], 3], "prompt[1]"),
            ([[1, 2], [1, -1]], "prompt[1]"),
            (["a", [1, 2], {}], "prompt[2]"),
        ],
    )
    async def test_bad_batches_are_400_on_prompt(
        self, config: EngineConfig, prompt: Any, needle: str
    ) -> None:
        """A batch too long, or with a bad member, is a 400 on ``prompt`` naming the member."""
        async with client_for(create_app(config)) as client:
            resp = await client.post("/v1/completions", json=_body(prompt=prompt))
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == "prompt"
        assert needle in resp.json()["error"]["message"]

    @pytest.mark.anyio
    async def test_one_bad_prompt_fails_all_and_leaks_nothing(self, config: EngineConfig) -> None:
        """A prompt the engine refuses (bad token id) fails the request; none stays admitted."""
        async with AsyncEngine(config) as engine:
            async with client_for(create_app(engine)) as client:
                resp = await client.post("/v1/completions", json=_body(prompt=[[1, 2], [10**9]]))
                assert resp.status_code == 400
                assert resp.json()["error"]["param"] == "prompt"
                ok = await client.post("/v1/completions", json=_body(prompt=[1, 2]))
                assert ok.status_code == 200
            assert engine.num_requests == 0


class TestContextLength:
    @pytest.mark.anyio
    async def test_max_tokens_past_the_context_is_400(self, config: EngineConfig) -> None:
        """prompt + max_tokens > max_model_len: 400 on max_tokens naming both numbers."""
        async with client_for(create_app(config)) as client:
            resp = await client.post(
                "/v1/completions", json=_body(prompt=[1, 2, 3], max_tokens=100_000_000)
            )
        assert resp.status_code == 400
        error = resp.json()["error"]
        assert error["param"] == "max_tokens"
        assert error["code"] == "context_length_exceeded"
        assert f"maximum context length is {MAX_MODEL_LEN} tokens" in error["message"]
        assert (
            "100000003 tokens (3 in your prompt; 100000000 for the completion)"
            in (error["message"])
        )

    @pytest.mark.anyio
    async def test_exact_fit_is_served(self, config: EngineConfig) -> None:
        """prompt + max_tokens == max_model_len is served to the last token."""
        prompt = list(range(1, 101))
        async with client_for(create_app(config)) as client:
            resp = await client.post(
                "/v1/completions", json=_body(prompt=prompt, max_tokens=MAX_MODEL_LEN - 100)
            )
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == MAX_MODEL_LEN - 100

    @pytest.mark.anyio
    async def test_prompt_alone_too_long_is_400_on_prompt(self, config: EngineConfig) -> None:
        """A prompt that leaves no room is a 400 on prompt with OpenAI's message."""
        async with client_for(create_app(config)) as client:
            resp = await client.post(
                "/v1/completions", json=_body(prompt=[1] * MAX_MODEL_LEN, max_tokens=1)
            )
        error = resp.json()["error"]
        assert resp.status_code == 400
        assert error["param"] == "prompt"
        assert f"maximum context length is {MAX_MODEL_LEN} tokens" in error["message"]
        assert f"your prompt is {MAX_MODEL_LEN} tokens" in error["message"]

    @pytest.mark.anyio
    async def test_absent_max_tokens_is_clamped_to_the_room(self, config: EngineConfig) -> None:
        """Without max_tokens the default 16 is clamped to the room left, never a 400."""
        body = _body(prompt=[1] * (MAX_MODEL_LEN - 3))
        del body["max_tokens"]
        async with client_for(create_app(config)) as client:
            short = await client.post("/v1/completions", json={**body, "prompt": [1, 2]})
            long = await client.post("/v1/completions", json=body)
        assert short.json()["usage"]["completion_tokens"] == 16
        assert long.status_code == 200, long.text
        assert long.json()["usage"]["completion_tokens"] == 3

    @pytest.mark.anyio
    async def test_batch_checks_each_prompt(self, config: EngineConfig) -> None:
        """In a batch the longest prompt decides: one that does not fit fails the request."""
        prompt = [[1, 2], [1] * (MAX_MODEL_LEN - 4)]
        async with client_for(create_app(config)) as client:
            resp = await client.post("/v1/completions", json=_body(prompt=prompt, max_tokens=5))
        assert resp.status_code == 400
        assert resp.json()["error"]["param"] == "max_tokens"


class TestIncludeUsage:
    @pytest.mark.anyio
    @pytest.mark.parametrize("options", [None, {"include_usage": False}, {}])
    async def test_no_usage_unless_asked(self, config: EngineConfig, options: Any) -> None:
        """Without include_usage true no chunk carries usage (OpenAI's default)."""
        body = _body(prompt=[1, 2, 3], stream=True)
        if options is not None:
            body["stream_options"] = options
        async with client_for(create_app(config)) as client:
            chunks = _events(await client.post("/v1/completions", json=body))
        assert all("usage" not in c and len(c["choices"]) == 1 for c in chunks)

    @pytest.mark.anyio
    async def test_usage_chunk_last_with_empty_choices(self, config: EngineConfig) -> None:
        """include_usage: one last chunk, choices [], usage summed over the batch."""
        body = _body(stream=True, stream_options={"include_usage": True})
        async with client_for(create_app(config)) as client:
            chunks = _events(await client.post("/v1/completions", json=body))
        assert chunks[-1]["choices"] == []
        prompt_tokens = sum(len(p) for p in PROMPTS)
        assert chunks[-1]["usage"] == {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 15,
            "total_tokens": prompt_tokens + 15,
        }
        assert all("usage" not in c for c in chunks[:-1])


class TestTokenize:
    @pytest.mark.anyio
    async def test_round_trip(self, tiny: EngineConfig) -> None:
        """/tokenize gives the tokenizer's ids, count and max_model_len; /detokenize inverts."""
        tokenizer = load_tokenizer(tokenizer_dir("builtin:tiny"))
        assert tokenizer is not None
        text = "hello world, the tokenizer works"
        async with client_for(create_app(tiny)) as client:
            tok = await client.post("/tokenize", json={"prompt": text})
            ids = tok.json()["tokens"]
            detok = await client.post("/detokenize", json={"tokens": ids})
        assert tok.status_code == 200, tok.text
        assert tok.json() == {
            "tokens": tokenizer.encode(text),
            "count": len(ids),
            "max_model_len": 256,
        }
        assert detok.json() == {"prompt": tokenizer.decode(ids)}

    @pytest.mark.anyio
    @pytest.mark.parametrize(
        ("route", "body", "param"),
        [
            ("/tokenize", {"prompt": 3}, "prompt"),
            ("/tokenize", {"prompt": "a", "stop": "x"}, "stop"),
            ("/tokenize", [1], "body"),
            ("/tokenize", {"prompt": "a", "add_special_tokens": False}, "add_special_tokens"),
            ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
            ("/detokenize", {"tokens": [1, -1]}, "tokens"),
            ("/detokenize", {"tokens": [True]}, "tokens"),
            ("/detokenize", {"tokens": "1 2"}, "tokens"),
            ("/detokenize", {"tokens": [0] * (MAX_DETOKENIZE_TOKENS + 1)}, "tokens"),
        ],
    )
    async def test_strict_400s(
        self, tiny: EngineConfig, route: str, body: Any, param: str | None
    ) -> None:
        """Bad (de)tokenize bodies are 400s naming the field, never 5xx."""
        async with client_for(create_app(tiny)) as client:
            resp = await client.post(route, json=body)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == (None if param == "body" else param)

    @pytest.mark.anyio
    async def test_without_tokenizer_is_400(self, config: EngineConfig) -> None:
        """A model without tokenizer.json: both routes are 400 saying so."""
        async with client_for(create_app(config)) as client:
            tok = await client.post("/tokenize", json={"prompt": "hi"})
            detok = await client.post("/detokenize", json={"tokens": [1, 2]})
        for resp, param in ((tok, "prompt"), (detok, "tokens")):
            assert resp.status_code == 400
            assert resp.json()["error"]["param"] == param
            assert "tokenizer" in resp.json()["error"]["message"]

    @pytest.mark.anyio
    async def test_behind_the_api_key(self, tiny: EngineConfig) -> None:
        """Both routes need the API key when one is set."""
        app = create_app(tiny, options=ServerOptions(api_key="sekrit"))
        async with client_for(app) as client:
            denied = await client.post("/tokenize", json={"prompt": "hi"})
            denied2 = await client.post("/detokenize", json={"tokens": [1]})
            ok = await client.post(
                "/tokenize", json={"prompt": "hi"}, headers={"Authorization": "Bearer sekrit"}
            )
        assert denied.status_code == denied2.status_code == 401
        assert ok.status_code == 200


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("parity") / "server.log"
    with run_server("builtin:tiny", log, ["--max-model-len", "256"]) as proc:
        yield proc


class TestOpenAIClient:
    def test_batch_and_usage_chunk(self, tiny_server: ServerProcess) -> None:
        """The official client: a batch gets one choice per prompt; include_usage gets usage."""
        openai = pytest.importorskip("openai")
        client = openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="x", max_retries=0)
        try:
            model = client.models.list().data[0].id
            done = client.completions.create(
                model=model, prompt=["hello", "world"], max_tokens=4, temperature=0.0
            )
            stream = client.completions.create(
                model=model,
                prompt=[[1, 2, 3], [4, 5]],
                max_tokens=4,
                temperature=0.0,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = list(stream)
        finally:
            client.close()
        assert sorted(c.index for c in done.choices) == [0, 1]
        assert done.usage is not None and done.usage.prompt_tokens > 0
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        assert {c.choices[0].index for c in chunks[:-1]} == {0, 1}

    def test_context_length_error(self, tiny_server: ServerProcess) -> None:
        """The official client raises BadRequestError with OpenAI's context-length message."""
        openai = pytest.importorskip("openai")
        client = openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="x", max_retries=0)
        try:
            with pytest.raises(openai.BadRequestError, match="maximum context length is 256"):
                client.completions.create(
                    model=client.models.list().data[0].id, prompt=[1, 2], max_tokens=10**8
                )
        finally:
            client.close()


def _metric(server: ServerProcess, name: str) -> float:
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


class TestBatchDisconnect:
    def test_client_gone_mid_batch_stream_aborts_every_prompt(
        self, tiny_server: ServerProcess
    ) -> None:
        """A client gone mid-stream aborts all of its batch's requests; nothing stays held."""
        abort = 'kvstep_requests_total{finish_reason="abort"}'
        before = _metric(tiny_server, abort)
        body = _body(prompt=[[1, 2, 3]] * 3, max_tokens=200, stream=True)
        url = f"{tiny_server.url}/v1/completions"
        with httpx.Client(timeout=30) as client, client.stream("POST", url, json=body) as resp:
            lines = resp.iter_lines()
            seen = 0
            while seen < 2:
                seen += next(lines).startswith("data: ")
        deadline = time.monotonic() + 20
        while tiny_server.health().json()["requests"] or _metric(tiny_server, abort) < before + 3:
            assert time.monotonic() < deadline, tiny_server.health().json()
            time.sleep(0.05)
        assert _metric(tiny_server, abort) == before + 3


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(11 if depth < 2 else 6)
    if kind >= 9:  # a well-formed batch, mostly
        member = rng.choice(["hello world", [1, 2, 3], [5]])
        return [member] * rng.randrange(1, 6) + ([] if rng.random() < 0.8 else [[]])
    if kind == 0:
        return rng.randrange(-5, 300)
    if kind == 1:
        return rng.choice([2**63, -(2**70), 10**9, 0, True, None, 1.5])
    if kind == 2:
        return rng.choice(["", "hello", "a b c", "\u00e9\u4e16", "x" * 300])
    if kind in (3, 4, 5):
        return [rng.randrange(0, 300) for _ in range(rng.randrange(0, 8))]
    if kind in (6, 7):
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(0, 70))]
    return {"prompt": _random_value(rng, depth + 1)}


class TestFuzz:
    @pytest.mark.anyio
    async def test_random_batches_and_tokenize_bodies_never_5xx(self, tiny: EngineConfig) -> None:
        """Random prompt batches and (de)tokenize bodies: 200 or 4xx, never 5xx, nothing held."""
        rng = random.Random(12)
        batches_served = 0
        async with AsyncEngine(tiny) as engine, client_for(create_app(engine)) as client:
            for _ in range(150):
                prompt = _random_value(rng)
                body = {"prompt": prompt, "max_tokens": rng.choice([1, 2, 300, None])}
                body["stream"] = rng.random() < 0.3
                resp = await client.post("/v1/completions", json=body)
                assert resp.status_code < 500, (body, resp.text)
                if resp.status_code == 200 and not body["stream"]:
                    batch = isinstance(prompt, list) and isinstance(prompt[0], list | str)
                    assert len(resp.json()["choices"]) == (len(prompt) if batch else 1)
                    batches_served += batch
                tok = await client.post("/tokenize", json={"prompt": _random_value(rng)})
                detok = await client.post("/detokenize", json={"tokens": _random_value(rng)})
                assert tok.status_code < 500 and detok.status_code < 500, (tok.text, detok.text)
            assert engine.num_requests == 0
        assert batches_served >= 5


class TestOnePromptFails:
    @pytest.mark.anyio
    @pytest.mark.parametrize("stream", [False, True])
    async def test_engine_failure_of_one_prompt_fails_the_request(
        self, config: EngineConfig, stream: bool, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """As in vLLM: one prompt's engine error fails the whole request, aborting the rest."""
        async with AsyncEngine(config) as engine:
            real = engine.generate
            calls: list[RequestStream] = []

            def generate(prompt: Any, params: Any = None, **kw: Any) -> RequestStream:
                handle = real(prompt, params, **kw)
                calls.append(handle)
                if len(calls) == 2:  # the second prompt's request fails in the engine
                    handle._deliver(EngineDeadError("injected"))
                return handle

            monkeypatch.setattr(engine, "generate", generate)
            app = create_app(engine)
            body = _body(max_tokens=50, stream=stream)
            async with client_for(app) as client:
                resp = await client.post("/v1/completions", json=body)
            deadline = time.monotonic() + 20  # aborts land at the next step
            while engine.num_requests:
                assert time.monotonic() < deadline
                await anyio.sleep(0.01)
        if stream:
            data = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
            assert "[DONE]" not in data
            assert json.loads(data[-1])["error"]["code"] == "engine_unavailable"
        else:
            assert resp.status_code == 503
            assert resp.json()["error"]["code"] == "engine_unavailable"
        aborted = app.state.kvstep.metrics.render(queue_depth=0, lag=app.state.kvstep.lag).decode()
        assert 'kvstep_requests_total{finish_reason="abort"} 2.0' in aborted  # the other two
