"""A response's choices and bodies: text, logprobs, finish and stop reasons, usage.

A choice's text is the engine's (``RequestOutput.text``, stop strings and their
hold-back applied: a streamed text is never retracted); an engine without a tokenizer
gives none, and each token is then written as a space and its id (``" 17 4 99"``), so
stream chunks still concatenate to the whole text. Every choice also carries its raw
token ids in ``token_ids`` (an extension, as vLLM's ``return_token_ids``) and vLLM's
``stop_reason`` (the stop string or stop token id that ended it, else ``null``).

``usage`` sums the completion tokens of every choice and counts each prompt's tokens
once (not once per each of its ``n`` choices), as OpenAI does.

vLLM's ``kv_transfer_params`` (what the KV connector's ``request_finished`` returned) is
a top-level field: of a whole response (:func:`transfer_params`), and of each stream
chunk that finishes a choice (:func:`with_transfer_params`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from pipeline.detokenize import decode_ids_text
from pipeline.logprobs import TokenLogprob
from pipeline.request import RequestOutput
from pipeline.server.chat_message import MessageReader
from pipeline.server.logprobs_format import (
    Entry,
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
)

__all__ = [
    "Choice",
    "chat_body",
    "completion_body",
    "output_text",
    "transfer_params",
    "usage",
    "with_transfer_params",
]


def output_text(out: RequestOutput) -> str:
    """All the text of ``out`` so far (token ids written out without a tokenizer)."""
    return out.text if out.text is not None else decode_ids_text(out.token_ids)


def _delta_text(out: RequestOutput) -> str:
    return out.new_text if out.text is not None else decode_ids_text(out.new_token_ids)


def usage(finals: Sequence[RequestOutput], n: int = 1) -> dict[str, int]:
    """OpenAI ``usage`` of a response's last outputs (``n`` choices per prompt, in
    prompt-major order)."""
    prompt = sum(len(out.prompt_token_ids) for out in finals[::n])
    completion = sum(len(out.token_ids) for out in finals)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def transfer_params(finals: Sequence[RequestOutput]) -> dict[str, Any] | None:
    """A whole response's ``kv_transfer_params``: its one request's (``None`` when the
    response holds several, which a request with ``kv_transfer_params`` cannot)."""
    return finals[0].kv_transfer_params if len(finals) == 1 else None


def with_transfer_params(body: dict[str, Any], out: RequestOutput) -> dict[str, Any]:
    """``body`` (a stream chunk of ``out``), with ``kv_transfer_params`` if ``out`` is final."""
    if out.finished:
        body["kv_transfer_params"] = out.kv_transfer_params
    return body


class Choice:
    """One choice as its outputs arrive: whole (non-streaming) or chunk by chunk.

    Args:
        index: The choice's ``index``.
        texts: The response's token texts (for logprobs).
        logprobs: Alternatives per token to show, or ``None``: no ``logprobs``.
        echo: Text to put before the choice's text (completions' ``echo``); with
            ``logprobs``, the prompt tokens' logprobs come first too.
        reader: How a chat choice's text becomes its message (reasoning, tool calls);
            ``None``: all of it is ``content``.
    """

    def __init__(
        self,
        index: int,
        texts: TokenTexts,
        *,
        logprobs: int | None,
        echo: str | None = None,
        reader: MessageReader | None = None,
    ) -> None:
        self.index = index
        self._texts = texts
        self._top = logprobs
        self._echo = echo
        self._reader = reader
        self._offset = 0  # characters of token text given so far (the next text_offset)

    def completion(self, out: RequestOutput, *, whole: bool = False) -> dict[str, Any]:
        """A completions choice: all of ``out`` (``whole``) or what it adds."""
        text, entries, ids = self._piece(out, whole)
        logprobs = None
        if self._top is not None:
            logprobs = completion_logprobs(entries, self._top, self._texts, self._offset)
            self._offset += sum(len(token) for token in logprobs["tokens"])
        return {"index": self.index, "text": text, "logprobs": logprobs, **_ends(out, ids)}

    def chat(self, out: RequestOutput, *, whole: bool = False) -> dict[str, Any]:
        """A chat choice: the whole ``message`` of ``out`` or the ``delta`` it adds."""
        text, entries, ids = self._piece(out, whole)
        logprobs = None
        if self._top is not None:
            logprobs = {"content": chat_logprobs(entries, self._top, self._texts)}
        reader = self._reader
        if whole:
            fields = {"content": text} if reader is None else reader.message(text)
            message: dict[str, Any] = {"message": {"role": "assistant", **fields}}
        else:
            fields = {"content": text} if reader is None else reader.delta(text, last=out.finished)
            message = {"delta": fields}
        ends = _ends(out, ids)
        if reader is not None and reader.made_calls and ends["finish_reason"] == "stop":
            ends["finish_reason"] = "tool_calls"
        return {"index": self.index, **message, "logprobs": logprobs, **ends}

    def _piece(self, out: RequestOutput, whole: bool) -> tuple[str, list[Entry], tuple[int, ...]]:
        if whole:
            text, ids = output_text(out), out.token_ids
        else:
            text, ids = _delta_text(out), out.new_token_ids
        entries = []
        if self._top is not None:
            start = len(out.token_ids) - len(ids)
            entries = _entries(ids, out.logprobs, start)
        if self._echo is not None:
            text = self._echo + text
            if self._top is not None:
                entries = _entries(out.prompt_token_ids, out.prompt_logprobs, 0) + entries
            self._echo = None
        return text, entries, ids


def _entries(
    ids: Sequence[int], logprobs: Sequence[TokenLogprob | None] | None, start: int
) -> list[Entry]:
    """``ids`` paired with their entries in ``logprobs`` (from ``start``; ``None`` where
    there is none, as on the last output of a request that failed)."""
    found = logprobs or ()
    return [
        (tok, found[start + i] if start + i < len(found) else None) for i, tok in enumerate(ids)
    ]


def _ends(out: RequestOutput, ids: Sequence[int]) -> dict[str, Any]:
    return {
        "finish_reason": out.finish_reason if out.finished else None,
        "stop_reason": out.stop_reason,
        "token_ids": list(ids),
    }


def completion_body(
    request_id: str,
    model: str,
    choices: list[dict[str, Any]],
    created: int | None = None,
    usage_: dict[str, int] | None = None,
) -> dict[str, Any]:
    """An OpenAI ``text_completion`` object (or one stream chunk of it)."""
    body: dict[str, Any] = {
        "id": f"cmpl-{request_id}",
        "object": "text_completion",
        "created": int(time.time()) if created is None else created,
        "model": model,
        "choices": choices,
    }
    if usage_ is not None:
        body["usage"] = usage_
    return body


def chat_body(
    request_id: str,
    model: str,
    choices: list[dict[str, Any]],
    created: int | None = None,
    *,
    chunk: bool = False,
    usage_: dict[str, int] | None = None,
) -> dict[str, Any]:
    """An OpenAI ``chat.completion`` (or ``chat.completion.chunk``) object."""
    body: dict[str, Any] = {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion.chunk" if chunk else "chat.completion",
        "created": int(time.time()) if created is None else created,
        "model": model,
        "choices": choices,
    }
    if usage_ is not None:
        body["usage"] = usage_
    return body
