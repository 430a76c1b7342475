"""ModelRunner: per-request state, validation, connector hooks, sharing, lifecycle."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from connectors.base import ConnectorContext, ForwardContext, KVConnectorRole, KVConnectorWorker
from pipeline.artifacts import ScheduledRequest, SchedulerOutput
from pipeline.config import SamplingParams
from pipeline.errors import InvalidConfigError, InvalidRequestError, StageError
from stages.model import ModelRunner
from stages.speculative import accept_greedy

GREEDY = SamplingParams(temperature=0.0)


def _req(
    req_id: str,
    tokens: list[int],
    *,
    computed: int = 0,
    blocks: tuple[int, ...] = (0,),
    new: bool = True,
    sample: bool = True,
) -> ScheduledRequest:
    return ScheduledRequest(
        req_id=req_id,
        token_ids=tuple(tokens),
        num_computed_tokens=computed,
        block_ids=blocks,
        new=new,
        sampling=GREEDY,
        sample=sample,
        num_output_tokens=0,
    )


def _step(
    step_id: int, *reqs: ScheduledRequest, finished: frozenset[str] = frozenset()
) -> SchedulerOutput:
    return SchedulerOutput(step_id=step_id, requests=tuple(reqs), finished_req_ids=finished)


@pytest.fixture(scope="module")
def llama_dir(hf_checkpoint: Callable[[str], tuple[Any, Path]]) -> Path:
    return hf_checkpoint("llama_gqa")[1]


@pytest.fixture
def runner(llama_dir: Path) -> Iterator[ModelRunner]:
    runner = ModelRunner.load(
        str(llama_dir), device="cpu", dtype="float32", num_blocks=32, max_model_len=256
    )
    yield runner
    runner.close()


class _Recorder(KVConnectorWorker):
    def __init__(self) -> None:
        super().__init__(ConnectorContext(role=KVConnectorRole.WORKER))
        self.calls: list[tuple[str, int]] = []
        self.saved: list[tuple[torch.Tensor, ForwardContext]] = []

    def wait_for_layer_load(self, layer: int) -> None:
        self.calls.append(("wait_for_layer_load", layer))

    def save_kv_layer(self, layer: int, kv_layer: torch.Tensor, ctx: ForwardContext) -> None:
        self.calls.append(("save_kv_layer", layer))
        self.saved.append((kv_layer, ctx))


class TestLoad:
    def test_attributes_and_fingerprint(self, runner: ModelRunner) -> None:
        """The runner exposes its config, cache layout and fingerprint."""
        cfg = runner.model_config
        assert runner.device == torch.device("cpu") and runner.dtype == torch.float32
        assert len(runner.kv_caches) == cfg.num_hidden_layers
        assert runner.kv_caches[0].shape == (2, 32, 16, cfg.num_key_value_heads, cfg.head_dim)
        fp = runner.fingerprint
        assert (fp.architecture, fp.dtype, fp.block_size) == ("LlamaForCausalLM", "float32", 16)
        assert (fp.tp_rank, fp.tp_size) == (0, 1) and len(fp.weights_id) == 64

    @pytest.mark.parametrize(
        ("kwargs", "field"),
        [
            ({"dtype": "float64"}, "dtype"),
            ({"device": "tpu"}, "device"),
            ({"block_size": 0}, "block_size"),
            ({"num_blocks": -1}, "num_blocks"),
            ({"rank": 2, "world_size": 2}, "rank"),
        ],
    )
    def test_bad_arguments(self, llama_dir: Path, kwargs: dict[str, Any], field: str) -> None:
        """Bad dtype/device/sizes/rank raise InvalidConfigError naming the field."""
        with pytest.raises(InvalidConfigError) as info:
            ModelRunner.load(str(llama_dir), **kwargs)
        assert info.value.field == field

    @pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
    def test_cuda_unavailable(self, llama_dir: Path) -> None:
        """Asking for CUDA without one is a configuration error."""
        with pytest.raises(InvalidConfigError, match="CUDA is not available"):
            ModelRunner.load(str(llama_dir), device="cuda")

    def test_auto_on_cpu(self, llama_dir: Path) -> None:
        """auto picks CPU and float32 here; the default cache size follows the cap."""
        if torch.cuda.is_available():
            pytest.skip("CPU-only expectation")
        runner = ModelRunner.load(
            str(llama_dir), max_num_seqs=4, max_model_len=64, kv_cache_memory_bytes=1 << 30
        )
        assert runner.device.type == "cpu" and runner.dtype == torch.float32
        assert runner.num_blocks == 4 * 4
        capped = ModelRunner.load(
            str(llama_dir), max_num_seqs=4, max_model_len=64, kv_cache_memory_bytes=6 * 8192
        )
        assert capped.num_blocks == 6  # 8 KiB a block: 2 layers x K,V x 16 x 2 heads x 16 x 4 B

    def test_cache_cap_too_small(self, llama_dir: Path) -> None:
        """A memory cap below one max_model_len sequence is refused."""
        with pytest.raises(InvalidConfigError, match="kv_cache_memory_bytes"):
            ModelRunner.load(str(llama_dir), max_model_len=64, kv_cache_memory_bytes=1000)

    def test_shared_model(self, runner: ModelRunner, llama_dir: Path) -> None:
        """A second rank shares the weights but has its own cache and same outputs."""
        other = ModelRunner.load(
            str(llama_dir),
            device="cpu",
            dtype="float32",
            num_blocks=32,
            max_model_len=256,
            rank=1,
            world_size=2,
            shared_model=runner,
        )
        assert other.model is runner.model
        assert other.kv_caches[0].data_ptr() != runner.kv_caches[0].data_ptr()
        assert other.fingerprint.tp_rank == 1
        assert other.fingerprint.weights_id == runner.fingerprint.weights_id
        step = _step(0, _req("a", [1, 2, 3, 4]))
        assert torch.equal(runner.execute(step).logits, other.execute(step).logits)

    def test_shared_model_must_match(self, runner: ModelRunner, llama_dir: Path) -> None:
        """Sharing weights across dtypes is refused."""
        with pytest.raises(InvalidConfigError, match="shared_model"):
            ModelRunner.load(str(llama_dir), dtype="bfloat16", shared_model=runner)


class TestExecute:
    def test_empty_step(self, runner: ModelRunner) -> None:
        """An empty step returns empty logits and still drops finished requests."""
        runner.execute(_step(0, _req("a", [1, 2, 3])))
        assert runner.num_requests == 1
        out = runner.execute(_step(1, finished=frozenset({"a"})))
        assert out.req_ids == () and out.logits.shape == (0, runner.model_config.vocab_size)
        assert out.num_tokens == 0 and runner.num_requests == 0
        assert runner.sample(_step(1), out).token_ids == {}

    def test_only_sampling_rows_return_logits(self, runner: ModelRunner) -> None:
        """A non-final prefill chunk yields no logits row; order follows the batch."""
        out = runner.execute(
            _step(
                0,
                _req("a", [1, 2, 3], blocks=(0,), sample=False),
                _req("b", [4, 5], blocks=(1,)),
                _req("c", [6], blocks=(2,)),
            )
        )
        assert out.req_ids == ("b", "c") and out.logits.shape[0] == 2
        assert out.logits.dtype == torch.float32 and out.num_tokens == 6

    def test_block_ids_append(self, runner: ModelRunner) -> None:
        """Non-new requests append their block ids to the table."""
        runner.execute(_step(0, _req("a", list(range(16)), blocks=(5,))))
        runner.execute(_step(1, _req("a", [1], computed=16, blocks=(9,), new=False)))
        assert runner.block_table("a") == (5, 9)

    def test_resume_with_new_blocks_recomputes(self, runner: ModelRunner) -> None:
        """A request re-sent as new (after preemption) gets a fresh table, same logits."""
        prompt = list(range(20, 40))
        first = runner.execute(_step(0, _req("a", prompt, blocks=(3, 4)))).logits
        runner.execute(_step(1, finished=frozenset({"a"})))
        again = runner.execute(_step(2, _req("a", prompt, blocks=(7, 11)))).logits
        assert runner.block_table("a") == (7, 11)
        assert torch.allclose(first, again, atol=1e-5)

    @pytest.mark.parametrize(
        ("request_", "what"),
        [
            (_req("x", [1], new=False), "req_id"),
            (_req("x", [1], blocks=(99,)), "block_ids"),
            (_req("x", list(range(17)), blocks=(0,)), "block_ids"),
            (_req("x", [1, 100000]), "token_id"),
            (_req("x", [1], computed=256, blocks=tuple(range(17))), "num_computed_tokens"),
            (_req("x", []), "token_ids"),
        ],
    )
    def test_invalid_requests(
        self, runner: ModelRunner, request_: ScheduledRequest, what: str
    ) -> None:
        """Inconsistent requests raise InvalidRequestError and change no state."""
        runner.execute(_step(0, _req("keep", [1, 2], blocks=(20,))))
        with pytest.raises(InvalidRequestError) as info:
            runner.execute(
                _step(1, _req("keep", [3], computed=2, blocks=(21,), new=False), request_)
            )
        assert info.value.what == what
        assert runner.block_table("keep") == (20,)
        assert "x" not in runner._states

    def test_duplicate_request(self, runner: ModelRunner) -> None:
        """A request scheduled twice in one step is refused."""
        with pytest.raises(InvalidRequestError, match="twice"):
            runner.execute(_step(0, _req("a", [1]), _req("a", [2])))

    def test_connector_hooks(self, runner: ModelRunner) -> None:
        """Each layer waits for its load before attention, then saves its KV tensor."""
        conn = _Recorder()
        step = _step(7, _req("a", [1, 2, 3]))
        runner.execute(step, conn)
        layers = runner.model_config.num_hidden_layers
        expected = [(c, i) for i in range(layers) for c in ("wait_for_layer_load", "save_kv_layer")]
        assert conn.calls == expected
        for i, (kv, ctx) in enumerate(conn.saved):
            assert kv is runner.kv_caches[i]
            assert ctx.step_id == 7 and ctx.scheduler_output is step and ctx.rank == 0
        assert runner.forward_context(step).kv_caches is runner.kv_caches

    def test_draft_logits_are_those_of_decoding_them(self, runner: ModelRunner) -> None:
        """A step over a token and two drafts gives, at each position, the logits that
        decoding the same tokens one step at a time gives (speculative decoding's
        verify pass); the drafts' rows come apart from the sampled rows, in batch order."""
        prompt = list(range(30, 50))
        tokens = (7, 11, 13)  # the last known token, then two drafts
        runner.execute(_step(0, _req("ref", prompt, blocks=(0, 1))))
        ref = [
            runner.execute(
                _step(1 + i, _req("ref", [t], computed=20 + i, blocks=(), new=False))
            ).logits[0]
            for i, t in enumerate(tokens)
        ]
        runner.execute(_step(4, _req("spec", prompt, blocks=(2, 3))))
        spec = attrs.evolve(
            _req("spec", [tokens[0]], computed=20, blocks=(), new=False),
            draft_token_ids=tokens[1:],
        )
        out = runner.execute(_step(5, spec, _req("other", [5, 6, 7], blocks=(4,))))
        assert out.req_ids == ("spec", "other") and out.logits.shape[0] == 2
        assert out.draft_req_ids == ("spec",) and out.num_tokens == 6
        assert out.draft_logits.shape == (2, runner.model_config.vocab_size)
        torch.testing.assert_close(out.logits[0], ref[0], atol=1e-4, rtol=0)
        torch.testing.assert_close(out.draft_logits[0], ref[1], atol=1e-4, rtol=0)
        torch.testing.assert_close(out.draft_logits[1], ref[2], atol=1e-4, rtol=0)
        sampled = runner.sample(_step(5, spec), attrs.evolve(out, req_ids=("spec",),
                                                             logits=out.logits[:1]))  # fmt: skip
        choices = [int(out.logits[0].argmax()), *out.draft_logits.argmax(-1).tolist()]
        assert sampled.token_ids["spec"] == tuple(accept_greedy(choices, tokens[1:]))

    def test_a_step_without_drafts_has_no_draft_rows(self, runner: ModelRunner) -> None:
        out = runner.execute(_step(0, _req("a", [1, 2, 3])))
        assert out.draft_req_ids == () and out.draft_logits is None

    @pytest.mark.parametrize(
        ("drafts", "kwargs", "what"),
        [
            ((1, 100000), {}, "draft_token_id"),
            ((1,), {"sample": False}, "draft_token_ids"),
            ((1, 2), {"computed": 254, "blocks": tuple(range(16))}, "num_computed_tokens"),
            ((1,), {"tokens": list(range(16))}, "block_ids"),
        ],
    )
    def test_bad_drafts_are_refused(
        self, runner: ModelRunner, drafts: tuple[int, ...], kwargs: dict[str, Any], what: str
    ) -> None:
        """A draft outside the vocabulary, drafts on a chunk that does not sample, drafts
        past max_model_len or past the block table: the request's error names it."""
        tokens = kwargs.pop("tokens", [1])
        request = attrs.evolve(_req("x", tokens, **kwargs), draft_token_ids=drafts)
        with pytest.raises(InvalidRequestError, match=what):
            runner.execute(_step(0, request))

    def test_kv_written_at_slots(self, runner: ModelRunner) -> None:
        """New K/V land in the request's blocks and nowhere else."""
        runner.execute(_step(0, _req("a", list(range(1, 19)), blocks=(6, 2))))
        cache = runner.kv_caches[0]
        written = cache[0].abs().sum(dim=(-1, -2)) != 0  # [num_blocks, block_size]
        expected = torch.zeros_like(written)
        expected[6, :] = True
        expected[2, :2] = True
        assert torch.equal(written, expected)

    def test_bfloat16_close_to_float32(self, runner: ModelRunner, llama_dir: Path) -> None:
        """bfloat16 weights run and give float32 logits close to the float32 run."""
        low = ModelRunner.load(
            str(llama_dir), device="cpu", dtype="bfloat16", num_blocks=8, max_model_len=64
        )
        step = _step(0, _req("a", list(range(30)), blocks=(0, 1)))
        out = low.execute(step).logits
        ref = runner.execute(step).logits
        assert out.dtype == torch.float32
        assert (out - ref).abs().max() < 0.1 * ref.abs().max()

    @pytest.mark.parametrize("saved", ["bfloat16", "float32", None])
    def test_auto_dtype_on_cpu(self, llama_dir: Path, tmp_path: Path, saved: str | None) -> None:
        """``dtype="auto"`` on the CPU: bfloat16 only for a bfloat16 checkpoint on a CPU with
        native bfloat16 arithmetic, float32 otherwise."""
        import json
        import shutil

        from stages.model.runner_parts import cpu_has_native_bf16

        path = tmp_path / "model"
        shutil.copytree(llama_dir, path)
        config = json.loads((path / "config.json").read_text())
        config.pop("dtype", None)
        config.pop("torch_dtype", None)
        if saved is not None:
            config["dtype"] = saved
        (path / "config.json").write_text(json.dumps(config))
        runner = ModelRunner.load(str(path), device="cpu", num_blocks=4, max_model_len=64)
        try:
            native = saved == "bfloat16" and cpu_has_native_bf16()
            want = torch.bfloat16 if native else torch.float32
            assert {t.dtype for t in runner.kv_caches} == {want}
        finally:
            runner.close()

    def test_auto_dtype_without_native_bf16(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Where bfloat16 is emulated, a bfloat16 checkpoint runs in float32."""
        from stages.model import runner_parts

        cpu = torch.device("cpu")
        monkeypatch.setattr(runner_parts, "cpu_has_native_bf16", lambda: False)
        assert runner_parts.resolve_dtype("auto", cpu, "bfloat16") == torch.float32
        monkeypatch.setattr(runner_parts, "cpu_has_native_bf16", lambda: True)
        assert runner_parts.resolve_dtype("auto", cpu, "bfloat16") == torch.bfloat16
        assert runner_parts.resolve_dtype("auto", cpu, "float32") == torch.float32
        assert runner_parts.resolve_dtype("float32", cpu, "bfloat16") == torch.float32

    def test_sample(self, runner: ModelRunner) -> None:
        """sample() returns one greedy token per sampled request."""
        step = _step(0, _req("a", [5, 6, 7], blocks=(0,)), _req("b", [8], blocks=(1,)))
        out = runner.execute(step)
        tokens = runner.sample(step, out).token_ids
        assert tokens == {
            r: (t,) for r, t in zip(out.req_ids, out.logits.argmax(-1).tolist(), strict=True)
        }

    def test_close(self, llama_dir: Path) -> None:
        """close() is idempotent; executing afterwards raises StageError."""
        runner = ModelRunner.load(str(llama_dir), device="cpu", num_blocks=4, max_model_len=64)
        runner.close()
        runner.close()
        assert runner.kv_caches == []
        with pytest.raises(StageError, match="closed"):
            runner.execute(_step(3, _req("a", [1])))
