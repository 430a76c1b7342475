"""Engine configuration and per-request sampling parameters.

Both are frozen attrs classes validated at construction: a bad value raises
:class:`~pipeline.errors.InvalidConfigError` (engine) or
:class:`~pipeline.errors.InvalidRequestError` (request) naming the field, a short repr
of the value and what is allowed. Every field is type-checked (a ``bool`` is never
taken for a number, nor a string for a ``bool``), numbers must be finite and in a
64-bit range, and what passes is exactly what the engine↔worker wire
(:mod:`pipeline.executors.wire`, msgspec) encodes and its typed decoder accepts.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs

from pipeline.checks import (
    INT64_MAX,
    INT64_MIN,
    SECRET_KEY,
    check_float,
    check_int,
    check_plain,
    redact,
)
from pipeline.errors import InvalidConfigError, InvalidRequestError

__all__ = [
    "DTYPES",
    "EXECUTORS",
    "MAX_LOGIT_BIAS",
    "MAX_STOP_TOKEN_IDS",
    "MAX_TOKENS_LIMIT",
    "SAMPLING_EPS",
    "EngineConfig",
    "SamplingParams",
    "config_values",
]

EXECUTORS = ("inprocess", "multiproc", "ray")
DTYPES = ("auto", "float32", "float16", "bfloat16")
LOAD_FAILURE_POLICIES = ("recompute", "fail")

#: A temperature below this samples greedily (vLLM's ``_SAMPLING_EPS``): dividing
#: logits by a smaller one overflows to inf and the softmax to NaN.
SAMPLING_EPS = 1e-5
#: Largest ``max_tokens`` (and ``top_k``) a request may ask for (int32).
MAX_TOKENS_LIMIT = (1 << 31) - 1
#: Most ``stop_token_ids`` one request may name.
MAX_STOP_TOKEN_IDS = 1024
_MAX_TOKEN_ID = (1 << 31) - 1
#: Most ``logit_bias`` entries one request may give (OpenAI allows 300).
MAX_LOGIT_BIAS = 300
#: Bound of each ``logit_bias`` value (OpenAI: [-100, 100]).
LOGIT_BIAS_LIMIT = 100.0
#: Bound of ``presence_penalty`` and ``frequency_penalty`` (OpenAI: [-2, 2]).
PENALTY_LIMIT = 2.0


def _positive(inst: object, attribute: attrs.Attribute[Any], value: int) -> None:
    check_int(attribute.name, value, InvalidConfigError, lo=1)


def _int64(inst: object, attribute: attrs.Attribute[Any], value: int) -> None:
    check_int(attribute.name, value, InvalidConfigError)


def _optional_positive(inst: object, attribute: attrs.Attribute[Any], value: int | None) -> None:
    check_int(attribute.name, value, InvalidConfigError, lo=1, optional=True)


def _bool(inst: object, attribute: attrs.Attribute[Any], value: bool) -> None:
    if not isinstance(value, bool):
        raise InvalidConfigError(attribute.name, value, "must be true or false (a bool)")


def _choice(choices: tuple[str, ...]) -> Any:
    def check(inst: object, attribute: attrs.Attribute[Any], value: str) -> None:
        if not isinstance(value, str) or value not in choices:
            raise InvalidConfigError(attribute.name, value, f"must be one of {', '.join(choices)}")

    return check


def _positive_float(inst: object, attribute: attrs.Attribute[Any], value: float) -> None:
    check_float(
        attribute.name,
        value,
        InvalidConfigError,
        lo=0.0,
        hi=float("inf"),
        lo_open=True,
        allow_inf=True,
    )


def _non_negative_float(inst: object, attribute: attrs.Attribute[Any], value: float) -> None:
    check_float(attribute.name, value, InvalidConfigError, lo=0.0, hi=float("inf"), allow_inf=True)


def _model(inst: object, attribute: attrs.Attribute[Any], value: str) -> None:
    if not isinstance(value, str) or not value:
        raise InvalidConfigError("model", value, "must be a local model directory or builtin:tiny")


def _device(inst: object, attribute: attrs.Attribute[Any], value: str) -> None:
    if not isinstance(value, str) or not (
        value in ("auto", "cpu", "cuda")
        or (value.startswith("cuda:") and value[5:].isdigit() and value[5:].isascii())
    ):
        raise InvalidConfigError("device", value, "must be auto, cpu, cuda or cuda:N")


def _connector(inst: object, attribute: attrs.Attribute[Any], value: str | None) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise InvalidConfigError("connector", value, "must be a registered connector name or None")


def _secret_safe_error(name: str, value: object, allowed: str) -> InvalidConfigError:
    return InvalidConfigError(name, "***" if SECRET_KEY.search(name) else value, allowed)


def _options(inst: object, attribute: attrs.Attribute[Any], value: dict[str, Any]) -> None:
    if not isinstance(value, dict):
        raise InvalidConfigError(
            "connector_options", type(value).__name__, "must be a dict with str keys"
        )
    check_plain("connector_options", value, _secret_safe_error)


def _step_log(inst: object, attribute: attrs.Attribute[Any], value: str | Path | None) -> None:
    if value is not None and not isinstance(value, str | os.PathLike):
        raise InvalidConfigError("step_log", value, "must be a path (str or PathLike) or None")


def _options_repr(value: dict[str, Any]) -> str:
    return repr(redact(value))


def _hash_seed_repr(value: int) -> str:
    # A non-default seed may be the secret that makes store keys unguessable.
    return "0" if value == 0 else "<hidden>"


@attrs.frozen(kw_only=True)
class EngineConfig:
    """Everything an engine needs to start; each field is also a ``kvstep`` CLI flag.

    Attributes:
        model: A local Hugging Face directory (``config.json`` + ``*.safetensors``) or
            ``"builtin:tiny"``.
        dtype: ``"auto"`` picks bfloat16 on CUDA and float32 on CPU.
        device: ``"auto"`` picks CUDA when available, else CPU.
        block_size: Tokens per KV block.
        num_gpu_blocks: KV blocks per rank; ``None`` sizes the cache for
            ``max_num_seqs`` sequences of ``max_model_len`` tokens, capped by
            ``kv_cache_memory_bytes``.
        max_num_seqs: Most requests in one step.
        max_num_batched_tokens: Token budget of one step (chunked prefill beyond it).
        max_model_len: Longest prompt + output a request may reach.
        max_queue_depth: Most requests admitted at once (running + waiting); past it
            ``generate`` raises ``EngineOverloaded``.
        connector: A registered connector name, or ``None``.
        connector_options: Options handed to that connector.
        enable_prefix_caching: Reuse cached blocks inside the engine.
        hash_seed: Root of the chained block hashes (stable across restarts). A secret
            seed makes the keys of a shared store unguessable (who can list the store
            cannot test whether a prompt was seen); ``repr`` hides a non-zero seed.
        executor: ``"inprocess"`` (virtual ranks in this process, each with the whole
            model), ``"multiproc"`` (a worker process per rank) or ``"ray"`` (a Ray actor
            per rank); the last two split the model tensor-parallel across the ranks.
        world_size: Number of worker ranks; with ``multiproc`` / ``ray`` it must divide
            the model's attention heads and MLP width, and divide its KV heads or be a
            multiple of them (each KV head is then held by several ranks).
        step_log: Path of a JSON-lines step log, or ``None``.
        load_failure_policy: ``"recompute"`` or ``"fail"`` for blocks that fail to load.
        fan_in_timeout_s: Deadline for all ranks' outputs of one step.
        finalizer_timeout_s: Bound on each finalizer's awaited part.
        transfer_lease_s: How long a KV transfer reported finished by some ranks may
            wait for the others; then it expires: a send frees its blocks, a load fails
            its request (``finish_reason="error"``). ``math.inf`` waits forever.
        seed: Seed of the sampler for requests without their own seed.
    """

    model: str = attrs.field(default="builtin:tiny", validator=_model)
    dtype: str = attrs.field(default="auto", validator=_choice(DTYPES))
    device: str = attrs.field(default="auto", validator=_device)
    block_size: int = attrs.field(default=16, validator=_positive)
    num_gpu_blocks: int | None = attrs.field(default=None, validator=_optional_positive)
    kv_cache_memory_bytes: int = attrs.field(default=2 << 30, validator=_positive)
    max_num_seqs: int = attrs.field(default=64, validator=_positive)
    max_num_batched_tokens: int = attrs.field(default=2048, validator=_positive)
    max_model_len: int = attrs.field(default=4096, validator=_positive)
    max_queue_depth: int = attrs.field(default=1024, validator=_positive)
    connector: str | None = attrs.field(default=None, validator=_connector)
    connector_options: dict[str, Any] = attrs.field(
        factory=dict, validator=_options, repr=_options_repr
    )
    enable_prefix_caching: bool = attrs.field(default=True, validator=_bool)
    hash_seed: int = attrs.field(default=0, validator=_int64, repr=_hash_seed_repr)
    executor: str = attrs.field(default="inprocess", validator=_choice(EXECUTORS))
    world_size: int = attrs.field(default=1, validator=_positive)
    step_log: str | Path | None = attrs.field(default=None, validator=_step_log)
    load_failure_policy: str = attrs.field(
        default="recompute", validator=_choice(LOAD_FAILURE_POLICIES)
    )
    fan_in_timeout_s: float = attrs.field(default=300.0, validator=_non_negative_float)
    finalizer_timeout_s: float = attrs.field(default=30.0, validator=_non_negative_float)
    transfer_lease_s: float = attrs.field(default=60.0, validator=_positive_float)
    seed: int = attrs.field(default=0, validator=_int64)


def config_values(config: EngineConfig, spec: type[Any], **renamed: str) -> dict[str, Any]:
    """The keyword arguments of the attrs class ``spec`` that ``config`` holds.

    A spec (a stage's or the runner's settings, derived once by its ``from_config``) names
    its fields as ``EngineConfig`` does, so its field list is the only list of what it
    takes; ``renamed`` maps a field that the spec names otherwise to the ``EngineConfig``
    field it reads (``num_blocks="num_gpu_blocks"``).

    Raises:
        AttributeError: A field of ``spec`` that ``EngineConfig`` lacks (a programming
            error, caught by any test that builds the spec).
    """
    return {
        field.name: getattr(config, renamed.get(field.name, field.name))
        for field in attrs.fields(spec)
    }


def _stop_token_ids(values: Iterable[int]) -> frozenset[int]:
    """The stop tokens as a set; at most :data:`MAX_STOP_TOKEN_IDS` token ids, read
    lazily so that a huge iterable is refused without being materialised."""
    what = "stop_token_ids"
    allowed = f"must be a list of at most {MAX_STOP_TOKEN_IDS} token ids"
    if isinstance(values, str | bytes | bytearray | Mapping) or not isinstance(values, Iterable):
        raise InvalidRequestError(what, values, allowed)
    items = list(itertools.islice(values, MAX_STOP_TOKEN_IDS + 1))
    if len(items) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequestError(what, values, allowed)
    return frozenset(
        check_int(f"{what}[{i}]", tok, InvalidRequestError, lo=0, hi=_MAX_TOKEN_ID)
        for i, tok in enumerate(items)
    )


def _logit_bias(values: object) -> tuple[tuple[int, float], ...]:
    """The bias as ``(token id, bias)`` pairs sorted by token id (what the wire carries):
    from a mapping token id → bias or an iterable of pairs; at most
    :data:`MAX_LOGIT_BIAS` entries, ids in ``[0, 2**31)``, biases finite in [-100, 100],
    no id twice."""
    what = "logit_bias"
    allowed = (
        f"must map at most {MAX_LOGIT_BIAS} token ids to biases in "
        f"[{-LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]"
    )
    if isinstance(values, Mapping):
        if len(values) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(what, f"<{len(values)} entries>", allowed)
        items: list[Any] = list(values.items())
    elif isinstance(values, str | bytes | bytearray) or not isinstance(values, Iterable):
        raise InvalidRequestError(what, values, allowed)
    else:
        items = list(itertools.islice(values, MAX_LOGIT_BIAS + 1))
        if len(items) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(what, f"<more than {MAX_LOGIT_BIAS} entries>", allowed)
    pairs: dict[int, float] = {}
    for item in items:
        if not isinstance(item, tuple | list) or len(item) != 2:
            raise InvalidRequestError(what, item, "entries must be (token id, bias) pairs")
        tok = check_int(f"{what} token id", item[0], InvalidRequestError, lo=0, hi=_MAX_TOKEN_ID)
        if tok in pairs:
            raise InvalidRequestError(f"{what}[{tok}]", item[1], "token id given twice")
        pairs[tok] = check_float(
            f"{what}[{tok}]",
            item[1],
            InvalidRequestError,
            lo=-LOGIT_BIAS_LIMIT,
            hi=LOGIT_BIAS_LIMIT,
        )
    return tuple(sorted(pairs.items()))


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How one request samples and when it stops; checked strictly at construction.

    Everything that passes crosses the engine↔worker wire unchanged: integers are real
    ``int`` (a ``bool`` is refused) in the ranges below, floats are stored as finite
    builtin ``float`` (an ``int`` is accepted and converted; one too large for a float is
    refused), so that no later ``float()`` or encode can fail for one request.

    Attributes:
        max_tokens: Most tokens to generate, in ``[1, MAX_TOKENS_LIMIT]``.
        temperature: Finite, >= 0; below :data:`SAMPLING_EPS` means greedy (argmax);
            otherwise logits are divided by it.
        top_p: Nucleus sampling mass in (0, 1].
        top_k: Keep the k most likely tokens; 0 or -1 keeps all; at most
            ``MAX_TOKENS_LIMIT``.
        seed: Per-request seed, a signed 64-bit integer, or ``None``: the same seed gives
            the same tokens whatever the batch.
        stop_token_ids: Tokens that end the request (the stop token is kept in output):
            at most :data:`MAX_STOP_TOKEN_IDS` ids in ``[0, 2**31)``, kept as a set.
        ignore_eos: Do not stop at the model's end-of-sequence token (a ``bool``).
        presence_penalty: In [-2, 2] (OpenAI): subtracted once from the logit of every
            token already generated (output tokens only).
        frequency_penalty: In [-2, 2] (OpenAI): subtracted from a token's logit once per
            time it was generated (output tokens only).
        repetition_penalty: Finite, > 0; 1 is off (vLLM, CTRL): the positive logits of
            tokens in the prompt or the output are divided by it, the negative ones
            multiplied by it.
        min_p: In [0, 1] (vLLM): after temperature, tokens whose probability is below
            ``min_p`` times the most likely token's are dropped (0 is off).
        logit_bias: Token id → bias in [-100, 100] added to its logit before the
            penalties (OpenAI); at most :data:`MAX_LOGIT_BIAS` entries. A mapping or
            pairs are accepted; stored as ``(id, bias)`` pairs sorted by id. An id
            outside the model's vocabulary fails the request when it is sampled.
        min_tokens: In [0, max_tokens] (vLLM): until this many tokens are generated the
            end-of-sequence token (unless ``ignore_eos``) and ``stop_token_ids`` cannot
            be sampled.

    Logits are adjusted as vLLM's sampler does, in this order: ``min_tokens`` masking,
    ``logit_bias``, repetition, frequency and presence penalties; then temperature,
    ``min_p``, top-k and top-p.

    Raises:
        InvalidRequestError: A field of another type or out of range; the message names
            the field and what is allowed.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: frozenset[int] = attrs.field(default=frozenset(), converter=_stop_token_ids)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=_logit_bias)
    min_tokens: int = 0

    def __attrs_post_init__(self) -> None:
        error = InvalidRequestError
        max_tokens = check_int("max_tokens", self.max_tokens, error, lo=1, hi=MAX_TOKENS_LIMIT)
        normalised: dict[str, object] = {
            "max_tokens": max_tokens,
            "temperature": check_float(
                "temperature", self.temperature, error, lo=0.0, hi=float("inf")
            ),
            "top_p": check_float("top_p", self.top_p, error, lo=0.0, hi=1.0, lo_open=True),
        }
        top_k = check_int("top_k", self.top_k, error, lo=-1, hi=MAX_TOKENS_LIMIT)
        normalised["top_k"] = top_k
        for name in ("presence_penalty", "frequency_penalty"):
            normalised[name] = check_float(
                name, getattr(self, name), error, lo=-PENALTY_LIMIT, hi=PENALTY_LIMIT
            )
        normalised["repetition_penalty"] = check_float(
            "repetition_penalty",
            self.repetition_penalty,
            error,
            lo=0.0,
            hi=float("inf"),
            lo_open=True,
        )
        normalised["min_p"] = check_float("min_p", self.min_p, error, lo=0.0, hi=1.0)
        normalised["min_tokens"] = check_int(
            "min_tokens", self.min_tokens, error, lo=0, hi=max_tokens
        )
        if not isinstance(self.logit_bias, tuple):  # decoded, not converted
            raise error("logit_bias", self.logit_bias, "must be (token id, bias) pairs")
        if self.logit_bias:  # a decoded value was not converted: check it again
            normalised["logit_bias"] = _logit_bias(self.logit_bias)
        if self.seed is not None:
            normalised["seed"] = check_int("seed", self.seed, error, lo=INT64_MIN, hi=INT64_MAX)
        if not isinstance(self.ignore_eos, bool):
            raise error("ignore_eos", self.ignore_eos, "must be true or false (a bool)")
        if not isinstance(self.stop_token_ids, frozenset):  # decoded, not converted
            raise error("stop_token_ids", self.stop_token_ids, "must be a set of token ids")
        for name, value in normalised.items():
            object.__setattr__(self, name, value)

    @property
    def greedy(self) -> bool:
        """Whether sampling reduces to argmax (temperature below ``SAMPLING_EPS`` or top_k 1)."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def needs_history(self) -> bool:
        """Whether sampling reads the request's earlier tokens (a penalty is on)."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def adjusts_logits(self) -> bool:
        """Whether the logits are changed before temperature (penalties, bias, min_tokens)."""
        return self.needs_history or bool(self.logit_bias) or self.min_tokens > 0
