"""The forward pass compiled by ``torch.compile`` (issue 27): transformers' logits and
greedy tokens with every linear kernel, the step's attention, hooks and cache through the
opaque op, and an eager pass, with one warning saying why, where it cannot compile."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch
from test_forward_bf16 import PROMPT_LENS, _hf_greedy
from test_forward_logits import _check_against_hf

from stages.model import ModelRunner
from stages.model import compiled_forward as cf
from stages.model import linear_kernels as lk
from stages.model.layers import swiglu
from stages.model.rope import apply_rotary

HFGet = Callable[[str], tuple[Any, Path]]
CPU = torch.device("cpu")
ONEDNN_BF16 = pytest.mark.skipif(
    "onednn" not in lk.available_kernels(CPU, torch.bfloat16),
    reason="oneDNN cannot pack bfloat16 on this CPU",
)


def _warnings(logs: list[dict[str, Any]], event: str) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == event and e["log_level"] == "warning"]


def _compiled_passes(runner: ModelRunner) -> int:
    forward = runner._forward
    assert isinstance(forward, cf.CompiledForward)
    return forward.passes


@pytest.mark.slow
class TestTransformersOracle:
    @pytest.mark.parametrize(
        ("variant", "kernel"),
        [("llama_gqa", "mkl"), ("llama_gqa", "onednn"), ("llama_bias_head_dim", "onednn"),
         ("qwen3", "onednn"), ("phi3", "onednn")],
    )  # fmt: skip
    def test_fp32_logits(
        self,
        hf_checkpoint: HFGet,
        step_driver: Any,
        monkeypatch: pytest.MonkeyPatch,
        variant: str,
        kernel: str,
    ) -> None:
        """Chunked prefill and decode (mixed steps and lone decodes) through the compiled
        graph: logits within 1e-4 of transformers', greedy tokens equal, every pass
        compiled, nothing warned."""
        if kernel not in lk.available_kernels(CPU):
            pytest.skip(f"no {kernel}")
        monkeypatch.setenv(lk.ENV, kernel)
        with structlog.testing.capture_logs() as logs:
            runner = _check_against_hf(
                hf_checkpoint, step_driver, variant, chunk=48, torch_compile=True
            )
        assert runner.compiled and _compiled_passes(runner) > 0
        assert runner.linear_kernel == kernel
        assert not _warnings(logs, "torch_compile_fallback")
        assert [e for e in logs if e["event"] == "torch_compiled"]

    @ONEDNN_BF16
    @pytest.mark.parametrize("variant", ["llama_gqa", "qwen3"])
    def test_bf16_greedy_tokens(
        self, hf_checkpoint: HFGet, step_driver: Any, monkeypatch: pytest.MonkeyPatch,
        variant: str,
    ) -> None:  # fmt: skip
        """bfloat16, prepacked oneDNN projections, compiled: transformers' bfloat16
        greedy tokens for each prompt length (a batch of two, decoded together)."""
        monkeypatch.setenv(lk.ENV, "onednn")
        _, path = hf_checkpoint(variant)
        runner = ModelRunner.load(str(path), dtype="bfloat16", device="cpu", num_blocks=128,
                                  max_model_len=512, torch_compile=True)  # fmt: skip
        try:
            gen = torch.Generator().manual_seed(3)
            for n in PROMPT_LENS:
                prompts = torch.randint(1, 256, (2, n), generator=gen)
                driver = step_driver(runner, chunk=512)
                for i, prompt in enumerate(prompts.tolist()):
                    driver.add(f"{n}-{i}", prompt)
                driver.run(16)
                got = [driver.outputs(f"{n}-{i}")[:16] for i in range(2)]
                for req_id in driver.tokens:  # free the blocks for the next batch
                    runner.execute(_finish(driver, req_id))
                assert got == _hf_greedy(path, prompts), f"prompt length {n}"
            assert runner.compiled and _compiled_passes(runner) > 0
        finally:
            runner.close()


def _finish(driver: Any, req_id: str) -> Any:
    from pipeline.artifacts import SchedulerOutput

    driver.step_id += 1
    finished = frozenset({req_id})
    return SchedulerOutput(step_id=driver.step_id, requests=(), finished_req_ids=finished)


class TestPointwiseForms:
    """The rotary embedding and the SwiGLU product have a form of their own under
    ``torch.compile`` (one parallel loop each for inductor): bit for bit the eager one's,
    in bfloat16 and float32, at a decode step's rows and a prefill's."""

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
    def test_rotary_equals_eager(self, dtype: torch.dtype) -> None:
        gen = torch.Generator().manual_seed(0)
        table = torch.randn(64, 64, generator=gen), torch.randn(64, 64, generator=gen)

        def rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            cos, sin = (t.index_select(0, positions).to(dtype)[:, None, :] for t in table)
            return apply_rotary(x, cos, sin)

        compiled = torch.compile(rotate, dynamic=True, options=cf._INDUCTOR)
        for rows in (1, 3, 40):
            x = torch.randn(rows, 4, 64, generator=gen).to(dtype)
            positions = torch.randint(0, 64, (rows,), generator=gen)
            assert torch.equal(compiled(x, positions), rotate(x, positions)), rows

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
    def test_packed_swiglu_equals_eager(self, dtype: torch.dtype) -> None:
        # Identity projections: the pointwise part alone (inductor may sum a one-row
        # GEMM in another order than the eager kernel, which is not this test's subject).
        gen = torch.Generator().manual_seed(1)
        identity = torch.nn.Identity()

        def mlp(gate_up: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
            return swiglu((identity, None, identity), gate_up, residual)

        compiled = torch.compile(mlp, dynamic=True, options=cf._INDUCTOR)
        for rows in (1, 3, 40):
            gate_up = torch.randn(rows, 2 * 96, generator=gen).to(dtype)
            residual = torch.randn(rows, 96, generator=gen).to(dtype)
            eager = mlp(gate_up.clone(), residual)  # in place, in its own copy
            assert torch.equal(compiled(gate_up, residual), eager), rows


class TestEager:
    def test_off_by_default(self) -> None:
        runner = ModelRunner.load("builtin:tiny", device="cpu", num_blocks=8)
        try:
            assert not runner.compiled and runner._forward is runner.model
        finally:
            runner.close()

    def test_ineligible_model_runs_eagerly_with_one_warning(
        self, hf_checkpoint: HFGet, step_driver: Any
    ) -> None:
        """A mixture of experts is not compiled: its pass runs eagerly (transformers'
        logits still), and one warning names why."""
        with structlog.testing.capture_logs() as logs:
            runner = _check_against_hf(
                hf_checkpoint, step_driver, "mixtral", chunk=48, torch_compile=True
            )
        assert not runner.compiled and runner._forward is runner.model
        (warning,) = _warnings(logs, "torch_compile_fallback")
        assert "mixture-of-experts" in warning["reason"] and warning["forward"] == "eager"

    @pytest.mark.parametrize(
        ("change", "reason"),
        [(dict(device=torch.device("meta")), "CPU only"),
         (dict(lora=True), "LoRA"), (dict(tp_size=2), "tensor parallel size 2")],
    )  # fmt: skip
    def test_reasons(self, change: dict[str, Any], reason: str) -> None:
        from stages.model.parallel import TensorParallel

        runner = ModelRunner.load("builtin:tiny", device="cpu", num_blocks=8)
        try:
            tp = TensorParallel(rank=0, size=change.get("tp_size", 1))
            got = cf.ineligible(runner.model, change.get("device", CPU), tp,
                                change.get("lora", False))  # fmt: skip
            assert got is not None and reason in got
            assert cf.ineligible(runner.model, CPU, TensorParallel(), False) is None
        finally:
            runner.close()

    @pytest.mark.slow
    def test_a_failed_compilation_runs_eagerly_with_one_warning(
        self, monkeypatch: pytest.MonkeyPatch, hf_checkpoint: HFGet, step_driver: Any
    ) -> None:
        """No C++ compiler (the one inductor calls does not exist, and nothing is in its
        cache): the model loads, runs eagerly with transformers' logits, and the warning
        carries the compiler's failure."""
        import torch._inductor.config as inductor

        compiler = "/nonexistent/kvstep-c++"
        monkeypatch.setenv("CXX", compiler)
        no_compiler = {"cpp.cxx": (None, compiler), "force_disable_caches": True}
        with inductor.patch(no_compiler), structlog.testing.capture_logs() as logs:
            runner = _check_against_hf(
                hf_checkpoint, step_driver, "llama_gqa", chunk=48, torch_compile=True
            )
        assert not runner.compiled
        (warning,) = _warnings(logs, "torch_compile_fallback")
        assert warning["reason"].startswith("compilation failed") and compiler in warning["reason"]


class TestAttentionOp:
    def test_outside_a_compiled_pass_it_refuses(self) -> None:
        q = torch.zeros(1, 2, 4)
        with pytest.raises(RuntimeError, match="inside CompiledForward"):
            torch.ops.kvstep.paged_attention(q, q[:, :1], q[:, :1], 0, 1.0, True)

    def test_connector_hooks_run_around_each_layer(self, step_driver: Any) -> None:
        """The hooks a connector gets (wait before a layer's attention, save after it)
        are called by the op, in layer order, once per layer and pass."""
        runner = ModelRunner.load("builtin:tiny", device="cpu", num_blocks=64, torch_compile=True)
        calls: list[tuple[str, int]] = []

        class Hooks:
            def before_attention(self, layer: int) -> None:
                calls.append(("before", layer))

            def after_attention(self, layer: int) -> None:
                calls.append(("after", layer))

        try:
            assert runner.compiled
            layers = runner.model_config.num_hidden_layers
            ids = torch.tensor([5, 6, 7])
            from stages.model.attention import build_attention_metadata

            meta = build_attention_metadata(query_lens=[3], context_lens=[0], block_tables=[[1]],
                                            block_size=runner.block_size, device=CPU)  # fmt: skip
            with torch.inference_mode():
                compiled = runner._forward(ids, meta.positions, meta, runner.kv_caches, Hooks())
                eager = runner.model(ids, meta.positions, meta, runner.kv_caches, None)
            want = [(kind, i) for i in range(layers) for kind in ("before", "after")]
            assert calls == want
            torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
        finally:
            runner.close()


class TestGraphInputs:
    @pytest.mark.parametrize("rows", [1, 3])  # the one-row graph and the dynamic one
    def test_the_models_floats_are_constants(
        self, monkeypatch: pytest.MonkeyPatch, rows: int
    ) -> None:
        """The norms' epsilons and the attention scales are constants of both graphs: no
        float is wrapped into a tensor before a pass (dynamo's default makes each one an
        input, ~2.5 us apiece, three per layer), and the pass equals the eager one."""
        from stages.model.attention import build_attention_metadata

        runner = ModelRunner.load("builtin:tiny", device="cpu", num_blocks=64, torch_compile=True)
        wrapped: list[object] = []
        as_tensor = torch._as_tensor_fullprec

        def counting(value: Any) -> torch.Tensor:
            wrapped.append(value)
            return as_tensor(value)

        try:
            assert runner.compiled
            ids = torch.arange(5, 5 + rows)
            meta = build_attention_metadata(query_lens=[rows], context_lens=[0], block_tables=[[1]],
                                            block_size=runner.block_size, device=CPU)  # fmt: skip
            passes = _compiled_passes(runner)
            monkeypatch.setattr(torch, "_as_tensor_fullprec", counting)
            with torch.inference_mode():
                compiled = runner._forward(ids, meta.positions, meta, runner.kv_caches, None)
                eager = runner.model(ids, meta.positions, meta, runner.kv_caches, None)
            assert wrapped == [] and _compiled_passes(runner) == passes + 1
            torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
        finally:
            runner.close()
