"""``POST /v1/chat/completions``: messages rendered with the model's chat template.

The template (``chat_template`` of the model's ``tokenizer_config.json``) is rendered
in Jinja2's immutable sandbox, as transformers renders it (``trim_blocks``,
``lstrip_blocks``, ``raise_exception``), with ``messages``,
``add_generation_prompt=True`` and the special tokens (``bos_token``, ...). The text is
then encoded like a text prompt and generated like a completion; the sampling fields,
the model check, disconnect handling and error shapes are the completions endpoint's.
A message's ``content`` is a string or a list of ``{"type": "text", "text": ...}`` parts
(joined with newlines, as vLLM does).
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, NoReturn

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from pipeline.engine.async_engine import RequestStream
from pipeline.errors import EngineDeadError, InvalidRequestError
from pipeline.logs import get_logger
from pipeline.request import RequestOutput
from pipeline.server.body import CLIENT_CLOSED, read_body
from pipeline.server.completions import _count_finished
from pipeline.server.detokenize import Detokenizer, decode_ids_text
from pipeline.server.errors import error_body, request_id
from pipeline.server.prompts import fit_max_tokens
from pipeline.server.schemas import parse_shared_fields, usage

if TYPE_CHECKING:
    import jinja2

    from pipeline.server.app import ServerState

__all__ = ["chat_completions", "render_chat"]

_log = get_logger()
ROLES = ("system", "user", "assistant")
_CHAT_FIELDS = frozenset({"messages"})
MAX_MESSAGES = 1024


async def chat_completions(request: Request) -> Response:
    """The chat completions route (see the module doc)."""
    state: ServerState = request.app.state.kvstep
    body = await read_body(request)
    if isinstance(body, Response):  # the client went away mid-body
        return body
    if not isinstance(body, dict):
        raise InvalidRequestError("body", type(body).__name__, "must be a JSON object")
    _check_max_completion_tokens(body)
    messages = parse_messages(body.get("messages"))
    model, params, stream_, include_usage = parse_shared_fields(body, extra_known=_CHAT_FIELDS)
    if model is not None and model != state.model_name:
        message = f"model {model[:80]!r} is not served; the served model is {state.model_name!r}"
        return JSONResponse(
            error_body(message, "not_found_error", "model_not_found", "model"), status_code=404
        )
    text = render_chat(state.tokenizer, messages)
    prompt = await state.encoder.encode(text)
    given = body.get("max_tokens") is not None
    params = fit_max_tokens(params, len(prompt), state.max_model_len, given=given)
    stream = state.running_engine().generate(prompt, params)
    if stream_:
        return _ChatStream(state, stream, include_usage=include_usage)
    return await _collect_unless_gone(request, state, stream)


class _ChatStream(StreamingResponse):
    """The SSE response; however it ends (done, client gone before the first chunk,
    an error), an unfinished request is counted as aborted and aborted."""

    def __init__(self, state: ServerState, stream: RequestStream, *, include_usage: bool):
        self._state, self._stream = state, stream
        events = _sse(state, stream, include_usage=include_usage)
        super().__init__(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self._stream.finished:
                self._state.metrics.requests.labels("abort").inc()
            await self._stream.aclose()


async def _collect_unless_gone(
    request: Request, state: ServerState, stream: RequestStream
) -> Response:
    """Collect the reply; abort the request if the client disconnects meanwhile."""
    result: list[Response] = []
    failed: list[Exception] = []

    async def watch_disconnect(scope: anyio.CancelScope) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        scope.cancel()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch_disconnect, tg.cancel_scope)
            try:
                result.append(await _collect(state, stream))
            except Exception as exc:  # raised below, not wrapped in an ExceptionGroup
                failed.append(exc)
            tg.cancel_scope.cancel()
    finally:
        await stream.aclose()  # aborts the request if it has not finished
    if failed:
        raise failed[0]
    if not result:  # cancelled by the watcher
        _log.info(
            "client_disconnected", request_id=request_id(request), engine_request=stream.request_id
        )
        state.metrics.requests.labels("abort").inc()
        return Response(status_code=CLIENT_CLOSED)
    return result[0]


def _check_max_completion_tokens(body: dict[Any, Any]) -> None:
    """``max_completion_tokens`` (OpenAI's newer name) stands for ``max_tokens``."""
    if body.get("max_completion_tokens") is None:
        body.pop("max_completion_tokens", None)
        return
    if body.get("max_tokens") is not None:
        raise InvalidRequestError(
            "max_completion_tokens", "...", "give max_tokens or max_completion_tokens, not both"
        )
    body["max_tokens"] = body.pop("max_completion_tokens")


def parse_messages(value: object) -> list[dict[str, str]]:
    """``messages`` checked and normalised to ``[{"role", "content"}]`` (content a string)."""
    if not isinstance(value, list) or not value:
        _bad("messages", value, "must be a non-empty list of {role, content} objects")
    if len(value) > MAX_MESSAGES:
        _bad("messages", f"<{len(value)} messages>", f"must hold at most {MAX_MESSAGES}")
    messages = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            _bad(where, type(message).__name__, "must be an object with role and content")
        role = message.get("role")
        if role not in ROLES:
            _bad(f"{where}.role", role, f"must be one of {', '.join(ROLES)}")
        messages.append({"role": str(role), "content": _content(where, message.get("content"))})
    return messages


def _content(where: str, content: object) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        _bad(f"{where}.content", content, "must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            _bad(f"{where}.content[{j}]", part, 'must be {"type": "text", "text": ...}')
        text = part.get("text")
        if not isinstance(text, str):
            _bad(f"{where}.content[{j}].text", text, "must be a string")
        texts.append(text)
    return "\n".join(texts)


def _bad(field: str, value: object, why: str) -> NoReturn:
    if isinstance(value, str) and len(value) > 40:
        value = value[:40] + "..."
    elif isinstance(value, list | dict):
        value = f"<{type(value).__name__} of {len(value)}>"
    raise InvalidRequestError(field, value, why)


def render_chat(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """The prompt text of ``messages`` through the tokenizer's chat template.

    Raises:
        InvalidRequestError: The model has no tokenizer or no chat template
            (``param`` ``messages``), or the template refused the messages.
    """
    import jinja2

    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        what = "tokenizer.json" if tokenizer is None else "chat_template in tokenizer_config.json"
        raise InvalidRequestError(
            "messages",
            "...",
            f"cannot be rendered: the model has no chat template (no {what}); "
            "use /v1/completions with a prompt instead",
        )
    special = dict(getattr(tokenizer, "special_tokens", {}))
    try:
        return _compile(template).render(messages=messages, add_generation_prompt=True, **special)
    except jinja2.TemplateError as exc:
        raise InvalidRequestError(
            "messages", "...", f"the chat template refused them: {exc}"
        ) from exc


@functools.lru_cache(maxsize=4)
def _compile(template: str) -> jinja2.Template:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(template)


def _raise_exception(message: str) -> NoReturn:
    import jinja2

    raise jinja2.TemplateError(message)


def chat_body(
    request_id: str, model: str, choice: dict[str, Any], created: int | None = None, *,
    chunk: bool = False, usage_: dict[str, int] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """An OpenAI ``chat.completion`` (or ``chat.completion.chunk``) object."""
    body: dict[str, Any] = {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion.chunk" if chunk else "chat.completion",
        "created": int(time.time()) if created is None else created,
        "model": model,
        "choices": [{"index": 0, "logprobs": None, **choice}] if choice else [],
    }
    if usage_ is not None:
        body["usage"] = usage_
    return body


async def _collect(state: ServerState, stream: RequestStream) -> Response:
    last: RequestOutput | None = None
    try:
        async for out in stream:
            last = out
    finally:
        await stream.aclose()
    if last is None:
        raise EngineDeadError("the engine ended the request without output")
    _count_finished(state, last)
    if state.tokenizer is None:
        text = decode_ids_text(last.token_ids)
    else:
        text = state.tokenizer.decode(list(last.token_ids), skip_special_tokens=True)
    choice = {
        "message": {"role": "assistant", "content": text},
        "finish_reason": last.finish_reason,
        "token_ids": list(last.token_ids),
    }
    return JSONResponse(chat_body(stream.request_id, state.model_name, choice, usage_=usage(last)))


async def _sse(
    state: ServerState, stream: RequestStream, *, include_usage: bool
) -> AsyncIterator[str]:
    """Chunks: the role first, then content deltas, the finish reason, usage, ``[DONE]``
    (:class:`_ChatStream` aborts the request if they stop early)."""
    detok = Detokenizer(state.tokenizer)
    created = int(time.time())

    def event(choice: dict[str, Any], usage_: dict[str, int] | None = None) -> str:
        body = chat_body(
            stream.request_id, state.model_name, choice, created, chunk=True, usage_=usage_
        )
        return f"data: {json.dumps(body)}\n\n"

    try:
        yield event({"delta": {"role": "assistant", "content": ""}, "finish_reason": None})
        async for out in stream:
            if not out.new_token_ids and not out.finished:
                continue
            if out.finished:
                _count_finished(state, out)
            choice = {
                "delta": {"content": detok.delta(out)},
                "finish_reason": out.finish_reason if out.finished else None,
                "token_ids": list(out.new_token_ids),
            }
            yield event(choice)
            if out.finished and include_usage:
                yield event({}, usage(out))
        yield "data: [DONE]\n\n"
    except EngineDeadError as exc:
        _log.error(
            "stream_failed_engine_unavailable", engine_request=stream.request_id, error=str(exc)
        )
        message = f"the engine is unavailable (request {stream.request_id})"
        body = error_body(message, "service_unavailable_error", "engine_unavailable")
        yield f"data: {json.dumps(body)}\n\n"
