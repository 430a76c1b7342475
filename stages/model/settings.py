"""``RunnerSettings``: what every rank's :class:`~stages.model.runner.ModelRunner` is built
from, derived once from :class:`~pipeline.config.EngineConfig`.

The engine builds one ``RunnerSettings`` and hands it to each in-process rank; a worker
process rebuilds ``EngineConfig`` from its ``Init`` message and derives the same settings
there (they never cross a process boundary, only the config's plain values do). What differs
between ranks (the rank, its tensor-parallel group, the runner whose weights it shares)
is an argument of :meth:`ModelRunner.load`, not part of the settings.
"""

from __future__ import annotations

import attrs

from pipeline.checks import check_float, check_int
from pipeline.config import (
    INLINE_FORWARD_BELOW_S,
    MAX_INLINE_FORWARD_BELOW_S,
    EngineConfig,
    config_values,
)
from pipeline.errors import InvalidConfigError

__all__ = ["RunnerSettings"]

_POSITIVE = ("block_size", "max_num_seqs", "max_model_len", "kv_cache_memory_bytes", "world_size",
             "max_loras", "max_lora_rank")  # fmt: skip


@attrs.frozen(kw_only=True)
class RunnerSettings:
    """The model, its placement and the KV cache's sizing, the same for every rank.

    Attributes:
        model: A local HF directory or ``"builtin:tiny"``.
        dtype: ``auto`` | ``float32`` | ``float16`` | ``bfloat16`` (resolved at load).
        device: ``auto`` | ``cpu`` | ``cuda`` | ``cuda:N`` (resolved at load).
        block_size: Tokens per KV block.
        num_blocks: KV blocks; ``None`` sizes the cache for ``max_num_seqs`` sequences
            of ``max_model_len`` tokens, capped by ``kv_cache_memory_bytes``
            (``EngineConfig.num_gpu_blocks``).
        max_num_seqs: Sequences the default cache size provides for.
        max_model_len: Longest context served (also the rotary table length).
        kv_cache_memory_bytes: Cap of the default cache size.
        seed: Seed of the sampler for requests without their own seed.
        world_size: Number of ranks.
        inline_forward: Run the forward pass and sampling on the thread that awaits
            them (the event loop's) instead of the runner's compute thread.
        inline_forward_below_s: Run a pass there when recent passes of its step's
            shape took less than this many seconds (one rank on a CPU only;
            :mod:`~stages.model.compute_thread`); ``0``: never. At most ``1``.
        cuda_graphs: Replay decode-only steps from CUDA graphs
            (:class:`~stages.model.cuda_graphs.DecodeGraphs`); CUDA only, one rank.
        torch_compile: On a CPU, compile the forward pass at load
            (:mod:`~stages.model.compiled_forward`); eager where it cannot be.
        keep_freed_memory: On a CPU, keep the memory a step frees for the next one
            (:func:`~stages.model.cpu_allocator.keep_freed_memory`, process-wide).
        enable_lora: Apply requests' LoRA adapters (:mod:`stages.model.lora`).
        max_loras: Adapters the runner holds at once (a step has at most that many).
        max_lora_rank: Largest adapter rank accepted.
        decode_mirror: On a CPU without CUDA graphs, keep the decode requests' keys and
            values contiguous too (:mod:`~stages.model.decode_mirror`).
        decode_mirror_memory_bytes: Most bytes that copy takes (all layers); ``None``:
            the paged cache's own size.

    Raises:
        InvalidConfigError: A size that is not a positive integer, naming the field.
            The dtype and device names are checked when the runner loads (``auto``
            depends on the machine that loads it).
    """

    model: str
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    num_blocks: int | None = None
    max_num_seqs: int = 64
    max_model_len: int = 4096
    kv_cache_memory_bytes: int = 2 << 30
    seed: int = 0
    world_size: int = 1
    inline_forward: bool = False
    inline_forward_below_s: float = INLINE_FORWARD_BELOW_S
    cuda_graphs: bool = False
    torch_compile: bool = False
    keep_freed_memory: bool = True
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    decode_mirror: bool = True
    decode_mirror_memory_bytes: int | None = None

    def __attrs_post_init__(self) -> None:
        for name in _POSITIVE:
            check_int(name, getattr(self, name), InvalidConfigError, lo=1)
        check_int("num_blocks", self.num_blocks, InvalidConfigError, lo=1, optional=True)
        name, value = "inline_forward_below_s", self.inline_forward_below_s
        check_float(name, value, InvalidConfigError, lo=0.0, hi=MAX_INLINE_FORWARD_BELOW_S)
        check_int(
            "decode_mirror_memory_bytes",
            self.decode_mirror_memory_bytes,
            InvalidConfigError,
            lo=0,
            optional=True,
        )
        for name in ("inline_forward", "cuda_graphs", "torch_compile", "keep_freed_memory",
                     "enable_lora", "decode_mirror"):  # fmt: skip
            if not isinstance(getattr(self, name), bool):
                raise InvalidConfigError(name, getattr(self, name), "must be a bool")
        if self.cuda_graphs and self.world_size != 1:
            raise InvalidConfigError(
                "cuda_graphs", True, f"only with world_size=1, not {self.world_size}"
            )

    @classmethod
    def from_config(cls, config: EngineConfig, *, device: str | None = None) -> RunnerSettings:
        """Every rank's settings under ``config``.

        Args:
            device: This rank's device where the executor places each rank itself (a
                worker process is given ``cuda:N`` or ``cpu``); ``None`` keeps
                ``config.device``.
        """
        settings = cls(**config_values(config, cls, num_blocks="num_gpu_blocks"))
        return settings if device is None else attrs.evolve(settings, device=device)
