"""The server's ``priority`` field and ``X-Tenant-Id`` header, in process: they reach
the engine request, and bad values are a 400 naming them."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("starlette")
pytest.importorskip("jinja2")

from asgi_client import client_for

from pipeline import AsyncEngine, EngineConfig
from pipeline.server import create_app

pytestmark = pytest.mark.anyio

CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
BODIES = {
    CMPL: {"prompt": "hello", "max_tokens": 2, "temperature": 0.0},
    CHAT: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0.0},
}


def _config(policy: str = "priority") -> EngineConfig:
    return EngineConfig(
        model="builtin:tiny", dtype="float32", max_model_len=256, scheduling_policy=policy
    )


class _Recording(AsyncEngine):
    """An engine that records the priority and tenant of each request it admits."""

    seen: list[tuple[int, str | None]]

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        stream = super().generate(*args, **kwargs)
        request = self.core.scheduler.requests[stream.request_id]
        self.seen.append((request.priority, request.tenant))
        return stream


@pytest.mark.parametrize("path", [CMPL, CHAT])
async def test_priority_and_tenant_reach_the_engine(path: str) -> None:
    """The body's priority and the X-Tenant-Id header become the engine request's; both
    absent, the request has priority 0 and no tenant."""
    engine = _Recording(_config())
    engine.seen = []
    async with engine, client_for(create_app(engine)) as client:
        resp = await client.post(
            path,
            json={**BODIES[path], "priority": -3, "n": 2},
            headers={"X-Tenant-Id": "team-a"},
        )
        assert resp.status_code == 200, resp.text
        resp = await client.post(path, json=BODIES[path])
        assert resp.status_code == 200, resp.text
    assert engine.seen == [(-3, "team-a"), (-3, "team-a"), (0, None)]


@pytest.mark.parametrize("path", [CMPL, CHAT])
@pytest.mark.parametrize("value", ["1", 1.5, True, 2**63, [1]])
async def test_a_bad_priority_is_a_400_naming_it(path: str, value: object) -> None:
    """priority is a 64-bit integer: a string, float, bool or list is refused."""
    async with client_for(create_app(_config())) as client:
        resp = await client.post(path, json={**BODIES[path], "priority": value})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "priority"


@pytest.mark.parametrize("path", [CMPL, CHAT])
async def test_priority_needs_the_priority_policy(path: str) -> None:
    """Under fcfs a non-zero priority is a 400 naming it (as vLLM); 0 is served."""
    async with client_for(create_app(_config("fcfs"))) as client:
        resp = await client.post(path, json={**BODIES[path], "priority": 1})
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == "priority"
        assert "priority scheduling policy" in resp.json()["error"]["message"]
        resp = await client.post(path, json={**BODIES[path], "priority": 0})
        assert resp.status_code == 200, resp.text


@pytest.mark.parametrize("value", ["", "t" * 129])
async def test_a_bad_tenant_header_is_a_400_naming_it(value: str) -> None:
    """X-Tenant-Id is 1 to 128 printable characters."""
    async with client_for(create_app(_config())) as client:
        resp = await client.post(CMPL, json=BODIES[CMPL], headers={"X-Tenant-Id": value})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "X-Tenant-Id"
