"""OpenAI completions: request parsing and response bodies (plain JSON dicts).

Token text convention without a tokenizer: each generated token is written as a space
followed by its id (``" 17 4 99"``), so the texts of stream chunks concatenate to the
text of the whole completion; every choice also carries the raw ids in ``token_ids``
(an extension field, as in vLLM's ``return_token_ids``).
"""

from __future__ import annotations

import time
from typing import Any

import attrs

from pipeline.config import SamplingParams
from pipeline.errors import InvalidRequestError
from pipeline.request import RequestOutput

__all__ = ["CompletionRequest", "Detokenizer", "parse_completion_request"]

_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos")


@attrs.frozen(kw_only=True)
class CompletionRequest:
    """A validated ``POST /v1/completions`` body."""

    model: str | None
    prompt: list[int] | str
    params: SamplingParams
    stream: bool


def parse_completion_request(body: object) -> CompletionRequest:
    """Validate a decoded JSON body; raise ``InvalidRequestError`` naming the bad field."""
    if not isinstance(body, dict):
        raise InvalidRequestError("body", type(body).__name__, "must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list | str):
        prompt = prompt[0]  # a batch of one
    if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt)):
        raise InvalidRequestError(
            "prompt", prompt, "must be a non-empty string or a non-empty list of token ids"
        )
    if isinstance(prompt, list) and not all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        raise InvalidRequestError("prompt", prompt[:8], "must be a list of integer token ids")
    n = body.get("n", 1)
    if n != 1:
        raise InvalidRequestError("n", n, "only n=1 is supported")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequestError("model", model, "must be a string")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidRequestError("stream", stream, "must be true or false")
    fields: dict[str, Any] = {k: body[k] for k in _SAMPLING_FIELDS if body.get(k) is not None}
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list):
            raise InvalidRequestError("stop_token_ids", stop_ids, "must be a list of token ids")
        fields["stop_token_ids"] = stop_ids
    try:
        params = SamplingParams(**fields)
    except TypeError as exc:  # e.g. a float where attrs expected something else
        raise InvalidRequestError("sampling parameters", fields, str(exc)) from exc
    return CompletionRequest(model=model, prompt=prompt, params=params, stream=stream)


class Detokenizer:
    """Turns one request's growing token list into text deltas. Not thread-safe."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._text = ""

    def delta(self, out: RequestOutput) -> str:
        """The text of ``out.new_token_ids`` (with a tokenizer: the new suffix of the text)."""
        if self._tokenizer is None:
            return "".join(f" {t}" for t in out.new_token_ids)
        text = self._tokenizer.decode(list(out.token_ids), skip_special_tokens=True)
        if text.startswith(self._text):
            new, self._text = text[len(self._text) :], text
            return new
        self._text = text
        return ""


def usage(out: RequestOutput) -> dict[str, int]:
    """OpenAI ``usage`` of a request's (last) output."""
    prompt, completion = len(out.prompt_token_ids), len(out.token_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def completion_body(
    request_id: str,
    model: str,
    text: str,
    token_ids: list[int] | tuple[int, ...],
    finish_reason: str | None,
    usage_: dict[str, int] | None,
    created: int | None = None,
) -> dict[str, Any]:
    """An OpenAI ``text_completion`` object (or one stream chunk of it)."""
    body: dict[str, Any] = {
        "id": f"cmpl-{request_id}",
        "object": "text_completion",
        "created": int(time.time()) if created is None else created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason,
                "token_ids": list(token_ids),
            }
        ],
    }
    if usage_ is not None:
        body["usage"] = usage_
    return body


def error_body(message: str, kind: str, code: int) -> dict[str, Any]:
    """An OpenAI-style error object."""
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}
