"""The completions ``prompt`` field (one prompt or a batch) and the context-length check.

``prompt`` is a string, a list of token ids, or a batch: a list of strings or a list of
token-id lists (at most :data:`MAX_PROMPTS`), each checked as a single prompt is. Each
prompt of a batch becomes one engine request and one choice, ``index`` in the batch's
order (as OpenAI and vLLM number them).

Context length, as vLLM does it: a prompt must leave room for one token
(``len(prompt) < max_model_len``, else a 400 on ``prompt``), and an explicit
``max_tokens`` must fit after it (``len(prompt) + max_tokens <= max_model_len``, else a
400 on ``max_tokens``), both with OpenAI's "maximum context length" message naming the
numbers. Without ``max_tokens``, kvstep keeps its default (16, OpenAI's default for
completions) clamped to the room left, so a request that names no ``max_tokens`` is
never refused for it (vLLM instead defaults to all the room left; 16 keeps a forgetful
client from generating up to the whole context).
"""

from __future__ import annotations

import attrs

from pipeline.config import SamplingParams
from pipeline.errors import InvalidRequestError
from pipeline.server.errors import HTTPProblem, short_value

__all__ = ["MAX_PROMPTS", "context_length_error", "fit_max_tokens", "parse_prompts"]

#: Most prompts one completions request may carry.
MAX_PROMPTS = 64
_INT64 = 2**63

Prompt = list[int] | str


def parse_prompts(prompt: object, max_model_len: int) -> tuple[Prompt, ...]:
    """The request's prompts (one, or a batch); ``InvalidRequestError`` on ``prompt``."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list | str):
        if len(prompt) > MAX_PROMPTS:
            raise InvalidRequestError(
                "prompt", f"<batch of {len(prompt)}>", f"may hold at most {MAX_PROMPTS} prompts"
            )
        return tuple(_one(p, max_model_len, f"prompt[{i}]") for i, p in enumerate(prompt))
    return (_one(prompt, max_model_len, "prompt"),)


def _one(prompt: object, max_model_len: int, where: str) -> Prompt:
    if isinstance(prompt, str):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequestError(
                "prompt", "<text>", f"{where} must be valid Unicode"
            ) from None
        return prompt
    if not isinstance(prompt, list) or not prompt:
        raise InvalidRequestError(
            "prompt",
            short_value(prompt),
            f"{where} must be a non-empty string or a non-empty list of token ids",
        )
    if len(prompt) >= max_model_len:
        raise context_length_error(max_model_len, len(prompt), None)
    for tok in prompt:
        if type(tok) is not int or not 0 <= tok < _INT64:
            raise InvalidRequestError(
                "prompt", short_value(tok), f"{where} must be a list of integer token ids"
            )
    return prompt


def fit_max_tokens(
    params: SamplingParams, prompt_len: int, max_model_len: int, *, given: bool
) -> SamplingParams:
    """``params`` fitted to the context (see the module doc), or a 400 ``HTTPProblem``."""
    room = max_model_len - prompt_len
    if room < 1:
        raise context_length_error(max_model_len, prompt_len, params.max_tokens if given else None)
    if not given:
        return attrs.evolve(params, max_tokens=min(params.max_tokens, room))
    if params.max_tokens > room:
        raise context_length_error(max_model_len, prompt_len, params.max_tokens)
    return params


def context_length_error(
    max_model_len: int, prompt_len: int, max_tokens: int | None
) -> HTTPProblem:
    """OpenAI's "maximum context length" 400, on ``max_tokens`` or on ``prompt``."""
    if max_tokens is None or prompt_len >= max_model_len:
        param = "prompt"
        asked = f"your prompt is {prompt_len} tokens"
        if max_tokens is not None:
            asked += f" and you requested {max_tokens} tokens for the completion"
        fix = f"Please reduce your prompt to fewer than {max_model_len} tokens."
    else:
        param = "max_tokens"
        asked = (
            f"you requested {prompt_len + max_tokens} tokens ({prompt_len} in your prompt; "
            f"{max_tokens} for the completion)"
        )
        fix = "Please reduce your prompt; or completion length."
    message = (
        f"This model's maximum context length is {max_model_len} tokens. However, {asked}. {fix}"
    )
    return HTTPProblem(400, message, code="context_length_exceeded", param=param)
