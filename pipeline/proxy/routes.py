"""The routes ``/v1/completions`` and ``/v1/chat/completions``.

In front of replicas (``--backend``) a request goes to the one the pool's policy picks,
and the client gets its answer unchanged. In front of disaggregated pools, each request
goes first to a producer (prefill) backend, as itself but for
``max_tokens: 1`` (``max_completion_tokens: 1`` when the client used that instead),
``stream: false`` and
``kv_transfer_params: {"do_remote_decode": true}``; the ``kv_transfer_params`` of its
answer (``do_remote_prefill``, where the blocks are, ...) then go with the client's
original body to a consumer (decode) backend, whose answer the client gets unchanged.
A 4xx of either backend reaches the client as it is; a 5xx becomes a 502.

The proxy is the trust boundary between clients and engines: a client's
``kv_transfer_params`` are removed in every mode (a client never chooses which peer, or
which blocks, an engine reads; counted in
``kvstep_proxy_client_transfer_params_dropped_total``), its ``Authorization`` header is
never passed on (the backends get the proxy's ``--backend-api-key``, set on the
upstream client), and its ``X-Request-Id`` is (the proxy's own id when it sent none or an
unusable one), so a request can be followed across the proxy's and the engines' logs.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import anyio
import httpx
from starlette.requests import Request
from starlette.responses import Response

from pipeline.errors import InvalidRequestError
from pipeline.proxy.pool import Backend
from pipeline.proxy.relay import RelayResponse
from pipeline.proxy.upstream import Hop, Sent, bad_gateway
from pipeline.server.body import read_body
from pipeline.server.errors import request_id, short_value
from pipeline.server.kv_transfer import RELEASE_PATH

__all__ = ["chat_completions", "completions"]

# Headers of a backend's answer the client gets; the rest (framing, the backend's own
# request id, Date, Server) is the proxy's.
_ANSWER_HEADERS = ("content-type", "cache-control", "x-kvstep-ignored-fields")
_RELEASE_TIMEOUT_S = 5.0


async def completions(request: Request) -> Response:
    """``POST /v1/completions`` through a replica, or a producer and a consumer."""
    return await _route(request, "/v1/completions")


async def chat_completions(request: Request) -> Response:
    """``POST /v1/chat/completions`` through a replica, or a producer and a consumer."""
    return await _route(request, "/v1/chat/completions")


async def _route(request: Request, path: str) -> Response:
    state = request.app.state.kvstep
    body = await read_body(request)
    if isinstance(body, Response):  # the client left mid-body
        return body
    if not isinstance(body, dict):
        raise InvalidRequestError("body", short_value(body), "must be a JSON object")
    if body.pop("kv_transfer_params", None) is not None:  # only engines and the proxy set them
        state.metrics.transfer_params_dropped.inc()
    rid = request_id(request)
    headers = _upstream_headers(request, rid)
    hashes = await state.prompt_hashes(path, body)
    if state.prefill is None:  # replicas: one hop
        return await _forward(state.decode, path, body, headers, rid, state.timeout_s, hashes)
    n = body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n > 1:
        raise InvalidRequestError("n", n, "must be 1 behind kvstep proxy (one decode per prefill)")
    prefilled = await _prefill(state.prefill, path, body, headers, rid, state.timeout_s, hashes)
    if isinstance(prefilled, Response):
        return prefilled
    params, producer = prefilled
    decode_body = dict(body)
    if params:
        decode_body["kv_transfer_params"] = params
    try:
        answer = await _forward(
            state.decode, path, decode_body, headers, rid, state.timeout_s, hashes
        )
    except BaseException:
        if params:  # the consumer never took the request: nobody will read the blocks
            await _release(state, producer, params, headers, rid)
        raise
    if params and answer.status_code >= 400:  # refused (a 4xx: too long, a bad field)
        await _release(state, producer, params, headers, rid)
    return answer


async def _release(
    state: Any, producer: Backend, params: dict[str, Any], headers: dict[str, str], rid: str
) -> None:
    """Ask ``producer`` to free the blocks it holds for ``params`` now, not after its
    lease (bounded, shielded: it runs on the way out of a failed request too)."""
    hop: Hop = state.prefill
    result = "failed"
    with anyio.move_on_after(_RELEASE_TIMEOUT_S, shield=True):
        try:
            answer = await hop.client.post(
                producer.url + RELEASE_PATH, json={"kv_transfer_params": params}, headers=headers
            )
            released = answer.status_code == 200 and answer.json().get("released") is True
            result = "released" if released else "not_held"
            if answer.status_code != 200:
                hop.failed(producer, "release", f"status {answer.status_code}", rid)
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            hop.failed(producer, "release", exc, rid)
    state.metrics.transfers_released.labels(result).inc()


async def _forward(
    hop: Hop,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str],
    rid: str,
    timeout: float,
    hashes: Sequence[Any],
) -> Response:
    """``body`` sent through ``hop``; its answer relayed (a stream) or read."""
    sent = await hop.send(path, body, headers, rid, hashes)
    status = sent.response.status_code
    media_type = sent.response.headers.get("content-type", "")
    if status < 400 and media_type.startswith("text/event-stream"):
        return RelayResponse(sent, hop, rid, _answer_headers(sent))
    content = await hop.read(sent, rid, timeout)
    return _answer(hop, sent, content, rid)


async def _prefill(
    hop: Hop,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str],
    rid: str,
    timeout: float,
    hashes: Sequence[Any],
) -> tuple[dict[str, Any] | None, Backend] | Response:
    """The producer's ``kv_transfer_params`` (``None`` when it gave none) and the
    producer that answered them, or its 4xx."""
    prefill_body = {**body, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    prefill_body.pop("stream_options", None)  # only allowed with stream: true
    # One generated token. kvstep's chat refuses max_tokens beside max_completion_tokens,
    # so the latter alone is set when the client used it (vLLM's proxy sets both).
    limits = [k for k in ("max_tokens", "max_completion_tokens") if k in body] or ["max_tokens"]
    prefill_body.update(dict.fromkeys(limits, 1))
    sent = await hop.send(path, prefill_body, headers, rid, hashes)
    content = await hop.read(sent, rid, timeout)
    if sent.response.status_code >= 300:
        return _answer(hop, sent, content, rid)
    try:
        answer = json.loads(content)
    except (ValueError, RecursionError) as exc:  # not JSON, or nested past the stack
        hop.failed(sent.backend, "response", exc, rid)
        raise bad_gateway(hop.pool.name, rid) from None
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    if params is not None and not isinstance(params, dict):
        hop.failed(sent.backend, "response", f"kv_transfer_params={params!r:.80}", rid)
        raise bad_gateway(hop.pool.name, rid)
    return params, sent.backend


def _answer(hop: Hop, sent: Sent, content: bytes, rid: str) -> Response:
    """A backend's read answer for the client: as it is, but a 5xx (or 3xx) is a 502."""
    status = sent.response.status_code
    if status < 300 or 400 <= status < 500:
        return Response(content, status_code=status, headers=_answer_headers(sent))
    hop.failed(sent.backend, "status", f"status {status}: {content[:200]!r}", rid)
    raise bad_gateway(hop.pool.name, rid)


def _answer_headers(sent: Sent) -> dict[str, str]:
    found = sent.response.headers
    return {name: found[name] for name in _ANSWER_HEADERS if name in found}


def _upstream_headers(request: Request, rid: str) -> dict[str, str]:
    """The client's ``X-Request-Id`` (the proxy's id when it sent none or an unusable
    one), a JSON body and no compression; never the client's ``Authorization`` (the
    upstream client adds the backends' key)."""
    headers = {"content-type": "application/json", "accept-encoding": "identity"}
    given = request.headers.get("x-request-id", "")
    usable = 0 < len(given) <= 128 and given.isascii() and given.isprintable()
    headers["x-request-id"] = given if usable else rid
    return headers
