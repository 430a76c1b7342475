"""A request as the scheduler tracks it, and what callers receive about it."""

from __future__ import annotations

import enum
import time
from concurrent.futures import Future
from typing import Any

import attrs

from pipeline.config import SamplingParams
from pipeline.errors import StepFailure
from pipeline.logprobs import TokenLogprob
from pipeline.lora import LoRAAdapter

__all__ = ["FINISH_REASONS", "Request", "RequestMetrics", "RequestOutput", "RequestStatus"]

FINISH_REASONS = ("length", "stop", "abort", "error")


class RequestStatus(enum.IntEnum):
    """Where a request is in its life; the ``FINISHED_*`` members are terminal."""

    WAITING = 0
    WAITING_FOR_REMOTE_KVS = 1
    RUNNING = 2
    PREEMPTED = 3
    #: Waiting for its ``structured_outputs`` grammar to compile (others keep running).
    WAITING_FOR_GRAMMAR = 4
    FINISHED_STOPPED = 10
    FINISHED_LENGTH = 11
    FINISHED_ABORTED = 12
    FINISHED_ERROR = 13

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASON.get(self)


_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One generation request, owned and mutated by the scheduler only.

    ``all_token_ids`` is prompt + output and grows as tokens are sampled.
    ``draft_token_ids`` are speculative tokens proposed to follow it (vLLM's
    ``spec_token_ids``): the next step computes and verifies them, and the scheduler
    consumes them when it schedules that step; empty without speculative decoding.
    ``num_computed_tokens`` counts the tokens whose KV is in the cache (from compute,
    the prefix cache or a connector). ``block_hashes`` holds the chained hash of every
    *full* block of ``all_token_ids``; the scheduler extends it as tokens arrive.
    """

    __slots__ = (
        "all_token_ids",
        "arrival_time",
        "block_hashes",
        "draft_token_ids",
        "eos_token_id",
        "error",
        "finished_time",
        "first_scheduled_time",
        "first_token_time",
        "grammar_wait",
        "kv_transfer_params",
        "kv_variant",
        "last_token_time",
        "logprobs",
        "lora",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_external_computed_tokens",
        "num_output_placeholders",
        "num_preemptions",
        "num_prefix_cached_tokens",
        "num_prompt_tokens",
        "priority",
        "prompt_logprobs",
        "request_id",
        "sampling_params",
        "status",
        "tenant",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        lora: LoRAAdapter | None = None,
        priority: int = 0,
        tenant: str | None = None,
        kv_variant: str | None = None,
    ) -> None:
        self.request_id = request_id
        # Under the priority policy, lower runs first (ties by arrival); never changed.
        self.priority = priority
        # Whose request it is, for tenant fair share (``None``: the unnamed tenant).
        self.tenant = tenant
        # The adapter the request runs with (``None``: the base model); every block
        # hash of the request covers it. Set before the first hash, never changed.
        self.lora = lora
        # What else the model makes the request's KV depend on, beyond its tokens (a
        # longrope model's long prompts: ModelConfig.prefix_cache_key), or None; every
        # block hash covers it too. Set before the first hash, never changed.
        self.kv_variant = kv_variant
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit length, set when first scheduled
        self.num_external_computed_tokens = 0
        self.num_prefix_cached_tokens = 0  # of num_cached_tokens, from the local prefix cache
        self.num_preemptions = 0
        # Tokens sampled in steps scheduled but not yet applied (async scheduling): the
        # scheduler counts them as known when it plans the next step.
        self.num_output_placeholders = 0
        # time.monotonic() of the request's milestones, set by the scheduler.
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finished_time: float | None = None
        self.block_hashes: list[bytes] = []
        self.draft_token_ids: list[int] = []
        self.error: str | None = None
        # ``(future of the compiled grammar, monotonic deadline, timeout s)`` while the
        # request's ``structured_outputs`` compile (``WAITING_FOR_GRAMMAR``), else None.
        self.grammar_wait: tuple[Future[Any], float, float] | None = None
        # Set at admission (checked, a copy) for the connector to read; replaced by
        # what the connector's ``request_finished`` returned once the request finishes.
        self.kv_transfer_params: dict[str, Any] | None = None
        # One entry per output token when ``sampling_params.logprobs`` is set.
        self.logprobs: list[TokenLogprob] | None = None if sampling_params.logprobs is None else []
        # When ``sampling_params.prompt_logprobs`` is set: entry i belongs to prompt
        # token i (entry 0 is always ``None``); a list filled as the prompt's chunks
        # compute, then a tuple (shared by every output) once complete.
        self.prompt_logprobs: list[TokenLogprob | None] | tuple[TokenLogprob | None, ...] | None
        if sampling_params.prompt_logprobs is None:
            self.prompt_logprobs = None
        else:
            self.prompt_logprobs = [None] if self.num_prompt_tokens > 1 else (None,)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.all_token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def hash_extra_keys(self) -> tuple[str, ...] | None:
        """What each block hash of the request also covers: its adapter and its KV
        variant, or nothing."""
        lora, variant = self.lora, self.kv_variant
        if variant is None:
            return None if lora is None else lora.extra_keys()
        return (variant,) if lora is None else (*lora.extra_keys(), variant)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        """Known tokens and drafts: what the scheduler brings ``num_computed_tokens``
        up to (vLLM's arithmetic for chunked prefill, prefix caching and speculative
        decoding alike)."""
        return len(self.all_token_ids) + len(self.draft_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether the request asked for prompt logprobs and some are still missing."""
        pl = self.prompt_logprobs
        return pl is not None and len(pl) < self.num_prompt_tokens

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    @property
    def metrics(self) -> RequestMetrics:
        """The request's timings and cache counts so far."""
        return RequestMetrics(
            arrival_time=self.arrival_time,
            first_scheduled_time=self.first_scheduled_time,
            first_token_time=self.first_token_time,
            last_token_time=self.last_token_time,
            finished_time=self.finished_time,
            num_output_tokens=len(self.all_token_ids) - self.num_prompt_tokens,
            num_cached_tokens=self.num_prefix_cached_tokens,
            num_external_tokens=self.num_external_computed_tokens,
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )


@attrs.frozen(kw_only=True)
class RequestMetrics:
    """A request's timings and cache counts, as known when an output was made.

    Times are ``time.monotonic()`` seconds of this process (compare them with each
    other, not with wall time); each is ``None`` until the milestone happened.

    Attributes:
        arrival_time: When the engine received the request.
        first_scheduled_time: When a step first admitted it (its queue wait ends).
        first_token_time: When its first output token was sampled.
        last_token_time: When its latest output token was sampled.
        finished_time: When it finished (any reason).
        num_output_tokens: Tokens generated so far.
        num_cached_tokens: Prompt tokens served from the local prefix cache.
        num_external_tokens: Prompt tokens loaded by the KV connector.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_external_tokens: int = 0

    @property
    def queue_time_s(self) -> float | None:
        """Arrival to first scheduled (``None`` until scheduled)."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft_s(self) -> float | None:
        """Time to first token: arrival to first sampled token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def mean_itl_s(self) -> float | None:
        """Mean inter-token latency: (last - first token time) / (tokens - 1);
        ``None`` with fewer than two tokens."""
        if self.first_token_time is None or self.last_token_time is None:
            return None
        if self.num_output_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_output_tokens - 1)

    @property
    def e2e_s(self) -> float | None:
        """End-to-end latency: arrival to finished (``None`` until finished)."""
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@attrs.frozen(kw_only=True)
class RequestOutput:
    """What a caller receives for one request after a step (or at its end).

    Attributes:
        request_id: The request's id.
        prompt_token_ids: The prompt as token ids.
        token_ids: Every token generated so far.
        new_token_ids: The tokens generated since the previous output of this request.
        finished: Whether this is the request's last output.
        finish_reason: ``"length" | "stop" | "abort" | "error"`` once finished.
        error: A description of the failure when ``finish_reason == "error"``.
        num_cached_tokens: Prompt tokens served from a cache (local or connector).
        failure: Why the step this request was in failed (``finish_reason="error"``).
        metrics: The request's timings and cache counts so far (``None`` only for an
            output not made by the scheduler).
        text: The text emitted so far, cumulative (the incremental detokenization of
            ``token_ids``, less what is held back while it may begin a stop string, and
            less a stop token's or, by default, a stop string's text at the end);
            ``None`` when the engine has no tokenizer or ``detokenize`` is off.
        new_text: What this output adds to ``text`` (never retracted later).
        stop_reason: The stop string, or the ``stop_token_ids`` token id, that ended
            the request; ``None`` for EOS, length, abort and error (vLLM's
            ``CompletionOutput.stop_reason``).
        logprobs: When the request set ``SamplingParams.logprobs``: one entry per token
            of ``token_ids`` (cumulative), else ``None``.
        prompt_logprobs: When the request set ``SamplingParams.prompt_logprobs``: one
            entry per prompt token, the first ``None`` (nothing precedes it), then the
            logprob of prompt token i given the tokens before it; present on every
            output once the whole prompt was computed, ``None`` before (and on the
            final output of a request that failed before that).
        kv_transfer_params: On the final output: what the KV connector's
            ``request_finished`` returned for the request (vLLM's disaggregated
            prefill/decode hands it to the next engine); ``None`` on every other output,
            and without a connector. Not part of the hash.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    failure: StepFailure | None = None
    metrics: RequestMetrics | None = None
    text: str | None = None
    new_text: str = ""
    stop_reason: str | int | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    kv_transfer_params: dict[str, Any] | None = attrs.field(default=None, hash=False)
