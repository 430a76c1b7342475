"""Tensor parallelism: sharded ranks in real gloo processes match the unsharded model."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from checkpoints import build_checkpoint
from ports import free_port
from safetensors import safe_open
from safetensors.torch import load_file
from tp_rank_worker import BLOCK_SIZE, MAX_MODEL_LEN, NUM_BLOCKS, run_scenario

from pipeline.errors import InvalidConfigError
from stages.model import (
    ModelConfig,
    ModelRunner,
    TensorParallel,
    check_tp_divisible,
    destroy_process_group,
    kv_cache_block_bytes,
)
from stages.model import linear_kernels as lk
from stages.model.parallel import RowParallelLinear, kv_head_range

REPO = Path(__file__).resolve().parents[3]
WORKER = Path(__file__).with_name("tp_rank_worker.py")
# (checkpoint, tp size) pairs checked against the unsharded model.
# llama_gqa at 4 ranks: more ranks than its 2 KV heads, each KV head held by 2 ranks.
CASES = [
    ("llama_gqa", 2),
    ("llama_gqa", 4),
    ("qwen2", 2),
    ("qwen3", 2),
    ("phi3", 2),
    ("mixtral", 2),
    ("qwen3_moe", 2),
    ("gemma3", 2),
    ("llama_bias", 2),
    ("llama_bias", 4),
]


@pytest.fixture(scope="module")
def tp_checkpoints(
    tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """Llama with GQA (4 heads, 2 KV), Qwen2 (qkv bias, tied) and a Llama with every bias.

    The last has 4 KV heads, so it also splits 4 ways.
    """
    bias = build_checkpoint(
        "llama",
        tmp_path_factory.mktemp("tp") / "llama_bias",
        seed=3,
        attention_bias=True,
        mlp_bias=True,
        num_key_value_heads=4,
    )
    return {
        "llama_gqa": tiny_checkpoints["llama"],
        "qwen2": tiny_checkpoints["qwen2"],
        "qwen3": tiny_checkpoints["qwen3"],
        "phi3": tiny_checkpoints["phi3"],
        "mixtral": tiny_checkpoints["mixtral"],
        "qwen3_moe": tiny_checkpoints["qwen3_moe"],
        "gemma3": tiny_checkpoints["gemma3"],
        "llama_bias": bias,
    }


def _spawn(world_size: int, items: list[str], out: Path) -> list[subprocess.Popen[str]]:
    """``world_size`` worker processes joined by gloo over loopback TCP."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "1",
    }
    if any(name == "lo" for _, name in socket.if_nameindex()):
        env["GLOO_SOCKET_IFNAME"] = "lo"
    common = ["--world-size", str(world_size), "--init-method", f"tcp://127.0.0.1:{free_port()}"]
    return [
        subprocess.Popen(
            [sys.executable, str(WORKER), "--rank", str(rank), *common, "--out", str(out), *items],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world_size)
    ]


@pytest.fixture(scope="module")
def tp_logits(
    tp_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[tuple[str, int], list[dict[str, torch.Tensor]]]:
    """Every rank's logits per (checkpoint, size), from processes spawned once.

    The four processes form one TP=4 group and two TP=2 groups (ranks 0-1 and 2-3).
    """
    out = tmp_path_factory.mktemp("tp-logits")
    world = max(size for _, size in CASES)
    items = [f"{name}:{size}={tp_checkpoints[name]}" for name, size in CASES]
    failures = []
    for proc in _spawn(world, items, out):
        try:
            _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        if proc.returncode != 0:
            failures.append(f"{proc.args[2:4]} exited {proc.returncode}:\n{err[-3000:]}")
    assert not failures, "\n".join(failures)
    return {
        (name, size): [
            load_file(out / f"{name}.tp{size}.group{rank // size}.rank{rank % size}.safetensors")
            for rank in range(world)
        ]
        for name, size in CASES
    }


def _load(path: Path, **kwargs: object) -> ModelRunner:
    return ModelRunner.load(
        str(path),
        device="cpu",
        dtype="float32",
        block_size=BLOCK_SIZE,
        num_blocks=NUM_BLOCKS,
        max_model_len=MAX_MODEL_LEN,
        **kwargs,  # type: ignore[arg-type]
    )


@pytest.fixture(scope="module")
def reference_logits(tp_checkpoints: dict[str, Path]) -> dict[str, dict[str, torch.Tensor]]:
    """The unsharded runner's logits of the same scenario, per checkpoint."""
    result = {}
    for name, path in tp_checkpoints.items():
        runner = _load(path)
        result[name] = run_scenario(runner)
        runner.close()
    return result


@pytest.fixture
def llama_shard(
    tp_checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> Iterator[ModelRunner]:
    """Rank 1 of 2 of the GQA Llama, loaded in-process (its reduce is a no-op), on the
    kernel that keeps the loaded weights (a prepacked one keeps no ``.weight`` to read)."""
    monkeypatch.setenv(lk.ENV, "mkl")
    runner = _load(tp_checkpoints["llama_gqa"], rank=1, world_size=2, tp=TensorParallel(1, 2))
    yield runner
    runner.close()


class TestShardedLogits:
    @pytest.mark.parametrize(("name", "size"), CASES, ids=[f"{n}-tp{s}" for n, s in CASES])
    def test_every_rank_matches_unsharded(
        self,
        name: str,
        size: int,
        tp_logits: dict[tuple[str, int], list[dict[str, torch.Tensor]]],
        reference_logits: dict[str, dict[str, torch.Tensor]],
    ) -> None:
        """Each rank's logits of prefill, mixed and decode steps equal the whole model's."""
        reference = reference_logits[name]
        assert set(reference) == {"0.a", "1.a", "1.b", "2.a", "2.b"}
        for process, logits in enumerate(tp_logits[(name, size)]):
            assert logits.keys() == reference.keys(), process
            for key, expected in reference.items():
                torch.testing.assert_close(
                    logits[key], expected, atol=1e-5, rtol=0, msg=f"process {process} {key}"
                )


class TestShardLayout:
    def test_projection_shapes_are_the_shards(self, llama_shard: ModelRunner) -> None:
        """q/k/v/gate/up hold a slice of their rows, o_proj/down_proj a slice of columns,
        an untied lm_head its share of the vocabulary."""
        attn = llama_shard.model.model.layers[0].self_attn
        mlp = llama_shard.model.model.layers[0].mlp
        assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
        assert attn.q_proj.weight.shape == (2 * 16, 64)
        assert attn.k_proj.weight.shape == (1 * 16, 64)
        assert attn.v_proj.weight.shape == (1 * 16, 64)
        assert attn.o_proj.weight.shape == (64, 2 * 16)
        assert mlp.gate_proj.weight.shape == (64, 64)
        assert mlp.down_proj.weight.shape == (64, 64)
        assert isinstance(attn.o_proj, RowParallelLinear)
        assert llama_shard.model.vocab_parallel
        assert llama_shard.model.lm_head.weight.shape == (128, 64)

    def test_rank_reads_its_own_slice(
        self, llama_shard: ModelRunner, tp_checkpoints: dict[str, Path]
    ) -> None:
        """Rank 1 holds the second half of the split dimension of each split weight."""
        params = dict(llama_shard.model.named_parameters())
        file = tp_checkpoints["llama_gqa"] / "model.safetensors"
        with safe_open(str(file), framework="pt") as fh:
            full = {name: fh.get_tensor(name) for name in params}
        prefix = "model.layers.1."
        assert torch.equal(
            params[prefix + "self_attn.k_proj.weight"],
            full[prefix + "self_attn.k_proj.weight"][16:],
        )
        assert torch.equal(
            params[prefix + "self_attn.o_proj.weight"],
            full[prefix + "self_attn.o_proj.weight"][:, 32:],
        )
        assert torch.equal(
            params[prefix + "mlp.down_proj.weight"], full[prefix + "mlp.down_proj.weight"][:, 64:]
        )
        assert torch.equal(params["model.norm.weight"], full["model.norm.weight"])
        assert torch.equal(params["lm_head.weight"], full["lm_head.weight"][128:])

    def test_kv_cache_holds_local_heads(self, llama_shard: ModelRunner) -> None:
        """The shard's KV cache has num_kv_heads / size heads and is sized for them."""
        cfg = llama_shard.model_config
        assert all(c.shape == (2, NUM_BLOCKS, BLOCK_SIZE, 1, 16) for c in llama_shard.kv_caches)
        whole = kv_cache_block_bytes(cfg, BLOCK_SIZE, torch.float32)
        assert kv_cache_block_bytes(cfg, BLOCK_SIZE, torch.float32, tp_size=2) * 2 == whole

    def test_fingerprint_tells_shard_from_virtual_rank(
        self, llama_shard: ModelRunner, tp_checkpoints: dict[str, Path]
    ) -> None:
        """A TP shard and an in-process rank of the same rank/size have different keys."""
        virtual = _load(tp_checkpoints["llama_gqa"], rank=1, world_size=2)
        try:
            assert (llama_shard.fingerprint.kv_heads, virtual.fingerprint.kv_heads) == (1, 2)
            assert llama_shard.fingerprint.weights_id == virtual.fingerprint.weights_id
            assert llama_shard.fingerprint.key() != virtual.fingerprint.key()
            assert (llama_shard.tp, virtual.tp) == (TensorParallel(1, 2), TensorParallel())
        finally:
            virtual.close()

    def test_row_bias_is_replicated(self, tp_checkpoints: dict[str, Path]) -> None:
        """A row-split layer keeps its full bias (added once, after the reduce)."""
        runner = _load(tp_checkpoints["llama_bias"], rank=0, world_size=4, tp=TensorParallel(0, 4))
        try:
            layer = runner.model.model.layers[0]
            assert layer.self_attn.o_proj.bias.shape == (64,)
            assert layer.mlp.down_proj.bias.shape == (64,)
            assert layer.self_attn.q_proj.bias.shape == (16,)
            assert layer.mlp.up_proj.bias.shape == (32,)
        finally:
            runner.close()

    def test_unsharded_model_uses_plain_linears(self, tp_checkpoints: dict[str, Path]) -> None:
        """Without sharding nothing in the model reduces (the hot path is unchanged)."""
        runner = _load(tp_checkpoints["llama_gqa"])
        try:
            assert not any(isinstance(m, RowParallelLinear) for m in runner.model.modules())
        finally:
            runner.close()


class TestRunnerChecks:
    def test_tp_rank_must_match(self, tp_checkpoints: dict[str, Path]) -> None:
        """A tp whose rank differs from the runner's rank is refused."""
        with pytest.raises(InvalidConfigError, match=r"tp\.rank=0"):
            _load(tp_checkpoints["llama_gqa"], rank=1, world_size=2, tp=TensorParallel(0, 2))

    def test_tp_size_must_match(self, tp_checkpoints: dict[str, Path]) -> None:
        """A tp whose size differs from world_size is refused."""
        with pytest.raises(InvalidConfigError, match=r"tp\.size=2"):
            _load(tp_checkpoints["llama_gqa"], rank=0, world_size=1, tp=TensorParallel(0, 2))

    def test_shared_model_with_sharded_tp_is_refused(self, tp_checkpoints: dict[str, Path]) -> None:
        """Sharing weights and sharding them are exclusive."""
        first = _load(tp_checkpoints["llama_gqa"])
        try:
            with pytest.raises(InvalidConfigError, match="shared_model"):
                _load(
                    tp_checkpoints["llama_gqa"],
                    rank=1,
                    world_size=2,
                    tp=TensorParallel(1, 2),
                    shared_model=first,
                )
        finally:
            first.close()

    def test_indivisible_world_size_is_refused_before_loading(
        self, tp_checkpoints: dict[str, Path]
    ) -> None:
        """Three ranks cannot split four query heads."""
        with pytest.raises(InvalidConfigError, match="num_attention_heads=4"):
            _load(tp_checkpoints["llama_gqa"], rank=0, world_size=3, tp=TensorParallel(0, 3))


def _config(heads: int, kv_heads: int, inter: int) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=32,
        hidden_size=heads * 8,
        intermediate_size=inter,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=8,
    )


class TestCheckDivisible:
    @pytest.mark.parametrize(
        ("heads", "kv_heads", "inter", "size", "field"),
        [
            (6, 2, 48, 4, "num_attention_heads=6"),
            (12, 4, 48, 6, "num_key_value_heads=4"),
            (4, 4, 30, 4, "intermediate_size=30"),
        ],
    )
    def test_names_the_size_and_the_model_field(
        self, heads: int, kv_heads: int, inter: int, size: int, field: str
    ) -> None:
        """An indivisible head count or MLP width names world_size and the model field."""
        with pytest.raises(InvalidConfigError, match=f"world_size={size}: must divide {field}"):
            check_tp_divisible(_config(heads, kv_heads, inter), size)

    def test_divisible_sizes_pass(self) -> None:
        """Sizes that split heads, KV heads and MLP width evenly are accepted, and so are
        multiples of the KV head count (each KV head is then replicated)."""
        for size in (1, 2, 4, 8):
            check_tp_divisible(_config(8, 4, 64), size)

    def test_ranks_past_the_kv_heads_share_them(self) -> None:
        """With 8 ranks and 2 KV heads, ranks 0-3 hold KV head 0 and ranks 4-7 head 1:
        the head their query heads attend to."""
        config = _config(8, 2, 64)
        heads = [kv_head_range(config, TensorParallel(r, 8)) for r in range(8)]
        assert heads == [(0, 1)] * 4 + [(1, 2)] * 4

    def test_size_must_be_positive(self) -> None:
        """A size below one is refused."""
        with pytest.raises(InvalidConfigError, match="world_size=0"):
            check_tp_divisible(_config(8, 4, 64), 0)


class TestTensorParallel:
    def test_default_is_unsharded_and_reduce_is_identity(self) -> None:
        """TensorParallel() is rank 0 of 1; reduce returns the same tensor unchanged."""
        tp = TensorParallel()
        x = torch.arange(3.0)
        assert (tp.rank, tp.size, tp.sharded) == (0, 1, False)
        assert tp.reduce(x) is x and x.tolist() == [0.0, 1.0, 2.0]

    def test_reduce_calls_the_group_reduce_in_place(self) -> None:
        """reduce() hands the tensor to all_reduce and returns it."""
        tp = TensorParallel(1, 2, all_reduce=lambda t: t.mul_(2))
        x = torch.ones(2)
        assert tp.sharded and tp.reduce(x) is x and x.tolist() == [2.0, 2.0]

    @pytest.mark.parametrize(("rank", "size", "field"), [(2, 2, "rank"), (0, 0, "world_size")])
    def test_bad_rank_or_size_is_refused(self, rank: int, size: int, field: str) -> None:
        """A rank outside [0, size) or a size below one is an InvalidConfigError."""
        with pytest.raises(InvalidConfigError, match=f"{field}="):
            TensorParallel(rank, size)

    def test_from_process_group_needs_an_initialised_group(self) -> None:
        """Without init_process_group there is no group to build from."""
        destroy_process_group()  # a no-op when none is initialised
        with pytest.raises(InvalidConfigError, match="process_group"):
            TensorParallel.from_process_group()
