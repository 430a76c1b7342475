"""Structured outputs, tool calls and reasoning over HTTP (issue 26).

``builtin:tiny`` has random weights: only the grammar can make what it writes valid, so
every constrained answer is checked by an oracle that is not the backend (``jsonschema``,
``re.fullmatch``, membership). Tool calls the model chooses itself (``tool_choice:
"auto"``) and reasoning are tested on scripted outputs: the :class:`ForceScript` logits
stage makes the model write a given text.
"""

from __future__ import annotations

import importlib.util
import json
import random
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import jsonschema
import pytest

pytest.importorskip("starlette")
pytest.importorskip("llguidance")

from asgi_client import client_for
from scripted_output import ForceScript
from structured_schemas import random_schema

from pipeline import AsyncEngine, EngineConfig
from pipeline.server import create_app
from pipeline.server.options import ServerOptions
from pipeline.tokenizer import load_tokenizer
from stages.model.builtin import tokenizer_dir

CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 99},
                "b": {"type": "integer", "minimum": 0, "maximum": 99},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]
NEEDS_XGRAMMAR = pytest.mark.skipif(
    importlib.util.find_spec("xgrammar") is None, reason="xgrammar is not installed"
)
BACKENDS = ["llguidance", pytest.param("xgrammar", marks=NEEDS_XGRAMMAR)]
DEEP: list[Any] = [1]
for _ in range(40):
    DEEP = [DEEP]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}


@asynccontextmanager
async def served(backend: str = "llguidance", **options: Any) -> AsyncIterator[httpx.AsyncClient]:
    """A server on builtin:tiny with the scripting stage, the grammar ``backend`` and
    the server ``options``."""
    config = EngineConfig(
        model="builtin:tiny", dtype="float32", max_model_len=2048,
        structured_outputs_backend=backend,
    )  # fmt: skip
    graph = lambda g: g.insert_after("logits", ForceScript())  # noqa: E731
    async with (
        AsyncEngine(config, worker_graph=graph) as engine,
        client_for(create_app(engine, options=ServerOptions(**options))) as client,
    ):
        yield client


def script(text: str) -> dict[str, Any]:
    """The ``vllm_xargs`` that make the model write ``text`` and stop."""
    tokenizer = load_tokenizer(tokenizer_dir("builtin:tiny"))
    assert tokenizer is not None
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    return {"script": ids}


def sampled(seed: int, **fields: Any) -> dict[str, Any]:
    return {"temperature": 1.0, "seed": seed, "max_tokens": 300, **fields}


async def post(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    if path == CMPL:
        body = {"prompt": "hello", **body}
    elif "messages" not in body:
        body = {"messages": MESSAGES, **body}
    resp = await client.post(path, json=body)
    assert resp.status_code == 200, resp.text
    assert "x-kvstep-ignored-fields" not in resp.headers
    reply: dict[str, Any] = resp.json()
    return reply


async def stream(client: httpx.AsyncClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat stream's chunks (``[DONE]`` checked and dropped)."""
    body = {"messages": MESSAGES, **body, "stream": True}
    async with client.stream("POST", CHAT, json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        lines = [line async for line in resp.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def text_of(reply: dict[str, Any], path: str) -> str:
    choice = reply["choices"][0]
    text: str = choice["text"] if path == CMPL else choice["message"]["content"]
    return text


def joined(chunks: list[dict[str, Any]], key: str) -> str:
    return "".join(c["choices"][0]["delta"].get(key) or "" for c in chunks if c["choices"])


def streamed_calls(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []
    for chunk in chunks:
        for delta in chunk["choices"][0]["delta"].get("tool_calls") or ():
            calls.append(delta)
    return calls


class TestResponseFormat:
    @pytest.mark.anyio
    @pytest.mark.parametrize("backend", BACKENDS)
    @pytest.mark.parametrize("path", [CMPL, CHAT])
    async def test_json_schema_outputs_are_valid(self, path: str, backend: str) -> None:
        """response_format json_schema at temperature 1: every output validates against
        its schema (8 random schemas per endpoint), on both endpoints, both backends."""
        rng = random.Random(f"http-{path}")
        async with served(backend) as client:
            for seed in range(8):
                schema = random_schema(rng)
                fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
                reply = await post(client, path, sampled(seed, response_format=fmt))
                assert reply["choices"][0]["finish_reason"] == "stop", reply
                jsonschema.validate(json.loads(text_of(reply, path)), schema)

    @pytest.mark.anyio
    async def test_every_way_to_ask(self) -> None:
        """json_object, vLLM's structured_outputs (regex, choice, grammar, json) and the
        legacy guided_* fields each constrain the output as asked."""
        choices = ["red", "green", "blue"]
        lark = 'start: "yes" | "no" | "maybe"'
        object_schema = {"type": "object", "properties": {"n": {"type": "integer"}},
                         "required": ["n"], "additionalProperties": False}  # fmt: skip
        checks = [
            ({"response_format": {"type": "json_object"}},
             lambda t: isinstance(json.loads(t), dict)),
            ({"structured_outputs": {"regex": r"[a-c]{2,5}-\d{3}"}},
             lambda t: re.fullmatch(r"[a-c]{2,5}-\d{3}", t)),
            ({"structured_outputs": {"choice": choices}}, lambda t: t in choices),
            ({"structured_outputs": {"grammar": lark}}, lambda t: t in ("yes", "no", "maybe")),
            ({"structured_outputs": {"json": object_schema}},
             lambda t: jsonschema.validate(json.loads(t), object_schema) is None),
            ({"guided_json": object_schema},
             lambda t: jsonschema.validate(json.loads(t), object_schema) is None),
            ({"guided_regex": r"\d{4}"}, lambda t: re.fullmatch(r"\d{4}", t)),
            ({"guided_choice": choices}, lambda t: t in choices),
            ({"guided_grammar": lark, "guided_decoding_backend": "auto"},
             lambda t: t in ("yes", "no", "maybe")),
        ]  # fmt: skip
        async with served() as client:
            for seed, (fields, ok) in enumerate(checks):
                for path in (CMPL, CHAT):
                    text = text_of(await post(client, path, sampled(seed, **fields)), path)
                    assert ok(text), (fields, text)

    @pytest.mark.anyio
    async def test_stream_deltas_join_to_the_whole_text(self) -> None:
        """A constrained chat stream's deltas concatenate to the non-streamed content."""
        schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 6},
                  "b": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
                  "required": ["a", "b"], "additionalProperties": False}  # fmt: skip
        fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
        async with served() as client:
            whole = await post(client, CHAT, sampled(3, response_format=fmt))
            chunks = await stream(client, sampled(3, response_format=fmt))
        assert joined(chunks, "content") == whole["choices"][0]["message"]["content"]
        jsonschema.validate(json.loads(joined(chunks, "content")), schema)

    @pytest.mark.anyio
    @pytest.mark.parametrize(
        ("fields", "param", "said"),
        [
            ({"response_format": {"type": "yaml"}}, "response_format.type", "json_schema"),
            ({"response_format": "json"}, "response_format", "must be an object"),
            ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
             "response_format.json_schema.schema", "required"),
            ({"response_format": {"type": "json_schema",
                                  "json_schema": {"schema": {"type": "nope"}}}},
             "structured_outputs.json", "does not compile"),
            ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex",
             "does not compile"),
            ({"structured_outputs": {"grammar": "start: undefined_rule"}},
             "structured_outputs.grammar", "does not compile"),
            ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
             "exactly one"),
            ({"structured_outputs": {"jsn": {}}}, "structured_outputs.jsn", "not a field"),
            ({"structured_outputs": {"disable_fallback": True, "regex": "a"}},
             "structured_outputs.disable_fallback", "not supported"),
            ({"guided_json": {"a": DEEP}}, "guided_json", "nest at most"),
            ({"guided_regex": "x" * 70_000}, "guided_regex", "KiB"),
            ({"guided_choice": []}, "guided_choice", "1 to"),
            ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex",
             "second way"),
        ],
    )  # fmt: skip
    async def test_bad_specs_are_a_400_naming_the_field(
        self, fields: dict[str, Any], param: str, said: str
    ) -> None:
        """A spec that is malformed, too big, or does not compile is a 400 whose param is
        the field at fault; the engine serves the next request."""
        async with served() as client:
            for path in (CMPL, CHAT):
                body = {"prompt": "x"} if path == CMPL else {"messages": MESSAGES}
                resp = await client.post(path, json={**body, **fields, "max_tokens": 4})
                assert resp.status_code == 400, resp.text
                error = resp.json()["error"]
                assert (error["param"], said in error["message"]) == (param, True), error
            await post(client, CHAT, {"max_tokens": 3})


class TestForcedToolCalls:
    @pytest.mark.anyio
    @pytest.mark.parametrize(
        ("parser", "backend"),
        [(None, "llguidance"), ("hermes", "llguidance"), ("llama3_json", "llguidance"),
         pytest.param("hermes", "xgrammar", marks=NEEDS_XGRAMMAR)],
    )  # fmt: skip
    async def test_required_calls_validate_stream_and_not(
        self, parser: str | None, backend: str
    ) -> None:
        """tool_choice required: each answer is only tool calls to the given tools, each
        call's arguments valid against the tool's parameters; finish_reason tool_calls;
        the stream's calls are the same calls. In the server's parser's format (hermes'
        without one); with xgrammar, one JSON call."""
        async with served(backend, tool_call_parser=parser) as client:
            for seed in range(4):
                # random weights call again about every other time: room for ~25 calls
                body = sampled(seed, tools=TOOLS, tool_choice="required", max_tokens=1400)
                whole = (await post(client, CHAT, body))["choices"][0]
                chunks = await stream(client, body)
                assert whole["finish_reason"] == "tool_calls"
                assert whole["message"]["content"] is None
                calls = whole["message"]["tool_calls"]
                assert calls
                for call in calls:
                    assert call["type"] == "function" and call["id"].startswith("call_")
                    args = json.loads(call["function"]["arguments"])
                    jsonschema.validate(args, SCHEMAS[call["function"]["name"]])
                got = streamed_calls(chunks)
                assert [(c["index"], c["function"]) for c in got] == [
                    (i, c["function"]) for i, c in enumerate(calls)
                ]
                assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
                assert joined(chunks, "content") == ""

    @pytest.mark.anyio
    async def test_named_function_and_no_parallel_calls(self) -> None:
        """A named tool_choice calls that function, exactly once without
        parallel_tool_calls; its arguments validate."""
        named = {"type": "function", "function": {"name": "add"}}
        async with served() as client:
            for seed in range(4):
                body = sampled(seed, tools=TOOLS, tool_choice=named, parallel_tool_calls=False)
                [call] = (await post(client, CHAT, body))["choices"][0]["message"]["tool_calls"]
                assert call["function"]["name"] == "add"
                jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS["add"])

    @pytest.mark.anyio
    async def test_tool_choice_none_writes_text(self) -> None:
        """tool_choice none: the tools are in the prompt, the answer is content only."""
        async with served(tool_call_parser="hermes") as client:
            call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
            body = {"tools": TOOLS, "tool_choice": "none", "vllm_xargs": script(call),
                    "max_tokens": 200}  # fmt: skip
            message = (await post(client, CHAT, body))["choices"][0]["message"]
        assert message["content"] == call and "tool_calls" not in message

    @pytest.mark.anyio
    @pytest.mark.parametrize(
        ("fields", "param"),
        [
            ({"tool_choice": "auto"}, "tool_choice"),  # the server has no parser
            ({"tool_choice": "sometimes"}, "tool_choice"),
            ({"tool_choice": {"type": "function", "function": {"name": "nope"}}},
             "tool_choice.function.name"),
            ({"tools": [{"type": "function", "function": {"name": "a b"}}]},
             "tools[0].function.name"),
            ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
            ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
            ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
             "tools[0].function.parameters"),
            ({"tools": TOOLS, "tool_choice": "required",
              "response_format": {"type": "json_object"}}, "tool_choice"),
            ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ],
    )  # fmt: skip
    async def test_bad_tools_are_a_400_naming_the_field(
        self, fields: dict[str, Any], param: str
    ) -> None:
        """Malformed tools, a choice naming no tool, auto without a parser: 400s."""
        body = {"messages": MESSAGES, "max_tokens": 3, "tools": TOOLS, **fields}
        if fields.get("tool_choice") == "sometimes":
            del body["tools"]
        async with served() as client:
            resp = await client.post(CHAT, json=body)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == param


class TestParsedOutputs:
    @pytest.mark.anyio
    @pytest.mark.parametrize(
        ("parser", "text", "content", "names"),
        [
            ("hermes", 'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}'
             '\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": '
             '{"city": "Oslo", "unit": "c"}}\n</tool_call>', "Sure.", ["add", "get_weather"]),
            ("hermes", "No tools needed: 4.", "No tools needed: 4.", []),
            ("llama3_json", '{"name": "add", "parameters": {"a": 5, "b": 6}}', None, ["add"]),
        ],
    )  # fmt: skip
    async def test_auto_reads_the_calls_the_model_wrote(
        self, parser: str, text: str, content: str | None, names: list[str]
    ) -> None:
        """tool_choice auto with --tool-call-parser: the scripted output's calls become
        tool_calls, the rest content; streaming gives the same, never a partial call as
        content."""
        async with served(tool_call_parser=parser) as client:
            body = {"tools": TOOLS, "vllm_xargs": script(text), "max_tokens": 200}
            choice = (await post(client, CHAT, body))["choices"][0]
            chunks = await stream(client, body)
        message = choice["message"]
        calls = message.get("tool_calls") or []
        assert message["content"] == content
        assert [c["function"]["name"] for c in calls] == names
        assert choice["finish_reason"] == ("tool_calls" if names else "stop")
        assert joined(chunks, "content") == (content or "")
        assert "<tool_call>" not in joined(chunks, "content")
        assert [c["function"] for c in streamed_calls(chunks)] == [c["function"] for c in calls]

    @pytest.mark.anyio
    async def test_reasoning_content_is_split_off(self) -> None:
        """--reasoning-parser deepseek_r1: the thinking is reasoning_content, the answer
        content, streamed or not; a call after the thinking is still a call."""
        text = (
            "<think>The user wants weather.</think>Calling it."
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "c"}}'
            "\n</tool_call>"
        )
        async with served(tool_call_parser="hermes", reasoning_parser="deepseek_r1") as client:
            body = {"tools": TOOLS, "vllm_xargs": script(text), "max_tokens": 200}
            message = (await post(client, CHAT, body))["choices"][0]["message"]
            chunks = await stream(client, body)
            body = {"vllm_xargs": script("<think>hm</think>Hi"), "max_tokens": 50}
            plain = await post(client, CHAT, body)
        assert message["reasoning_content"] == "The user wants weather."
        assert message["content"] == "Calling it."
        assert message["tool_calls"][0]["function"]["name"] == "get_weather"
        assert joined(chunks, "reasoning_content") == "The user wants weather."
        assert joined(chunks, "content") == "Calling it."
        assert plain["choices"][0]["message"]["reasoning_content"] == "hm"
        assert plain["choices"][0]["message"]["content"] == "Hi"

    @pytest.mark.anyio
    async def test_a_conversation_with_calls_and_results_is_rendered(self) -> None:
        """An assistant message with tool_calls and a tool message answering it are
        accepted and rendered (the next answer is served)."""
        history = [
            *MESSAGES,
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"},
        ]  # fmt: skip
        async with served() as client:
            reply = await post(client, CHAT, {"messages": history, "tools": TOOLS,
                                              "tool_choice": "none", "max_tokens": 4})  # fmt: skip
        assert reply["usage"]["prompt_tokens"] > 100  # the tools and the turns are in it


class TestConstraintsAfterReasoning:
    @pytest.mark.anyio
    @pytest.mark.parametrize(
        ("parser", "thinking", "reasoning"),
        [
            ("deepseek_r1", "<think>Plan: an object.</think>", "Plan: an object."),
            ("deepseek_r1", "Opened by the template.</think>", "Opened by the template."),
            ("qwen3", "<think>Short plan.</think>", "Short plan."),
            ("qwen3", "", None),
        ],
    )  # fmt: skip
    async def test_the_schema_applies_after_the_thinking(
        self, parser: str, thinking: str, reasoning: str | None
    ) -> None:
        """With a reasoning parser, a response_format constrains what follows the
        thinking (scripted; after it the model writes freely, masked): the content is
        valid, the thinking is reasoning_content, streamed or not."""
        schema = {"type": "object", "properties": {"n": {"type": "integer"},
                  "s": {"type": "string", "maxLength": 5}}, "required": ["n", "s"],
                  "additionalProperties": False}  # fmt: skip
        fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
        xargs = {**script(thinking), "then": "free"} if thinking else {"script": [], "then": "free"}
        # unscripted, a qwen3 output may open a <think> block itself (the grammar allows
        # it, and "<" is one of the few tokens it allows first): barred, so that none is
        extra = {} if thinking else {"logit_bias": {str(script("<")["script"][0]): -100}}
        async with served(reasoning_parser=parser) as client:
            for seed in range(3):
                body = sampled(seed, response_format=fmt, vllm_xargs=xargs, **extra)
                message = (await post(client, CHAT, body))["choices"][0]["message"]
                chunks = await stream(client, body)
                assert message["reasoning_content"] == reasoning
                jsonschema.validate(json.loads(message["content"]), schema)
                assert joined(chunks, "content") == message["content"]
                assert joined(chunks, "reasoning_content") == (reasoning or "")
