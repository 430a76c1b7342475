"""Fake backends for the proxy tests (not a test file): Starlette apps served by uvicorn
on loopback ports in background threads."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

SSE_CHUNKS = [b'data: {"choices": [{"text": "a"}]}\n\n', b'data: {"choices": [{"text": "b"}]}\n\n']
SSE_BODY = b"".join(SSE_CHUNKS) + b"data: [DONE]\n\n"


class Fake:
    """A fake producer or consumer: records each body and headers; ``mode`` picks its answer."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.mode = "ok"
        self.healthy = True
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.health_auth: list[str | None] = []  # the Authorization of each /health poll
        self.stream_closed = threading.Event()
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self._complete, methods=["POST"]),
                Route("/v1/chat/completions", self._complete, methods=["POST"]),
                Route("/health", self._health),
            ]
        )

    async def _health(self, request: Request) -> Response:
        self.health_auth.append(request.headers.get("authorization"))
        return JSONResponse({"ok": self.healthy}, status_code=200 if self.healthy else 503)

    async def _complete(self, request: Request) -> Response:
        body = json.loads(await request.body())
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        if self.mode in ("400", "500"):
            error = {"message": f"{self.name} says no", "type": "x", "param": None, "code": "y"}
            return JSONResponse({"error": error}, status_code=int(self.mode))
        if body.get("stream"):
            return StreamingResponse(self._events(), media_type="text/event-stream")
        answer: dict[str, Any] = {"id": self.name, "choices": [{"text": "x"}]}
        if self.mode == "huge":
            answer["padding"] = "x" * 4096
        if self.mode != "bare":  # "bare": a producer that answers no kv_transfer_params
            answer["kv_transfer_params"] = {
                "do_remote_prefill": True,
                "remote_engine_id": self.name,
            }
        return JSONResponse(answer)

    async def _events(self) -> AsyncIterator[bytes]:
        try:
            if self.mode == "slow":
                while True:
                    yield SSE_CHUNKS[0]
                    await anyio.sleep(0.05)
            if self.mode == "paced":  # about 1.5 s, then the usual end
                for _ in range(30):
                    yield SSE_CHUNKS[0]
                    await anyio.sleep(0.05)
            for chunk in SSE_CHUNKS:
                yield chunk
            if self.mode == "break":
                raise RuntimeError("the consumer died mid-stream")
            yield b"data: [DONE]\n\n"
        finally:
            self.stream_closed.set()


class Served:
    """An ASGI app served by uvicorn on 127.0.0.1 in a background thread."""

    def __init__(self, app: Any) -> None:
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="critical", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "did not start"
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


class Servers:
    """Starts apps (``servers(app)``); stops them, and closes the clients, at teardown."""

    def __init__(self) -> None:
        self.started: list[Served] = []
        self.clients: list[httpx.Client] = []

    def __call__(self, app: Any) -> Served:
        self.started.append(Served(app))
        return self.started[-1]

    def close(self) -> None:
        for client in self.clients:
            client.close()
        for served in self.started:  # all at once: each takes a tick of uvicorn's loop
            served.server.should_exit = True
        for served in self.started:
            served.thread.join(10)
