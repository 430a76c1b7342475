"""Embed kvstep's OpenAI-compatible app in your own Starlette app, then call it.

Your app owns the engine (opened in its lifespan); ``create_app(engine)`` is mounted
under ``/llm``. Standalone, the same server is ``kvstep serve`` or
``python -m pipeline.server --model builtin:tiny --port 8000``.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator

import anyio
import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Mount, Route

from pipeline import AsyncEngine, EngineConfig
from pipeline.server import create_app


def build_app(engine: AsyncEngine) -> Starlette:
    llm_app = create_app(engine, model_name="tiny")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with engine, llm_app.router.lifespan_context(llm_app):
            yield

    async def hello(request: Request) -> PlainTextResponse:
        return PlainTextResponse("my own route\n")

    return Starlette(routes=[Route("/", hello), Mount("/llm", llm_app)], lifespan=lifespan)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def amain() -> list[int]:
    engine = AsyncEngine(EngineConfig(model="builtin:tiny", max_model_len=256))
    port = free_port()
    config = uvicorn.Config(build_app(engine), host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.serve)
        with anyio.fail_after(60):
            while not server.started:
                await anyio.sleep(0.05)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 5, "temperature": 0}
            resp = await client.post("/llm/v1/completions", json=body)
            resp.raise_for_status()
        server.should_exit = True
    choice = resp.json()["choices"][0]
    print("text:", repr(choice["text"]), "token ids:", choice["token_ids"])
    token_ids: list[int] = choice["token_ids"]
    return token_ids


def main() -> list[int]:
    return anyio.run(amain)


if __name__ == "__main__":
    main()
