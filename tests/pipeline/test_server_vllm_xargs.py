"""The server's ``vllm_xargs`` (issue 25): vLLM's per-request arguments for custom logits
stages become ``SamplingParams.extra_args``; a bad value is a 400 naming ``vllm_xargs``."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("starlette")
pytest.importorskip("jinja2")


from asgi_client import client_for

from pipeline import AsyncEngine, EngineConfig, SamplingParams
from pipeline.sampling_params import MAX_EXTRA_ARGS_BYTES, MAX_EXTRA_ARGS_KEYS
from pipeline.server import create_app

CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"


@pytest.fixture
def tiny() -> EngineConfig:
    return EngineConfig(model="builtin:tiny", dtype="float32", max_model_len=256)


def _body(path: str, **fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": 3, "temperature": 0.0, "ignore_eos": True}
    if path == CMPL:
        body["prompt"] = "hello world"
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
    return {**body, **fields}


class _Recording:
    """Wraps an engine's ``generate`` to keep the params each request was admitted with."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.params: list[SamplingParams] = []
        self._generate = engine.generate

    def __call__(self, prompt: Any, params: SamplingParams | None = None, **kw: Any) -> Any:
        assert params is not None
        self.params.append(params)
        return self._generate(prompt, params, **kw)


@pytest.mark.anyio
@pytest.mark.parametrize("path", [CMPL, CHAT])
async def test_vllm_xargs_become_extra_args(
    tiny: EngineConfig, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each choice's request carries vllm_xargs as SamplingParams.extra_args; without
    it extra_args is empty; the field is not reported as ignored."""
    xargs = {"force": 5, "words": ["a", "b"], "nested": {"x": 0.5, "on": True, "no": None}}
    async with AsyncEngine(tiny) as engine, client_for(create_app(engine)) as client:
        recording = _Recording(engine)
        monkeypatch.setattr(engine, "generate", recording)
        resp = await client.post(path, json=_body(path, vllm_xargs=xargs, n=2))
        plain = await client.post(path, json=_body(path))
    assert resp.status_code == 200, resp.text
    assert plain.status_code == 200, plain.text
    assert "x-kvstep-ignored-fields" not in resp.headers
    assert [p.extra_args for p in recording.params] == [
        {"force": 5, "words": ("a", "b"), "nested": {"x": 0.5, "on": True, "no": None}},
    ] * 2 + [{}]


@pytest.mark.anyio
@pytest.mark.parametrize("path", [CMPL, CHAT])
@pytest.mark.parametrize(
    ("xargs", "said"),
    [
        ([1, 2], "mapping"),
        ("force=5", "mapping"),
        (5, "mapping"),
        ({"a": 2**64}, "vllm_xargs['a']"),
        ({"a": {"b": [1, {"c": 2**70}]}}, "vllm_xargs['a']['b'][1]['c']"),
        ({str(i): i for i in range(MAX_EXTRA_ARGS_KEYS + 1)}, f"at most {MAX_EXTRA_ARGS_KEYS}"),
        ({"a": "x" * MAX_EXTRA_ARGS_BYTES}, f"at most {MAX_EXTRA_ARGS_BYTES} bytes"),
        ({"a": [[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]}, "nests deeper"),
    ],
)
async def test_bad_vllm_xargs_is_a_400_naming_it(
    tiny: EngineConfig, path: str, xargs: object, said: str
) -> None:
    """A vllm_xargs that is not a bounded JSON object of JSON values is refused with a
    400 whose param is vllm_xargs and whose message says where and why."""
    async with client_for(create_app(tiny)) as client:
        resp = await client.post(path, json=_body(path, vllm_xargs=xargs))
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "vllm_xargs"
    assert error["code"] == "invalid_value"
    assert said in error["message"]
    assert len(error["message"]) < 400


@pytest.mark.anyio
async def test_null_vllm_xargs_is_no_arguments(tiny: EngineConfig) -> None:
    """vllm_xargs: null is the same as leaving it out (as vLLM), a known field."""
    async with client_for(create_app(tiny)) as client:
        resp = await client.post(CMPL, json=_body(CMPL, vllm_xargs=None))
    assert resp.status_code == 200, resp.text
    assert "x-kvstep-ignored-fields" not in resp.headers
