"""``POST /v1/chat/completions``: messages rendered with the model's chat template.

The template (``chat_template`` of the model's ``tokenizer_config.json``) is rendered
in Jinja2's immutable sandbox, as transformers renders it (``trim_blocks``,
``lstrip_blocks``, ``raise_exception``), with ``messages``,
``add_generation_prompt=True`` and the special tokens (``bos_token``, ...). The text is
then encoded like a text prompt and generated like a completion; the sampling fields,
the model check, disconnect handling and error shapes are the completions endpoint's.
A message's ``content`` is a string or a list of ``{"type": "text", "text": ...}`` parts
(joined with newlines, as vLLM does).

``n`` choices are ``n`` requests of the one prompt (see :mod:`pipeline.server.fanin`); a
stream starts with each choice's role chunk. ``logprobs: true`` (with ``top_logprobs``
alternatives) gives each choice ``logprobs.content``; vLLM's ``prompt_logprobs``
(non-streaming only) is a field of the response, as in vLLM; so is
``kv_transfer_params`` (see :mod:`pipeline.server.completions`).

Tools (:mod:`pipeline.server.tools`): ``tools`` are rendered into the prompt by the
template; ``tool_choice`` ``"required"`` or a named function forces calls by grammar,
``"auto"`` reads them with the server's ``--tool-call-parser``; a choice with calls has
``message.tool_calls`` (streamed as ``delta.tool_calls``, each call whole once its text
closes) and ``finish_reason: "tool_calls"``. With ``--reasoning-parser`` the thinking is
``reasoning_content`` (:mod:`pipeline.server.chat_message`), and a constraint (a
``response_format``, forced calls) applies to what follows it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import attrs
from starlette.requests import Request
from starlette.responses import Response

from pipeline.config import SamplingParams
from pipeline.errors import InvalidRequestError
from pipeline.request import RequestOutput
from pipeline.server.body import read_body
from pipeline.server.chat_message import MessageReader
from pipeline.server.chat_template import parse_messages, render_chat
from pipeline.server.choices import (
    Choice,
    chat_body,
    transfer_params,
    usage,
    with_transfer_params,
)
from pipeline.server.completions import logprob_entries, served_name
from pipeline.server.errors import arrival_time, note_ignored_fields
from pipeline.server.fanin import FanInStream, admit, collect_unless_gone, copy_params, sse
from pipeline.server.fields import TENANT_HEADER, tenant
from pipeline.server.limits import check_choices, check_prompt_logprobs
from pipeline.server.logprobs_format import TokenTexts, prompt_logprobs_json
from pipeline.server.prompt_field import fit_max_tokens
from pipeline.server.reply import json_reply
from pipeline.server.schemas import SharedFields, parse_shared_fields
from pipeline.server.tool_parsers import TOOL_PARSERS, ToolParser
from pipeline.server.tools import LARK_BACKENDS, ToolRequest, forcing_parser, parse_tools
from pipeline.structured_outputs import Reasoning

if TYPE_CHECKING:
    from pipeline.server.app import ServerState

__all__ = ["chat_completions", "render_chat"]


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
    fields = parse_shared_fields(body, endpoint="chat")
    tools = parse_tools(body)
    note_ignored_fields(request, fields.ignored)
    lora = state.loras.for_model(fields.model)
    check_choices(state.options, state.max_num_seqs, fields.n, 1)
    params, calls = _tool_params(state, tools, fields.params)
    params = _after_reasoning(state, params)
    text = render_chat(state.tokenizer, messages, tools.template_tools() if tools else None)
    prompt = await state.encoder.encode(text)
    check_prompt_logprobs(state.options, params.prompt_logprobs, [len(prompt)], fields.n)
    params = fit_max_tokens(params, len(prompt), state.max_model_len, given=fields.max_tokens_given)
    n = fields.n
    streams = await admit(
        state.running_engine(),
        [prompt] * n,
        copy_params(params, n),
        arrival_time(request),
        fields.kv_transfer_params,
        lora,
        priority=fields.priority,
        tenant=tenant(request.headers.get(TENANT_HEADER)),
    )
    texts = TokenTexts(state.tokenizer)
    choices = [
        Choice(i, texts, logprobs=fields.logprobs, reader=_reader(state, calls)) for i in range(n)
    ]
    rid = streams[0].request_id
    if fields.stream:
        return FanInStream(state, streams, functools.partial(_render, state, rid, choices, fields))
    finals = await collect_unless_gone(request, state, streams)
    if isinstance(finals, Response):
        return finals

    def build() -> dict[str, Any]:
        bodies = [choice.chat(out, whole=True) for choice, out in zip(choices, finals, strict=True)]
        reply = chat_body(rid, served_name(state, fields), bodies, usage_=usage(finals, n))
        reply["kv_transfer_params"] = transfer_params(finals)
        if fields.prompt_logprobs is not None:  # vLLM: one prompt, so a field of the response
            reply["prompt_logprobs"] = prompt_logprobs_json(
                finals[0].prompt_token_ids, finals[0].prompt_logprobs, texts
            )
        return reply

    return await json_reply(state, build, entries=logprob_entries(fields, finals))


async def _render(
    state: ServerState,
    rid: str,
    choices: list[Choice],
    fields: SharedFields,
    outputs: AsyncIterator[tuple[int, RequestOutput]],
) -> AsyncIterator[str]:
    """Chunks: each choice's role first, then content deltas (the last with the finish
    reason), the usage chunk if asked, ``[DONE]``."""
    created = int(time.time())

    def event(chunk: list[dict[str, Any]], usage_: dict[str, int] | None = None) -> str:
        return sse(body(chunk, usage_))

    def body(chunk: list[dict[str, Any]], usage_: dict[str, int] | None = None) -> dict[str, Any]:
        return chat_body(rid, served_name(state, fields), chunk, created, chunk=True, usage_=usage_)

    for choice in choices:
        delta = {"role": "assistant", "content": ""}
        first = {"index": choice.index, "delta": delta, "logprobs": None, "finish_reason": None}
        yield event([first])
    finals: dict[int, RequestOutput] = {}
    async for index, out in outputs:
        if out.finished:
            finals[index] = out
        yield sse(with_transfer_params(body([choices[index].chat(out)]), out))
    if fields.include_usage and len(finals) == len(choices):
        yield event([], usage([finals[i] for i in range(len(choices))], fields.n))
    yield "data: [DONE]\n\n"


def _tool_params(
    state: ServerState, tools: ToolRequest | None, params: SamplingParams
) -> tuple[SamplingParams, ToolParser | None]:
    """The request's parameters with its forced tool calls' grammar, and the parser its
    output is read for calls with (``None``: no calls are read)."""
    if tools is None or not tools.parses_calls:
        return params, None
    if tools.choice == "auto":
        if state.tool_parser is None:
            raise InvalidRequestError(
                "tool_choice",
                "auto",
                "needs a tool-call parser: start the server with --tool-call-parser "
                f"({', '.join(sorted(TOOL_PARSERS))}), or use required or a named function",
            )
        return params, state.tool_parser
    if params.structured_outputs is not None:
        raise InvalidRequestError(
            "tool_choice",
            tools.choice,
            "forces a tool call, which cannot be combined with response_format or "
            "structured_outputs",
        )
    backend = state.running_engine().config.structured_outputs_backend
    parser = forcing_parser(state.tool_parser, backend)
    spec = tools.forcing_spec(parser, lark=backend in LARK_BACKENDS)
    return attrs.evolve(params, structured_outputs=spec), parser


def _after_reasoning(state: ServerState, params: SamplingParams) -> SamplingParams:
    """With a reasoning parser, a constraint applies after the model's thinking."""
    spec, parser = params.structured_outputs, state.reasoning_parser
    if spec is None or parser is None:
        return params
    reasoning: Reasoning = "required" if parser.implicit_open else "optional"
    return attrs.evolve(params, structured_outputs=attrs.evolve(spec, reasoning=reasoning))


def _reader(state: ServerState, calls: ToolParser | None) -> MessageReader | None:
    if calls is None and state.reasoning_parser is None:
        return None
    return MessageReader(calls, state.reasoning_parser)


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
