"""Engine configuration and per-request sampling parameters.

Both are frozen attrs classes validated at construction: a bad value raises
:class:`~pipeline.errors.InvalidConfigError` (engine) or
:class:`~pipeline.errors.InvalidRequestError` (request) naming the field, the value and
what is allowed.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import attrs

from pipeline.errors import InvalidConfigError, InvalidRequestError

__all__ = ["EXECUTORS", "DTYPES", "EngineConfig", "SamplingParams"]

EXECUTORS = ("inprocess", "multiproc", "ray")
DTYPES = ("auto", "float32", "float16", "bfloat16")
LOAD_FAILURE_POLICIES = ("recompute", "fail")


def _positive(inst: object, attribute: attrs.Attribute[Any], value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InvalidConfigError(attribute.name, value, "must be a positive integer")


def _choice(choices: tuple[str, ...]) -> Any:
    def check(inst: object, attribute: attrs.Attribute[Any], value: str) -> None:
        if value not in choices:
            raise InvalidConfigError(attribute.name, value, f"must be one of {', '.join(choices)}")

    return check


def _positive_float(inst: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
        raise InvalidConfigError(attribute.name, value, "must be a number > 0")


def _non_negative_float(inst: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not value >= 0:
        raise InvalidConfigError(attribute.name, value, "must be a number >= 0")


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
        hash_seed: Root of the chained block hashes (stable across restarts).
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

    model: str = "builtin:tiny"
    dtype: str = attrs.field(default="auto", validator=_choice(DTYPES))
    device: str = "auto"
    block_size: int = attrs.field(default=16, validator=_positive)
    num_gpu_blocks: int | None = None
    kv_cache_memory_bytes: int = attrs.field(default=2 << 30, validator=_positive)
    max_num_seqs: int = attrs.field(default=64, validator=_positive)
    max_num_batched_tokens: int = attrs.field(default=2048, validator=_positive)
    max_model_len: int = attrs.field(default=4096, validator=_positive)
    max_queue_depth: int = attrs.field(default=1024, validator=_positive)
    connector: str | None = None
    connector_options: dict[str, Any] = attrs.field(factory=dict)
    enable_prefix_caching: bool = True
    hash_seed: int = 0
    executor: str = attrs.field(default="inprocess", validator=_choice(EXECUTORS))
    world_size: int = attrs.field(default=1, validator=_positive)
    step_log: str | Path | None = None
    load_failure_policy: str = attrs.field(
        default="recompute", validator=_choice(LOAD_FAILURE_POLICIES)
    )
    fan_in_timeout_s: float = attrs.field(default=300.0, validator=_non_negative_float)
    finalizer_timeout_s: float = attrs.field(default=30.0, validator=_non_negative_float)
    transfer_lease_s: float = attrs.field(default=60.0, validator=_positive_float)
    seed: int = 0

    def __attrs_post_init__(self) -> None:
        if self.num_gpu_blocks is not None and (
            not isinstance(self.num_gpu_blocks, int) or self.num_gpu_blocks <= 0
        ):
            raise InvalidConfigError(
                "num_gpu_blocks", self.num_gpu_blocks, "must be a positive integer or None"
            )
        if self.device != "auto" and not (
            self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")
        ):
            raise InvalidConfigError("device", self.device, "must be auto, cpu, cuda or cuda:N")
        if not isinstance(self.model, str) or not self.model:
            raise InvalidConfigError(
                "model", self.model, "must be a local model directory or builtin:tiny"
            )


def _int_tuple(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(values)


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How one request samples and when it stops.

    Attributes:
        max_tokens: Most tokens to generate (>= 1).
        temperature: 0 means greedy; otherwise logits are divided by it.
        top_p: Nucleus sampling mass in (0, 1].
        top_k: Keep the k most likely tokens; 0 or -1 keeps all.
        seed: Per-request seed: the same seed gives the same tokens whatever the batch.
        stop_token_ids: Tokens that end the request (the stop token is kept in output).
        ignore_eos: Do not stop at the model's end-of-sequence token.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_int_tuple)
    ignore_eos: bool = False

    def __attrs_post_init__(self) -> None:
        if (
            not isinstance(self.max_tokens, int)
            or isinstance(self.max_tokens, bool)
            or (self.max_tokens < 1)
        ):
            raise InvalidRequestError("max_tokens", self.max_tokens, "must be an integer >= 1")
        if not isinstance(self.temperature, int | float) or not self.temperature >= 0:
            raise InvalidRequestError("temperature", self.temperature, "must be a number >= 0")
        if not isinstance(self.top_p, int | float) or not 0 < self.top_p <= 1:
            raise InvalidRequestError("top_p", self.top_p, "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise InvalidRequestError("top_k", self.top_k, "must be -1, 0 (all) or >= 1")
        if self.seed is not None and not isinstance(self.seed, int):
            raise InvalidRequestError("seed", self.seed, "must be an integer or None")
        for tok in self.stop_token_ids:
            if not isinstance(tok, int) or tok < 0:
                raise InvalidRequestError(
                    "stop_token_ids", self.stop_token_ids, "must be non-negative integers"
                )

    @property
    def greedy(self) -> bool:
        """Whether sampling reduces to argmax."""
        return self.temperature == 0.0 or self.top_k == 1
