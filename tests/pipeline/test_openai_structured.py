"""Acceptance (issue 26): structured outputs and tool calls through the official ``openai``
client against a real ``kvstep serve`` on ``builtin:tiny`` (random weights: only the
grammar can make an output valid), checked by oracles that are not the backend; once per
grammar backend (llguidance, xgrammar)."""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import random
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
from server_process import ServerProcess, run_server
from structured_schemas import random_schema

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("llguidance")

MODEL = "builtin:tiny"
MESSAGES = [{"role": "user", "content": "Answer in the format asked."}]
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two small numbers.",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 9},
                "b": {"type": "integer", "minimum": 0, "maximum": 9},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}


NEEDS_XGRAMMAR = pytest.mark.skipif(
    importlib.util.find_spec("xgrammar") is None, reason="xgrammar is not installed"
)


@pytest.fixture(
    scope="module", params=["llguidance", pytest.param("xgrammar", marks=NEEDS_XGRAMMAR)]
)
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """A server of each grammar backend."""
    log = tmp_path_factory.mktemp(f"openai-structured-{request.param}") / "server.log"
    flags = ["--max-model-len", "1024", "--tool-call-parser", "hermes"]
    flags += ["--structured-outputs-backend", request.param]
    with run_server(MODEL, log, flags) as s:
        yield s


@pytest.fixture
def client(server: ServerProcess) -> Iterator[Any]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as one:
        yield one


def _chat(client: Any, seed: int, **fields: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=1.0, seed=seed, max_tokens=400, **fields
    )


class TestStructuredThroughTheClient:
    def test_thirty_random_schemas_all_valid(self, client: Any) -> None:
        """30 seeded random JSON schemas (nested objects, enums, arrays with maxItems,
        strings with maxLength, integer ranges) at temperature 1: all 30 outputs validate
        (jsonschema), each ended by the grammar (finish_reason stop)."""
        rng = random.Random(2026)
        schemas = [random_schema(rng) for _ in range(30)]

        def one(i: int) -> tuple[str, str | None]:
            fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schemas[i]}}
            [choice] = _chat(client, i, response_format=fmt).choices
            return choice.finish_reason, choice.message.content

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(one, range(30)))
        for schema, (finish, content) in zip(schemas, answers, strict=True):
            assert finish == "stop", (schema, content)
            jsonschema.validate(json.loads(content or ""), schema)

    def test_regex_and_choice(self, client: Any) -> None:
        """A regex is matched whole; a choice is one of its strings (vLLM's fields in
        extra_body); completions take them too."""
        pattern = r"[A-Z][a-z]{1,6} \d{2}"
        for seed in range(4):
            text = _chat(client, seed, extra_body={"structured_outputs": {"regex": pattern}})
            assert re.fullmatch(pattern, text.choices[0].message.content or "")
            picked = client.completions.create(
                model=MODEL, prompt="Pick:", temperature=1.0, seed=seed, max_tokens=20,
                extra_body={"guided_choice": ["alpha", "beta", "gamma delta"]},
            ).choices[0].text  # fmt: skip
            assert picked in ("alpha", "beta", "gamma delta")

    def test_stream_deltas_join_to_the_whole_text(self, client: Any) -> None:
        """The same seeded constrained request, streamed: the deltas concatenate to the
        non-streamed content."""
        schema = random_schema(random.Random(7))
        fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
        whole = _chat(client, 5, response_format=fmt).choices[0].message.content
        chunks = list(_chat(client, 5, response_format=fmt, stream=True))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == whole
        jsonschema.validate(json.loads(streamed), schema)


class TestToolsThroughTheClient:
    @pytest.mark.parametrize("choice", ["required", "named"])
    def test_forced_calls_validate_stream_and_not(self, client: Any, choice: str) -> None:
        """tool_choice required and named: the client reads tool_calls whose arguments
        validate against the tool's parameters; streamed, the deltas carry the same
        calls; finish_reason tool_calls."""
        tool_choice: Any = "required"
        if choice == "named":
            tool_choice = {"type": "function", "function": {"name": "add"}}
        for seed in range(3):
            fields = {"tools": [ADD], "tool_choice": tool_choice, "parallel_tool_calls": False}
            [out] = _chat(client, seed, **fields).choices
            assert out.finish_reason == "tool_calls"
            [call] = out.message.tool_calls
            assert call.function.name == "add"
            parameters = ADD["function"]["parameters"]  # type: ignore[index]
            jsonschema.validate(json.loads(call.function.arguments), parameters)
            chunks = list(_chat(client, seed, stream=True, **fields))
            deltas = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or ()]
            assert [(d.function.name, d.function.arguments) for d in deltas] == [
                ("add", call.function.arguments)
            ]
            assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
