"""Adapter directories are hostile input: each malformed one is refused by name, before
any tensor is used."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoints import build_checkpoint
from lora_adapters import ADAPTERS, build_adapter
from safetensors.torch import load_file, save_file

from pipeline.errors import InvalidRequestError
from pipeline.lora import LoRAAdapter, LoRARequest
from stages.model import lora_files
from stages.model.config import load_model_config
from stages.model.lora_files import cached_adapter, read_adapter, resolve_adapter

A_Q0 = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
B_V1 = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("lora_files")
    base = build_checkpoint("llama", root / "base")
    return base, build_adapter(base, root / "qv", **ADAPTERS["qv"])


@pytest.fixture
def adapter(made: tuple[Path, Path], tmp_path: Path) -> Path:
    """A fresh copy of the good q/v adapter, to spoil."""
    return Path(shutil.copytree(made[1], tmp_path / "adapter"))


def read(made: tuple[Path, Path], path: Path, max_rank: int = 16) -> Any:
    config = load_model_config(made[0])
    return read_adapter(LoRARequest("a", 1, str(path)), config, max_rank=max_rank)


def edit_config(path: Path, **fields: Any) -> None:
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg.update(fields)
    (path / "adapter_config.json").write_text(json.dumps(cfg))


def edit_weights(path: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(path / "adapter_model.safetensors")
    change(tensors)
    save_file(tensors, path / "adapter_model.safetensors")


class TestGoodAdapter:
    def test_reads_what_peft_saved(self, made: tuple[Path, Path], adapter: Path) -> None:
        """Rank, scaling (alpha / r), targets and one pair per layer and target."""
        weights = read(made, adapter)
        assert (weights.rank, weights.scaling, weights.targets) == (8, 2.0, ("q_proj", "v_proj"))
        assert sorted(weights.tensors) == [(0, "q_proj"), (0, "v_proj"), (1, "q_proj"),
                                           (1, "v_proj")]  # fmt: skip
        a, b = weights.tensors[0, "q_proj"]
        assert a.shape == (8, 64) and b.shape == (64, 8)

    def test_content_id_follows_the_bytes(self, made: tuple[Path, Path], adapter: Path) -> None:
        """Another weight, or another alpha, is another content id; a copy is the same."""
        first = read(made, adapter).content_id
        assert read(made, adapter).content_id == first
        edit_config(adapter, lora_alpha=17)
        assert read(made, adapter).content_id != first
        edit_config(adapter, lora_alpha=16)
        edit_weights(adapter, lambda t: t[A_Q0].mul_(2))
        assert read(made, adapter).content_id != first

    def test_regex_targets(self, made: tuple[Path, Path], adapter: Path) -> None:
        """A regular expression ``target_modules`` is matched against each projection's
        name, as peft does."""
        edit_config(adapter, target_modules=r".*(q|v)_proj")
        assert read(made, adapter).targets == ("q_proj", "v_proj")

    def test_a_worker_refuses_changed_files(self, made: tuple[Path, Path], adapter: Path) -> None:
        """A worker (empty cache) reading the directory after the engine checked it
        refuses other bytes than the engine's content id names."""
        config = load_model_config(made[0])
        resolved = resolve_adapter(LoRARequest("a", 1, str(adapter)), config, max_rank=16)
        assert isinstance(resolved, LoRAAdapter)
        lora_files._cache.clear()
        assert cached_adapter(resolved, config, max_rank=16).content_id == resolved.content_id
        lora_files._cache.clear()
        edit_weights(adapter, lambda t: t[A_Q0].add_(1))
        with pytest.raises(InvalidRequestError, match="changed since"):
            cached_adapter(resolved, config, max_rank=16)


SPOILED_CONFIGS = [
    ({"peft_type": "PREFIX_TUNING"}, "only LORA"),
    ({"r": 32}, r"r=32: must be an int in \[1, max_lora_rank=16\]"),
    ({"r": "8"}, "r='8'"),
    ({"lora_alpha": -1}, "lora_alpha=-1"),
    ({"use_dora": True}, "use_dora=True is not supported"),
    ({"bias": "all"}, "bias='all' is not supported"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"layers_to_transform": [0]}, "layers_to_transform"),
    ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, r"\['embed_tokens'\] cannot be applied"),
    ({"target_modules": ["qkv_proj"]}, "qkv_proj"),
    ({"target_modules": 3}, "must be a list of names or a regex"),
    ({"target_modules": "(("}, "not a valid regex"),
]


class TestRefused:
    @pytest.mark.parametrize(("fields", "message"), SPOILED_CONFIGS)
    def test_configuration(
        self, made: tuple[Path, Path], adapter: Path, fields: dict[str, Any], message: str
    ) -> None:
        """Each configuration kvstep cannot apply as peft would is refused, naming the
        field and value."""
        edit_config(adapter, **fields)
        with pytest.raises(InvalidRequestError, match=message):
            read(made, adapter)

    def test_not_json(self, made: tuple[Path, Path], adapter: Path) -> None:
        (adapter / "adapter_config.json").write_text("{not json")
        with pytest.raises(InvalidRequestError, match="is not JSON"):
            read(made, adapter)

    def test_pickle_only(self, made: tuple[Path, Path], adapter: Path) -> None:
        """A directory with only ``adapter_model.bin`` (a pickle) is refused unread."""
        (adapter / "adapter_model.safetensors").rename(adapter / "adapter_model.bin")
        with pytest.raises(InvalidRequestError, match="is a pickle"):
            read(made, adapter)

    def test_not_safetensors(self, made: tuple[Path, Path], adapter: Path) -> None:
        (adapter / "adapter_model.safetensors").write_bytes(b"\x08" + b"\x00" * 7 + b"{junk")
        with pytest.raises(InvalidRequestError, match="is not a safetensors file"):
            read(made, adapter)

    def test_larger_than_its_shapes_need(self, made: tuple[Path, Path], adapter: Path) -> None:
        """A file far larger than the configured shapes need is refused before parsing."""
        edit_weights(adapter, lambda t: t.update(pad=torch.zeros(1 << 19)))
        with pytest.raises(InvalidRequestError, match="larger than"):
            read(made, adapter)

    @pytest.mark.parametrize(
        ("change", "message"),
        [
            (lambda t: t.update({A_Q0: torch.zeros(8, 65)}), r"\(8, 65\).*expected \(8, 64\)"),
            (lambda t: t.update({A_Q0: t[A_Q0].to(torch.int32)}), "torch.int32"),
            (lambda t: t[A_Q0].__setitem__((0, 0), float("nan")), "NaN or infinity"),
            (lambda t: t.pop(B_V1), "layer 1 v_proj: lora_A and lora_B are both needed"),
            (
                lambda t: t.update({B_V1.replace("1.", "7.", 1): t[B_V1].clone()}),
                "unexpected tensor",
            ),
            (lambda t: t.update({"lm_head.weight": torch.zeros(2)}), "unexpected tensor"),
            (
                lambda t: t.update({A_Q0.replace("q_proj", "k_proj"): t[A_Q0].clone()}),
                "unexpected tensor",
            ),
        ],
    )
    def test_tensors(
        self, made: tuple[Path, Path], adapter: Path, change: Any, message: str
    ) -> None:
        """A wrong shape or dtype, a non-finite value, a missing half, a layer the
        model lacks, a tensor of an untargeted or unknown module: refused by name."""
        edit_weights(adapter, change)
        with pytest.raises(InvalidRequestError, match=message):
            read(made, adapter)

    def test_not_a_directory(self, made: tuple[Path, Path], tmp_path: Path) -> None:
        with pytest.raises(InvalidRequestError, match="is not a directory"):
            read(made, tmp_path / "missing")

    def test_mixture_of_experts_mlp(self, tmp_path: Path, adapter: Path) -> None:
        """A mixture of experts has no single gate/up/down: only attention targets."""
        moe = build_checkpoint("mixtral", tmp_path / "moe")
        config = load_model_config(moe)
        edit_config(adapter, target_modules=["q_proj", "down_proj"])
        with pytest.raises(InvalidRequestError, match=r"\['down_proj'\] cannot be applied"):
            read_adapter(LoRARequest("a", 1, str(adapter)), config, max_rank=16)
