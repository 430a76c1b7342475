"""What a :class:`~stages.model.runner.ModelRunner` is built from: checks, then loading.

:func:`load_parts` is the loading half of ``ModelRunner.load``: it resolves the device
and dtype of the :class:`~stages.model.settings.RunnerSettings` (which checked their own
sizes), checks the rank and tensor-parallel group, reuses a compatible
:class:`SharedWeights` or reads the checkpoint, sizes the KV cache and returns the
:class:`RunnerParts` the runner is constructed from. Every bad argument is an
:class:`~pipeline.errors.InvalidConfigError` raised before any weight is read. This
module knows nothing of the runner itself (only ``runner.py`` imports it).
"""

from __future__ import annotations

from pathlib import Path

import attrs
import torch

from pipeline.errors import InvalidConfigError
from pipeline.logger import get_logger
from stages.model import cuda_graphs
from stages.model.builtin import resolve_model_path
from stages.model.checkpoint import LoadedModel, load_model
from stages.model.config import load_model_config
from stages.model.cpu_allocator import keep_freed_memory
from stages.model.cuda_graphs import GraphCapture
from stages.model.kv_cache import default_num_blocks, kv_cache_block_bytes
from stages.model.linear_kernels import apply_kernel, choose_kernel
from stages.model.parallel import UNSHARDED, TensorParallel, check_tp_divisible
from stages.model.settings import RunnerSettings

__all__ = [
    "RunnerParts",
    "SharedWeights",
    "cpu_has_native_bf16",
    "load_parts",
    "resolve_device",
    "resolve_dtype",
]

log = get_logger()

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(device: str) -> torch.device:
    """``"auto"`` (CUDA when available), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.

    Raises:
        InvalidConfigError: Another name, or CUDA asked for but unavailable.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        return torch.device("cpu")
    if device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit()):
        if not torch.cuda.is_available():
            raise InvalidConfigError("device", device, "CUDA is not available here; use cpu")
        return torch.device(device)
    raise InvalidConfigError("device", device, "must be auto, cpu, cuda or cuda:N")


def cpu_has_native_bf16() -> bool:
    """Whether this CPU does bfloat16 arithmetic in hardware (AVX512-BF16 or AMX), where a
    bfloat16 model runs faster than in float32; elsewhere torch emulates it, slower."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def resolve_dtype(
    dtype: str, device: torch.device, checkpoint_dtype: str | None = None
) -> torch.dtype:
    """``"auto"`` or a name of :data:`_DTYPES`.

    ``"auto"`` is bfloat16 on CUDA. On the CPU it is bfloat16 for a checkpoint saved in
    bfloat16 (``checkpoint_dtype``, the config's ``torch_dtype``) when the CPU has native
    bfloat16 arithmetic (:func:`cpu_has_native_bf16`), and float32 otherwise: a float32
    checkpoint keeps its float32 tokens, and without the hardware bfloat16 is slower.

    Raises:
        InvalidConfigError: Any other name.
    """
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        native = checkpoint_dtype == "bfloat16" and cpu_has_native_bf16()
        return torch.bfloat16 if native else torch.float32
    if dtype not in _DTYPES:
        raise InvalidConfigError("dtype", dtype, f"must be auto or one of {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


@attrs.frozen
class SharedWeights:
    """The weights an open runner offers to another in-process rank, and how it holds them.

    Attributes:
        loaded: The runner's loaded model.
        device: Where the weights live.
        dtype: Their dtype.
        max_model_len: The runner's longest context (its rotary table length).
        sharded: Whether the runner holds a tensor-parallel shard.
        closed: Whether the runner was closed (its weights may be gone).
    """

    loaded: LoadedModel
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    sharded: bool
    closed: bool


@attrs.frozen(kw_only=True)
class RunnerParts:
    """Everything ``ModelRunner(parts)`` is constructed from, checked and loaded.

    Attributes:
        settings: What every rank is built from.
        loaded: The model (this rank's shard of it, or another rank's shared weights).
        device: ``settings.device`` resolved.
        dtype: ``settings.dtype`` resolved.
        num_blocks: KV blocks to allocate (``settings.num_blocks`` or the default size).
        rank: This worker's rank.
        tp: How the model is sharded (``UNSHARDED`` for a whole model).
        graph_capture: How decode graphs are captured (``settings.cuda_graphs``), or ``None``.
    """

    settings: RunnerSettings
    loaded: LoadedModel
    device: torch.device
    dtype: torch.dtype
    num_blocks: int
    rank: int
    tp: TensorParallel
    graph_capture: GraphCapture | None = None


def _check_tp(
    tp: TensorParallel | None, rank: int, world_size: int, shared: SharedWeights | None
) -> TensorParallel:
    """The sharding to load with (``UNSHARDED`` for ``None``), checked against the ranks."""
    if tp is None:
        return UNSHARDED
    if tp.rank != rank:
        raise InvalidConfigError("tp.rank", tp.rank, f"must equal rank={rank}")
    if tp.size != world_size:
        raise InvalidConfigError("tp.size", tp.size, f"must equal world_size={world_size}")
    if tp.sharded and shared is not None:
        raise InvalidConfigError(
            "shared_model",
            shared.loaded.config.architecture,
            "cannot be combined with a sharded tp: each tensor-parallel rank loads its shard",
        )
    return tp


def _shared(
    other: SharedWeights,
    path: Path,
    device: torch.device,
    dtype: torch.dtype,
    max_model_len: int,
) -> LoadedModel:
    """``other``'s weights, when it is an open, unsharded runner of the same model."""
    same = (
        other.loaded.path.resolve() == path.resolve()
        and other.device == device
        and other.dtype == dtype
        and other.max_model_len >= max_model_len
        and not other.closed
        and not other.sharded
    )
    if not same:
        raise InvalidConfigError(
            "shared_model",
            other.loaded.path,
            f"must be an open, unsharded runner of {path} on {device} in {dtype} "
            f"with max_model_len >= {max_model_len}",
        )
    return other.loaded


def _on_fastest_kernel(loaded: LoadedModel, dev: torch.device, dtype: torch.dtype) -> LoadedModel:
    """``loaded`` with its projections on the kernel :func:`choose_kernel` picks (timed on
    this machine, or forced by ``$KVSTEP_LINEAR_KERNEL``); CPU models only."""
    choice = choose_kernel(loaded.model, dev, dtype)
    apply_kernel(loaded.model, choice.kernel)
    log.info(
        "linear_kernel_chosen",
        kernel=choice.kernel,
        forced=choice.forced,
        seconds=dict(choice.seconds),
        candidates=list(choice.candidates),  # without oneDNN where it can't pack
        dtype=str(dtype).removeprefix("torch."),
    )
    return attrs.evolve(loaded, linear_kernel=choice.kernel)


def load_parts(
    settings: RunnerSettings,
    *,
    rank: int = 0,
    shared_model: SharedWeights | None = None,
    tp: TensorParallel | None = None,
) -> RunnerParts:
    """Load ``settings.model`` (a local HF directory or ``"builtin:tiny"``) and size the cache.

    Args:
        settings: The model, dtype, device and cache sizing (checked when it was built).
        rank: This worker's rank (part of the fingerprint), in ``[0, settings.world_size)``.
        shared_model: Reuse that runner's weights (same model, dtype and device); this
            runner still gets its own KV cache, request state and sampler.
        tp: This process's tensor-parallel group (``tp.rank == rank``,
            ``tp.size == settings.world_size``): load only its shard and allocate its share
            of the KV heads; every rank must then run each step together. ``None``
            loads the whole model (in-process ranks each hold every head).

    Raises:
        InvalidConfigError: A bad dtype, device or rank, ``cuda_graphs`` off CUDA, an
            incompatible ``shared_model``, a ``tp`` that disagrees with ``rank``/``world_size``
            or is combined with ``shared_model``, or a ``world_size`` that does not
            divide the model's heads or MLP width.
        ModelLoadError: The checkpoint cannot be loaded.

    Blocks on disk I/O and weight conversion; call it off the event loop.
    """
    dev = resolve_device(settings.device)
    if dev.type == "cpu" and settings.keep_freed_memory:
        log.info("cpu_allocator", keeps_freed_memory=keep_freed_memory())
    capture = cuda_graphs.graph_capture(dev) if settings.cuda_graphs else None  # before loading
    world_size, max_model_len = settings.world_size, settings.max_model_len
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise InvalidConfigError("rank", rank, f"must be in [0, world_size={world_size})")
    tp = _check_tp(tp, rank, world_size, shared_model)
    path = resolve_model_path(settings.model)
    config = load_model_config(path)
    torch_dtype = resolve_dtype(settings.dtype, dev, config.torch_dtype)
    if shared_model is not None:
        loaded = _shared(shared_model, path, dev, torch_dtype, max_model_len)
    else:
        config.check_max_model_len(max_model_len, path)
        check_tp_divisible(config, tp.size)
        if max_model_len > config.max_position_embeddings:
            log.warning(
                "max_model_len_exceeds_model",
                max_model_len=max_model_len,
                max_position_embeddings=config.max_position_embeddings,
            )
        loaded = load_model(
            path, dtype=torch_dtype, device=dev, max_len=max_model_len, config=config, tp=tp
        )
        loaded = _on_fastest_kernel(loaded, dev, torch_dtype)
    num_blocks = settings.num_blocks
    if num_blocks is None:
        num_blocks = default_num_blocks(
            max_num_seqs=settings.max_num_seqs,
            max_model_len=max_model_len,
            block_size=settings.block_size,
            block_bytes=kv_cache_block_bytes(
                loaded.config, settings.block_size, torch_dtype, tp_size=tp.size
            ),
            memory_cap_bytes=settings.kv_cache_memory_bytes,
        )
    log.info(
        "model_loaded",
        model=settings.model,
        path=str(path),
        device=str(dev),
        dtype=str(torch_dtype).removeprefix("torch."),
        num_blocks=num_blocks,
        block_size=settings.block_size,
        rank=rank,
        shared=shared_model is not None,
        tp_size=tp.size,
        linear_kernel=loaded.linear_kernel,
    )
    return RunnerParts(
        settings=settings,
        loaded=loaded,
        device=dev,
        dtype=torch_dtype,
        num_blocks=num_blocks,
        rank=rank,
        tp=tp,
        graph_capture=capture,
    )
