"""OpenAI/vLLM fields in process: n, best_of, stop, echo, logprobs, prompt_logprobs."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("starlette")
pytest.importorskip("jinja2")


from asgi_client import client_for

from pipeline import AsyncEngine, EngineConfig
from pipeline.logprobs import TokenLogprob
from pipeline.request import RequestOutput
from pipeline.server import create_app
from pipeline.server.choices import Choice, usage
from pipeline.server.logprobs_format import TokenTexts, chat_logprobs, prompt_logprobs_json
from pipeline.tokenizer import load_tokenizer
from stages.model.builtin import tokenizer_dir

PROMPT = "hello world"
MESSAGES = [{"role": "user", "content": "hi"}]
CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"


@pytest.fixture
def tiny() -> EngineConfig:
    return EngineConfig(model="builtin:tiny", dtype="float32", max_model_len=256)


def _cmpl(**fields: Any) -> dict[str, Any]:
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0.0, "ignore_eos": True}
    return {**body, **fields}


def _chat(**fields: Any) -> dict[str, Any]:
    body = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    return {**body, **fields}


def _events(resp: httpx.Response) -> list[Any]:
    assert resp.status_code == 200, resp.text
    data = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def _stop_in(text: str) -> tuple[str, int]:
    """A short plain-ASCII piece of ``text`` first found mid-way, and where."""
    for start in range(2, len(text) - 2):
        piece = text[start : start + 2]
        if piece.isascii() and piece.isprintable() and text.find(piece) == start:
            return piece, start
    raise AssertionError(f"no stop string candidate in {text!r}")


class TestValidation:
    @pytest.mark.anyio
    @pytest.mark.parametrize(
        ("fields", "param", "code"),
        [
            ({"n": 0}, "n", "invalid_value"),
            ({"n": 17}, "n", "invalid_value"),
            ({"n": True}, "n", "invalid_value"),
            ({"n": 2.0}, "n", "invalid_value"),
            ({"n": 2, "prompt": [[1, 2]] * 33}, "n", "invalid_value"),
            ({"best_of": 2}, "best_of", "unsupported_field"),
            ({"n": 2, "best_of": 3}, "best_of", "unsupported_field"),
            ({"best_of": True}, "best_of", "invalid_value"),
            ({"stop": 5}, "stop", "invalid_value"),
            ({"stop": ["a", ""]}, "stop", "invalid_value"),
            ({"stop": ["a"] * 17}, "stop", "invalid_value"),
            ({"stop": "x" * 513}, "stop", "invalid_value"),
            ({"stop": {"a": 1}}, "stop", "invalid_value"),
            ({"include_stop_str_in_output": 1}, "include_stop_str_in_output", "invalid_value"),
            ({"logprobs": -1}, "logprobs", "invalid_value"),
            ({"logprobs": 21}, "logprobs", "invalid_value"),
            ({"logprobs": True}, "logprobs", "invalid_value"),
            ({"logprobs": "2"}, "logprobs", "invalid_value"),
            ({"echo": "true"}, "echo", "invalid_value"),
            ({"prompt_logprobs": 21}, "prompt_logprobs", "invalid_value"),
            ({"prompt_logprobs": True}, "prompt_logprobs", "invalid_value"),
            ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "invalid_value"),
            ({"suffix": "x"}, "suffix", "unsupported_field"),
        ],
    )
    async def test_completions_fields_name_the_param(
        self, tiny: EngineConfig, fields: dict[str, Any], param: str, code: str
    ) -> None:
        """A bad n, best_of, stop, logprobs, echo or prompt_logprobs is a 400 naming it."""
        async with client_for(create_app(tiny)) as client:
            resp = await client.post(CMPL, json=_cmpl(**fields))
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == param
        assert resp.json()["error"]["code"] == code

    @pytest.mark.anyio
    @pytest.mark.parametrize(
        ("fields", "param"),
        [
            ({"logprobs": 1}, "logprobs"),
            ({"top_logprobs": 5}, "top_logprobs"),
            ({"logprobs": False, "top_logprobs": 0}, "top_logprobs"),
            ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
            ({"logprobs": True, "top_logprobs": True}, "top_logprobs"),
            ({"echo": True}, "echo"),
            ({"n": 0}, "n"),
            ({"best_of": 3}, "best_of"),
            ({"stop": [1]}, "stop"),
            ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ],
    )
    async def test_chat_fields_name_the_param(
        self, tiny: EngineConfig, fields: dict[str, Any], param: str
    ) -> None:
        """Chat: logprobs is a bool, top_logprobs needs it true and is capped at 20."""
        async with client_for(create_app(tiny)) as client:
            resp = await client.post(CHAT, json=_chat(**fields))
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == param

    @pytest.mark.anyio
    async def test_stop_without_a_tokenizer_is_400(self, llama_path: Path) -> None:
        """A model without tokenizer.json cannot match stop strings: 400 on stop."""
        config = EngineConfig(model=str(llama_path), dtype="float32", max_model_len=128)
        async with client_for(create_app(config)) as client:
            resp = await client.post(CMPL, json=_cmpl(prompt=[1, 2, 3], stop="x"))
            neutral = await client.post(CMPL, json=_cmpl(prompt=[1, 2, 3], stop=[], best_of=1))
        assert resp.status_code == 400
        assert resp.json()["error"]["param"] == "stop"
        assert neutral.status_code == 200, neutral.text


class TestN:
    @pytest.mark.anyio
    async def test_seeded_copies_are_the_seeds_alone(self, tiny: EngineConfig) -> None:
        """n=3 with a seed: copy i is the request with seed + i; usage counts the prompt once."""
        sampled = {"temperature": 1.0, "max_tokens": 8}
        async with client_for(create_app(tiny)) as client:
            resp = await client.post(CMPL, json=_cmpl(n=3, seed=7, **sampled))
            alone = [
                (await client.post(CMPL, json=_cmpl(seed=7 + i, **sampled))).json()
                for i in range(3)
            ]
        body = resp.json()
        assert [c["index"] for c in body["choices"]] == [0, 1, 2]
        ids = [c["token_ids"] for c in body["choices"]]
        assert ids == [a["choices"][0]["token_ids"] for a in alone]
        assert len({tuple(i) for i in ids}) > 1
        assert body["usage"]["prompt_tokens"] == alone[0]["usage"]["prompt_tokens"]
        assert body["usage"]["completion_tokens"] == 24

    @pytest.mark.anyio
    async def test_copies_share_the_prompt_blocks(self, tiny: EngineConfig) -> None:
        """n=3 on a 40-token prompt: copies 2 and 3 hit its two full blocks (16 tokens)."""
        async with client_for(create_app(tiny)) as client:
            resp = await client.post(CMPL, json=_cmpl(prompt=list(range(1, 41)), n=3))
            metrics = (await client.get("/metrics")).text
        assert resp.status_code == 200, resp.text
        assert "kvstep_prefix_cache_hits_total 64.0" in metrics.splitlines()

    @pytest.mark.anyio
    async def test_batch_times_n_is_prompt_major(self, tiny: EngineConfig) -> None:
        """Two prompts, n=2: choices 0-1 are prompt 0's, 2-3 prompt 1's (vLLM's order)."""
        prompts = [[5, 6, 7], [9, 10]]
        async with client_for(create_app(tiny)) as client:
            resp = await client.post(CMPL, json=_cmpl(prompt=prompts, n=2, max_tokens=4))
            one = [
                (await client.post(CMPL, json=_cmpl(prompt=p, max_tokens=4))).json()
                for p in prompts
            ]
        choices = resp.json()["choices"]
        assert [c["index"] for c in choices] == [0, 1, 2, 3]
        expected = [o["choices"][0]["token_ids"] for o in one]
        assert [c["token_ids"] for c in choices] == [expected[0]] * 2 + [expected[1]] * 2
        assert resp.json()["usage"] == {
            "prompt_tokens": 5,
            "completion_tokens": 16,
            "total_tokens": 21,
        }

    @pytest.mark.anyio
    async def test_stream_n_with_usage(self, tiny: EngineConfig) -> None:
        """A streamed n=2: chunks per index add up to the non-stream choices; usage last."""
        fields = {"n": 2, "seed": 3, "temperature": 1.0, "max_tokens": 6}
        async with AsyncEngine(tiny) as engine, client_for(create_app(engine)) as client:
            whole = (await client.post(CMPL, json=_cmpl(**fields))).json()
            stream = _events(
                await client.post(
                    CMPL, json=_cmpl(stream=True, stream_options={"include_usage": True}, **fields)
                )
            )
            assert engine.num_requests == 0
        texts = {0: "", 1: ""}
        for chunk in stream[:-1]:
            [choice] = chunk["choices"]
            texts[choice["index"]] += choice["text"]
        assert [texts[0], texts[1]] == [c["text"] for c in whole["choices"]]
        assert stream[-1]["choices"] == [] and stream[-1]["usage"] == whole["usage"]

    @pytest.mark.anyio
    async def test_chat_n(self, tiny: EngineConfig) -> None:
        """Chat n=2: two choices; a stream opens each with its role chunk."""
        fields = {"n": 2, "seed": 1, "temperature": 1.0, "best_of": 2}
        async with client_for(create_app(tiny)) as client:
            whole = (await client.post(CHAT, json=_chat(**fields))).json()
            chunks = _events(await client.post(CHAT, json=_chat(stream=True, **fields)))
        assert [c["index"] for c in whole["choices"]] == [0, 1]
        assert whole["usage"]["completion_tokens"] == 16
        roles = [c["choices"][0] for c in chunks[:2]]
        assert [(r["index"], r["delta"]["role"]) for r in roles] == [
            (0, "assistant"),
            (1, "assistant"),
        ]
        content = {0: "", 1: ""}
        for chunk in chunks[2:]:
            [choice] = chunk["choices"]
            content[choice["index"]] += choice["delta"]["content"]
        assert [content[0], content[1]] == [c["message"]["content"] for c in whole["choices"]]


class TestStop:
    @pytest.mark.anyio
    async def test_stop_ends_the_text_before_it_streamed_or_not(self, tiny: EngineConfig) -> None:
        """A stop string from the middle of a greedy completion: the text ends before it,
        finish_reason stop, stop_reason the string; the stream's chunks join to the same
        text and carry the finish reason on the last content chunk only."""
        async with client_for(create_app(tiny)) as client:
            free = (await client.post(CMPL, json=_cmpl(max_tokens=24))).json()["choices"][0]
            stop, at = _stop_in(free["text"])
            resp = await client.post(CMPL, json=_cmpl(max_tokens=24, stop=["zzzz", stop]))
            chunks = _events(
                await client.post(CMPL, json=_cmpl(max_tokens=24, stop=stop, stream=True))
            )
            kept = await client.post(
                CMPL, json=_cmpl(max_tokens=24, stop=stop, include_stop_str_in_output=True)
            )
        choice = resp.json()["choices"][0]
        assert choice["text"] == free["text"][:at]
        assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)
        assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
        finishes = [c["choices"][0]["finish_reason"] for c in chunks]
        assert finishes[-1] == "stop" and set(finishes[:-1]) <= {None}
        assert chunks[-1]["choices"][0]["stop_reason"] == stop
        assert kept.json()["choices"][0]["text"] == free["text"][: at + len(stop)]

    @pytest.mark.anyio
    async def test_chat_stop(self, tiny: EngineConfig) -> None:
        """Chat: a stop string cuts the message and the stream alike."""
        async with client_for(create_app(tiny)) as client:
            free = (await client.post(CHAT, json=_chat(max_tokens=24))).json()["choices"][0]
            text = free["message"]["content"]
            stop, at = _stop_in(text)
            whole = (await client.post(CHAT, json=_chat(max_tokens=24, stop=stop))).json()
            chunks = _events(
                await client.post(CHAT, json=_chat(max_tokens=24, stop=stop, stream=True))
            )
        choice = whole["choices"][0]
        assert choice["message"]["content"] == text[:at]
        assert choice["finish_reason"] == "stop"
        assert "".join(c["choices"][0]["delta"]["content"] for c in chunks) == text[:at]
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


class TestLogprobs:
    @pytest.mark.anyio
    async def test_completion_logprobs_shape_and_stream(self, tiny: EngineConfig) -> None:
        """logprobs=3: one entry per token, the chosen token in each top (at most 4 keys),
        offsets from 0; the stream's per-chunk logprobs join to the same lists."""
        async with client_for(create_app(tiny)) as client:
            whole = (await client.post(CMPL, json=_cmpl(logprobs=3, max_tokens=6))).json()
            chunks = _events(
                await client.post(CMPL, json=_cmpl(logprobs=3, max_tokens=6, stream=True))
            )
            zero = (await client.post(CMPL, json=_cmpl(logprobs=0, max_tokens=3))).json()
        logprobs = whole["choices"][0]["logprobs"]
        assert len(logprobs["tokens"]) == len(whole["choices"][0]["token_ids"]) == 6
        for token, logprob, top in zip(
            logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True
        ):
            assert logprob <= 0 and top[token] == logprob and 3 <= len(top) <= 4
        assert logprobs["text_offset"][0] == 0
        assert logprobs["text_offset"] == sorted(logprobs["text_offset"])
        joined: dict[str, list[Any]] = {k: [] for k in logprobs}
        for chunk in chunks:
            for key, values in chunk["choices"][0]["logprobs"].items():
                joined[key].extend(values)
        assert joined["tokens"] == logprobs["tokens"]
        assert joined["text_offset"] == logprobs["text_offset"]
        assert joined["token_logprobs"] == pytest.approx(logprobs["token_logprobs"], abs=1e-4)
        for top in zero["choices"][0]["logprobs"]["top_logprobs"]:
            assert len(top) == 1

    @pytest.mark.anyio
    async def test_echo_with_logprobs_and_prompt_logprobs(self, tiny: EngineConfig) -> None:
        """echo: the text starts with the prompt, its tokens' logprobs first (the first
        null); prompt_logprobs: null, then the prompt token and its k alternatives."""
        async with client_for(create_app(tiny)) as client:
            resp = await client.post(
                CMPL, json=_cmpl(echo=True, logprobs=2, prompt_logprobs=2, max_tokens=4)
            )
            ids = await client.post(CMPL, json=_cmpl(prompt=[5, 6, 7], echo=True, max_tokens=2))
            plain = (await client.post(CMPL, json=_cmpl(max_tokens=4))).json()["choices"][0]
            chunks = _events(await client.post(CMPL, json=_cmpl(echo=True, stream=True, n=2)))
        choice = resp.json()["choices"][0]
        assert choice["text"] == PROMPT + plain["text"]
        prompt_len = resp.json()["usage"]["prompt_tokens"]
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == prompt_len + 4
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        assert all(lp <= 0 for lp in logprobs["token_logprobs"][1:])
        prompt_logprobs = choice["prompt_logprobs"]
        assert len(prompt_logprobs) == prompt_len and prompt_logprobs[0] is None
        for entry in prompt_logprobs[1:]:
            assert 2 <= len(entry) <= 3
            ranks = sorted(e["rank"] for e in entry.values())
            assert ranks[:2] == [1, 2]
            assert all(
                e["logprob"] <= 0 and isinstance(e["decoded_token"], str) for e in entry.values()
            )
        tokenizer = load_tokenizer(tokenizer_dir("builtin:tiny"))
        assert tokenizer is not None
        decoded = tokenizer.decode([5, 6, 7], skip_special_tokens=False)
        assert ids.json()["choices"][0]["text"].startswith(decoded)
        firsts: dict[int, str] = {}
        for chunk in chunks:
            [c] = chunk["choices"]
            firsts.setdefault(c["index"], c["text"])
        assert all(text.startswith(PROMPT) for text in firsts.values()) and len(firsts) == 2

    @pytest.mark.anyio
    async def test_chat_logprobs(self, tiny: EngineConfig) -> None:
        """Chat logprobs with top_logprobs=5: 5 alternatives per token, bytes the token's
        UTF-8, the chosen logprob <= 0 and equal to its entry among the alternatives."""
        async with client_for(create_app(tiny)) as client:
            whole = (await client.post(CHAT, json=_chat(logprobs=True, top_logprobs=5))).json()
            bare = (await client.post(CHAT, json=_chat(logprobs=True, max_tokens=2))).json()
            chunks = _events(
                await client.post(CHAT, json=_chat(logprobs=True, top_logprobs=1, stream=True))
            )
            prompt = (await client.post(CHAT, json=_chat(prompt_logprobs=0, max_tokens=1))).json()
        content = whole["choices"][0]["logprobs"]["content"]
        assert len(content) == len(whole["choices"][0]["token_ids"])
        for item in content:
            assert item["logprob"] <= 0 and item["bytes"] == list(item["token"].encode())
            assert len(item["top_logprobs"]) == 5
            # greedy: the chosen token is the most likely, the first of its text
            match = next(a for a in item["top_logprobs"] if a["token"] == item["token"])
            assert match["logprob"] == pytest.approx(item["logprob"])
        assert all(i["top_logprobs"] == [] for i in bare["choices"][0]["logprobs"]["content"])
        streamed = [i for c in chunks[1:] for i in c["choices"][0]["logprobs"]["content"]]
        assert [i["token"] for i in streamed] == [i["token"] for i in content]
        assert prompt["prompt_logprobs"][0] is None
        assert len(prompt["prompt_logprobs"]) == prompt["usage"]["prompt_tokens"]


class TestFormatting:
    """The response shapes from synthetic outputs (no engine)."""

    @staticmethod
    def _out(**fields: Any) -> RequestOutput:
        base: dict[str, Any] = {
            "request_id": "r",
            "prompt_token_ids": (1, 2),
            "token_ids": (7, 8),
            "new_token_ids": (8,),
            "finished": True,
            "finish_reason": "stop",
            "stop_reason": 8,
        }
        return RequestOutput(**{**base, **fields})

    def test_completion_logprobs_without_a_tokenizer(self) -> None:
        """Token texts are " <id>"; -inf is -9999.0; the chosen token leads its top."""
        entries = (
            TokenLogprob(7, -0.5, 1, ((7, -0.5), (3, -1.0))),
            TokenLogprob(8, -math.inf, 9, ((4, -0.1),)),
        )
        choice = Choice(0, TokenTexts(None), logprobs=1)
        body = choice.completion(self._out(logprobs=entries), whole=True)
        assert body["text"] == " 7 8" and body["stop_reason"] == 8
        assert body["logprobs"] == {
            "tokens": [" 7", " 8"],
            "token_logprobs": [-0.5, -9999.0],
            "top_logprobs": [{" 7": -0.5}, {" 8": -9999.0, " 4": -0.1}],
            "text_offset": [0, 2],
        }

    def test_stream_offsets_continue(self) -> None:
        """A streamed choice's text offsets go on from the previous chunk's tokens."""
        entries = (TokenLogprob(7, -0.5, 1), TokenLogprob(8, -0.25, 1))
        choice = Choice(0, TokenTexts(None), logprobs=0, echo="P")
        first = choice.completion(
            self._out(token_ids=(7,), new_token_ids=(7,), finished=False, logprobs=entries[:1])
        )
        second = choice.completion(self._out(logprobs=entries))
        assert first["text"] == "P 7" and second["text"] == " 8"
        assert first["logprobs"]["tokens"] == [" 1", " 2", " 7"]  # echo: the prompt first
        assert first["logprobs"]["token_logprobs"] == [None, None, -0.5]
        assert second["logprobs"]["text_offset"] == [6]

    def test_chat_and_prompt_logprobs(self) -> None:
        """Chat items carry bytes and k alternatives; prompt logprobs list ranks."""
        entry = TokenLogprob(7, -0.5, 2, ((3, -0.1), (7, -0.5)))
        content = chat_logprobs([(7, entry), (8, None)], 1, TokenTexts(None))
        assert content[0] == {
            "token": " 7",
            "logprob": -0.5,
            "bytes": [32, 55],
            "top_logprobs": [{"token": " 3", "logprob": -0.1, "bytes": [32, 51]}],
        }
        assert content[1]["logprob"] == -9999.0 and content[1]["top_logprobs"] == []
        prompt = prompt_logprobs_json((1, 7), (None, entry), TokenTexts(None))
        assert prompt == [
            None,
            {
                "7": {"logprob": -0.5, "rank": 2, "decoded_token": " 7"},
                "3": {"logprob": -0.1, "rank": 1, "decoded_token": " 3"},
            },
        ]
        assert prompt_logprobs_json((1,), None, TokenTexts(None)) is None

    def test_usage_counts_each_prompt_once(self) -> None:
        """n=2 over two prompts: prompt tokens once per prompt, completion tokens summed."""
        outs = [self._out(), self._out(), self._out(prompt_token_ids=(1,)), self._out()]
        assert usage(outs, 2) == {"prompt_tokens": 3, "completion_tokens": 8, "total_tokens": 11}


class TestIgnoredFields:
    @pytest.mark.anyio
    @pytest.mark.parametrize(("path", "make"), [(CMPL, _cmpl), (CHAT, _chat)])
    @pytest.mark.parametrize("stream", [False, True])
    async def test_unknown_fields_are_named_in_a_header(
        self, tiny: EngineConfig, path: str, make: Any, stream: bool
    ) -> None:
        """Unknown fields are ignored, never silently: the response names them in
        ``X-Kvstep-Ignored-Fields`` (escaped: a name cannot break the header)."""
        body = make(max_tokens=2, stream=stream, frobnicate=1, **{"evil\r\nX-Set: 1,2": 0})
        async with AsyncEngine(tiny) as engine, client_for(create_app(engine)) as client:
            resp = await client.post(path, json=body)
            plain = await client.post(path, json=make(max_tokens=2, stream=stream))
        assert resp.status_code == 200, resp.text
        header = resp.headers["x-kvstep-ignored-fields"]
        assert header == "evil\\r\\nX-Set: 1\\u002c2, frobnicate"
        assert "x-set" not in resp.headers
        assert "x-kvstep-ignored-fields" not in plain.headers

    def test_the_header_is_capped(self) -> None:
        from pipeline.server.errors import ignored_fields_header

        names = tuple(f"f{i:02d}" for i in range(25))
        value = ignored_fields_header(names)
        assert value is not None
        assert value.decode().split(", ")[-1] == "... (5 more)"
        assert value.decode().count(", ") == 20
        assert ignored_fields_header(()) is None
