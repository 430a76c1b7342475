"""``ServerOptions``: the HTTP server's limits and its API key, validated once."""

from __future__ import annotations

import math
import os
from typing import Any

import attrs

from pipeline.checks import check_float, check_int
from pipeline.errors import InvalidConfigError

__all__ = ["API_KEY_ENV", "ServerOptions"]

API_KEY_ENV = "KVSTEP_API_KEY"
"""The environment variable ``kvstep serve`` reads the API key from (``--api-key`` wins)."""

_MIB = 1024 * 1024


def _positive_seconds(instance: Any, attribute: attrs.Attribute[Any], value: object) -> None:
    check_float(attribute.name, value, InvalidConfigError, lo=0.0, hi=math.inf, lo_open=True)


def _seconds(instance: Any, attribute: attrs.Attribute[Any], value: object) -> None:
    check_float(attribute.name, value, InvalidConfigError, lo=0.0, hi=math.inf)


def _int_at_least(low: int, *, optional: bool = False) -> Any:
    def check(instance: Any, attribute: attrs.Attribute[Any], value: object) -> None:
        check_int(attribute.name, value, InvalidConfigError, lo=low, optional=optional)

    return check


def _share(instance: Any, attribute: attrs.Attribute[Any], value: object) -> None:
    check_float(attribute.name, value, InvalidConfigError, lo=0.0, hi=1.0, lo_open=True)


def _parser_name(instance: Any, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None:
        return
    if attribute.name == "tool_call_parser":
        from pipeline.server.tool_parsers import get_tool_parser

        get_tool_parser(value)  # type: ignore[arg-type]  # raises naming the known ones
    else:
        from pipeline.server.reasoning import get_reasoning_parser

        get_reasoning_parser(value)  # type: ignore[arg-type]


def _api_key(instance: Any, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None:
        return
    # Never echo the value: a misplaced key must not end up in an error message or log.
    if not isinstance(value, str) or not value or not value.isprintable() or not value.isascii():
        raise InvalidConfigError("api_key", "<hidden>", "must be a non-empty printable ASCII str")


def _lora_modules(instance: Any, attribute: attrs.Attribute[Any], value: tuple[Any, ...]) -> None:
    if any(not isinstance(e, tuple) or len(e) != 2 for e in value):
        raise InvalidConfigError("lora_modules", value, "must be (name, path) pairs")
    names = [name for name, _ in value]
    if len(set(names)) != len(names):
        raise InvalidConfigError("lora_modules", names, "names must be unique")


@attrs.frozen(kw_only=True)
class ServerOptions:
    """How the HTTP server guards itself; immutable, checked at construction.

    Attributes:
        api_key: When set, every route but ``/health`` requires
            ``Authorization: Bearer <api_key>`` (401 otherwise; compared in constant
            time). Never shown in ``repr``, logs or responses.
        max_body_bytes: The largest request body accepted (413 past it), enforced while
            the body streams in, whatever ``Content-Length`` claims.
        body_timeout_s: The longest a client may take to send a request body (408).
        header_timeout_s: The longest a connection may take to send a request's headers,
            on a new connection or between keep-alive requests (then it is closed).
        timeout_keep_alive_s: How long an idle keep-alive connection is kept open.
        limit_concurrency: Connections plus in-flight requests uvicorn serves at once;
            past it uvicorn answers 503 (plain text) at once. ``None``: no limit.
        max_request_share: The share of the engine's ``max_num_seqs`` that one HTTP
            request's choices (``n`` times its prompts) may take, in ``(0, 1]``: at most
            ``max(1, floor(share * max_num_seqs))`` choices, a 400 naming ``n`` past it,
            so that one request cannot hold every scheduler slot while others wait.
        max_prompt_logprobs: The most prompt logprob values one request may ask for:
            its choices' prompt tokens times ``prompt_logprobs + 1`` (the token's own
            and its alternatives), summed; a 400 naming ``prompt_logprobs`` past it.
        tool_call_parser: The model's tool-call format (a name in
            :data:`~pipeline.server.tool_parsers.TOOL_PARSERS`: ``"hermes"``,
            ``"llama3_json"``), which chat's ``tool_choice: "auto"`` needs; ``None``:
            ``"auto"`` is a 400, and forced calls are written in hermes' format.
        reasoning_parser: The model's reasoning format (a name in
            :data:`~pipeline.server.reasoning.REASONING_PARSERS`), which splits chat's
            ``reasoning_content`` from ``content``; ``None``: no split.
        lora_modules: LoRA adapters served from the start, as ``(name, path)`` pairs
            (``--lora-modules name=path``); each is served as a model of that name
            (:mod:`pipeline.server.lora`). Given any, the engine runs with
            ``enable_lora``.
        shutdown_timeout_s: How long a drain lets the requests in flight finish after
            SIGTERM or SIGINT (vLLM's ``--shutdown-timeout``): meanwhile ``/health``
            answers 503 ``draining`` and new requests 503 with ``Retry-After``; past
            it, what is left is aborted (streams end with ``finish_reason: "abort"``).
            ``0``: abort at once. Finite, so a shutdown is always bounded
            (:mod:`pipeline.server.drain`). The default, 25 s, leaves 5 s of
            Kubernetes' default 30 s grace period for the abort and the close.
    """

    api_key: str | None = attrs.field(default=None, repr=False, validator=_api_key)
    max_body_bytes: int = attrs.field(default=4 * _MIB, validator=_int_at_least(1024))
    body_timeout_s: float = attrs.field(default=30.0, validator=_positive_seconds)
    header_timeout_s: float = attrs.field(default=10.0, validator=_positive_seconds)
    timeout_keep_alive_s: float = attrs.field(default=5.0, validator=_positive_seconds)
    limit_concurrency: int | None = attrs.field(
        default=1024, validator=_int_at_least(1, optional=True)
    )
    max_request_share: float = attrs.field(default=0.5, validator=_share)
    max_prompt_logprobs: int = attrs.field(default=100_000, validator=_int_at_least(1))
    tool_call_parser: str | None = attrs.field(default=None, validator=_parser_name)
    reasoning_parser: str | None = attrs.field(default=None, validator=_parser_name)
    lora_modules: tuple[tuple[str, str], ...] = attrs.field(
        default=(), converter=tuple, validator=_lora_modules
    )
    shutdown_timeout_s: float = attrs.field(default=25.0, validator=_seconds)

    @classmethod
    def from_env(cls, **fields: Any) -> ServerOptions:
        """Options from ``fields``, the API key from ``$KVSTEP_API_KEY`` when not given."""
        if fields.get("api_key") is None:
            fields["api_key"] = os.environ.get(API_KEY_ENV) or None
        return cls(**fields)

    def max_choices(self, max_num_seqs: int) -> int:
        """The most choices one request may have on an engine of ``max_num_seqs``."""
        return max(1, math.floor(self.max_request_share * max_num_seqs))

    def api_key_bytes(self) -> bytes | None:
        """The key as bytes, for ``hmac.compare_digest``."""
        return None if self.api_key is None else self.api_key.encode("ascii")
