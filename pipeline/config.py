"""Engine configuration (and, re-exported from :mod:`pipeline.sampling_params`, the
per-request sampling parameters).

:class:`EngineConfig` is a frozen attrs class validated at construction: a bad value
raises :class:`~pipeline.errors.InvalidConfigError` naming the field, a short repr
of the value and what is allowed. Every field is type-checked (a ``bool`` is never
taken for a number, nor a string for a ``bool``), numbers must be finite and in a
64-bit range, and what passes is exactly what the engine↔worker wire
(:mod:`pipeline.executors.wire`, msgspec) encodes and its typed decoder accepts.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from pipeline.checks import (
    SECRET_KEY,
    check_float,
    check_int,
    check_plain,
    redact,
)
from pipeline.errors import InvalidConfigError
from pipeline.kv_events.config import KVEventsConfig, kv_events_config
from pipeline.logits_processors import LogitsProcessorEntry, check_logits_processors
from pipeline.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOKENS_LIMIT,
    SAMPLING_EPS,
    SamplingParams,
)
from pipeline.speculative_config import SpeculativeConfig

__all__ = [
    "DTYPES",
    "EXECUTORS",
    "MAX_LOGIT_BIAS",
    "MAX_STOP_TOKEN_IDS",
    "MAX_TOKENS_LIMIT",
    "SAMPLING_EPS",
    "EngineConfig",
    "KVEventsConfig",
    "SamplingParams",
    "config_values",
]

EXECUTORS = ("inprocess", "multiproc", "ray")
DTYPES = ("auto", "float32", "float16", "bfloat16")
LOAD_FAILURE_POLICIES = ("recompute", "fail")
#: How ``executor="ray"`` places its ranks (a Ray placement group's strategy).
RAY_PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
#: How waiting requests are ordered (``EngineConfig.scheduling_policy``), as vLLM's.
SCHEDULING_POLICIES = ("fcfs", "priority")
#: The grammar backends of structured outputs (``EngineConfig.structured_outputs_backend``).
STRUCTURED_OUTPUTS_BACKENDS = ("llguidance", "xgrammar")
INLINE_FORWARD_BELOW_S = 0.002
"""Default ``inline_forward_below_s``: passes shorter than a few thread hand-overs."""
MAX_INLINE_FORWARD_BELOW_S = 1.0
#: Largest ``max_lora_rank`` (vLLM's largest supported rank).
MAX_LORA_RANK = 512
"""Longest ``inline_forward_below_s``: a longer pass blocking the loop is ``inline_forward``."""


def _positive(inst: object, attribute: attrs.Attribute[Any], value: int) -> None:
    check_int(attribute.name, value, InvalidConfigError, lo=1)


def _int64(inst: object, attribute: attrs.Attribute[Any], value: int) -> None:
    check_int(attribute.name, value, InvalidConfigError)


def _optional_positive(inst: object, attribute: attrs.Attribute[Any], value: int | None) -> None:
    check_int(attribute.name, value, InvalidConfigError, lo=1, optional=True)


def _bool(inst: object, attribute: attrs.Attribute[Any], value: bool) -> None:
    if not isinstance(value, bool):
        raise InvalidConfigError(attribute.name, value, "must be true or false (a bool)")


def _inline_forward(inst: EngineConfig, attribute: attrs.Attribute[Any], value: bool) -> None:
    _bool(inst, attribute, value)
    if value and inst.executor != "inprocess":
        raise InvalidConfigError(
            attribute.name,
            value,
            f"only with executor='inprocess' (the ranks of {inst.executor!r} run in their own "
            "workers, with their compute threads)",
        )


def _inline_forward_below(inst: object, attribute: attrs.Attribute[Any], value: float) -> None:
    check_float(attribute.name, value, InvalidConfigError, lo=0.0, hi=MAX_INLINE_FORWARD_BELOW_S)


def _cuda_graphs(inst: EngineConfig, attribute: attrs.Attribute[Any], value: bool) -> None:
    _bool(inst, attribute, value)
    refused = (
        (inst.device == "cpu", "needs a CUDA device, not device='cpu'"),
        (inst.world_size != 1, f"only with world_size=1, not {inst.world_size}"),
        (
            inst.connector is not None,
            f"not with a connector ({inst.connector!r} runs per-layer hooks a graph cannot)",
        ),
    )
    for bad, why in refused:
        if value and bad:
            raise InvalidConfigError(attribute.name, value, why)


def _lora_rank(inst: object, attribute: attrs.Attribute[Any], value: int) -> None:
    check_int(attribute.name, value, InvalidConfigError, lo=1, hi=MAX_LORA_RANK)


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


def _engine_id(inst: object, attribute: attrs.Attribute[Any], value: str | None) -> None:
    if value is not None and (
        not isinstance(value, str) or not 0 < len(value) <= 256 or not value.isprintable()
    ):
        raise InvalidConfigError(
            "engine_id", value, "must be None or a printable string of 1..256 characters"
        )


def _step_log(inst: object, attribute: attrs.Attribute[Any], value: str | Path | None) -> None:
    if value is not None and not isinstance(value, str | os.PathLike):
        raise InvalidConfigError("step_log", value, "must be a path (str or PathLike) or None")


def _entries(value: Sequence[LogitsProcessorEntry]) -> tuple[LogitsProcessorEntry, ...]:
    # A list becomes a tuple; anything else is refused after construction.
    return tuple(value) if isinstance(value, list) else value  # type: ignore[return-value]


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
        dtype: ``"auto"`` picks bfloat16 on CUDA; on the CPU, bfloat16 for a checkpoint
            saved in bfloat16 when the CPU has native bfloat16 (AVX512-BF16 or AMX),
            else float32.
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
        async_scheduling: Plan step N+1 while step N's forward pass runs, and hand step
            N's outputs to their streams while step N+1 runs (vLLM's async scheduling).
            Tokens are the same either way. Off by default: on a CPU the engine's work
            competes with the forward pass for the cores and the GIL, and the steps
            measured slower with it (``benchmarks/step_overhead.py``).
        inline_forward: Run each forward pass and its sampling on the event loop's
            thread, and load the model there, instead of handing them to the runner's
            compute thread: no thread hand-over per step (two thread wake-ups), the
            larger part of a small model's decode step on a small machine
            (``benchmarks/step_overhead.py``); the loop is blocked during each forward
            pass, so it is off by default, for an engine whose loop serves nothing else
            while a step computes (offline ``LLM`` use, a benchmark). A connector's layer
            hooks then run on the loop's thread too (the built-in connectors do their I/O
            on their own threads). Only with ``executor="inprocess"``.
        inline_forward_below_s: With one rank on a CPU, run a forward pass (and its
            sampling) on the event loop's thread when recent passes of the same step
            shape (requests, tokens' power of two) took less than this many seconds:
            a short pass then costs no thread hand-over, and blocks the loop no
            longer than about this. A pass that runs a connector's layer hooks is
            always handed over. ``0`` hands every pass over.
            In ``[0, 1]``; default 2 ms (:mod:`stages.model.compute_thread`).
        cuda_graphs: Replay decode-only steps from CUDA graphs, captured the first time
            each padded batch size and block-table width is needed: one launch for the
            whole decoder instead of a dozen per layer, what a small batch's decode step
            on a GPU is bound by. Only on CUDA, with ``world_size=1`` and no connector;
            steps with a prefill chunk, and steps larger than ``max_num_seqs``'s largest
            padded size, run eagerly.
        torch_compile: On a CPU, compile each worker's forward pass with
            ``torch.compile`` (inductor) at load, before the engine serves: the small
            ops of each layer (norms, rotary, residuals, SiLU) fused into generated C++
            loops, the GEMMs and the paged attention called as they are
            (:mod:`stages.model.compiled_forward`). Costs seconds at start (a C++
            compiler must be installed; compiled code is cached on disk by inductor)
            and makes every decode step cheaper. Where it cannot be used (CUDA, tensor
            parallel ranks, mixture-of-experts or sliding-window layers, LoRA, or a
            failed compilation) the pass runs eagerly and one warning
            (``torch_compile_fallback``) says why. ``kvstep serve`` turns it on by
            default (``--no-torch-compile`` turns it off).
        kv_events: Publish the KV cache events of the block pool and of the connector
            tiers that report them (vLLM's schema, on ZeroMQ): a ``KVEventsConfig``, a
            PUB endpoint to bind such as ``tcp://127.0.0.1:5557``, or a dict (JSON
            object) of ``KVEventsConfig`` fields, e.g. ``{"endpoint":
            "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5558"}``;
            ``None``: off.
        keep_freed_memory: On a CPU, set this process's C allocator (glibc's
            ``malloc``) to keep the memory a step frees for the next step instead of
            handing it back to the kernel, which then pages it in again zeroed, one fault
            per 4 KiB (:mod:`stages.model.cpu_allocator`: a prefill's page faults went
            from thousands to none and the prefill got 5-10% faster). Process-wide and
            once per process: turn it off for an engine embedded in a process whose
            memory must shrink back after a burst. Nothing is changed on a GPU or
            under another C library.
        engine_id: This engine's id among the engines that exchange KV (vLLM's
            ``kv_transfer_config.engine_id``): what a producer names itself in the
            ``kv_transfer_params`` it answers, and what its NIXL agents are named after.
            ``None`` (the default): a fresh random id (a uuid4) each time an engine
            starts, so two engines on one host never share one.
        logits_processors: Logits stages to insert after the built-in ``logits`` stage,
            in order (vLLM's ``logits_processors``): ``pipeline.LogitsStage``
            subclasses, or their import paths ``"module:Class"`` / ``"module.Class"``,
            each built with no arguments on every rank when its worker graph is built.
            With ``executor`` ``multiproc`` or ``ray`` a class is stored as its
            ``"module:qualname"`` path (the workers import it), so it must be defined at
            the top level of an importable module.
        speculative_config: Speculative decoding, as vLLM's dict (``--speculative-config
            JSON``): ``{"method": "ngram", "num_speculative_tokens": k,
            "prompt_lookup_max": 4, "prompt_lookup_min": 2}`` or ``{"method":
            "draft_model", "model": DIR, "num_speculative_tokens": k}``
            (:class:`~pipeline.speculative_config.SpeculativeConfig`). Each step,
            requests with nothing but temperature, top-k/p and min-p processing their
            logits (greedy or sampled) get up to k drafts (an n-gram of their own text,
            or the draft model's greedy guesses); one forward pass verifies them, and
            the tokens are distributed as without it (greedy and seeded: the same
            tokens); k adapts per request
            (:class:`~stages.speculative.budget.DraftBudget`). ``None`` (the default):
            off. A connector saves and announces only blocks of kept tokens; worker
            processes verify the drafts as one forward pass does in-process. Not yet
            with async scheduling or logits processors (refused by name).
        structured_outputs_backend: The grammar backend of structured outputs (vLLM's
            ``structured_outputs_config.backend``): ``"llguidance"`` (the default,
            ``kvstep[structured]``) or ``"xgrammar"`` (``pip install xgrammar``; JSON
            schemas, regexes, choices and GBNF/EBNF grammars, not Lark, and no reasoning
            section before the constrained output).
        ray_placement_strategy: With ``executor="ray"``, the strategy of the placement
            group that places one bundle per rank: ``"PACK"`` (the default: as few nodes
            as possible), ``"SPREAD"``, ``"STRICT_PACK"`` (one node) or
            ``"STRICT_SPREAD"`` (every rank on a node of its own).
        enable_lora: Serve LoRA adapters (vLLM's ``--enable-lora``): requests may name
            a peft adapter (``lora_request=LoRARequest(name, int_id, path)``), applied
            to that request's rows of the batch only (q/k/v/o and gate/up/down
            projections; :mod:`stages.model.lora`).
        max_loras: Most adapters in one step (each worker holds that many, least
            recently used out first); a request whose adapter would be one more waits.
        max_lora_rank: Largest adapter rank accepted (at most 512).
        decode_mirror: On a CPU without CUDA graphs, each worker keeps its decode
            requests' keys and values in contiguous per-request rows as well, appended
            one token a step, so decode attention no longer gathers every request's
            blocks each layer (:mod:`stages.model.decode_mirror`); the paged cache stays
            the source of truth.
        decode_mirror_memory_bytes: Most bytes that copy may take per worker; a step
            that needs more gathers from the paged cache (logged once, counted).
            ``None``: the paged cache's own size.
        scheduling_policy: ``"fcfs"`` (the default: waiting requests start in arrival
            order) or ``"priority"`` (vLLM's ``--scheduling-policy priority``: by each
            request's ``priority``, lower first, ties by arrival; a running request of a
            lower priority is preempted when a higher one cannot start). A non-zero
            ``priority`` is refused under ``"fcfs"``, as vLLM does.
        tenant_fair_share: Share the running slots fairly among tenants (a request's
            ``tenant``; the server reads it from the ``X-Tenant-Id`` header): a free slot
            goes to the waiting request of the tenant with the fewest running requests,
            then the one served least recently (round robin), so one tenant's flood
            cannot starve the others. A lone tenant still gets every slot. Under
            ``"priority"``, priority comes first.
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
    kv_events: KVEventsConfig | None = attrs.field(default=None, converter=kv_events_config)
    async_scheduling: bool = attrs.field(default=False, validator=_bool)
    inline_forward: bool = attrs.field(default=False, validator=_inline_forward)
    inline_forward_below_s: float = attrs.field(
        default=INLINE_FORWARD_BELOW_S, validator=_inline_forward_below
    )
    cuda_graphs: bool = attrs.field(default=False, validator=_cuda_graphs)
    torch_compile: bool = attrs.field(default=False, validator=_bool)
    keep_freed_memory: bool = attrs.field(default=True, validator=_bool)
    speculative_config: dict[str, Any] | None = attrs.field(default=None)
    engine_id: str | None = attrs.field(default=None, validator=_engine_id)
    logits_processors: tuple[LogitsProcessorEntry, ...] = attrs.field(
        default=(), converter=_entries
    )
    structured_outputs_backend: str = attrs.field(
        default="llguidance", validator=_choice(STRUCTURED_OUTPUTS_BACKENDS)
    )
    ray_placement_strategy: str = attrs.field(
        default="PACK", validator=_choice(RAY_PLACEMENT_STRATEGIES)
    )
    enable_lora: bool = attrs.field(default=False, validator=_bool)
    max_loras: int = attrs.field(default=1, validator=_positive)
    max_lora_rank: int = attrs.field(default=16, validator=_lora_rank)
    decode_mirror: bool = attrs.field(default=True, validator=_bool)
    decode_mirror_memory_bytes: int | None = attrs.field(default=None, validator=_optional_positive)
    scheduling_policy: str = attrs.field(default="fcfs", validator=_choice(SCHEDULING_POLICIES))
    tenant_fair_share: bool = attrs.field(default=False, validator=_bool)

    def __attrs_post_init__(self) -> None:
        entries = check_logits_processors(
            self.logits_processors, by_path=self.executor != "inprocess"
        )
        object.__setattr__(self, "logits_processors", entries)
        if self.speculative_config is not None:
            self._check_speculative()

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """``speculative_config`` checked (``None``: speculative decoding is off)."""
        if self.speculative_config is None:
            return None
        return SpeculativeConfig.parse(self.speculative_config)

    def _check_speculative(self) -> None:
        SpeculativeConfig.parse(self.speculative_config or {})
        value = self.speculative_config
        for refused, why in (
            (self.async_scheduling, "async_scheduling (drafts would follow tokens in flight)"),
            (bool(self.logits_processors), "logits_processors (drafts are verified by argmax)"),
        ):
            if refused:
                raise InvalidConfigError(
                    "speculative_config", value, f"is not supported yet with {why}"
                )


def config_values(config: EngineConfig, settings: type[Any], **renamed: str) -> dict[str, Any]:
    """The keyword arguments of the attrs class ``settings`` that ``config`` holds.

    A settings class (a stage's or the runner's, derived once by its ``from_config``) names
    its fields as ``EngineConfig`` does, so its field list is the only list of what it
    takes; ``renamed`` maps a field that the class names otherwise to the ``EngineConfig``
    field it reads (``num_blocks="num_gpu_blocks"``).

    Raises:
        AttributeError: A field of ``settings`` that ``EngineConfig`` lacks (a programming
            error, caught by any test that builds the settings).
    """
    return {
        field.name: getattr(config, renamed.get(field.name, field.name))
        for field in attrs.fields(settings)
    }
