"""``RequestStream``: the outputs of one request of an
:class:`~pipeline.engine.async_engine.AsyncEngine`, as an async iterator."""

from __future__ import annotations

import contextlib
import math
from typing import Protocol

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from pipeline.request import RequestOutput

__all__ = ["RequestStream"]


class _Aborts(Protocol):
    def _request_abort(self, request_id: str) -> None: ...


class RequestStream:
    """The outputs of one request, as an async iterator.

    Cancelling the task that iterates it (a client gone), calling :meth:`aclose`, or
    dropping it unfinished aborts the request and frees its blocks.
    """

    def __init__(self, engine: _Aborts, request_id: str) -> None:
        self.request_id = request_id
        self._engine = engine
        send, receive = anyio.create_memory_object_stream[RequestOutput | BaseException](math.inf)
        self._send: MemoryObjectSendStream[RequestOutput | BaseException] = send
        self._receive: MemoryObjectReceiveStream[RequestOutput | BaseException] = receive
        self.finished = False
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._receive.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            self._close()
            raise StopAsyncIteration from None
        except anyio.get_cancelled_exc_class():
            self._abandon()
            raise
        if isinstance(item, BaseException):
            self._close()
            raise item
        if item.finished:
            self._close()
        return item

    async def aclose(self) -> None:
        """Abort the request if it has not finished; idempotent."""
        self._abandon()

    def _close(self) -> None:
        self.finished = True
        self._done = True
        self._receive.close()

    def _abandon(self) -> None:
        if not self.finished:
            self._engine._request_abort(self.request_id)
        self._close()

    def _deliver(self, item: RequestOutput | BaseException) -> None:
        # A consumer that is gone leaves the request to the abort path.
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            self._send.send_nowait(item)
        if isinstance(item, BaseException) or item.finished:
            self._send.close()

    def _end(self) -> None:
        """Engine side: no more outputs will come."""
        self._send.close()

    def __del__(self) -> None:
        if not self.finished:
            self._engine._request_abort(self.request_id)
        self._send.close()
        self._receive.close()
