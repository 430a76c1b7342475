"""``POST /tokenize`` and ``POST /detokenize``, in vLLM's shapes.

``{"prompt": "text"}`` gives ``{"tokens": [...], "count": n, "max_model_len": N}``, and
``{"tokens": [...]}`` gives ``{"prompt": "text"}``. Both need the model's tokenizer (a
400 on ``prompt`` / ``tokens`` without one), sit behind the API key like every other
route, and are checked strictly: unknown fields are a 400 (``model`` must name the
served model), token ids must lie in the model's vocabulary, and at most
:data:`MAX_DETOKENIZE_TOKENS` ids are decoded at once (the body cap bounds the text).
Text above a few KiB is encoded (with the GIL released: :meth:`Tokenizer.encode
<pipeline.tokenizer.Tokenizer.encode>`), long id lists decoded, and a long answer
written (:func:`~pipeline.server.reply.json_reply`), on a worker thread: a 3.8 MiB
``/tokenize`` body no longer stops the event loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio.to_thread
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pipeline.errors import InvalidRequestError
from pipeline.server.body import read_body
from pipeline.server.errors import UnsupportedFieldError, error_body
from pipeline.server.prompt_encoder import INLINE_ENCODE_BYTES
from pipeline.server.reply import json_reply

if TYPE_CHECKING:
    from pipeline.server.app import ServerState

__all__ = ["MAX_DETOKENIZE_TOKENS", "detokenize", "tokenize"]

#: Most token ids one ``/detokenize`` request may carry.
MAX_DETOKENIZE_TOKENS = 1 << 17
_INLINE_DECODE_TOKENS = 1024


async def tokenize(request: Request) -> Response:
    """``{"prompt": str}`` to ``{"tokens", "count", "max_model_len"}``."""
    state, body = await _read(request, {"prompt", "add_special_tokens"})
    if isinstance(body, Response):
        return body
    text = body.get("prompt")
    if not isinstance(text, str):
        raise InvalidRequestError("prompt", _kind(text), "must be a string")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequestError("prompt", "<text>", "must be valid Unicode") from None
    special = body.get("add_special_tokens")
    if special is not None and special is not True:
        raise UnsupportedFieldError("add_special_tokens", special)
    tokenizer = _tokenizer(state, "prompt")
    if len(text) <= INLINE_ENCODE_BYTES:
        ids: list[int] = tokenizer.encode(text)
    else:
        ids = await anyio.to_thread.run_sync(tokenizer.encode, text, limiter=state.encoder.limiter)
    reply = {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}
    return await json_reply(state, lambda: reply, entries=len(ids))


async def detokenize(request: Request) -> Response:
    """``{"tokens": [int]}`` to ``{"prompt": str}``."""
    state, body = await _read(request, {"tokens"})
    if isinstance(body, Response):
        return body
    ids = body.get("tokens")
    if not isinstance(ids, list) or len(ids) > MAX_DETOKENIZE_TOKENS:
        raise InvalidRequestError(
            "tokens", _kind(ids), f"must be a list of at most {MAX_DETOKENIZE_TOKENS} token ids"
        )
    tokenizer = _tokenizer(state, "tokens")
    vocab = state.running_engine().core.model_config.vocab_size
    for tok in ids:
        if type(tok) is not int or not 0 <= tok < vocab:
            shown = tok if type(tok) is int and abs(tok) < 10**30 else _kind(tok)
            raise InvalidRequestError("tokens", shown, f"must hold integers in [0, {vocab})")
    if len(ids) <= _INLINE_DECODE_TOKENS:
        text = tokenizer.decode(ids)
    else:
        text = await anyio.to_thread.run_sync(tokenizer.decode, ids, limiter=state.encoder.limiter)
    return JSONResponse({"prompt": text})


async def _read(request: Request, fields: set[str]) -> tuple[ServerState, Any]:
    state: ServerState = request.app.state.kvstep
    body = await read_body(request)
    if isinstance(body, Response):  # the client went away mid-body
        return state, body
    if not isinstance(body, dict):
        raise InvalidRequestError("body", type(body).__name__, "must be a JSON object")
    for key in body:
        if key not in fields and key != "model":
            name = key[:64].encode("utf-8", "backslashreplace").decode("utf-8")
            raise InvalidRequestError(name, "...", "is not a field of this route")
    model = body.get("model")
    if model is not None and model != state.model_name and model not in state.loras:
        shown = model[:80] if isinstance(model, str) else _kind(model)
        served = ", ".join(repr(n) for n in (state.model_name, *state.loras.names()))
        message = f"model {shown!r} is not served; the served models are {served}"
        error = error_body(message, "not_found_error", "model_not_found", "model")
        return state, JSONResponse(error, status_code=404)
    return state, body


def _tokenizer(state: ServerState, param: str) -> Any:
    if state.tokenizer is None:
        raise InvalidRequestError(
            param, "...", "needs a tokenizer (tokenizer.json), which the served model has none of"
        )
    return state.tokenizer


def _kind(value: object) -> str:
    if isinstance(value, list | dict):
        return f"<{type(value).__name__} of {len(value)}>"
    return f"<{type(value).__name__}>"
