"""Acceptance: the official ``openai`` client against a real ``kvstep serve`` (builtin:tiny)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from server_process import ServerProcess, run_server

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

MODEL = "builtin:tiny"
MESSAGES = [{"role": "user", "content": "Say hello."}]
PROMPT = "hello world"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("openai-client") / "server.log"
    with run_server(MODEL, log, ["--max-model-len", "256"]) as proc:
        yield proc


@pytest.fixture
def client(server: ServerProcess) -> Iterator[Any]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as one:
        yield one


def _greedy(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "temperature": 0.0, "extra_body": {"ignore_eos": True}, **fields}


class TestOpenAIClient:
    def test_chat_stream_and_not(self, client: Any) -> None:
        """Chat completions: the streamed deltas join to the non-streamed message."""
        reply = client.chat.completions.create(messages=MESSAGES, **_greedy(max_tokens=10))
        chunks = list(
            client.chat.completions.create(messages=MESSAGES, stream=True, **_greedy(max_tokens=10))
        )
        [choice] = reply.choices
        assert choice.message.role == "assistant" and choice.finish_reason == "length"
        assert reply.usage.completion_tokens == 10
        assert chunks[0].choices[0].delta.role == "assistant"
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert content == choice.message.content
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"

    def test_stop_string_ends_the_text_before_it(self, client: Any) -> None:
        """A stop string taken from a greedy completion ends the text just before it."""
        free = client.completions.create(prompt=PROMPT, **_greedy(max_tokens=24)).choices[0].text
        start = next(
            i
            for i in range(2, len(free) - 2)
            if free[i : i + 2].isascii() and free[i : i + 2].isprintable()
            and free.find(free[i : i + 2]) == i
        )  # fmt: skip
        stop = free[start : start + 2]
        done = client.completions.create(prompt=PROMPT, stop=[stop], **_greedy(max_tokens=24))
        [choice] = done.choices
        assert choice.text == free[:start]
        assert stop not in choice.text
        assert choice.finish_reason == "stop"

    def test_n_seeded_choices_differ(self, client: Any) -> None:
        """n=3 with temperature > 0 and a seed: three choices, not all the same."""
        done = client.completions.create(
            model=MODEL, prompt=PROMPT, n=3, temperature=1.0, seed=11, max_tokens=8
        )
        assert sorted(c.index for c in done.choices) == [0, 1, 2]
        assert len({c.text for c in done.choices}) > 1
        chat = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, n=3, temperature=1.0, seed=11, max_tokens=8
        )
        assert len({c.message.content for c in chat.choices}) > 1

    def test_chat_logprobs(self, client: Any) -> None:
        """logprobs with top_logprobs=5: five alternatives per token; the chosen logprob is
        <= 0 and equals its entry among the alternatives (greedy: the first of its text)."""
        reply = client.chat.completions.create(
            messages=MESSAGES, logprobs=True, top_logprobs=5, **_greedy(max_tokens=6)
        )
        content = reply.choices[0].logprobs.content
        assert len(content) == 6
        for item in content:
            assert item.logprob <= 0
            assert len(item.top_logprobs) == 5
            match = [alt for alt in item.top_logprobs if alt.token == item.token]
            if match:
                assert match[0].logprob == pytest.approx(item.logprob)

    def test_completions_echo(self, client: Any) -> None:
        """echo=True: the text starts with the prompt, streamed or not."""
        done = client.completions.create(prompt=PROMPT, echo=True, **_greedy(max_tokens=4))
        assert done.choices[0].text.startswith(PROMPT)
        assert len(done.choices[0].text) > len(PROMPT)
        chunks = list(
            client.completions.create(
                prompt=PROMPT, echo=True, stream=True, **_greedy(max_tokens=4)
            )
        )
        assert "".join(c.choices[0].text for c in chunks) == done.choices[0].text
