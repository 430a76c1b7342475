"""Strict checks of single request fields, each raising ``InvalidRequestError`` naming it.

A bool is never a number, integers must fit in 64 bits, floats must be finite and lists
and strings are capped; :mod:`pipeline.server.schemas` composes these into requests.
"""

from __future__ import annotations

import math
from typing import Any

from pipeline.config import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS
from pipeline.engine.admission import MAX_TENANT_CHARS
from pipeline.errors import InvalidRequestError
from pipeline.logprobs import MAX_LOGPROBS
from pipeline.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from pipeline.server.errors import UnsupportedFieldError, short_value

__all__ = [
    "MAX_N",
    "TENANT_HEADER",
    "best_of",
    "choices_n",
    "count",
    "field_name",
    "finite",
    "integer",
    "logit_bias",
    "optional",
    "stop_ids",
    "stop_strings",
    "stream_options",
    "tenant",
]

INT64 = 2**63
#: Most choices per prompt (``n``); a request's prompts times ``n`` is capped as well.
MAX_N = 16
#: The request header that names a request's tenant (``tenant_fair_share``).
TENANT_HEADER = "X-Tenant-Id"


def optional(body: dict[Any, Any], name: str, kind: type, what: str) -> Any:
    """``body[name]`` when it is exactly of type ``kind`` (or absent/null: ``None``)."""
    value = body.get(name)
    if value is not None and type(value) is not kind:
        raise InvalidRequestError(name, short_value(value), f"must be {what}")
    return value


def integer(name: str, value: object, low: int, high: int) -> int:
    """An ``int`` (never a bool) in ``[low, high)``."""
    if type(value) is not int or not low <= value < high:
        raise InvalidRequestError(
            name, short_value(value), f"must be an integer in [{low}, {high})"
        )
    return value


def count(name: str, value: object, high: int = MAX_LOGPROBS) -> int | None:
    """``None`` or an ``int`` in ``[0, high]`` (``logprobs``, ``top_logprobs``, ...)."""
    if value is None:
        return None
    if type(value) is not int or not 0 <= value <= high:
        raise InvalidRequestError(
            name, short_value(value), f"must be an integer in [0, {high}] or null"
        )
    return value


def finite(name: str, value: object) -> float:
    """A finite number (an ``int`` is converted; a bool is refused)."""
    if type(value) is int and abs(value) < INT64:
        return float(value)
    if type(value) is not float or not math.isfinite(value):
        raise InvalidRequestError(name, short_value(value), "must be a finite number")
    return value


def choices_n(value: object) -> int:
    """``n``: choices per prompt, an ``int`` in ``[1, MAX_N]`` (``null``: 1)."""
    if value is None:
        return 1
    if type(value) is not int or not 1 <= value <= MAX_N:
        raise InvalidRequestError("n", short_value(value), f"must be an integer in [1, {MAX_N}]")
    return value


def best_of(value: object, n: int) -> None:
    """vLLM's ``best_of``: only ``null`` or ``n`` itself (no extra candidates) is served."""
    if value is None:
        return
    if type(value) is not int:
        raise InvalidRequestError("best_of", short_value(value), "must be an integer or null")
    if value != n:
        raise UnsupportedFieldError("best_of", short_value(value))


def stop_strings(value: object) -> tuple[str, ...]:
    """``stop``: a string or a list of at most :data:`MAX_STOP_STRINGS` non-empty strings.

    A lone ``""`` (and ``[]``) means no stop strings, as clients send it for "none".
    """
    items = [value] if isinstance(value, str) else value
    allowed = f"must be a string or a list of at most {MAX_STOP_STRINGS} non-empty strings"
    if not isinstance(items, list) or len(items) > MAX_STOP_STRINGS:
        raise InvalidRequestError("stop", short_value(value), allowed)
    if items == [""]:
        return ()
    for item in items:
        if not isinstance(item, str) or not item:
            raise InvalidRequestError("stop", short_value(item), allowed)
        if len(item) > MAX_STOP_STRING_CHARS:
            raise InvalidRequestError(
                "stop", short_value(item), f"must hold at most {MAX_STOP_STRING_CHARS} characters"
            )
        try:
            item.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequestError("stop", "<text>", "must be valid Unicode") from None
    return tuple(items)


def stop_ids(value: object) -> list[int]:
    """``stop_token_ids``: at most :data:`MAX_STOP_TOKEN_IDS` token ids."""
    if not isinstance(value, list) or len(value) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequestError(
            "stop_token_ids",
            short_value(value),
            f"must be a list of at most {MAX_STOP_TOKEN_IDS} token ids",
        )
    for tok in value:
        if type(tok) is not int or not 0 <= tok < INT64:
            raise InvalidRequestError(
                "stop_token_ids", short_value(tok), "must hold token ids >= 0"
            )
    return value


def logit_bias(value: object) -> dict[int, float]:
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
        bias[tok] = finite(f"logit_bias[{tok}]", item)
    return bias


def stream_options(value: object) -> bool:
    """Whether ``stream_options.include_usage`` is true (its only supported option)."""
    if value is None:
        return False  # OpenAI: usage only when stream_options.include_usage is true
    if not isinstance(value, dict):
        raise InvalidRequestError("stream_options", short_value(value), "must be an object")
    for key, option in value.items():
        if key != "include_usage":
            raise UnsupportedFieldError(f"stream_options.{field_name(key)}", short_value(option))
        if option is not None and type(option) is not bool:
            raise InvalidRequestError(
                "stream_options.include_usage", short_value(option), "must be true or false"
            )
    return value.get("include_usage") is True


def field_name(key: str) -> str:
    """A field name fit for a message, a log line and JSON (no lone surrogates)."""
    return key[:64].encode("utf-8", "backslashreplace").decode("utf-8")


def tenant(value: str | None) -> str | None:
    """The ``X-Tenant-Id`` header's tenant: absent is ``None`` (the unnamed tenant),
    else a printable string of 1 to ``MAX_TENANT_CHARS`` characters. The server trusts
    it: a deployment that shares an engine among tenants has its gateway set it."""
    if value is None:
        return None
    if not 0 < len(value) <= MAX_TENANT_CHARS or not value.isprintable():
        raise InvalidRequestError(
            TENANT_HEADER,
            short_value(value),
            f"must be 1 to {MAX_TENANT_CHARS} printable characters",
        )
    return value
