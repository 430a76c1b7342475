"""The linear kernel of a CPU model (issue 27): chosen by timing or forced by
``KVSTEP_LINEAR_KERNEL``; every kernel keeps transformers' logits and greedy tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from test_forward_bf16 import BATCH, _hf_greedy, kvstep_greedy
from test_forward_logits import _check_against_hf
from torch import nn

from pipeline.errors import InvalidConfigError
from stages.model import ModelRunner
from stages.model import linear_kernels as lk

HFGet = Callable[[str], tuple[Any, Path]]
CPU = torch.device("cpu")
ONEDNN = pytest.mark.skipif("onednn" not in lk.available_kernels(CPU), reason="no oneDNN")


def _needs_onednn(dtype: torch.dtype) -> None:
    if "onednn" not in lk.available_kernels(CPU, dtype):
        pytest.skip(f"oneDNN cannot pack {dtype} on this CPU")


class TestPackedLinear:
    @ONEDNN
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("bias", [False, True])
    def test_equals_f_linear(self, dtype: torch.dtype, bias: bool) -> None:
        """A prepacked layer gives F.linear's output (fp32 to rounding), any row count."""
        _needs_onednn(dtype)
        torch.manual_seed(0)
        linear = nn.Linear(64, 96, bias=bias, dtype=dtype)
        packed = lk.PackedLinear(linear)
        for rows in (1, 7, 300):
            x = torch.randn(rows, 64, dtype=dtype)
            with torch.inference_mode():
                got, want = packed(x), linear(x)
            assert got.dtype == dtype and got.shape == want.shape
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol)


class TestFusedProjections:
    @ONEDNN
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("bias", [False, True])
    def test_parts_equal_their_own_linears(self, dtype: torch.dtype, bias: bool) -> None:
        """One GEMM for three projections: each part's columns are its F.linear (fp32 to
        rounding), called through the fused module or alone; its bias is its slice."""
        _needs_onednn(dtype)
        torch.manual_seed(0)
        linears = [nn.Linear(64, n, bias=bias, dtype=dtype) for n in (96, 32, 32)]
        fused = lk.FusedPackedLinear(linears)
        parts = [lk.PackedPart(fused, i) for i in range(3)]
        assert fused.sizes == (96, 32, 32) and not list(fused.children())
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        for rows in (1, 7, 300):
            x = torch.randn(rows, 64, dtype=dtype)
            with torch.inference_mode():
                together = fused(x).split(fused.sizes, -1)
                for linear, part, got in zip(linears, parts, together, strict=True):
                    want = linear(x)
                    for out in (got, part(x)):
                        assert out.shape == want.shape and out.dtype == dtype
                        assert torch.allclose(out.float(), want.float(), atol=tol, rtol=tol)
        for linear, part in zip(linears, parts, strict=True):
            if bias:
                assert part.bias is not None and torch.equal(part.bias, linear.bias.detach())
            else:
                assert part.bias is None

    @ONEDNN
    def test_onednn_packs_qkv_and_gate_up_once(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Every decoder layer gets one qkv and one gate/up GEMM (the old names are parts
        of them), its other projections packed alone, no loaded weight kept, and its
        references hand the fused GEMMs to the hot path."""
        monkeypatch.setenv(lk.ENV, "mkl")  # loaded as plain linears, packed below
        runner = ModelRunner.load("builtin:tiny", dtype="float32", device="cpu", num_blocks=8)
        try:
            layers = runner.model.model.layers
            loaded = {
                name: sum(getattr(layer.self_attn if name[0] in "qkvo" else layer.mlp, name)
                          .weight.numel() for layer in layers)
                for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                             "down_proj")
            }  # fmt: skip
            loaded["lm_head"] = runner.model.lm_head.weight.numel()
            changed = lk.apply_kernel(runner.model, "onednn")
            assert not runner.model.config.tie_word_embeddings
            assert changed == 7 * len(layers) + 1  # and the untied lm_head
            assert isinstance(runner.model.lm_head, lk.PackedLinear)
            for layer in layers:
                attn, mlp = layer.self_attn, layer.mlp
                assert isinstance(attn.qkv_proj, lk.FusedPackedLinear)
                assert isinstance(mlp.gate_up_proj, lk.FusedPackedLinear)
                for parent, names in ((attn, "qkv"), (mlp, ("gate", "up"))):
                    fused = parent.qkv_proj if parent is attn else parent.gate_up_proj
                    for i, n in enumerate(names):
                        part = getattr(parent, f"{n}_proj")
                        assert isinstance(part, lk.PackedPart) and part.fused is fused
                        assert part.index == i
                assert isinstance(attn.o_proj, lk.PackedLinear)
                assert isinstance(mlp.down_proj, lk.PackedLinear)
                assert not any(type(m) is nn.Linear for m in layer.modules())
                refs = attn.refs()
                assert refs[0] is attn.qkv_proj and refs[1] is None and refs[2] is None
                gate_up, up, _ = mlp.refs()
                assert gate_up is mlp.gate_up_proj and up is None
            packed = sum(m.packed.numel() for m in runner.model.modules() if hasattr(m, "packed"))
            assert packed == sum(loaded.values())  # packed once, nothing else held
        finally:
            runner.close()


@ONEDNN
def test_onednn_packs_each_expert_once(hf_checkpoint: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mixture's experts: gate/up one GEMM (the old names parts of it), down packed
    alone, no plain linear left but the router, the stacked weights released, and the
    block's output unchanged."""
    from stages.model.moe import Expert, SparseMoE

    monkeypatch.setenv(lk.ENV, "mkl")
    runner = ModelRunner.load(str(hf_checkpoint("mixtral")[1]), dtype="float32", device="cpu",
                              num_blocks=8)  # fmt: skip
    try:
        moe = runner.model.model.layers[0].block_sparse_moe
        assert isinstance(moe, SparseMoE)
        x = torch.randn(5, moe.gate.in_features)
        with torch.inference_mode():
            before = moe(x)
        experts = sum(e.parts()[0].weight.numel() * 3 for e in moe.experts)
        lk.apply_kernel(runner.model, "onednn")
        for e in moe.experts:
            assert isinstance(e, Expert) and isinstance(e.gate_up, lk.FusedPackedLinear)
            assert isinstance(e.w1, lk.PackedPart) and isinstance(e.w3, lk.PackedPart)
            assert isinstance(e.w2, lk.PackedLinear) and e.w13 is None
            assert not any(type(m) is nn.Linear for m in e.modules())
        assert moe._stacked is None and type(moe.gate) is nn.Linear
        packed = sum(m.packed.numel() for m in moe.modules() if hasattr(m, "packed"))
        assert packed == experts
        with torch.inference_mode():
            torch.testing.assert_close(moe(x), before, rtol=1e-4, atol=1e-5)
    finally:
        runner.close()


class TestChoice:
    def test_forced_by_the_environment(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """KVSTEP_LINEAR_KERNEL names the kernel; no timing is done."""
        monkeypatch.setenv(lk.ENV, "mkl")
        choice = lk.choose_kernel(nn.Module(), CPU, torch.float32)
        assert (choice.kernel, choice.forced, dict(choice.seconds)) == ("mkl", True, {})

    @pytest.mark.parametrize("value", ["fast", "cuBLAS", "1"])
    def test_an_unknown_kernel_is_refused(
        self, monkeypatch: pytest.MonkeyPatch, value: str
    ) -> None:
        monkeypatch.setenv(lk.ENV, value)
        with pytest.raises(InvalidConfigError, match=lk.ENV):
            lk.choose_kernel(nn.Module(), CPU, torch.float32)

    def test_a_kernel_this_machine_lacks_is_refused(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Forcing oneDNN where it is not available names what is."""
        monkeypatch.setenv(lk.ENV, "onednn")
        monkeypatch.setattr(lk, "available_kernels", lambda device, dtype: ("mkl",))
        with pytest.raises(InvalidConfigError, match="available: mkl"):
            lk.choose_kernel(nn.Module(), CPU, torch.float32)

    @ONEDNN
    def test_auto_times_every_candidate(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Unforced, each candidate is timed on the model's shapes and the fastest wins."""
        monkeypatch.delenv(lk.ENV, raising=False)
        runner = ModelRunner.load("builtin:tiny", dtype="float32", device="cpu", num_blocks=8)
        try:
            choice = lk.choose_kernel(runner.model, CPU, torch.float32)
        finally:
            runner.close()
        assert set(choice.seconds) == set(lk.KERNELS) and not choice.forced
        assert choice.kernel == min(choice.seconds, key=lambda k: choice.seconds[k])

    def test_a_dtype_onednn_cannot_pack_leaves_mkl(self, tmp_path: Path) -> None:
        """oneDNN capped at AVX2 (``ONEDNN_MAX_CPU_ISA``, what an AVX2-only CPU has)
        cannot pack bfloat16: a bfloat16 model loads on MKL untimed (the timing of the
        candidates raised in oneDNN's packing before), its ``linear_kernel_chosen`` log
        naming MKL the only candidate; float32 keeps both candidates, and
        forcing oneDNN for bfloat16 is refused naming the dtype and what is available."""
        script = tmp_path / "capped.py"
        script.write_text(
            "import json, os, torch\n"
            "from pipeline.errors import InvalidConfigError\n"
            "from stages.model import ModelRunner, linear_kernels as lk\n"
            "cpu = torch.device('cpu')\n"
            "out = {'float32': lk.available_kernels(cpu),\n"
            "       'bfloat16': lk.available_kernels(cpu, torch.bfloat16)}\n"
            "import structlog.testing\n"
            "os.environ[lk.ENV] = 'auto'\n"
            "with structlog.testing.capture_logs() as logs:\n"
            "    runner = ModelRunner.load('builtin:tiny', dtype='bfloat16', device='cpu',\n"
            "                              num_blocks=8)\n"
            "out['loaded'] = runner.linear_kernel\n"
            "out['logged'] = [e['candidates'] for e in logs\n"
            "                 if e['event'] == 'linear_kernel_chosen']\n"
            "runner.close()\n"
            "os.environ[lk.ENV] = 'onednn'\n"
            "try:\n"
            "    lk.choose_kernel(torch.nn.Module(), cpu, torch.bfloat16)\n"
            "except InvalidConfigError as exc:\n"
            "    out['forced'] = str(exc)\n"
            "print(json.dumps(out))\n"
        )
        env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
        done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                              text=True, cwd=Path(__file__).parents[3], timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        out = json.loads(done.stdout.strip().splitlines()[-1])
        assert out["bfloat16"] == ["mkl"] and out["loaded"] == "mkl"
        assert out["logged"] == [["mkl"]]  # the log says why oneDNN was not timed
        assert out["float32"] == list(lk.available_kernels(CPU))
        assert "for bfloat16; available: mkl" in out["forced"] and lk.ENV in out["forced"]

    def test_float16_loads_whichever_kernels_can_pack_it(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A float16 model loads with the kernel timed among those that pack float16 here
        (oneDNN needs AVX512-FP16 or AVX-NE-CONVERT: without them its load failed)."""
        monkeypatch.setenv(lk.ENV, "auto")
        runner = ModelRunner.load("builtin:tiny", dtype="float16", device="cpu", num_blocks=8)
        try:
            assert runner.linear_kernel in lk.available_kernels(CPU, torch.float16)
            assert next(runner.model.parameters()).dtype == torch.float16
        finally:
            runner.close()


@ONEDNN
@pytest.mark.parametrize("kernel", lk.KERNELS)
class TestEveryKernelKeepsTransformersResults:
    def test_fp32_logits(
        self, hf_checkpoint: HFGet, step_driver: Any, kernel: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Chunked prefill and decode logits within 1e-4 of transformers', greedy tokens
        equal, with the kernel forced; the runner reports it."""
        monkeypatch.setenv(lk.ENV, kernel)
        variants = ("llama_gqa", "llama_bias_head_dim", "qwen2_tied", "qwen3", "phi3", "mixtral",
                    "qwen3_moe", "gemma3")  # fmt: skip
        for variant in variants:
            _check_against_hf(hf_checkpoint, step_driver, variant, chunk=48)
        runner = ModelRunner.load("builtin:tiny", dtype="float32", device="cpu", num_blocks=8)
        try:
            assert runner.linear_kernel == kernel
            packed = [m for m in runner.model.modules() if isinstance(m, lk.PackedLinear)]
            assert bool(packed) == (kernel == "onednn")
        finally:
            runner.close()

    def test_bf16_greedy_tokens(
        self, hf_checkpoint: HFGet, kernel: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """bfloat16 greedy tokens equal transformers' bfloat16 with the kernel forced."""
        if kernel not in lk.available_kernels(CPU, torch.bfloat16):
            pytest.skip(f"{kernel} cannot pack bfloat16 on this CPU")
        monkeypatch.setenv(lk.ENV, kernel)
        _, path = hf_checkpoint("llama_gqa")
        gen = torch.Generator().manual_seed(3)
        batches = [torch.randint(1, 256, (BATCH, n), generator=gen) for n in (7, 33)]
        assert kvstep_greedy(path, batches) == [_hf_greedy(path, b) for b in batches]


@ONEDNN
def test_an_untied_head_is_packed_a_tied_one_is_not(
    hf_checkpoint: HFGet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """oneDNN takes an untied ``lm_head`` too; a tied one stays the embedding matrix (no
    second copy); both keep transformers' greedy tokens (the oracle tests above run with
    every kernel forced)."""
    monkeypatch.setenv(lk.ENV, "onednn")
    for variant, untied in (("llama_gqa", True), ("qwen2_tied", False)):
        _, path = hf_checkpoint(variant)
        runner = ModelRunner.load(str(path), dtype="float32", device="cpu", num_blocks=8)
        try:
            head = runner.model.lm_head
            assert isinstance(head, lk.PackedLinear) == untied, variant
            if untied:  # the loaded weight released: only the packed one is kept
                assert list(head.parameters()) == [] and head.packed.dtype == torch.float32
            else:
                assert head.weight is runner.model.model.embed_tokens.weight
        finally:
            runner.close()
