"""``RelayResponse``: a backend's SSE stream passed to the client chunk by chunk.

Nothing is buffered: each chunk goes out as it arrives. When the client disconnects the
relay stops at once (it listens for the disconnect, whatever the ASGI spec version) and
closes the upstream response, which closes the connection to the backend and so ends
the request there. A stream that breaks off ends with an SSE error event.
"""

from __future__ import annotations

import json

import anyio
import httpx
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from pipeline.proxy.upstream import Hop, Sent
from pipeline.server.errors import error_body

__all__ = ["RelayResponse"]


class RelayResponse(Response):
    """Streams ``sent``'s body to the client (see the module doc).

    Args:
        sent: The backend's open response; always closed once this response ends.
        hop: The pool's hop, to count a broken stream.
        rid: The proxy's request id (in the error event and the log).
        headers: The response headers to send.
    """

    def __init__(self, sent: Sent, hop: Hop, rid: str, headers: dict[str, str]) -> None:
        super().__init__(status_code=sent.response.status_code, headers=headers)
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]
        self._sent = sent
        self._hop = hop
        self._rid = rid

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(self._relay, send, group.cancel_scope)
                await _until_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            await self._sent.aclose()

    async def _relay(self, send: Send, scope: anyio.CancelScope) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})  # fmt: skip
            try:
                async for chunk in self._sent.response.aiter_raw():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except httpx.HTTPError as exc:
                self._hop.failed(self._sent.backend, "stream", exc, self._rid)
                await send({"type": "http.response.body", "body": self._error_event(),
                            "more_body": True})  # fmt: skip
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client is gone (ASGI 2.4 servers raise on send)
            pass
        finally:
            scope.cancel()

    def _error_event(self) -> bytes:
        message = f"the {self._hop.pool.name} backend's stream broke off (request id {self._rid})"
        body = error_body(message, "upstream_error", "bad_gateway")
        return b"data: " + json.dumps(body).encode() + b"\n\n"


async def _until_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
