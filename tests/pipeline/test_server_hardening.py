"""Issue 10's server findings, in process (ASGI): health, auth, bodies, disconnects,
incremental detokenization and error bodies. The connection-level ones (slowloris,
body timeout, disconnect mid-body, the multiproc worker death) are in
``test_server_limits.py`` against a real server process."""

from __future__ import annotations

import json
import random
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

pytest.importorskip("starlette")

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from tiny_tokenizer import build_text_checkpoint, build_tokenizer

from pipeline import AsyncEngine, EngineConfig
from pipeline.config import MAX_STOP_TOKEN_IDS
from pipeline.server import create_app
from pipeline.tokenizer import Tokenizer

JSON = {"Content-Type": "application/json"}


@asynccontextmanager
async def client_for(app: Starlette, **kwargs: Any) -> AsyncIterator[httpx.AsyncClient]:
    """An httpx client talking to ``app`` in process, its lifespan open."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(
            transport=transport, base_url="http://kvstep", **kwargs
        ) as client:
            yield client


@pytest.fixture
def config(llama_path: Path) -> EngineConfig:
    return EngineConfig(model=str(llama_path), dtype="float32", max_model_len=128)


@pytest.fixture(scope="module")
def text_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama whose directory has a byte-level BPE tokenizer.json."""
    return build_text_checkpoint(tmp_path_factory.mktemp("text-model"))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """The byte-level BPE of ``tiny_tokenizer`` (400 tokens, multi-byte text)."""
    return Tokenizer(build_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json"))


def _body(**fields: object) -> dict[str, object]:
    return {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0.0, **fields}


def _is_openai_error(body: Any) -> bool:
    error = body.get("error") if isinstance(body, dict) else None
    return (
        isinstance(error, dict)
        and set(error) == {"message", "type", "param", "code"}
        and isinstance(error["code"], str)
    )


class TestHealth:
    @pytest.mark.anyio
    async def test_dead_engine_health_is_503(self, config: EngineConfig) -> None:
        """Finding 3: once the step loop died, /health is 503 "engine is dead" (no detail)."""
        async with AsyncEngine(config) as engine:

            def broken_schedule(*args: object, **kwargs: object) -> None:
                raise RuntimeError("scheduler bug in pid 424242")

            engine.core.scheduler.schedule = broken_schedule  # type: ignore[method-assign]
            async with client_for(create_app(engine)) as client:
                assert (await client.get("/health")).status_code == 200
                resp = await client.post("/v1/completions", json=_body())
                health = await client.get("/health")
        assert resp.status_code == 503
        assert health.status_code == 503
        assert health.json()["reason"] == "engine is dead"
        for text in (resp.text, health.text):
            assert "424242" not in text and "scheduler bug" not in text


class TestApiKey:
    @pytest.mark.anyio
    async def test_routes_need_the_bearer_key(self, config: EngineConfig) -> None:
        """Finding 5: with an API key, every route but /health needs the bearer key (401)."""
        from pipeline.server import ServerOptions

        key = "s3cret-key-for-test"
        options = ServerOptions(api_key=key)
        async with client_for(create_app(config, options=options)) as client:
            none = await client.get("/v1/models")
            wrong = await client.get("/v1/models", headers={"Authorization": "Bearer nope"})
            post = await client.post("/v1/completions", json=_body())
            metrics = await client.get("/metrics")
            health = await client.get("/health")
            good = await client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert [r.status_code for r in (none, wrong, post, metrics)] == [401] * 4
        assert health.status_code == 200 and good.status_code == 200
        assert _is_openai_error(none.json())
        assert all(key not in r.text for r in (none, wrong, post, health))
        assert key not in repr(options)

    def test_env_and_flag(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Finding 5: `kvstep serve` reads --api-key, else $KVSTEP_API_KEY."""
        from pipeline.cli import build_parser
        from pipeline.server.launch import server_options

        monkeypatch.setenv("KVSTEP_API_KEY", "from-env")
        args = build_parser().parse_args(["serve", "--max-body-bytes", "5000"])
        assert server_options(args).api_key == "from-env"
        assert server_options(args).max_body_bytes == 5000
        args = build_parser().parse_args(["serve", "--api-key", "from-flag"])
        assert server_options(args).api_key == "from-flag"


class TestBodies:
    @pytest.mark.anyio
    async def test_body_cap_content_type_nesting_and_constants(self, config: EngineConfig) -> None:
        """Finding 6: 413 past the cap (declared or chunked), 415 for non-JSON, 400 deep/NaN."""

        async def chunked() -> AsyncIterator[bytes]:
            for _ in range(10):
                yield b" " * 1000

        from pipeline.server import ServerOptions

        options = ServerOptions(max_body_bytes=4096)
        async with client_for(create_app(config, options=options)) as client:
            big = await client.post("/v1/completions", content=b" " * 5000, headers=JSON)
            streamed = await client.post("/v1/completions", content=chunked(), headers=JSON)
            plain = await client.post("/v1/completions", content=json.dumps(_body()))
            deep = await client.post("/v1/completions", content=b"[" * 3000, headers=JSON)
            nan = await client.post(
                "/v1/completions", content=b'{"prompt": [1], "temperature": NaN}', headers=JSON
            )
            huge = await client.post(
                "/v1/completions",
                content=b'{"prompt": [1], "max_tokens": 1' + b"0" * 400 + b"}",
                headers=JSON,
            )
            health = (await client.get("/health")).json()
        assert (big.status_code, streamed.status_code) == (413, 413)
        assert "chunked" in streamed.request.headers.get("transfer-encoding", "")
        assert plain.status_code == 415
        assert (deep.status_code, nan.status_code) == (400, 400)
        assert huge.status_code == 400 and huge.json()["error"]["param"] == "max_tokens"
        assert all(_is_openai_error(r.json()) for r in (big, plain, deep, nan, huge))
        assert health["requests"] == 0

    @pytest.mark.anyio
    @pytest.mark.parametrize(
        ("fields", "param"),
        [
            ({"max_tokens": True}, "max_tokens"),
            ({"temperature": False}, "temperature"),
            ({"n": True}, "n"),
            ({"n": 1.0}, "n"),
            ({"seed": 2**64}, "seed"),
            ({"top_k": 1.5}, "top_k"),
            ({"ignore_eos": 1}, "ignore_eos"),
            ({"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))}, "stop_token_ids"),
            ({"prompt": [1, True]}, "prompt"),
            ({"prompt": list(range(200))}, "prompt"),
            ({"stop": ["\n"]}, "stop"),
            ({"logprobs": True}, "logprobs"),
            ({"logprobs": 21}, "logprobs"),
            ({"echo": 1}, "echo"),
            ({"suffix": "x"}, "suffix"),
            ({"best_of": 3}, "best_of"),
            ({"presence_penalty": 2.5}, "presence_penalty"),
            ({"logit_bias": {"5": 101}}, "logit_bias[5]"),
            ({"logit_bias": {"x": 1}}, "logit_bias"),
            ({"min_tokens": 17}, "min_tokens"),
            ({"repetition_penalty": 0}, "repetition_penalty"),
            ({"min_p": True}, "min_p"),
            ({"stream_options": {"\ud800": 1}}, "stream_options.\\ud800"),
        ],
    )
    async def test_strict_fields_name_the_param(
        self, config: EngineConfig, fields: dict[str, object], param: str
    ) -> None:
        """Finding 6/10: a mistyped or unsupported field is a 400 whose `param` names it."""
        content = json.dumps(_body(**fields)).encode()  # ASCII: lone surrogates escaped
        async with client_for(create_app(config)) as client:
            resp = await client.post("/v1/completions", content=content, headers=JSON)
        assert resp.status_code == 400
        assert resp.json()["error"]["param"] == param

    @pytest.mark.anyio
    async def test_neutral_and_unknown_fields_are_served(self, config: EngineConfig) -> None:
        """Finding 6 (guard): neutral values of unsupported fields and unknown fields serve."""
        neutral = {"echo": False, "logprobs": None, "presence_penalty": 0, "best_of": 1}
        async with client_for(create_app(config)) as client:
            resp = await client.post("/v1/completions", json=_body(**neutral, x_custom=1))
        assert resp.status_code == 200

    @pytest.mark.anyio
    async def test_penalty_fields_are_served(self, config: EngineConfig) -> None:
        """Issue 12: penalties, min_p, min_tokens and logit_bias (string ids) are applied."""
        fields = {
            "presence_penalty": 1.5,
            "frequency_penalty": 0.5,
            "repetition_penalty": 1.3,
            "min_p": 0.1,
            "min_tokens": 2,
            "logit_bias": {"7": 100},
        }
        async with client_for(create_app(config)) as client:
            resp = await client.post("/v1/completions", json=_body(**fields))
            assert resp.status_code == 200
            assert resp.json()["choices"][0]["token_ids"][0] == 7  # +100 wins
            resp = await client.post("/v1/completions", json=_body(logit_bias={"99999999": 1}))
            assert resp.status_code == 400
            assert resp.json()["error"]["param"] == "logit_bias"

    @pytest.mark.anyio
    async def test_text_prompt_refused_before_encoding(
        self, text_model: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Finding 6: a provably too-long text prompt is refused unencoded; others off-loop."""
        config = EngineConfig(model=str(text_model), dtype="float32", max_model_len=256)
        threads: list[str] = []
        original = Tokenizer.encode

        def spy(self: Tokenizer, text: str) -> list[int]:
            threads.append(threading.current_thread().name)
            return original(self, text)

        monkeypatch.setattr(Tokenizer, "encode", spy)
        async with client_for(create_app(config)) as client:
            bound = client._transport.app.state.kvstep.encoder.max_token_bytes  # type: ignore[attr-defined]
            assert bound is not None
            too_long = "é" * (bound * 256)
            resp = await client.post("/v1/completions", json=_body(prompt=too_long))
            assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt"
            assert threads == []
            # 3000 bytes: not provably too long, and past the inline size: a worker thread
            # encodes it (the engine then refuses its actual length, or serves it).
            resp = await client.post("/v1/completions", json=_body(prompt="ab " * 1000))
        assert threads and threads[-1] != threading.main_thread().name
        assert resp.status_code in (200, 400)


class TestDisconnect:
    @pytest.mark.anyio
    async def test_non_streaming_disconnect_aborts(self, llama_path: Path) -> None:
        """Finding 8: a non-streaming request whose client disconnects is aborted early."""
        config = EngineConfig(model=str(llama_path), dtype="float32", max_model_len=1024)
        max_tokens = 1000
        body = json.dumps(_body(max_tokens=max_tokens, ignore_eos=True)).encode()
        async with AsyncEngine(config) as engine:
            app = create_app(engine)
            gone = anyio.Event()
            sent: list[dict[str, Any]] = []
            messages = [{"type": "http.request", "body": body, "more_body": False}]

            async def receive() -> dict[str, Any]:
                if messages:
                    return messages.pop()
                await gone.wait()
                return {"type": "http.disconnect"}

            async def send(message: dict[str, Any]) -> None:
                sent.append(message)

            scope = {
                "type": "http",
                "asgi": {"version": "3.0"},
                "http_version": "1.1",
                "method": "POST",
                "scheme": "http",
                "path": "/v1/completions",
                "raw_path": b"/v1/completions",
                "query_string": b"",
                "root_path": "",
                "headers": [(b"content-type", b"application/json"), (b"host", b"kvstep")],
                "client": ("127.0.0.1", 1),
                "server": ("127.0.0.1", 80),
            }
            steps_before = engine.num_steps
            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(app, scope, receive, send)
                    while engine.num_requests == 0:
                        await anyio.sleep(0.01)
                    await anyio.sleep(0.1)
                    gone.set()
                    while engine.num_requests:
                        await anyio.sleep(0.01)
            steps = engine.num_steps - steps_before
            leaks = engine.leak_report()
        assert steps < max_tokens // 2
        assert {k: v for k, v in leaks.items() if k != "cached_blocks" and v} == {}


class TestIncrementalDetokenizer:
    @settings(
        max_examples=300,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.function_scoped_fixture],
    )
    @given(data=st.data())
    def test_deltas_concatenate_to_the_full_decode(
        self, tokenizer: Tokenizer, data: st.DataObject
    ) -> None:
        """Finding 9: the stream's deltas join to decode(all ids), split UTF-8 included."""
        from pipeline.detokenize import Detokenizer

        vocab = 400
        ids = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=60))
        chunks = data.draw(st.lists(st.integers(1, 4), min_size=len(ids), max_size=len(ids)))
        detok, text, upto = Detokenizer(tokenizer), [], 0
        for size in chunks:
            if upto >= len(ids):
                break
            start, upto = upto, min(len(ids), upto + size)
            text.append(detok.delta(_output(ids[:upto], ids[start:upto], upto == len(ids))))
        assert "".join(text) == tokenizer.decode(ids)

    def test_a_4000_token_stream_decodes_o_n_tokens(self, tokenizer: Tokenizer) -> None:
        """Finding 9: streaming 4,000 tokens decodes O(n) tokens, not O(n²)."""
        from pipeline.detokenize import Detokenizer

        decoded = [0]

        class Counting:
            def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
                decoded[0] += len(ids)
                return tokenizer.decode(ids, skip_special_tokens)

        rng = random.Random(0)
        ids = [rng.randrange(1, 400) for _ in range(4000)]
        detok, text = Detokenizer(Counting()), []
        for i in range(1, len(ids) + 1):
            text.append(detok.delta(_output(ids[:i], ids[i - 1 : i], i == len(ids))))
        assert "".join(text) == tokenizer.decode(ids)
        assert decoded[0] < 20 * len(ids)


class TestErrorBodies:
    @pytest.mark.anyio
    async def test_unknown_route_and_method_are_openai_errors(self, config: EngineConfig) -> None:
        """Finding 10: 404 and 405 are OpenAI-shaped JSON errors with string codes."""
        async with client_for(create_app(config)) as client:
            missing = await client.get("/v1/nope")
            method = await client.get("/v1/completions")
        assert (missing.status_code, method.status_code) == (404, 405)
        assert _is_openai_error(missing.json()) and _is_openai_error(method.json())

    @pytest.mark.anyio
    async def test_500_and_503_are_generic_with_a_request_id(
        self, config: EngineConfig, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Finding 10: a 500 or 503 body has a generic message and the request id only."""
        from pipeline.errors import EngineDeadError

        async with AsyncEngine(config) as engine:
            app = create_app(engine)
            async with client_for(app) as client:
                monkeypatch.setattr(
                    engine, "generate", _raiser(RuntimeError("boom in worker pid 31337"))
                )
                internal = await client.post("/v1/completions", json=_body())
                monkeypatch.setattr(
                    engine, "generate", _raiser(EngineDeadError("worker pid 31337 died"))
                )
                dead = await client.post("/v1/completions", json=_body())
        for resp, status in ((internal, 500), (dead, 503)):
            assert resp.status_code == status
            assert _is_openai_error(resp.json())
            assert "31337" not in resp.text and "boom" not in resp.text
            assert resp.headers["x-request-id"] in resp.json()["error"]["message"]


def _output(token_ids: list[int], new: list[int], finished: bool) -> Any:
    from pipeline.request import RequestOutput

    return RequestOutput(
        request_id="r",
        prompt_token_ids=(1,),
        token_ids=tuple(token_ids),
        new_token_ids=tuple(new),
        finished=finished,
    )


def _raiser(exc: Exception) -> Any:
    def generate(*args: object, **kwargs: object) -> Iterator[None]:
        raise exc

    return generate
