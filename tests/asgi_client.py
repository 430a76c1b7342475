"""Helper for tests (not a test file): an httpx client talking to an ASGI app in process."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
from starlette.applications import Starlette


@asynccontextmanager
async def client_for(app: Starlette) -> AsyncIterator[httpx.AsyncClient]:
    """An httpx client talking to ``app`` in process, its lifespan open."""
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://kvstep") as client:
            yield client
