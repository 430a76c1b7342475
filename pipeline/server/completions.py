"""``POST /v1/completions``: read, validate, admit, then stream or collect.

A batch (``prompt`` a list of prompts, see :mod:`pipeline.server.prompt_field`) with ``n``
choices per prompt is one engine request per choice, all admitted before the response
starts (see :mod:`pipeline.server.fanin`): choice ``index`` is ``prompt_index * n +
copy`` and ``usage`` sums over them (each prompt counted once).

Streaming interleaves the choices' chunks as their tokens come, each chunk carrying its
choice's ``index``; a choice's chunks concatenate to its whole text. With
``stream_options.include_usage`` true, a last chunk with ``choices: []`` and the summed
``usage`` precedes ``[DONE]`` (OpenAI's shape); without it no chunk carries ``usage``.

``echo`` puts the prompt's text (the prompt string, or the token-id prompt decoded with
its special tokens) before each choice's text (streaming: in the choice's first chunk);
with ``logprobs``, the prompt tokens' logprobs come first, the first one ``null``, as in
vLLM. ``prompt_logprobs`` (vLLM's, non-streaming only) is a field of each choice.

vLLM's ``kv_transfer_params`` (one prompt, ``n`` 1) goes to the engine request; the
response's top-level ``kv_transfer_params`` is the connector's answer (``null`` if none),
in the chunk with the ``finish_reason`` when streaming.
"""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from pipeline.detokenize import decode_ids_text
from pipeline.errors import InvalidRequestError
from pipeline.request import RequestOutput
from pipeline.server.body import read_body
from pipeline.server.choices import (
    Choice,
    completion_body,
    transfer_params,
    usage,
    with_transfer_params,
)
from pipeline.server.errors import arrival_time, note_ignored_fields
from pipeline.server.fanin import FanInStream, admit, collect_unless_gone, copy_params, sse
from pipeline.server.fields import TENANT_HEADER, tenant
from pipeline.server.limits import check_choices, check_prompt_logprobs
from pipeline.server.logprobs_format import TokenTexts, prompt_logprobs_json
from pipeline.server.prompt_field import Prompt, fit_max_tokens
from pipeline.server.reply import json_reply
from pipeline.server.schemas import SharedFields, parse_completion_request

if TYPE_CHECKING:
    from pipeline.server.app import ServerState

__all__ = ["completions", "logprob_entries", "refuse_stop_without_tokenizer", "served_name"]


async def completions(request: Request) -> Response:
    """The completions route (see the module doc)."""
    state: ServerState = request.app.state.kvstep
    body = await read_body(request)
    if isinstance(body, Response):  # the client went away mid-body
        return body
    parsed = parse_completion_request(body, max_prompt_tokens=state.max_model_len)
    fields = parsed.fields
    note_ignored_fields(request, fields.ignored)
    lora = state.loras.for_model(fields.model)
    refuse_stop_without_tokenizer(state, fields)
    n = fields.n
    check_choices(state.options, state.max_num_seqs, n, len(parsed.prompts))
    prompts = [await state.encoder.encode(p) if isinstance(p, str) else p for p in parsed.prompts]
    check_prompt_logprobs(state.options, fields.params.prompt_logprobs, list(map(len, prompts)), n)
    params = []
    for prompt in prompts:
        fitted = fit_max_tokens(
            fields.params, len(prompt), state.max_model_len, given=fields.max_tokens_given
        )
        params.extend(copy_params(fitted, n))
    streams = await admit(
        state.running_engine(),
        [p for p in prompts for _ in range(n)],
        params,
        arrival_time(request),
        fields.kv_transfer_params,
        lora,
        priority=fields.priority,
        tenant=tenant(request.headers.get(TENANT_HEADER)),
    )
    texts = TokenTexts(state.tokenizer)
    echoes = [_echo_text(state, raw, ids) if fields.echo else None for raw, ids in zip(
        parsed.prompts, prompts, strict=True
    )]  # fmt: skip
    choices = [
        Choice(i, texts, logprobs=fields.logprobs, echo=echoes[i // n]) for i in range(len(streams))
    ]
    rid = streams[0].request_id
    if fields.stream:
        render = functools.partial(_render, state, rid, choices, fields)
        return FanInStream(state, streams, render)
    finals = await collect_unless_gone(request, state, streams)
    if isinstance(finals, Response):
        return finals

    def build() -> dict[str, Any]:
        bodies = []
        for choice, out in zip(choices, finals, strict=True):
            one = choice.completion(out, whole=True)
            if fields.prompt_logprobs is not None:
                one["prompt_logprobs"] = prompt_logprobs_json(
                    out.prompt_token_ids, out.prompt_logprobs, texts
                )
            bodies.append(one)
        reply = completion_body(rid, served_name(state, fields), bodies, usage_=usage(finals, n))
        reply["kv_transfer_params"] = transfer_params(finals)
        return reply

    return await json_reply(state, build, entries=logprob_entries(fields, finals))


def logprob_entries(fields: SharedFields, finals: Sequence[RequestOutput]) -> int:
    """About how many logprob entries a whole response of ``finals`` holds (its prompt
    logprobs and its tokens' logprobs, alternatives included): what makes a body large."""
    entries = 0
    if fields.params.prompt_logprobs is not None:
        per_token = fields.params.prompt_logprobs + 1
        entries += per_token * sum(len(out.prompt_token_ids) for out in finals)
    if fields.logprobs is not None:
        entries += (fields.logprobs + 1) * sum(len(out.token_ids) for out in finals)
    return entries


def served_name(state: ServerState, fields: SharedFields) -> str:
    """The ``model`` a response names: the request's (the base model or an adapter,
    checked already), else the base model's."""
    return state.model_name if fields.model is None else fields.model


def refuse_stop_without_tokenizer(state: ServerState, fields: SharedFields) -> None:
    """``stop`` strings are matched in text: a model without a tokenizer cannot."""
    if fields.params.stop and state.tokenizer is None:
        raise InvalidRequestError(
            "stop", "...", "needs a tokenizer (the model has no tokenizer.json); "
            "use stop_token_ids instead",
        )  # fmt: skip


def _echo_text(state: ServerState, raw: Prompt, ids: list[int]) -> str:
    if isinstance(raw, str):
        return raw
    if state.tokenizer is None:
        return decode_ids_text(ids)
    return str(state.tokenizer.decode(ids, skip_special_tokens=False))


async def _render(
    state: ServerState,
    rid: str,
    choices: list[Choice],
    fields: SharedFields,
    outputs: AsyncIterator[tuple[int, RequestOutput]],
) -> AsyncIterator[str]:
    """The chunks: one per output, the usage chunk if asked, then ``[DONE]``."""
    created = int(time.time())
    model = served_name(state, fields)
    finals: dict[int, RequestOutput] = {}
    async for index, out in outputs:
        if out.finished:
            finals[index] = out
        chunk = [choices[index].completion(out)]
        yield sse(with_transfer_params(completion_body(rid, model, chunk, created), out))
    if fields.include_usage and len(finals) == len(choices):
        last = [finals[i] for i in range(len(choices))]
        yield sse(completion_body(rid, model, [], created, usage(last, fields.n)))
    yield "data: [DONE]\n\n"
