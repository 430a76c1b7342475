"""OpenAI completions: strict request parsing and response bodies (plain JSON dicts).

Every known field is type-checked here, before ``SamplingParams`` sees it: a bool is not
a number, integers must fit in 64 bits, floats must be finite, ``n`` is exactly 1 and
lists are capped. Fields that would change what is generated but that kvstep does not
implement yet (``stop``, ``logprobs``, ``echo``, ``best_of``, ...) are
refused with a 400 naming them, unless they hold their neutral value (``"echo": false``,
``"presence_penalty": 0``), which clients often send. Other unknown fields are ignored
and named in a warning log, never silently.

Token text convention without a tokenizer: each generated token is written as a space
followed by its id (``" 17 4 99"``), so the texts of stream chunks concatenate to the
text of the whole completion; every choice also carries the raw ids in ``token_ids``
(an extension field, as in vLLM's ``return_token_ids``).

Penalties and biases: ``presence_penalty`` and ``frequency_penalty`` (OpenAI, [-2, 2]),
``logit_bias`` (OpenAI: an object of token id strings to biases in [-100, 100], at most
300), and vLLM's extensions ``repetition_penalty`` (> 0), ``min_p`` ([0, 1]) and
``min_tokens`` ([0, max_tokens]); see :class:`~pipeline.config.SamplingParams`.
"""

from __future__ import annotations

import math
import time
from typing import Any

import attrs

from pipeline.config import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS, SamplingParams
from pipeline.errors import InvalidRequestError
from pipeline.logs import get_logger
from pipeline.request import RequestOutput
from pipeline.server.errors import UnsupportedFieldError, short_value
from pipeline.server.prompts import parse_prompts

__all__ = ["CompletionRequest", "parse_completion_request", "parse_shared_fields"]

_log = get_logger()
_INT64 = 2**63
_INTS = ("max_tokens", "top_k", "min_tokens")
_FLOATS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
_NEUTRAL: dict[str, tuple[object, ...]] = {
    "stop": ("", ()),
    "logprobs": (False, 0),
    "echo": (False,),
    "best_of": (1,),
    "suffix": ("",),
    "prompt_logprobs": (False, 0),
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "use_beam_search": (False,),
    "length_penalty": (1,),
    "response_format": (),
    "allowed_token_ids": (),
    "bad_words": ((),),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "truncate_prompt_tokens": (),
    "kv_transfer_params": (),
}
_KNOWN = frozenset(
    {"model", "prompt", "stream", "stream_options", "n", "user", "seed", "ignore_eos"}
    | {"stop_token_ids", "logit_bias", *_INTS, *_FLOATS}
)


@attrs.frozen(kw_only=True)
class CompletionRequest:
    """A validated ``POST /v1/completions`` body."""

    model: str | None
    prompts: tuple[list[int] | str, ...]
    params: SamplingParams
    stream: bool
    include_usage: bool = False
    max_tokens_given: bool = False


def parse_completion_request(body: object, *, max_prompt_tokens: int) -> CompletionRequest:
    """Validate a decoded JSON body; raise ``InvalidRequestError`` naming the bad field.

    Args:
        body: The decoded JSON.
        max_prompt_tokens: Token-id prompts of this length or more are refused before
            their ids are looked at (the engine refuses them anyway).
    """
    if not isinstance(body, dict):
        raise InvalidRequestError("body", type(body).__name__, "must be a JSON object")
    _refuse_unsupported(body)
    prompts = parse_prompts(body.get("prompt"), max_prompt_tokens)
    model, params, stream, include_usage = parse_shared_fields(body)
    return CompletionRequest(
        model=model,
        prompts=prompts,
        params=params,
        stream=stream,
        include_usage=include_usage,
        max_tokens_given=body.get("max_tokens") is not None,
    )


def parse_shared_fields(
    body: dict[Any, Any], *, extra_known: frozenset[str] | None = None
) -> tuple[str | None, SamplingParams, bool, bool]:
    """The fields completions and chat completions share, checked strictly.

    Returns ``(model, params, stream, include_usage)``; raises ``InvalidRequestError``
    naming the bad field (``n``, ``model``, ``user``, ``stream``, ``stream_options``,
    the sampling fields). With ``extra_known`` (the endpoint's own fields), the body's
    field names are checked first: unsupported ones refused, unknown ones logged.
    """
    if extra_known is not None:
        _refuse_unsupported(body, extra_known)
    n = body.get("n")
    if n is not None and (type(n) is not int or n != 1):
        raise InvalidRequestError("n", short_value(n), "only n=1 is supported")
    model = _optional(body, "model", str, "a string")
    _optional(body, "user", str, "a string")
    stream = _optional(body, "stream", bool, "true or false") or False
    include_usage = _stream_options(body.get("stream_options"))
    fields: dict[str, Any] = {}
    for name in _INTS:
        if body.get(name) is not None:
            fields[name] = _int(name, body[name], -_INT64, _INT64)
    for name in _FLOATS:
        if body.get(name) is not None:
            fields[name] = _float(name, body[name])
    if body.get("seed") is not None:
        fields["seed"] = _int("seed", body["seed"], -_INT64, 2 * _INT64)
    ignore_eos = _optional(body, "ignore_eos", bool, "true or false")
    if ignore_eos is not None:
        fields["ignore_eos"] = ignore_eos
    if body.get("stop_token_ids") is not None:
        fields["stop_token_ids"] = _stop_ids(body["stop_token_ids"])
    if body.get("logit_bias") is not None:
        fields["logit_bias"] = _logit_bias(body["logit_bias"])
    try:
        params = SamplingParams(**fields)
    except (TypeError, OverflowError) as exc:
        raise InvalidRequestError("sampling parameters", "...", str(exc)) from exc
    return model, params, stream, include_usage


def _refuse_unsupported(body: dict[Any, Any], extra_known: frozenset[str] = frozenset()) -> None:
    ignored = []
    for key, value in body.items():
        if key in _KNOWN or key in extra_known:
            continue
        if key in _NEUTRAL:
            if not _is_neutral(value, _NEUTRAL[key]):
                raise UnsupportedFieldError(key, short_value(value))
        else:
            ignored.append(_name(key))
    if ignored:
        _log.warning("request_fields_ignored", fields=sorted(ignored)[:20], count=len(ignored))


def _is_neutral(value: object, neutral: tuple[object, ...]) -> bool:
    if value is None:
        return True
    if isinstance(value, list):
        value = tuple(value)
    for ok in neutral:
        if isinstance(ok, bool) or isinstance(value, bool):
            if value is ok:
                return True
        elif isinstance(ok, int | float) and isinstance(value, int | float):
            if value == ok:
                return True
        elif type(value) is type(ok) and value == ok:
            return True
    return False


def _optional(body: dict[Any, Any], name: str, kind: type, what: str) -> Any:
    value = body.get(name)
    if value is not None and type(value) is not kind:
        raise InvalidRequestError(name, short_value(value), f"must be {what}")
    return value


def _int(name: str, value: object, low: int, high: int) -> int:
    if type(value) is not int or not low <= value < high:
        raise InvalidRequestError(
            name, short_value(value), f"must be an integer in [{low}, {high})"
        )
    return value


def _float(name: str, value: object) -> float:
    if type(value) is int and abs(value) < _INT64:
        return float(value)
    if type(value) is not float or not math.isfinite(value):
        raise InvalidRequestError(name, short_value(value), "must be a finite number")
    return value


def _stop_ids(value: object) -> list[int]:
    if not isinstance(value, list) or len(value) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequestError(
            "stop_token_ids",
            short_value(value),
            f"must be a list of at most {MAX_STOP_TOKEN_IDS} token ids",
        )
    for tok in value:
        if type(tok) is not int or not 0 <= tok < _INT64:
            raise InvalidRequestError(
                "stop_token_ids", short_value(tok), "must hold token ids >= 0"
            )
    return value


def _logit_bias(value: object) -> dict[int, float]:
    """OpenAI's ``logit_bias``: an object of token ids (decimal strings) to numbers."""
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise InvalidRequestError(
            "logit_bias",
            short_value(value),
            f"must be an object of at most {MAX_LOGIT_BIAS} token ids to biases",
        )
    bias: dict[int, float] = {}
    for key, item in value.items():
        if not isinstance(key, str) or not (key.isascii() and key.isdigit()) or len(key) > 10:
            raise InvalidRequestError(
                "logit_bias", short_value(key), "keys must be token ids (decimal strings)"
            )
        tok = int(key)
        if tok in bias:
            raise InvalidRequestError("logit_bias", short_value(key), "token id given twice")
        bias[tok] = _float(f"logit_bias[{tok}]", item)
    return bias


def _stream_options(value: object) -> bool:
    if value is None:
        return False  # OpenAI: usage only when stream_options.include_usage is true
    if not isinstance(value, dict):
        raise InvalidRequestError("stream_options", short_value(value), "must be an object")
    for key, option in value.items():
        if key != "include_usage":
            raise UnsupportedFieldError(f"stream_options.{_name(key)}", short_value(option))
        if option is not None and type(option) is not bool:
            raise InvalidRequestError(
                "stream_options.include_usage", short_value(option), "must be true or false"
            )
    return value.get("include_usage") is True


def _name(key: str) -> str:
    """A field name fit for a message, a log line and JSON (no lone surrogates)."""
    return key[:64].encode("utf-8", "backslashreplace").decode("utf-8")


def usage(*outs: RequestOutput) -> dict[str, int]:
    """OpenAI ``usage`` of requests' (last) outputs, summed over a batch's prompts."""
    prompt = sum(len(out.prompt_token_ids) for out in outs)
    completion = sum(len(out.token_ids) for out in outs)
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
    *,
    index: int = 0,
) -> dict[str, Any]:
    """An OpenAI ``text_completion`` object (or one stream chunk of it), one choice."""
    body: dict[str, Any] = {
        "id": f"cmpl-{request_id}",
        "object": "text_completion",
        "created": int(time.time()) if created is None else created,
        "model": model,
        "choices": [
            {
                "index": index,
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
