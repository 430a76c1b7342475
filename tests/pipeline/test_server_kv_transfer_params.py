"""``kv_transfer_params`` over HTTP: accepted by both endpoints, seen by the connector,
answered at the response's top level (streaming: in the finishing chunk), refused (400
naming the field) when bad, with ``n`` > 1, or with a batch of prompts."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

pytest.importorskip("starlette")
pytest.importorskip("jinja2")

from starlette.applications import Starlette
from transfer_connector import NAME, TransferScheduler, registered

from pipeline import EngineConfig
from pipeline.server import create_app
from pipeline.transfer_params import MAX_TRANSFER_BYTES, MAX_TRANSFER_ENTRIES

pytestmark = pytest.mark.anyio

CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
SENT = {"do_remote_decode": True, "ids": [1, 2], "peer": {"port": 7}}


@pytest.fixture
def connector() -> Iterator[type[TransferScheduler]]:
    with registered() as scheduler:
        yield scheduler


@asynccontextmanager
async def client() -> AsyncIterator[httpx.AsyncClient]:
    config = EngineConfig(model="builtin:tiny", dtype="float32", max_model_len=256, connector=NAME)
    app: Starlette = create_app(config)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://kvstep") as c:
            yield c


def body(path: str, **fields: Any) -> dict[str, Any]:
    common = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    if path == CMPL:
        return {"prompt": "hello world", **common, **fields}
    return {"messages": [{"role": "user", "content": "hi"}], **common, **fields}


def events(resp: httpx.Response) -> list[dict[str, Any]]:
    assert resp.status_code == 200, resp.text
    data = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def answered(connector: type[TransferScheduler], got: object) -> list[str]:
    """The ids of the requests whose scheduler half saw ``got`` when matching."""
    return [s.req_id for s in connector.seen if s.method == "match" and s.params == got]


class TestRoundTrip:
    @pytest.mark.parametrize("path", [CMPL, CHAT])
    async def test_non_streaming(self, path: str, connector: type[TransferScheduler]) -> None:
        """The connector sees the body's params; the response's top level has its answer,
        and null for a request without params."""
        async with client() as c:
            resp = await c.post(path, json=body(path, kv_transfer_params=SENT))
            plain = await c.post(path, json=body(path, kv_transfer_params=None))
        assert resp.status_code == 200, resp.text
        (req_id,) = set(answered(connector, SENT))
        assert resp.json()["kv_transfer_params"] == {"remote_request_id": req_id, "got": SENT}
        assert plain.status_code == 200 and plain.json()["kv_transfer_params"] is None

    @pytest.mark.parametrize("path", [CMPL, CHAT])
    async def test_streaming(self, path: str, connector: type[TransferScheduler]) -> None:
        """Only the chunk with the finish_reason carries kv_transfer_params."""
        async with client() as c:
            resp = await c.post(path, json=body(path, kv_transfer_params=SENT, stream=True))
        chunks = events(resp)
        finishing = [e for e in chunks if e["choices"] and e["choices"][0]["finish_reason"]]
        assert len(finishing) == 1 and finishing[0] is chunks[-1]
        (req_id,) = set(answered(connector, SENT))
        assert chunks[-1]["kv_transfer_params"] == {"remote_request_id": req_id, "got": SENT}
        assert all("kv_transfer_params" not in e for e in chunks[:-1])

    async def test_n_and_batches_without_params_still_work(
        self, connector: type[TransferScheduler]
    ) -> None:
        """Several choices without params: served, top-level kv_transfer_params null."""
        async with client() as c:
            resp = await c.post(CMPL, json=body(CMPL, n=2, prompt=["a", "b"]))
        assert resp.status_code == 200, resp.text
        assert len(resp.json()["choices"]) == 4 and resp.json()["kv_transfer_params"] is None


class TestRefused:
    @pytest.mark.parametrize("path", [CMPL, CHAT])
    async def test_bad_values_are_400_naming_the_field(
        self, path: str, connector: type[TransferScheduler]
    ) -> None:
        """Not an object, too deep, too big, too many entries, non-finite, with n=2, with
        two prompts: 400, param kv_transfer_params; the connector saw nothing."""
        deep: dict[str, Any] = {}
        for _ in range(9):
            deep = {"d": deep}
        bad: list[dict[str, Any]] = [
            {"kv_transfer_params": [1, 2]},
            {"kv_transfer_params": "do_remote_decode"},
            {"kv_transfer_params": 1},
            {"kv_transfer_params": deep},
            {"kv_transfer_params": {"s": "x" * (MAX_TRANSFER_BYTES + 1)}},
            {"kv_transfer_params": {f"k{i}": i for i in range(MAX_TRANSFER_ENTRIES + 1)}},
            {"kv_transfer_params": {"big": 2**70}},
            {"kv_transfer_params": SENT, "n": 2},
        ]
        if path == CMPL:
            bad.append({"kv_transfer_params": SENT, "prompt": ["a", "b"]})
            bad.append({"kv_transfer_params": SENT, "prompt": [[1, 2], [3, 4]]})
        async with client() as c:
            for fields in bad:
                resp = await c.post(path, json=body(path, **fields))
                assert resp.status_code == 400, (fields, resp.text)
                error = resp.json()["error"]
                assert error["param"] == "kv_transfer_params", (fields, error)
                assert error["code"] == "invalid_value", (fields, error)
        assert connector.seen == []
