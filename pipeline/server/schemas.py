"""OpenAI (chat) completions: strict request parsing into :class:`SharedFields`.

Every known field is type-checked here (see :mod:`pipeline.server.fields`), before
``SamplingParams`` sees it: a bool is not a number, integers must fit in 64 bits, floats
must be finite and lists are capped. Both endpoints take:

- ``n`` (1 to :data:`~pipeline.server.fields.MAX_N` choices per prompt; a completions
  request's prompts times ``n`` at most :data:`~pipeline.server.prompt_field.MAX_PROMPTS`)
  and ``best_of`` (only ``null`` or ``n``: kvstep samples no extra candidates);
- ``stop`` (a string or at most 16 strings; needs a tokenizer) and vLLM's
  ``include_stop_str_in_output``; each choice reports vLLM's ``stop_reason``;
- vLLM's ``prompt_logprobs`` (0 to 20 alternatives per prompt token);
- vLLM's ``kv_transfer_params`` (disaggregated prefill/decode): a small JSON object for
  the KV connector (see :mod:`pipeline.transfer_params` for the bounds), refused with
  ``n`` > 1 or a batch of prompts; the response carries the connector's answer;
- vLLM's ``priority`` (an integer, default 0; lower runs first under
  ``--scheduling-policy priority``; a non-zero one is refused under ``fcfs``, as vLLM);
- vLLM's ``vllm_xargs``: a JSON object of arguments for the engine's custom logits
  stages, which becomes ``SamplingParams.extra_args`` (the bounds are
  :func:`~pipeline.sampling_params.check_extra_args`'; a bad one is a 400 naming
  ``vllm_xargs``);
- structured outputs: OpenAI's ``response_format``, vLLM's ``structured_outputs`` and
  its legacy ``guided_*`` fields (see :mod:`pipeline.server.response_format`), which
  become ``SamplingParams.structured_outputs``.

Completions also take ``echo`` and ``logprobs`` (OpenAI caps it at 5; kvstep allows
0 to 20, as vLLM); chat takes ``logprobs`` (true or false) and ``top_logprobs`` (0 to 20,
only with ``logprobs`` true). Fields that would change what is generated but that kvstep
does not implement (``suffix``, ``use_beam_search``, chat's ``echo``,
...) are refused with a 400 naming them, unless they hold their neutral value
(``"suffix": ""``, ``"echo": false``), which clients often send. Other unknown fields
are ignored, named in a warning log and in the response's ``X-Kvstep-Ignored-Fields``
header (at most 20 names, escaped to printable ASCII), never silently.

Penalties and biases: ``presence_penalty`` and ``frequency_penalty`` (OpenAI, [-2, 2]),
``logit_bias`` (OpenAI: an object of token id strings to biases in [-100, 100], at most
300), and vLLM's extensions ``repetition_penalty`` (> 0), ``min_p`` ([0, 1]) and
``min_tokens`` ([0, max_tokens]); see :class:`~pipeline.config.SamplingParams`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import attrs

from pipeline.config import SamplingParams
from pipeline.errors import InvalidRequestError
from pipeline.logger import get_logger
from pipeline.sampling_params import check_extra_args
from pipeline.server import fields as f
from pipeline.server.errors import UnsupportedFieldError, short_value
from pipeline.server.prompt_field import MAX_PROMPTS, Prompt, parse_prompts
from pipeline.server.response_format import BODY_FIELDS, parse_output_constraint
from pipeline.server.tools import BODY_FIELDS as TOOL_FIELDS
from pipeline.transfer_params import TRANSFER_PARAMS, check_transfer_params

__all__ = ["CompletionRequest", "SharedFields", "parse_completion_request", "parse_shared_fields"]

_log = get_logger()
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
    "echo": (False,),  # chat (completions implements it)
    "suffix": ("",),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "use_beam_search": (False,),
    "length_penalty": (1,),
    "allowed_token_ids": (),
    "bad_words": ((),),
    "truncate_prompt_tokens": (),
}
_KNOWN = frozenset(
    {"model", "stream", "stream_options", "n", "best_of", "user", "seed", "ignore_eos"}
    | {"priority"}
    | {"stop", "include_stop_str_in_output", "prompt_logprobs", "stop_token_ids"}
    | {"logit_bias", "logprobs", "kv_transfer_params", "vllm_xargs", *_INTS, *_FLOATS}
    | BODY_FIELDS
)
_ENDPOINT_KNOWN = {
    "completions": frozenset({"prompt", "echo"}),
    "chat": frozenset({"messages", "top_logprobs"}) | TOOL_FIELDS,
}
_INT64 = f.INT64
_ONE_REQUEST = "belongs to one engine request: it cannot be combined with {} (as vLLM)"


@attrs.frozen(kw_only=True)
class SharedFields:
    """The fields completions and chat completions share, validated.

    Attributes:
        model: The requested model, or ``None``.
        params: The sampling parameters of the first choice (copy ``i`` of a prompt uses
            ``seed + i``, see :func:`pipeline.server.fanin.copy_params`).
        stream: Whether to answer with server-sent events.
        include_usage: ``stream_options.include_usage``.
        n: Choices per prompt.
        max_tokens_given: Whether the body named ``max_tokens``.
        logprobs: Alternatives to show per generated token, or ``None``: no logprobs.
        prompt_logprobs: vLLM's ``prompt_logprobs`` as asked (``None``: not shown).
        echo: Completions' ``echo`` (always false for chat).
        kv_transfer_params: vLLM's ``kv_transfer_params``, checked and copied
            (:mod:`pipeline.transfer_params`), or ``None``.
        priority: vLLM's ``priority`` (0 when absent or null).
        ignored: The body's unknown field names, sorted (ignored, not refused; the
            response names them in its ``X-Kvstep-Ignored-Fields`` header).
    """

    model: str | None
    params: SamplingParams
    stream: bool
    include_usage: bool = False
    n: int = 1
    max_tokens_given: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    echo: bool = False
    kv_transfer_params: dict[str, Any] | None = None
    priority: int = 0
    ignored: tuple[str, ...] = ()


@attrs.frozen(kw_only=True)
class CompletionRequest:
    """A validated ``POST /v1/completions`` body: its prompts and the shared fields."""

    prompts: tuple[Prompt, ...]
    fields: SharedFields


def parse_completion_request(body: object, *, max_prompt_tokens: int) -> CompletionRequest:
    """Validate a decoded JSON body; raise ``InvalidRequestError`` naming the bad field.

    Args:
        body: The decoded JSON.
        max_prompt_tokens: Token-id prompts of this length or more are refused before
            their ids are looked at (the engine refuses them anyway).
    """
    if not isinstance(body, dict):
        raise InvalidRequestError("body", type(body).__name__, "must be a JSON object")
    shared = parse_shared_fields(body, endpoint="completions")
    prompts = parse_prompts(body.get("prompt"), max_prompt_tokens)
    if len(prompts) * shared.n > MAX_PROMPTS:
        raise InvalidRequestError(
            "n",
            shared.n,
            f"times the {len(prompts)} prompts gives {len(prompts) * shared.n} choices; "
            f"at most {MAX_PROMPTS} are served per request",
        )
    if shared.kv_transfer_params is not None and len(prompts) > 1:
        raise InvalidRequestError(
            TRANSFER_PARAMS, f"<{len(prompts)} prompts>", _ONE_REQUEST.format("a batch of prompts")
        )
    return CompletionRequest(prompts=prompts, fields=shared)


def parse_shared_fields(
    body: dict[Any, Any], *, endpoint: Literal["completions", "chat"]
) -> SharedFields:
    """The fields both endpoints take, checked strictly (the endpoint decides what
    ``logprobs`` means); raises ``InvalidRequestError`` naming the bad field. The body's
    field names are checked first: unsupported ones refused, unknown ones logged."""
    ignored = _refuse_unsupported(body, _ENDPOINT_KNOWN[endpoint])
    n = f.choices_n(body.get("n"))
    f.best_of(body.get("best_of"), n)
    transfer = check_transfer_params(body.get(TRANSFER_PARAMS))
    if transfer is not None and n > 1:
        raise InvalidRequestError(TRANSFER_PARAMS, f"<with n={n}>", _ONE_REQUEST.format("n > 1"))
    model = f.optional(body, "model", str, "a string")
    f.optional(body, "user", str, "a string")
    stream = f.optional(body, "stream", bool, "true or false") or False
    priority = (
        0
        if body.get("priority") is None
        else f.integer("priority", body["priority"], -_INT64, _INT64)
    )
    include_usage = f.stream_options(body.get("stream_options"))
    fields: dict[str, Any] = {}
    for name in _INTS:
        if body.get(name) is not None:
            fields[name] = f.integer(name, body[name], -_INT64, _INT64)
    for name in _FLOATS:
        if body.get(name) is not None:
            fields[name] = f.finite(name, body[name])
    if body.get("seed") is not None:
        fields["seed"] = f.integer("seed", body["seed"], -_INT64, 2 * _INT64)
    for name in ("ignore_eos", "include_stop_str_in_output"):
        flag = f.optional(body, name, bool, "true or false")
        if flag is not None:
            fields[name] = flag
    if body.get("stop") is not None and (stop := f.stop_strings(body["stop"])):
        fields["stop"] = stop
    if body.get("stop_token_ids") is not None:
        fields["stop_token_ids"] = f.stop_ids(body["stop_token_ids"])
    if body.get("logit_bias") is not None:
        fields["logit_bias"] = f.logit_bias(body["logit_bias"])
    if body.get("vllm_xargs") is not None:
        fields["extra_args"] = _vllm_xargs(body["vllm_xargs"])
    if (constraint := parse_output_constraint(body)) is not None:
        fields["structured_outputs"] = constraint
    echo = endpoint == "completions" and bool(f.optional(body, "echo", bool, "true or false"))
    logprobs = _logprobs(body, endpoint)
    prompt_logprobs = f.count("prompt_logprobs", body.get("prompt_logprobs"))
    if prompt_logprobs is not None and stream:
        raise InvalidRequestError(
            "prompt_logprobs", prompt_logprobs, "is not available when stream is true (as vLLM)"
        )
    if logprobs is not None:
        fields["logprobs"] = logprobs
    if prompt_logprobs is not None or (echo and logprobs is not None):
        # vLLM: echo with logprobs shows the prompt's tokens' logprobs first.
        fields["prompt_logprobs"] = logprobs if prompt_logprobs is None else prompt_logprobs
    try:
        params = SamplingParams(**fields)
    except (TypeError, OverflowError) as exc:
        raise InvalidRequestError("sampling parameters", "...", str(exc)) from exc
    return SharedFields(
        model=model,
        params=params,
        stream=stream,
        include_usage=include_usage,
        n=n,
        max_tokens_given=body.get("max_tokens") is not None,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        echo=echo,
        kv_transfer_params=transfer,
        priority=priority,
        ignored=ignored,
    )


def _vllm_xargs(value: object) -> Mapping[str, Any]:
    """vLLM's ``vllm_xargs`` as ``SamplingParams.extra_args``; an error names the field
    (the ``param`` of the 400) and, in its message, the key path at fault."""
    try:
        return check_extra_args(value, "vllm_xargs")
    except InvalidRequestError as exc:
        if exc.what == "vllm_xargs":
            raise
        raise InvalidRequestError(
            "vllm_xargs", exc.value, f"{exc.allowed} (at {exc.what})"
        ) from None


def _logprobs(body: dict[Any, Any], endpoint: str) -> int | None:
    """Alternatives per token: completions' ``logprobs`` count, or chat's ``logprobs``
    flag with ``top_logprobs`` (which needs ``logprobs`` true, as OpenAI and vLLM)."""
    if endpoint == "completions":
        return f.count("logprobs", body.get("logprobs"))
    wanted = f.optional(body, "logprobs", bool, "true or false")
    top = f.count("top_logprobs", body.get("top_logprobs"))
    if top is not None and not wanted:
        raise InvalidRequestError("top_logprobs", top, "needs logprobs set to true")
    return (top or 0) if wanted else None


def _refuse_unsupported(
    body: dict[Any, Any], extra_known: frozenset[str] = frozenset()
) -> tuple[str, ...]:
    """Refuse the fields kvstep knows but does not implement (unless neutral); return
    the unknown ones, sorted, after logging them."""
    ignored = []
    for key, value in body.items():
        if key in _KNOWN or key in extra_known:
            continue
        if key in _NEUTRAL:
            if not _is_neutral(value, _NEUTRAL[key]):
                raise UnsupportedFieldError(key, short_value(value))
        else:
            ignored.append(f.field_name(key))
    if ignored:
        _log.warning("request_fields_ignored", fields=sorted(ignored)[:20], count=len(ignored))
    return tuple(sorted(ignored))


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
