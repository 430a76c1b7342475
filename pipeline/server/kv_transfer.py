"""``POST /v1/kv_transfer/release``: free what this engine holds for a refused transfer.

A producer holds a finished prefill's KV blocks for its consumer until the consumer has
read them (or a lease runs out). When the consumer refuses the request instead (a
``max_tokens`` past the context, a bad field), nobody will ever read them: the router
that carried the transfer (``kvstep proxy``) posts the producer's own answer back here,
``{"kv_transfer_params": {...}}``, and the blocks are freed at once instead of after the
lease. Only a transfer the params name exactly (the producer checks its ticket) is
freed; the answer is ``{"released": true | false}``. Behind the API key like every
other route.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pipeline.errors import InvalidRequestError
from pipeline.server.body import read_body
from pipeline.transfer_params import TRANSFER_PARAMS

__all__ = ["RELEASE_PATH", "release_transfer"]

RELEASE_PATH = "/v1/kv_transfer/release"
"""Where a router posts the params of a transfer its receiver refused."""


async def release_transfer(request: Request) -> Response:
    """``{"kv_transfer_params": {...}}`` to ``{"released": bool}``."""
    body = await read_body(request)
    if isinstance(body, Response):  # the client went away mid-body
        return body
    if not isinstance(body, dict) or set(body) != {TRANSFER_PARAMS}:
        raise InvalidRequestError(
            "body", type(body).__name__, f"must be a JSON object with {TRANSFER_PARAMS} only"
        )
    engine = request.app.state.kvstep.running_engine()
    return JSONResponse({"released": engine.release_transfer(body[TRANSFER_PARAMS])})
