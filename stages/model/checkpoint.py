"""Load a Hugging Face checkpoint directory into :class:`~stages.model.model.CausalLM`.

A directory holds ``config.json`` and either one or more ``*.safetensors`` files or a
sharded set listed by ``model.safetensors.index.json``. Keys are checked strictly:
a missing or unexpected weight, or a shape mismatch, is a
:class:`~pipeline.errors.ModelLoadError` that names the path and a few of the keys.
With a sharded :class:`~stages.model.parallel.TensorParallel`, only this rank's slice of
each split weight is read from disk. A projection stored fused (Phi-3's ``qkv_proj`` and
``gate_up_proj``, :data:`FUSED_PROJECTIONS`) is read as its parts, each one's rows (and
this rank's slice of them) straight from the stored matrix.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any, Final

import attrs
import torch
from safetensors import safe_open
from torch import nn

from pipeline.errors import ModelLoadError
from stages.model.config import ModelConfig, load_model_config
from stages.model.model import CausalLM
from stages.model.moe import SparseMoE
from stages.model.parallel import UNSHARDED, TensorParallel, shard_slice

__all__ = ["LoadedModel", "checkpoint_files", "load_model", "weights_identity"]

_INDEX = "model.safetensors.index.json"
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_SAMPLE_CHUNKS = 16
_CHUNK = 64 << 10


@attrs.frozen(kw_only=True, eq=False)
class LoadedModel:
    """A model ready to run, with what identifies it.

    Attributes:
        model: The module, in eval mode, weights on the target device and dtype.
        config: Its parsed configuration.
        path: The checkpoint directory.
        weights_id: A sha256 hex digest identifying config + weights (see
            :func:`weights_identity`); that of the whole checkpoint, the same on every
            tensor-parallel rank.
        linear_kernel: The kernel the decoder's projections run on
            (:mod:`stages.model.linear_kernels`): ``"mkl"`` as loaded, or the one
            :func:`~stages.model.runner_parts.load_parts` chose.
    """

    model: CausalLM
    config: ModelConfig
    path: Path
    weights_id: str
    linear_kernel: str = "mkl"


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, sorted.

    Raises:
        ModelLoadError: No safetensors file, or the index names a file that is absent.
    """
    index = path / _INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise ModelLoadError(path, f"{_INDEX} is unreadable: {exc!r}") from exc
        files = sorted({path / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(path, f"{_INDEX} lists missing shard(s): {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(path, "no *.safetensors weight files in the directory")
    return files


def weights_identity(path: Path, files: list[Path]) -> str:
    """A sha256 over ``config.json`` and each file's name, size, header and sampled bytes.

    Files up to 1 MiB are hashed whole; larger ones by their safetensors header plus
    16 chunks of 64 KiB spread over the data, which tells apart checkpoints of the same
    shapes (fine-tunes) without reading gigabytes. Blocks on disk I/O.
    """
    digest = hashlib.sha256((path / "config.json").read_bytes())
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with file.open("rb") as fh:
            if size <= _SAMPLE_CHUNKS * _CHUNK:
                digest.update(fh.read())
                continue
            (header_len,) = struct.unpack("<Q", fh.read(8))
            digest.update(fh.read(header_len))
            data_start = 8 + header_len
            span = max(size - data_start - _CHUNK, 0)
            for i in range(_SAMPLE_CHUNKS):
                fh.seek(data_start + span * i // (_SAMPLE_CHUNKS - 1))
                digest.update(fh.read(_CHUNK))
    return digest.hexdigest()


def _list_keys(path: Path, files: list[Path]) -> dict[str, Path]:
    where: dict[str, Path] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as fh:
                for key in fh.keys():  # noqa: SIM118  (safe_open is not a mapping)
                    if key in where:
                        raise ModelLoadError(
                            path, f"weight {key!r} is in both {where[key].name} and {file.name}"
                        )
                    where[key] = file
        except ModelLoadError:
            raise
        except Exception as exc:  # safetensors raises its own error types
            raise ModelLoadError(
                path, f"{file.name} is not a valid safetensors file: {exc}"
            ) from exc
    return where


#: Projections some checkpoints store as one matrix (Phi-3's ``qkv_proj`` and
#: ``gate_up_proj``), and the parts they stack, in row order.
FUSED_PROJECTIONS: Final = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def _part_rows(part: str, config: ModelConfig) -> int:
    if part.endswith("q_proj"):
        return config.num_attention_heads * config.head_dim
    if part.endswith(("k_proj", "v_proj")):
        return config.num_key_value_heads * config.head_dim
    return config.intermediate_size


def _fused_parts(where: dict[str, Path], config: ModelConfig) -> dict[str, tuple[str, int, int]]:
    """``{part's weight name: (stored fused key, first row, rows)}`` for every fused
    projection of the checkpoint (its weight and bias); their parts are added to
    ``where`` (same file) and the fused keys removed."""
    parts: dict[str, tuple[str, int, int]] = {}
    for key in [k for k in where if k.endswith((".weight", ".bias"))]:
        owner, _, attr = key.rpartition(".")
        for fused, names in FUSED_PROJECTIONS.items():
            if not owner.endswith("." + fused):
                continue
            prefix = owner[: -len(fused)]
            offset = 0
            for name in names:
                rows = _part_rows(name, config)
                parts[f"{prefix}{name}.{attr}"] = (key, offset, rows)
                offset += rows
    for name, (key, _, _) in parts.items():
        where[name] = where[key]
    for key in {key for key, _, _ in parts.values()}:
        del where[key]
    return parts


class _Rows:
    """Rows ``[offset, offset + rows)`` of stored tensor ``key`` of ``fh``, read as if
    they were a tensor of their own (``safe_open``'s ``get_tensor``/``get_slice`` API);
    a fused matrix whose row count is not the parts' sum is refused by shape."""

    def __init__(self, fh: Any, key: str, offset: int, rows: int) -> None:
        self.fh, self.key, self.offset, self.rows = fh, key, offset, rows

    def get_tensor(self, name: str) -> torch.Tensor:
        return self[(slice(0, self.rows),)]

    def get_slice(self, name: str) -> _Rows:
        return self

    def get_shape(self) -> list[int]:
        shape = list(self.fh.get_slice(self.key).get_shape())
        return [self.rows, *shape[1:]]

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        first, rest = index[0], index[1:]
        start = self.offset + (first.start or 0)
        stop = self.offset + (self.rows if first.stop is None else first.stop)
        out: torch.Tensor = self.fh.get_slice(self.key)[(slice(start, stop), *rest)]
        return out


def _check_fused(fh: Any, key: str, parts: list[tuple[str, int, int]], directory: Path) -> None:
    """A fused matrix must have exactly its parts' rows."""
    rows = sum(r for k, _, r in parts if k == key)
    shape = tuple(fh.get_slice(key).get_shape())
    if not shape or shape[0] != rows:
        raise ModelLoadError(
            directory, f"weight {key!r} has shape {shape}, the config needs {rows} rows"
        )


def _few(keys: set[str]) -> str:
    shown = sorted(keys)[:5]
    more = f" (and {len(keys) - len(shown)} more)" if len(keys) > len(shown) else ""
    return ", ".join(shown) + more


def _read(
    fh: Any,
    name: str,
    shape: tuple[int, ...],
    tp: TensorParallel,
    directory: Path,
    *,
    config: ModelConfig,
    vocab_split: bool = False,
) -> torch.Tensor:
    """Weight ``name`` (this rank's slice when split), after checking its on-disk shape."""
    where = shard_slice(name, config, tp, vocab_split=vocab_split)
    if where is None:
        tensor: torch.Tensor = fh.get_tensor(name)
        full: tuple[int, ...] = tuple(tensor.shape)
        if full != shape:
            raise ModelLoadError(
                directory, f"weight {name!r} has shape {full}, the config needs {shape}"
            )
        return tensor
    dim, start, length, whole = where
    part = fh.get_slice(name)
    full = tuple(part.get_shape())
    needed = (*shape[:dim], whole, *shape[dim + 1 :])
    if full != needed or length != shape[dim]:
        raise ModelLoadError(
            directory, f"weight {name!r} has shape {full}, the config needs {needed}"
        )
    index = (slice(None),) * dim + (slice(start, start + length),)
    sliced: torch.Tensor = part[index]
    return sliced


def load_model(
    path: str | Path,
    *,
    dtype: torch.dtype,
    device: torch.device,
    max_len: int,
    config: ModelConfig | None = None,
    tp: TensorParallel = UNSHARDED,
) -> LoadedModel:
    """Read the checkpoint at ``path`` (or rank ``tp.rank``'s shard of it) onto ``device``.

    Args:
        path: Checkpoint directory.
        dtype: Floating dtype of the weights (converted while loading).
        device: Target device.
        max_len: Length of the rotary table (the engine's ``max_model_len``).
        config: An already parsed config of ``path`` (parsed here when ``None``).
        tp: The tensor-parallel rank to load; split weights are read slice by slice
            (``safe_open(...).get_slice``), replicated ones whole.

    Raises:
        ModelLoadError: Bad directory or config, missing/unexpected weights, wrong shapes
            (a split weight's full on-disk shape is checked).
        InvalidConfigError: ``tp.size`` does not divide the model's heads or MLP width.

    Blocks on disk I/O; call it off the event loop.
    """
    directory = Path(path)
    config = config or load_model_config(directory)
    files = checkpoint_files(directory)
    where = _list_keys(directory, files)
    fused = _fused_parts(where, config)
    with torch.device("meta"):
        model = CausalLM(config, tp)
    params = dict(model.named_parameters())  # tied lm_head.weight appears once
    present = {k for k in where if not k.endswith(_IGNORED_SUFFIXES)}
    if config.tie_word_embeddings:
        present.discard("lm_head.weight")
    missing, unexpected = params.keys() - present, present - params.keys()
    if missing:
        raise ModelLoadError(directory, f"missing weights: {_few(missing)}")
    if unexpected:
        raise ModelLoadError(directory, f"unexpected weights: {_few(unexpected)}")
    by_file: dict[Path, list[str]] = {}
    for name in params:
        by_file.setdefault(where[name], []).append(name)
    for file, names in by_file.items():
        with safe_open(str(file), framework="pt") as fh:
            for key in {fused[n][0] for n in names if n in fused}:
                _check_fused(fh, key, list(fused.values()), directory)
            for name in names:
                tensor = _read(
                    fh if name not in fused else _Rows(fh, *fused[name]),
                    name,
                    tuple(params[name].shape),
                    tp,
                    directory,
                    config=config,
                    vocab_split=model.vocab_parallel,
                )
                owner, _, attr = name.rpartition(".")
                value = tensor.to(device=device, dtype=dtype)
                setattr(model.get_submodule(owner), attr, nn.Parameter(value, requires_grad=False))
    model.tie_weights()
    for module in model.modules():
        if isinstance(module, SparseMoE):
            module.pack()
    model.init_rope(max_len, device)
    model.eval()
    return LoadedModel(
        model=model,
        config=config,
        path=directory,
        weights_id=weights_identity(directory, files),
    )
