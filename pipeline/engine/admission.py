"""What a request must pass before the engine admits it: its prompt and its parameters.

Both checks run in the caller's task, before anything reaches the scheduler, and name
the bad value and what is allowed (:class:`~pipeline.errors.InvalidRequestError`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from pipeline.checks import check_float
from pipeline.config import SamplingParams
from pipeline.engine.output_text import OutputText
from pipeline.errors import InvalidRequestError
from pipeline.executors.wire_checks import check_sendable
from pipeline.lora import LoRAAdapter
from pipeline.request import Request
from pipeline.transfer_params import check_transfer_params

__all__ = ["MAX_TENANT_CHARS", "check_params", "check_priority", "check_prompt", "check_tenant"]

#: Longest tenant name (``generate(..., tenant=...)``, the ``X-Tenant-Id`` header).
MAX_TENANT_CHARS = 128
_INT64 = 2**63


def check_prompt(
    prompt: object, tokenizer: Any, vocab_size: int, max_model_len: int, cache_tokens: int
) -> list[int]:
    """Return ``prompt`` as token ids (text is encoded with ``tokenizer``).

    Raises:
        InvalidRequestError: text without a tokenizer; not a non-empty sequence of token
            ids in ``[0, vocab_size)`` (a bool is not a token id); as long as
            ``max_model_len`` or the KV cache's ``cache_tokens``, or longer.
    """
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidRequestError(
                "prompt",
                prompt[:40],
                "text prompts need a tokenizer.json in the model directory; pass token ids",
            )
        prompt = tokenizer.encode(prompt)
    if not isinstance(prompt, Sequence) or isinstance(prompt, bytes):
        raise InvalidRequestError("prompt", prompt, "must be a list of token ids")
    if len(prompt) == 0:
        raise InvalidRequestError("prompt", prompt, "must hold at least one token id")
    for tok in prompt:
        if not isinstance(tok, int) or isinstance(tok, bool) or not 0 <= tok < vocab_size:
            raise InvalidRequestError("token id", tok, f"must be an integer in [0, {vocab_size})")
    limit = min(max_model_len, cache_tokens)
    if len(prompt) >= limit:
        cache = f" and the KV cache's {limit} tokens" if limit < max_model_len else ""
        allowed = f"must be shorter than max_model_len={max_model_len}{cache}"
        raise InvalidRequestError("prompt length", len(prompt), allowed)
    return list(prompt)


def check_params(params: object, output_text: OutputText, vocab_size: int) -> SamplingParams:
    """Return ``params`` if the workers will accept it.

    ``SamplingParams`` checks its fields at construction; this also refuses what is not
    one, or one altered since (an admitted request always crosses the wire), a
    ``logit_bias`` naming a token outside the vocabulary, and ``stop`` strings without a
    tokenizer (``output_text``).

    Raises:
        InvalidRequestError: naming the field.
    """
    checked = output_text.check(check_sendable(params))
    for tok, _ in checked.logit_bias:
        if tok >= vocab_size:
            raise InvalidRequestError(
                "logit_bias", tok, f"token ids must be in [0, vocab_size={vocab_size})"
            )
    return checked


def check_priority(priority: object, policy: str) -> int:
    """Return ``priority`` if the engine's scheduling ``policy`` takes it.

    Raises:
        InvalidRequestError: Not an integer in the 64-bit range (a bool is not one), or
            not 0 under ``"fcfs"`` (as vLLM: priorities need the priority policy).
    """
    if type(priority) is not int or not -_INT64 <= priority < _INT64:
        raise InvalidRequestError("priority", priority, "must be a 64-bit integer")
    if priority != 0 and policy != "priority":
        raise InvalidRequestError(
            "priority",
            priority,
            "is only supported with the priority scheduling policy "
            "(scheduling_policy='priority', --scheduling-policy priority); must be 0",
        )
    return priority


def check_tenant(tenant: object) -> str | None:
    """Return ``tenant``: ``None`` or a printable string of 1 to
    :data:`MAX_TENANT_CHARS` characters.

    Raises:
        InvalidRequestError: Anything else.
    """
    if tenant is None:
        return None
    if (
        not isinstance(tenant, str)
        or not 0 < len(tenant) <= MAX_TENANT_CHARS
        or not tenant.isprintable()
    ):
        raise InvalidRequestError(
            "tenant",
            tenant if not isinstance(tenant, str) else tenant[:40],
            f"must be a printable string of 1 to {MAX_TENANT_CHARS} characters, or None",
        )
    return tenant


def new_request(
    request_id: str,
    prompt: list[int],
    params: SamplingParams,
    *,
    eos_token_id: int | list[int] | tuple[int, ...] | None,
    arrival_time: float | None = None,
    kv_transfer_params: dict[str, Any] | None = None,
    lora: LoRAAdapter | None = None,
    priority: int = 0,
    tenant: str | None = None,
    kv_variant: str | None = None,
) -> Request:
    """The :class:`Request` of a validated prompt and ``params`` (and a checked
    ``priority`` and ``tenant``, :func:`check_priority`, :func:`check_tenant`).

    ``eos_token_id`` is the model's (its first when it lists several); ``arrival_time``
    (``time.monotonic()``, default now) must be a finite time in the past;
    ``kv_transfer_params`` is checked and copied (:mod:`pipeline.transfer_params`);
    ``kv_variant`` is what the model makes the request's KV depend on beyond its tokens
    (its block hashes cover it: ``ModelConfig.prefix_cache_key``).

    Raises:
        InvalidRequestError: A bad ``arrival_time`` or ``kv_transfer_params``.
    """
    transfer = check_transfer_params(kv_transfer_params)
    now = time.monotonic()
    if arrival_time is not None:
        arrival_time = check_float(
            "arrival_time", arrival_time, InvalidRequestError, lo=0.0, hi=now
        )
    eos = eos_token_id
    if isinstance(eos, list | tuple):
        eos = eos[0] if eos else None
    request = Request(
        request_id,
        prompt,
        params,
        eos_token_id=eos,
        arrival_time=now if arrival_time is None else arrival_time,
        lora=lora,
        priority=priority,
        tenant=tenant,
        kv_variant=kv_variant,
    )
    request.kv_transfer_params = transfer
    return request
