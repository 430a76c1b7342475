"""Hypothesis fuzzing of a real ``kvstep serve`` process (in-process and multiproc executor).

Random bodies, raw JSON text mixing valid and invalid fields and types (bools, integers
of hundreds of digits, ``NaN``/``Infinity``, nested objects, deep nesting, long lists,
lone surrogates, bytes that are not JSON), each sent concurrently with a valid greedy
request. Invariants: no 5xx, every valid request gets the tokens it gets alone, and the
engine is alive and holds nothing afterwards.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("uvicorn")

from server_process import ServerProcess, run_server

from pipeline import LLM, EngineConfig, SamplingParams

MAX_MODEL_LEN = 64
VALID_PROMPTS = ([1, 2, 3, 4, 5], [7, 8, 9], [200, 100, 50, 25])
MAX_TOKENS = 6
FIELDS = [
    "prompt", "model", "stream", "max_tokens", "temperature", "top_p", "top_k", "seed",
    "ignore_eos", "stop_token_ids", "n", "user", "stream_options", "stop", "logprobs",
    "echo", "best_of", "presence_penalty", "logit_bias", "suffix", "x_unknown",
    "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "prompt_logprobs",
    "include_stop_str_in_output", "top_logprobs",
]  # fmt: skip
ODD_LITERALS = [
    "1" + "0" * 400, "-1" + "0" * 30, "NaN", "Infinity", "-Infinity", "1e400", "-0.0",
    "1e-400", "true", "false", "null", '"\\ud800"', '""', "0.5", "2", "1.0", "9223372036854775808",
    '{"\\ud800": 1}', '{"include_usage": 1}', '{"include_usage": true}',
]  # fmt: skip

leaves = st.one_of(
    st.integers(-10, 300).map(str),
    st.integers().map(str),
    st.sampled_from(ODD_LITERALS),
    st.floats(allow_nan=False, allow_infinity=False).map(json.dumps),
    st.text(max_size=20).map(json.dumps),
)
values = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=5).map(lambda xs: "[" + ",".join(xs) + "]"),
        st.dictionaries(st.text(max_size=8).map(json.dumps), children, max_size=4).map(
            lambda d: "{" + ",".join(f"{k}:{v}" for k, v in d.items()) + "}"
        ),
    ),
    max_leaves=8,
)
specials = st.one_of(
    st.integers(1, 6000).map(lambda d: "[" * d + "]" * d),
    st.integers(0, 3000).map(lambda n: "[" + ",".join(["1"] * n) + "]"),
    st.lists(st.integers(0, 600), min_size=1, max_size=80).map(json.dumps),
)
field_values = st.one_of(values, specials)
objects = st.dictionaries(
    st.one_of(st.sampled_from([*FIELDS, "\ud800"]), st.text(max_size=10)), field_values, max_size=6
).map(lambda d: "{" + ",".join(f"{json.dumps(k)}:{v}" for k, v in d.items()) + "}")
valid_values: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": st.integers(1, 8),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1),
    "top_k": st.integers(-1, 50),
    "seed": st.integers(0, 2**64 - 1),
    "ignore_eos": st.booleans(),
    "n": st.integers(1, 3),
    "best_of": st.sampled_from([None, 1]),
    "logprobs": st.one_of(st.none(), st.integers(0, 5)),
    "prompt_logprobs": st.one_of(st.none(), st.integers(0, 3)),
    "stop": st.sampled_from(["", [], "x"]),
    "user": st.text(max_size=10),
    "stop_token_ids": st.lists(st.integers(0, 255), max_size=4),
    "echo": st.booleans(),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
}


@st.composite
def near_valid(draw: st.DrawFn) -> str:
    """A valid body whose fields are each valid or fuzzed."""
    fields = {"prompt": json.dumps(draw(st.lists(st.integers(0, 255), min_size=1, max_size=8)))}
    for name in draw(st.lists(st.sampled_from(sorted(valid_values)), max_size=5, unique=True)):
        if draw(st.integers(0, 3)):
            fields[name] = json.dumps(draw(valid_values[name]))
        else:
            fields[name] = draw(field_values)
    return "{" + ",".join(f"{json.dumps(k)}:{v}" for k, v in fields.items()) + "}"


bodies = st.one_of(
    objects.map(str.encode),
    near_valid().map(str.encode),
    near_valid().map(str.encode),
    field_values.map(str.encode),
    st.binary(max_size=64),
)
content_types = st.sampled_from(["application/json"] * 6 + ["text/plain", ""])


@pytest.fixture(scope="module", params=["inprocess", "multiproc"])
def server(
    request: pytest.FixtureRequest, llama_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """A server per executor (world_size 1), the same small checkpoint."""
    extra = ["--max-model-len", str(MAX_MODEL_LEN), "--executor", request.param]
    extra += ["--world-size", "1"]
    log = tmp_path_factory.mktemp(f"fuzz-{request.param}") / "server.log"
    with run_server(llama_path, log, extra) as proc:
        yield proc


@pytest.fixture(scope="module")
def reference(llama_path: Path) -> dict[tuple[int, ...], list[int]]:
    """Each valid prompt's greedy tokens, alone, from LLM.generate."""
    config = EngineConfig(model=str(llama_path), dtype="float32", max_model_len=MAX_MODEL_LEN)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(config) as llm:
        outs = llm.generate([list(p) for p in VALID_PROMPTS], params)
    return {tuple(p): list(o.token_ids) for p, o in zip(VALID_PROMPTS, outs, strict=True)}


async def _valid(client: httpx.AsyncClient, url: str, prompt: list[int], stream: bool) -> Any:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    if not stream:
        resp = await client.post(url, json=body)
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["token_ids"]
    tokens: list[int] = []
    async with client.stream("POST", url, json={**body, "stream": True}) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                tokens.extend(json.loads(line[6:])["choices"][0]["token_ids"])
    return tokens


async def _fuzz(client: httpx.AsyncClient, url: str, body: bytes, ctype: str) -> httpx.Response:
    headers = {"Content-Type": ctype} if ctype else {}
    return await client.post(url, content=body, headers=headers)


def _wait_idle(server: ServerProcess, timeout_s: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        resp = server.health()
        assert resp.status_code == 200, resp.text
        health: dict[str, Any] = resp.json()
        leaks = {k: v for k, v in health["leaks"].items() if k != "cached_blocks" and v}
        if health["requests"] == 0 and not leaks:
            return health
        assert time.monotonic() < deadline, f"server still holds state: {health}"
        time.sleep(0.05)


@pytest.mark.timeout(900)
def test_fuzzed_bodies_never_hurt_the_server(
    server: ServerProcess, reference: dict[tuple[int, ...], list[int]]
) -> None:
    """Random and near-valid bodies, sent beside a valid request: never a 5xx; the valid
    request gets the tokens it gets alone; nothing leaks."""
    url = f"{server.url}/v1/completions"
    statuses: dict[int, int] = {}

    @settings(
        max_examples=80,
        deadline=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(
        body=bodies,
        near=near_valid().map(str.encode),
        ctype=content_types,
        which=st.integers(0, len(VALID_PROMPTS) - 1),
        stream=st.booleans(),
    )
    def one(body: bytes, near: bytes, ctype: str, which: int, stream: bool) -> None:
        prompt = list(VALID_PROMPTS[which])

        async def both() -> tuple[list[httpx.Response], list[int]]:
            results: dict[str, Any] = {}
            async with httpx.AsyncClient(timeout=60) as client:

                async def fuzz() -> None:
                    results["fuzz"] = await _fuzz(client, url, body, ctype)

                async def near_fuzz() -> None:
                    results["near"] = await _fuzz(client, url, near, "application/json")

                async def valid() -> None:
                    results["valid"] = await _valid(client, url, prompt, stream)

                async with anyio.create_task_group() as tg:
                    tg.start_soon(fuzz)
                    tg.start_soon(near_fuzz)
                    tg.start_soon(valid)
            return [results["fuzz"], results["near"]], results["valid"]

        responses, tokens = anyio.run(both)
        for sent, resp in zip((body, near), responses, strict=True):
            statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1
            assert resp.status_code < 500, (sent[:300], resp.text[:500])
            if resp.status_code >= 400:
                error = resp.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}
        assert tokens == reference[tuple(prompt)]

    one()
    print(f"fuzz statuses ({server.url}): {sorted(statuses.items())}")
    assert statuses.get(400, 0) > 10 and statuses.get(200, 0) > 5
    _wait_idle(server)
