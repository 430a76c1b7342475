"""Loading HF checkpoints: config parsing, strict weights, sharding, identity."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import attrs
import msgspec
import pytest
import torch
from safetensors.torch import load_file, save_file

from connectors import ModelFingerprint
from pipeline.errors import ModelLoadError
from stages.model import ModelConfig, ModelRunner, load_model, load_model_config
from stages.model.checkpoint import weights_identity

CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parents[3]

HFGet = Callable[[str], tuple[Any, Path]]


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _llama_dict(**extra: object) -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 32,
        "hidden_size": 16,
        "intermediate_size": 24,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        **extra,
    }


class TestModelConfig:
    def test_defaults_and_derived_fields(self) -> None:
        """head_dim defaults to hidden/heads and kv heads to heads; one eos id."""
        cfg = ModelConfig.from_hf_dict(_llama_dict(eos_token_id=2))
        assert (cfg.head_dim, cfg.num_key_value_heads) == (8, 2)
        assert cfg.eos_token_ids == (2,)
        assert cfg.rope.rope_type == "default"

    def test_eos_list(self) -> None:
        """A list of eos ids is kept; eos_token_id is the first."""
        cfg = ModelConfig.from_hf_dict(_llama_dict(eos_token_id=[5, 7]))
        assert cfg.eos_token_ids == (5, 7)
        assert cfg.eos_token_id == 5

    def test_legacy_rope_scaling_layout(self) -> None:
        """transformers 4's rope_theta + rope_scaling{type} is understood."""
        cfg = ModelConfig.from_hf_dict(
            _llama_dict(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 4.0})
        )
        assert (cfg.rope.rope_type, cfg.rope.theta, cfg.rope.get("factor")) == (
            "linear",
            5e5,
            4.0,
        )

    def test_rope_parameters_layout(self) -> None:
        """transformers 5's rope_parameters is understood."""
        cfg = ModelConfig.from_hf_dict(
            _llama_dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0})
        )
        assert cfg.rope.rope_type == "yarn"
        assert cfg.rope.get("original_max_position_embeddings") == 4096

    def test_unsupported_rope_type(self) -> None:
        """An unknown rope type is refused, naming the supported ones."""
        with pytest.raises(ModelLoadError, match=r"'wobble'.*supported: default"):
            ModelConfig.from_hf_dict(_llama_dict(rope_scaling={"rope_type": "wobble"}))


class TestLongRopeConfig:
    """``longrope`` (Phi-3's ``su``) settings, read as transformers reads them."""

    SHORT: ClassVar[list[float]] = [1.0, 1.5, 1.25, 1.0]  # head_dim 8: four frequencies
    LONG: ClassVar[list[float]] = [2.0, 3.0, 4.0, 5.0]

    def _phi3(self, rope: dict[str, object], **extra: object) -> ModelConfig:
        return ModelConfig.from_hf_dict(
            _llama_dict(architectures=["Phi3ForCausalLM"], rope_scaling=rope, **extra)
        )

    def test_longrope_is_read(self) -> None:
        """short/long factors become tuples and the threshold is the config's top-level
        original_max_position_embeddings (it wins over the rope settings' own)."""
        cfg = self._phi3(
            {"type": "longrope", "short_factor": self.SHORT, "long_factor": self.LONG,
             "original_max_position_embeddings": 8},
            original_max_position_embeddings=32, max_position_embeddings=128,
        )  # fmt: skip
        assert cfg.rope.rope_type == "longrope"
        assert cfg.rope.get("short_factor") == (1.0, 1.5, 1.25, 1.0)
        assert cfg.rope.longrope_threshold == 32
        assert cfg.prefix_cache_key(32) is None
        assert cfg.prefix_cache_key(33) == "longrope:long"

    @pytest.mark.parametrize("alias", ["su", "yarn"])
    def test_phi3_aliases(self, alias: str) -> None:
        """Phi-3's ``su`` and ``yarn`` mean longrope (``Phi3Config`` maps them); without
        a top-level original_max_position_embeddings a Phi-3 config's is 4096."""
        cfg = self._phi3({"type": alias, "short_factor": self.SHORT, "long_factor": self.LONG,
                          "original_max_position_embeddings": 8})  # fmt: skip
        assert cfg.rope.rope_type == "longrope"
        assert cfg.rope.longrope_threshold == 4096

    def test_llama_yarn_stays_yarn(self) -> None:
        """Only Phi-3 reads ``yarn`` as longrope; others' threshold comes from the rope
        settings when the top level has none."""
        yarn_rope = {"rope_type": "yarn", "factor": 2.0}
        yarn = ModelConfig.from_hf_dict(_llama_dict(rope_scaling=yarn_rope))
        assert yarn.rope.rope_type == "yarn" and yarn.rope.longrope_threshold is None
        llama = ModelConfig.from_hf_dict(_llama_dict(rope_parameters={
            "rope_type": "longrope", "short_factor": self.SHORT, "long_factor": self.LONG,
            "original_max_position_embeddings": 8}))  # fmt: skip
        assert llama.rope.longrope_threshold == 8

    @pytest.mark.parametrize(
        ("name", "value"), [("short_factor", None), ("long_factor", [1.0]),
                            ("short_factor", [1.0, 1.0, 1.0, "x"])],
    )  # fmt: skip
    def test_bad_factors_refused(self, name: str, value: object) -> None:
        """Missing factors, or a list not of head_dim // 2 numbers, is refused naming it."""
        rope: dict[str, object] = {"type": "longrope", "short_factor": self.SHORT,
                                   "long_factor": self.LONG}  # fmt: skip
        rope[name] = value
        with pytest.raises(ModelLoadError, match=name):
            self._phi3(rope)

    def test_qwen2_has_qkv_bias(self) -> None:
        """Qwen2 always has q/k/v bias and no o_proj bias."""
        cfg = ModelConfig.from_hf_dict(_llama_dict(architectures=["Qwen2ForCausalLM"]))
        assert cfg.attention_bias and not cfg.o_proj_bias

    def test_qwen3_norms_query_and_key_heads_without_bias(self) -> None:
        """Qwen3: q/k RMSNorm per head, no q/k/v bias unless the config says so, and no
        sliding window unless ``use_sliding_window``."""
        cfg = ModelConfig.from_hf_dict(
            _llama_dict(architectures=["Qwen3ForCausalLM"], sliding_window=4096)
        )
        assert cfg.qk_norm and not cfg.attention_bias and cfg.sliding_window is None
        biased = ModelConfig.from_hf_dict(
            _llama_dict(architectures=["Qwen3ForCausalLM"], attention_bias=True)
        )
        assert biased.attention_bias and biased.o_proj_bias
        assert not ModelConfig.from_hf_dict(_llama_dict()).qk_norm

    @pytest.mark.parametrize(
        "fields",
        [{}, {"num_local_experts": 2, "num_experts_per_tok": 3},
         {"num_local_experts": "8", "num_experts_per_tok": 2}],
    )  # fmt: skip
    def test_mixtral_needs_a_sound_routing(self, fields: dict[str, Any]) -> None:
        with pytest.raises(ModelLoadError, match="num_experts_per_tok"):
            ModelConfig.from_hf_dict(_llama_dict(architectures=["MixtralForCausalLM"], **fields))
        good = _llama_dict(architectures=["MixtralForCausalLM"], num_local_experts=8,
                           num_experts_per_tok=2)  # fmt: skip
        cfg = ModelConfig.from_hf_dict(good)
        assert (cfg.num_experts, cfg.num_experts_per_tok) == (8, 2)

    def test_qwen3_moe_sparse_layers(self) -> None:
        """decoder_sparse_step and mlp_only_layers pick the mixture layers; either
        spelling of the expert count is read."""
        data = _llama_dict(architectures=["Qwen3MoeForCausalLM"], num_hidden_layers=6,
                           num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                           decoder_sparse_step=2, mlp_only_layers=[3])  # fmt: skip
        cfg = ModelConfig.from_hf_dict(data)
        assert cfg.sparse_layers == (1, 5) and cfg.moe_style == "qwen3_moe"
        assert cfg.expert_intermediate_size == 24 and not cfg.norm_topk_prob and cfg.qk_norm
        data["num_local_experts"] = data.pop("num_experts")
        assert ModelConfig.from_hf_dict(data).num_experts == 8

    @pytest.mark.parametrize(
        ("fields", "match"),
        [
            ({"partial_rotary_factor": 0.75}, "partial_rotary_factor=0.75"),
            ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                  "partial_rotary_factor": 0.5}}, "partial_rotary_factor=0.5"),
            ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ],
    )  # fmt: skip
    def test_what_the_layers_do_not_compute_is_refused(
        self, fields: dict[str, Any], match: str
    ) -> None:
        with pytest.raises(ModelLoadError, match=match):
            ModelConfig.from_hf_dict(_llama_dict(architectures=["Phi3ForCausalLM"], **fields))

    def test_unknown_architecture(self, tmp_path: Path) -> None:
        """An unsupported architecture names the path and the supported list."""
        (tmp_path / "config.json").write_text(
            json.dumps(_llama_dict(architectures=["GPT2LMHeadModel"]))
        )
        with pytest.raises(ModelLoadError, match=r"GPT2LMHeadModel.*LlamaForCausalLM") as info:
            load_model_config(tmp_path)
        assert info.value.path == tmp_path

    def test_missing_config_json(self, tmp_path: Path) -> None:
        """A directory without config.json is refused, naming the directory."""
        with pytest.raises(ModelLoadError, match=r"config\.json") as info:
            load_model_config(tmp_path)
        assert str(tmp_path) in str(info.value)

    def test_missing_directory(self, tmp_path: Path) -> None:
        """A path that does not exist is refused."""
        with pytest.raises(ModelLoadError, match="no such directory"):
            load_model_config(tmp_path / "nope")

    def test_sliding_window_shorter_than_context(self) -> None:
        """A sliding window below max_model_len is refused as unsupported."""
        cfg = ModelConfig.from_hf_dict(
            _llama_dict(architectures=["MistralForCausalLM"], sliding_window=128)
        )
        cfg.check_max_model_len(128, "m")
        with pytest.raises(ModelLoadError, match=r"sliding_window=128.*unsupported"):
            cfg.check_max_model_len(129, "m")


def _gemma3_dict(**extra: object) -> dict[str, object]:
    return {**_llama_dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text"),
            "num_hidden_layers": 3, "head_dim": 8, **extra}  # fmt: skip


S, F = "sliding_attention", "full_attention"


class TestGemma3Config:
    def test_transformers_defaults(self) -> None:
        """Unset fields take Gemma3TextConfig's defaults: every sixth layer full, window
        4096, thetas 1e6 (full) and 1e4 (sliding), scale 256 ** -0.5, tied, GeGLU(tanh)."""
        cfg = ModelConfig.from_hf_dict(_gemma3_dict(num_hidden_layers=7))
        assert cfg.layer_types == (S, S, S, S, S, F, S)
        assert cfg.sliding_layers == (0, 1, 2, 3, 4, 6) and cfg.sliding_window == 4096
        assert (cfg.rope.theta, cfg.sliding_rope and cfg.sliding_rope.theta) == (1e6, 1e4)
        assert cfg.attention_scale == 256**-0.5 and cfg.tie_word_embeddings
        assert cfg.hidden_act == "gelu_pytorch_tanh" and cfg.layer_style == "gemma3"
        assert cfg.qk_norm and cfg.final_logit_softcapping is None

    def test_transformers_4_layout_reads_as_transformers_5_writes_it(self) -> None:
        """sliding_window_pattern, rope_theta, rope_local_base_freq and rope_scaling
        (the full layers') give the config transformers 5 converts them to."""
        import transformers

        legacy = dict(num_hidden_layers=5, sliding_window=32, sliding_window_pattern=2,
                      rope_theta=5e5, rope_local_base_freq=2e4, query_pre_attn_scalar=12,
                      rope_scaling={"rope_type": "linear", "factor": 8.0})  # fmt: skip
        ours = ModelConfig.from_hf_dict(_gemma3_dict(**legacy))
        hf = transformers.Gemma3TextConfig(**{**_gemma3_dict(), **legacy}).to_dict()
        theirs = ModelConfig.from_hf_dict({**hf, "architectures": ["Gemma3ForCausalLM"]})
        assert "layer_types" in hf and "rope_parameters" in hf
        assert attrs.evolve(ours, torch_dtype=None) == attrs.evolve(theirs, torch_dtype=None)
        assert ours.layer_types == (S, F, S, F, S) and ours.layer_pattern == "SFSFS:32"
        assert (ours.rope.rope_type, ours.rope.get("factor"), ours.rope.theta) == (
            "linear", 8.0, 5e5)  # fmt: skip
        assert ours.sliding_rope is not None and ours.sliding_rope.theta == 2e4
        assert ours.attention_scale == 12**-0.5

    def test_all_full_layers_slide_nowhere(self) -> None:
        """Without a sliding layer there is no window and no layer pattern."""
        cfg = ModelConfig.from_hf_dict(_gemma3_dict(layer_types=[F, F, F], sliding_window=8))
        assert cfg.sliding_window is None and cfg.layer_pattern == "" and not cfg.sliding_layers

    def test_a_window_shorter_than_the_context_is_served(self) -> None:
        """Gemma 3's sliding layers are computed, so max_model_len may exceed the window
        (Mistral's whole-model window is still refused: test_sliding_window_...)."""
        cfg = ModelConfig.from_hf_dict(_gemma3_dict(layer_types=[S, F, S], sliding_window=8))
        cfg.check_max_model_len(4096, "<dict>")

    @pytest.mark.parametrize(
        ("fields", "match"),
        [
            ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
            ({"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
            ({"hidden_activation": "silu"}, "hidden_activation='silu'"),
            ({"rope_parameters": {F: {"rope_type": "yarn", "factor": 4.0}}},
             "rope_type='yarn' of the full_attention layers"),
            ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
             "rope_parameters=.* must map"),
            ({"layer_types": [S, F]}, "layer_types=.* each of the 3 layers"),
            ({"layer_types": [S, F, "chunked_attention"]}, "layer_types="),
            ({"sliding_window": None}, "sliding_window=None"),
            ({"rope_parameters": {S: {"rope_type": "default", "partial_rotary_factor": 0.5}}},
             "partial_rotary_factor=0.5"),
        ],
    )  # fmt: skip
    def test_what_the_layers_do_not_compute_is_refused(
        self, fields: dict[str, Any], match: str
    ) -> None:
        with pytest.raises(ModelLoadError, match=match):
            ModelConfig.from_hf_dict(_gemma3_dict(**fields))


class TestLayerPatternFingerprint:
    def _fingerprint(self, config: ModelConfig) -> ModelFingerprint:
        return ModelFingerprint(architecture=config.architecture, weights_id="w",
                                dtype="float32", block_size=16, kv_heads=2,
                                layer_pattern=config.layer_pattern)  # fmt: skip

    def test_configs_differing_only_in_layer_types_have_other_keys(self) -> None:
        """The same weights under another sliding pattern (or window) never share KV."""
        keys = {
            self._fingerprint(ModelConfig.from_hf_dict(_gemma3_dict(**fields))).key()
            for fields in ({"layer_types": [S, F, S], "sliding_window": 8},
                           {"layer_types": [S, S, F], "sliding_window": 8},
                           {"layer_types": [S, F, S], "sliding_window": 16},
                           {"layer_types": [F, F, F], "sliding_window": 8})
        }  # fmt: skip
        assert len(keys) == 4

    def test_no_pattern_keeps_the_keys_made_before_the_field(self) -> None:
        """layer_pattern="" is left out of the key, as kv_heads=0 is."""
        import hashlib

        def old_key(fields: tuple[object, ...]) -> str:
            return hashlib.sha256(msgspec.msgpack.encode(fields)).hexdigest()[:32]

        fp = ModelFingerprint(architecture="A", weights_id="w", dtype="float32", block_size=16)
        assert fp.key() == old_key(("A", "w", "float32", 16, 0, 1))
        with_heads = attrs.evolve(fp, kv_heads=2)
        assert with_heads.key() == old_key(("A", "w", "float32", 16, 0, 1, 2))
        assert attrs.evolve(with_heads, layer_pattern="SF:8").key() != with_heads.key()

    def test_the_runner_fingerprints_its_layer_pattern(self, hf_checkpoint: HFGet) -> None:
        _, path = hf_checkpoint("gemma3")
        runner = ModelRunner.load(str(path), device="cpu", num_blocks=8, max_model_len=64)
        try:
            assert runner.fingerprint.layer_pattern == "SFS:8"
        finally:
            runner.close()


class TestLoadModel:
    def test_loads_in_requested_dtype(self, hf_checkpoint: HFGet) -> None:
        """Weights are converted to the requested dtype and match the checkpoint."""
        hf_model, path = hf_checkpoint("llama_gqa")
        loaded = load_model(path, dtype=torch.bfloat16, device=CPU, max_len=64)
        q = loaded.model.get_parameter("model.layers.0.self_attn.q_proj.weight")
        assert q.dtype == torch.bfloat16
        ref = hf_model.model.layers[0].self_attn.q_proj.weight
        assert torch.equal(q, ref.to(torch.bfloat16))

    def test_tied_embeddings_share_storage(self, hf_checkpoint: HFGet) -> None:
        """With tie_word_embeddings, lm_head is the embedding matrix."""
        _, path = hf_checkpoint("llama_tied")
        model = load_model(path, dtype=torch.float32, device=CPU, max_len=64).model
        assert model.lm_head.weight is model.model.embed_tokens.weight

    def test_fresh_load_does_not_import_dynamo(self, hf_checkpoint: HFGet) -> None:
        """Building the meta model skips the embedding's random init, which on the meta
        device imports ``torch._dynamo`` (over a second in every worker process)."""
        _, path = hf_checkpoint("llama_gqa")
        code = (
            "import sys, torch\n"
            "if 'torch._dynamo' in sys.modules: sys.exit(3)\n"
            "from stages.model import load_model\n"
            f"load_model({str(path)!r}, dtype=torch.float32, device=torch.device('cpu'), "
            "max_len=64)\n"
            "sys.exit(int('torch._dynamo' in sys.modules))\n"
        )
        pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        proc = subprocess.run(
            [sys.executable, "-c", code],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": pythonpath},
            capture_output=True,
            text=True,
            timeout=120,
        )
        if proc.returncode == 3:
            pytest.skip("this torch imports torch._dynamo on import")
        assert proc.returncode == 0, proc.stderr

    def test_missing_weight(self, hf_checkpoint: HFGet, tmp_path: Path) -> None:
        """A missing weight is a ModelLoadError naming the key and the path."""
        path = _copy(hf_checkpoint("llama_gqa")[1], tmp_path / "m")
        state = load_file(path / "model.safetensors")
        del state["model.layers.1.mlp.up_proj.weight"]
        save_file(state, path / "model.safetensors")
        with pytest.raises(ModelLoadError, match=r"missing weights: model\.layers\.1\.mlp\.up"):
            load_model(path, dtype=torch.float32, device=CPU, max_len=64)

    def test_unexpected_weight(self, hf_checkpoint: HFGet, tmp_path: Path) -> None:
        """An extra weight is refused, naming it."""
        path = _copy(hf_checkpoint("llama_gqa")[1], tmp_path / "m")
        state = load_file(path / "model.safetensors")
        state["model.extra.weight"] = torch.zeros(2)
        save_file(state, path / "model.safetensors")
        with pytest.raises(ModelLoadError, match=r"unexpected weights: model\.extra\.weight"):
            load_model(path, dtype=torch.float32, device=CPU, max_len=64)

    def test_shape_mismatch(self, hf_checkpoint: HFGet, tmp_path: Path) -> None:
        """A weight of the wrong shape is refused with both shapes."""
        path = _copy(hf_checkpoint("llama_gqa")[1], tmp_path / "m")
        state = load_file(path / "model.safetensors")
        state["model.norm.weight"] = torch.ones(3)
        save_file(state, path / "model.safetensors")
        with pytest.raises(ModelLoadError, match=r"model\.norm\.weight.*\(3,\).*\(64,\)"):
            load_model(path, dtype=torch.float32, device=CPU, max_len=64)

    def test_a_fused_matrix_of_the_wrong_rows(self, hf_checkpoint: HFGet, tmp_path: Path) -> None:
        """Phi-3's qkv_proj must hold exactly q, k and v's rows."""
        path = _copy(hf_checkpoint("phi3")[1], tmp_path / "m")
        state = load_file(path / "model.safetensors")
        key = "model.layers.0.self_attn.qkv_proj.weight"
        state[key] = state[key][:-16].clone()
        save_file(state, path / "model.safetensors")
        with pytest.raises(ModelLoadError, match=r"qkv_proj\.weight.*\(112, 64\).*128 rows"):
            load_model(path, dtype=torch.float32, device=CPU, max_len=64)

    def test_no_weight_files(self, hf_checkpoint: HFGet, tmp_path: Path) -> None:
        """A directory with a config but no safetensors is refused."""
        path = tmp_path / "m"
        path.mkdir()
        shutil.copy(hf_checkpoint("llama_gqa")[1] / "config.json", path)
        with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
            load_model(path, dtype=torch.float32, device=CPU, max_len=64)

    def test_sharded_checkpoint(self, hf_checkpoint: HFGet, tmp_path: Path) -> None:
        """A sharded checkpoint (index + shards) loads the same weights."""
        hf_model, single = hf_checkpoint("llama_gqa")
        sharded = tmp_path / "sharded"
        hf_model.save_pretrained(sharded, max_shard_size="100KB")
        assert (sharded / "model.safetensors.index.json").is_file()
        assert len(list(sharded.glob("*.safetensors"))) > 1
        a = load_model(single, dtype=torch.float32, device=CPU, max_len=64).model
        b = load_model(sharded, dtype=torch.float32, device=CPU, max_len=64).model
        for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
            assert torch.equal(pa, pb), name

    def test_weights_identity(self, hf_checkpoint: HFGet, tmp_path: Path) -> None:
        """The weights id is stable for equal files and changes with the weights."""
        _, path = hf_checkpoint("llama_gqa")
        files = [path / "model.safetensors"]
        copy = _copy(path, tmp_path / "copy")
        assert weights_identity(path, files) == weights_identity(copy, [copy / files[0].name])
        state = load_file(copy / "model.safetensors")
        state["model.norm.weight"] = state["model.norm.weight"] + 1
        save_file(state, copy / "model.safetensors")
        assert weights_identity(path, files) != weights_identity(copy, [copy / files[0].name])

    def test_weights_identity_of_large_files(self, tmp_path: Path) -> None:
        """Files over 1 MiB are identified by header and sampled data, still by content."""
        weights = torch.arange(1 << 20, dtype=torch.float32)
        ids = []
        for name, tensor in (("a", weights), ("b", weights), ("c", weights * 0.5)):
            directory = tmp_path / name
            directory.mkdir()
            (directory / "config.json").write_text("{}")
            save_file({"w": tensor}, directory / "model.safetensors")
            ids.append(weights_identity(directory, [directory / "model.safetensors"]))
        assert ids[0] == ids[1]
        assert ids[0] != ids[2]
