"""The model the worker stages drive: a Llama-family decoder over a paged KV cache, its
checkpoint loader, attention, sampling and compute thread.

``ModelRunner`` is the entry point the ``forward``, ``logits`` and ``sample`` stages use
(:mod:`stages.forward`, :mod:`stages.logits`, :mod:`stages.sample`), built from a
``RunnerSettings`` (derived once from ``EngineConfig``); the other names are its parts,
exported for tests, benchmarks and custom stages. ``TensorParallel`` and
``init_process_group`` shard the model across worker processes (Megatron-style).
"""

from pipeline.device_sync import (
    CpuDeviceSync,
    CudaDeviceSync,
    DeviceEvent,
    DeviceSync,
    make_device_sync,
)
from stages.model.attention import (
    AttentionMetadata,
    build_attention_metadata,
    paged_attention,
    sliding_window_metadata,
)
from stages.model.builtin import BUILTIN_MODELS, resolve_model_path
from stages.model.checkpoint import LoadedModel, load_model
from stages.model.config import (
    ROPE_TYPES,
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    RopeConfig,
    load_model_config,
)
from stages.model.cuda_graphs import DecodeGraphs
from stages.model.kv_cache import (
    allocate_kv_caches,
    default_num_blocks,
    kv_cache_block_bytes,
    local_kv_heads,
)
from stages.model.layers import LayerHooks
from stages.model.model import CausalLM
from stages.model.parallel import (
    TensorParallel,
    check_tp_divisible,
    destroy_process_group,
    init_process_group,
)
from stages.model.runner import ModelRunner
from stages.model.sampling import Sampler, request_seed
from stages.model.settings import RunnerSettings

__all__ = [
    "BUILTIN_MODELS",
    "ROPE_TYPES",
    "SUPPORTED_ARCHITECTURES",
    "AttentionMetadata",
    "CausalLM",
    "CpuDeviceSync",
    "CudaDeviceSync",
    "DecodeGraphs",
    "DeviceEvent",
    "DeviceSync",
    "LayerHooks",
    "LoadedModel",
    "ModelConfig",
    "ModelRunner",
    "RopeConfig",
    "RunnerSettings",
    "Sampler",
    "TensorParallel",
    "allocate_kv_caches",
    "build_attention_metadata",
    "check_tp_divisible",
    "default_num_blocks",
    "destroy_process_group",
    "init_process_group",
    "kv_cache_block_bytes",
    "load_model",
    "load_model_config",
    "local_kv_heads",
    "make_device_sync",
    "paged_attention",
    "request_seed",
    "resolve_model_path",
    "sliding_window_metadata",
]
