"""One hop to a pool: pick a backend, send, retry a failed connection once, read capped.

Every failure becomes an :class:`~pipeline.server.errors.HTTPProblem` with an OpenAI
error body (503 when the pool has no healthy backend, 502 for anything a backend did
wrong) and is counted in the proxy's metrics; the detail goes to the log.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import anyio
import attrs
import httpx

from pipeline.logger import get_logger
from pipeline.proxy.metrics import ProxyMetrics
from pipeline.proxy.pool import Backend, BackendPool
from pipeline.server.errors import HTTPProblem

__all__ = ["Hop", "Sent", "bad_gateway", "read_capped"]

_log = get_logger()
_CONNECT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout)


def bad_gateway(pool: str, rid: str) -> HTTPProblem:
    """The 502 of a backend of ``pool`` that failed (the detail is in the log)."""
    message = f"a {pool} backend failed to answer (request id {rid})"
    return HTTPProblem(502, message, kind="upstream_error", code="bad_gateway")


@attrs.define(eq=False)
class Sent:
    """A backend's answer, its headers read and its body not yet; it counts in its
    backend's ``in_flight`` until :meth:`aclose`.

    Attributes:
        backend: The backend that answered.
        response: Its open streaming response; the receiver must :meth:`aclose` this.
    """

    backend: Backend
    response: httpx.Response
    _open: bool = attrs.field(default=True, init=False)

    def __attrs_post_init__(self) -> None:
        self.backend.in_flight += 1

    async def aclose(self) -> None:
        """Close the response (bounded, shielded) and stop counting it; idempotent."""
        if self._open:
            self._open = False
            self.backend.in_flight -= 1
        with anyio.move_on_after(5, shield=True):
            await self.response.aclose()


@attrs.frozen
class Hop:
    """Sends requests to one pool on behalf of the proxy's routes.

    Attributes:
        pool: The pool to pick backends from.
        client: The proxy's shared upstream client.
        metrics: Where requests and failures are counted.
        max_response_bytes: The cap of :meth:`read`.
    """

    pool: BackendPool
    client: httpx.AsyncClient
    metrics: ProxyMetrics
    max_response_bytes: int

    async def send(
        self,
        path: str,
        body: dict[str, Any],
        headers: Mapping[str, str],
        rid: str,
        hashes: Sequence[Any] = (),
    ) -> Sent:
        """POST ``body`` to ``path`` of the healthy backend the pool picks (for a prompt
        of block ``hashes``) and return once its headers arrived. A backend whose
        connection fails is taken out of rotation and the request is sent once more to
        another one. Cancellation-safe.

        Raises:
            HTTPProblem: 503 when no healthy backend is left; 502 when the backend
                failed after the connection was open (or both tries failed to connect
                while some backend still counts as healthy).
        """
        tried: tuple[Backend, ...] = ()
        for _ in range(2):
            backend = self.pool.pick(exclude=tried, hashes=hashes)
            if backend is None:
                break
            request = self.client.build_request(
                "POST", backend.url + path, json=body, headers=dict(headers)
            )
            try:
                response = await self.client.send(request, stream=True)
            except _CONNECT_ERRORS as exc:
                backend.healthy = False
                self.failed(backend, "connect", exc, rid)
                tried += (backend,)
                continue
            except httpx.HTTPError as exc:
                self.failed(backend, _kind(exc), exc, rid)
                raise bad_gateway(self.pool.name, rid) from None
            self.metrics.requests.labels(self.pool.name, backend.url, response.status_code).inc()
            return Sent(backend, response)
        if self.pool.num_healthy and tried:
            raise bad_gateway(self.pool.name, rid)
        raise HTTPProblem(
            503,
            f"no healthy {self.pool.name} backend (request id {rid})",
            kind="service_unavailable_error",
            code="no_healthy_backend",
        )

    async def read(self, sent: Sent, rid: str, timeout_s: float) -> bytes:
        """The whole body of ``sent`` (then closed), at most ``max_response_bytes``.

        Raises:
            HTTPProblem: 502 when the body is larger, breaks off or takes longer than
                ``timeout_s``.
        """
        try:
            with anyio.fail_after(timeout_s):
                return await read_capped(sent.response, self.max_response_bytes)
        except (httpx.HTTPError, ValueError, TimeoutError) as exc:
            self.failed(sent.backend, _kind(exc), exc, rid)
            raise bad_gateway(self.pool.name, rid) from None
        finally:
            await sent.aclose()

    def failed(self, backend: Backend, kind: str, detail: object, rid: str) -> None:
        """Count and log a failure of ``backend`` (``kind``: a metrics label)."""
        self.metrics.errors.labels(self.pool.name, backend.url, kind).inc()
        if kind == "connect":
            self.metrics.requests.labels(self.pool.name, backend.url, 0).inc()
        _log.warning(
            "upstream_failed",
            request_id=rid,
            pool=self.pool.name,
            backend=backend.url,
            kind=kind,
            error=repr(detail)[:300],
        )


async def read_capped(response: httpx.Response, cap: int) -> bytes:
    """``response``'s raw body; ``ValueError`` once it passes ``cap`` bytes."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.aiter_raw():
        size += len(chunk)
        if size > cap:
            raise ValueError(f"the response is larger than {cap} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _kind(exc: BaseException) -> str:
    if isinstance(exc, httpx.TimeoutException | TimeoutError):
        return "timeout"
    if isinstance(exc, ValueError):
        return "response"
    return "stream"
