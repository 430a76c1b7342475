"""``POST /v1/chat/completions``: in process on builtin:tiny, and the openai client."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("starlette")
pytest.importorskip("jinja2")

from asgi_client import client_for
from server_process import ServerProcess, run_server

from pipeline import LLM, EngineConfig, SamplingParams
from pipeline.server import create_app
from pipeline.server.chat import render_chat
from pipeline.tokenizer import load_tokenizer
from stages.model.builtin import tokenizer_dir

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {
        "role": "user",
        "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}],
    },
]
NORMALISED = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hello\nworld"},
]
MAX_TOKENS = 8


def _config(model: str = "builtin:tiny") -> EngineConfig:
    return EngineConfig(model=model, dtype="float32", max_model_len=256)


def _body(**fields: object) -> dict[str, object]:
    return {
        "messages": MESSAGES,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        **fields,
    }


@pytest.fixture(scope="module")
def expected() -> tuple[str, list[int], str]:
    """The rendered prompt, LLM.generate's greedy tokens for it, and their text."""
    tok = load_tokenizer(tokenizer_dir("builtin:tiny"))
    assert tok is not None
    prompt = render_chat(tok, NORMALISED)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(_config()) as llm:
        (out,) = llm.generate([prompt], params)
    return prompt, list(out.token_ids), tok.decode(list(out.token_ids))


def _events(text: str) -> list[Any]:
    data = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


class TestRender:
    def test_template_output(self) -> None:
        """The builtin template: BOS, one header per turn, an open assistant turn."""
        tok = load_tokenizer(tokenizer_dir("builtin:tiny"))
        text = render_chat(tok, [{"role": "user", "content": "hi"}])
        assert text == (
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|end_of_text|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n"
        )

    def test_sandboxed(self) -> None:
        """A template cannot reach Python internals (the immutable sandbox refuses)."""
        from pipeline.errors import InvalidRequestError

        class Hostile:
            chat_template = "{{ messages.__class__.__mro__[1].__subclasses__() }}"

        with pytest.raises(InvalidRequestError, match="chat template"):
            render_chat(Hostile(), [{"role": "user", "content": "x"}])

        class Mutating:
            chat_template = "{% set _ = messages.append(1) %}ok"

        with pytest.raises(InvalidRequestError, match="chat template"):
            render_chat(Mutating(), [{"role": "user", "content": "x"}])


class TestChatInProcess:
    @pytest.mark.anyio
    async def test_non_stream_and_stream_match_llm_generate(
        self, expected: tuple[str, list[int], str]
    ) -> None:
        """Both modes give LLM.generate's greedy tokens of the rendered prompt, as text."""
        prompt, ids, text = expected
        async with client_for(create_app(_config())) as client:
            resp = await client.post("/v1/chat/completions", json=_body())
            streamed = await client.post(
                "/v1/chat/completions",
                json=_body(stream=True, stream_options={"include_usage": True}),
            )
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body["object"] == "chat.completion"
        assert body["id"].startswith("chatcmpl-")
        choice = body["choices"][0]
        assert choice["message"] == {"role": "assistant", "content": text}
        assert choice["token_ids"] == ids
        assert choice["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == MAX_TOKENS
        tok = load_tokenizer(tokenizer_dir("builtin:tiny"))
        assert tok is not None
        assert body["usage"]["prompt_tokens"] == len(tok.encode(prompt))

        assert streamed.status_code == 200
        chunks = _events(streamed.text)
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        with_choices = [c for c in chunks if c["choices"]]
        assert [c["choices"][0]["finish_reason"] for c in with_choices][-1] == "length"
        assert all(c["choices"][0]["finish_reason"] is None for c in with_choices[:-1])
        tokens = [t for c in with_choices for t in c["choices"][0].get("token_ids", [])]
        assert tokens == ids
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in with_choices) == text
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8

    @pytest.mark.anyio
    @pytest.mark.parametrize(
        ("fields", "param"),
        [
            ({"messages": None}, "messages"),
            ({"messages": []}, "messages"),
            ({"messages": "hi"}, "messages"),
            ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
            ({"messages": [{"content": "x"}]}, "messages[0].role"),
            ({"messages": ["x"]}, "messages[0]"),
            ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
            (
                {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                "messages[0].content[0]",
            ),
            ({"temperature": "hot"}, "temperature"),
            ({"max_tokens": 4, "max_completion_tokens": 4}, "max_completion_tokens"),
            ({"stream": "yes"}, "stream"),
            ({"seed": 1.5}, "seed"),
            ({"max_tokens": 10**6}, "max_tokens"),
        ],
    )
    async def test_bad_requests_name_the_field(self, fields: dict[str, object], param: str) -> None:
        body = _body()
        body.update(fields)
        if fields.get("messages", 0) is None:
            del body["messages"]
        async with client_for(create_app(_config())) as client:
            resp = await client.post("/v1/chat/completions", json=body)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == param

    @pytest.mark.anyio
    @pytest.mark.parametrize("kind", ["no tokenizer", "tokenizer without template"])
    async def test_no_template_is_a_400(
        self, kind: str, llama_path: Path, tmp_path_factory: pytest.TempPathFactory
    ) -> None:
        """A model without a chat template: 400 on ``messages`` saying what is missing."""
        from tiny_tokenizer import build_text_checkpoint

        if kind == "no tokenizer":
            model, missing = llama_path, "tokenizer.json"
        else:
            model, missing = build_text_checkpoint(tmp_path_factory.mktemp("text")), "chat_template"
        async with client_for(create_app(_config(str(model)))) as client:
            resp = await client.post("/v1/chat/completions", json=_body())
        assert resp.status_code == 400
        error = resp.json()["error"]
        assert error["param"] == "messages"
        assert "no chat template" in error["message"] and missing in error["message"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("chat-server") / "server.log"
    with run_server("builtin:tiny", log, ["--max-model-len", "1024"]) as proc:
        yield proc


class TestOpenAIClient:
    def test_chat_stream_and_not(
        self, server: ServerProcess, expected: tuple[str, list[int], str]
    ) -> None:
        """The official client chats with a real `kvstep serve` on builtin:tiny."""
        openai = pytest.importorskip("openai")
        _, _, text = expected
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        try:
            kwargs: dict[str, Any] = {
                "model": "builtin:tiny",
                "messages": MESSAGES,
                "max_tokens": MAX_TOKENS,
                "temperature": 0.0,
                "extra_body": {"ignore_eos": True},
            }
            reply = client.chat.completions.create(**kwargs)
            stream = client.chat.completions.create(stream=True, **kwargs)
            chunks = list(stream)
        finally:
            client.close()
        assert reply.choices[0].message.role == "assistant"
        assert reply.choices[0].message.content == text
        assert reply.choices[0].finish_reason == "length"
        assert chunks[0].choices[0].delta.role == "assistant"
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert content == text
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finishes[-1] == "length"


def _wait_idle(server: ServerProcess, timeout_s: float = 20.0) -> dict[str, Any]:
    """Poll /health until no request and no block is held (bounded)."""
    deadline = time.monotonic() + timeout_s
    while True:
        health: dict[str, Any] = server.health().json()
        leaks = {k: v for k, v in health["leaks"].items() if k != "cached_blocks" and v}
        if health["requests"] == 0 and not leaks:
            return health
        if time.monotonic() > deadline:
            raise AssertionError(f"server still holds state after {timeout_s} s: {health}")
        time.sleep(0.05)


class TestDisconnect:
    def test_client_gone_mid_stream_aborts(self, server: ServerProcess) -> None:
        """A chat stream whose client leaves after two chunks is aborted; nothing is held."""
        _wait_idle(server)
        steps_before = server.health().json()["steps"]
        body = _body(stream=True, max_tokens=900)
        data: list[str] = []
        url = f"{server.url}/v1/chat/completions"
        with httpx.Client(timeout=30) as client, client.stream("POST", url, json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            while len(data) < 2:
                line = next(lines)
                if line.startswith("data: "):
                    data.append(line)
        health = _wait_idle(server)
        assert health["steps"] < steps_before + 900
        assert json.loads(data[0][6:])["choices"][0]["delta"]["role"] == "assistant"

    def test_client_gone_before_the_reply_aborts(self, server: ServerProcess) -> None:
        """A non-stream chat whose client times out is aborted too."""
        _wait_idle(server)
        steps_before = server.health().json()["steps"]
        timeout = httpx.Timeout(10, read=0.02)
        with pytest.raises(httpx.ReadTimeout), httpx.Client(timeout=timeout) as client:
            client.post(f"{server.url}/v1/chat/completions", json=_body(max_tokens=900))
        health = _wait_idle(server)
        assert health["steps"] < steps_before + 900
