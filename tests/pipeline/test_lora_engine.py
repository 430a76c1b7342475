"""Multi-LoRA through the engine: transformers + peft as the oracle, one batch mixing
base rows and two adapters' rows, and KV that never crosses adapters."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from checkpoints import build_checkpoint
from lora_adapters import ADAPTERS, build_adapter, peft_greedy

from pipeline import LLM, AsyncEngine, EngineConfig, LoRARequest, SamplingParams
from pipeline.block_hashes import BlockHasher
from pipeline.errors import InvalidRequestError
from pipeline.kv_events.sink import KVEventSink
from pipeline.lora import LoRAAdapter
from pipeline.request import Request
from stages.scheduler.kv_manager import KVCacheManager

N = 10
GREEDY = SamplingParams(max_tokens=N, min_tokens=N, temperature=0.0, ignore_eos=True)
PROMPTS = (
    [5, 9, 17, 33, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 7, 8, 60, 61, 62, 63, 64,
     65, 66, 67, 68, 69, 70, 71, 72, 73, 3],
    [100, 101, 7, 99, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26],
)  # fmt: skip


class Setup:
    """The base checkpoint, the two adapters and every (adapter, prompt) reference."""

    def __init__(self, root: Path) -> None:
        self.base = build_checkpoint("llama", root / "base")
        self.paths = {
            name: build_adapter(self.base, root / name, seed=i + 1, **lora)
            for i, (name, lora) in enumerate(ADAPTERS.items())
        }
        self.requests = {
            name: LoRARequest(name, i + 1, str(path))
            for i, (name, path) in enumerate(self.paths.items())
        }
        self.refs = {
            (name, p): peft_greedy(self.base, self.paths.get(name), PROMPTS[p], N)  # type: ignore[arg-type]
            for name in (None, *self.paths)
            for p in range(len(PROMPTS))
        }

    def lora(self, name: str | None) -> LoRARequest | None:
        return None if name is None else self.requests[name]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    return Setup(tmp_path_factory.mktemp("lora"))


def config(setup: Setup, **kw: Any) -> EngineConfig:
    kw.setdefault("max_loras", 2)
    return EngineConfig(model=str(setup.base), enable_lora=True, **kw)


def run(llm: LLM, setup: Setup, rows: list[tuple[str | None, int]]) -> list[Any]:
    return llm.generate(
        [PROMPTS[p] for _, p in rows], GREEDY, lora_request=[setup.lora(n) for n, _ in rows]
    )


class TestTokens:
    def test_adapters_change_the_tokens(self, setup: Setup) -> None:
        """The oracle itself: each adapter's greedy tokens differ from the base's."""
        for p in range(len(PROMPTS)):
            refs = [setup.refs[name, p] for name in (None, "qv", "od")]
            assert len({tuple(r) for r in refs}) == 3

    @pytest.mark.parametrize("kernel", ["mkl", "onednn"])
    def test_mixed_batch_gives_each_row_its_reference(
        self, setup: Setup, kernel: str, monkeypatch: pytest.MonkeyPatch, leak_check: Any
    ) -> None:
        """One batch of base rows and both adapters' rows (q/v packed with the others
        on oneDNN): each row's tokens are transformers + peft's for its adapter."""
        monkeypatch.setenv("KVSTEP_LINEAR_KERNEL", kernel)
        rows = [(n, p) for p in range(len(PROMPTS)) for n in (None, "qv", "od")]
        with LLM(config(setup)) as llm:
            outs = run(llm, setup, rows)
            leak_check(llm.leak_report())
        for (name, p), out in zip(rows, outs, strict=True):
            assert list(out.token_ids) == setup.refs[name, p], (name, p)

    def test_chunked_prefill_and_preemption(self, setup: Setup, leak_check: Any) -> None:
        """Prompts in 8-token chunks and a pool too small for every request at once
        (preemptions recompute them): the tokens stay each adapter's."""
        rows = [(n, p) for n in ("qv", "od", None, "qv") for p in range(len(PROMPTS))]
        cfg = config(
            setup, block_size=4, num_gpu_blocks=16, max_num_batched_tokens=8, max_model_len=64
        )
        with LLM(cfg) as llm:
            outs = run(llm, setup, rows)
            assert llm.engine.core.scheduler.num_preemptions > 0
            leak_check(llm.leak_report())
        for (name, p), out in zip(rows, outs, strict=True):
            assert list(out.token_ids) == setup.refs[name, p], (name, p)

    def test_one_adapter_slot(self, setup: Setup, leak_check: Any) -> None:
        """``max_loras=1``: requests of the two adapters take turns (a worker refuses a
        step with two), and each gets its own tokens."""
        rows = [(n, p) for p in range(len(PROMPTS)) for n in ("qv", "od", None)]
        with LLM(config(setup, max_loras=1)) as llm:
            outs = run(llm, setup, rows)
            leak_check(llm.leak_report())
        for (name, p), out in zip(rows, outs, strict=True):
            assert out.finish_reason == "length"
            assert list(out.token_ids) == setup.refs[name, p], (name, p)


class TestKVNeverCrossesAdapters:
    def test_prefix_cache(self, setup: Setup) -> None:
        """The same prompt under A, then B, then the base model: nothing cached is
        reused across them; under A again, A's blocks are."""
        with LLM(config(setup)) as llm:
            hits = []
            for name in ("qv", "od", None, "qv"):
                (out,) = run(llm, setup, [(name, 0)])
                assert list(out.token_ids) == setup.refs[name, 0]
                hits.append(out.num_cached_tokens)
        assert hits[:3] == [0, 0, 0]
        assert hits[3] == len(PROMPTS[0]) // 16 * 16

    def test_shared_storage(self, setup: Setup, tmp_path: Path) -> None:
        """An engine saves A's KV to ``shared_storage``; a second engine loads none of
        it for B, nor for the base model, and loads it for A."""
        options = {"path": str(tmp_path / "store")}
        cfg = config(setup, connector="shared_storage", connector_options=options)
        with LLM(cfg) as llm:
            run(llm, setup, [("qv", 0)])
        loaded = {}
        with LLM(cfg) as llm:
            for name in ("od", None, "qv"):
                (out,) = run(llm, setup, [(name, 0)])
                assert list(out.token_ids) == setup.refs[name, 0], name
                loaded[name] = out.metrics.num_external_tokens
        assert loaded == {"od": 0, None: 0, "qv": len(PROMPTS[0]) // 16 * 16}

    def test_block_stored_names_the_adapter(self) -> None:
        """A device-tier ``BlockStored`` of an adapter's request carries its id and
        name; the base model's carries none; the two hash differently."""
        kv = KVCacheManager(num_blocks=8, block_size=4)
        sink = KVEventSink(4, "GPU")
        kv.block_pool.kv_events = sink
        adapter = LoRAAdapter(name="qv", int_id=1, path="/a", content_id="c0ffee", rank=8)
        for req_id, lora in (("a", adapter), ("b", None)):
            request = Request(req_id, list(range(8)), GREEDY, lora=lora)
            BlockHasher(4).update(request)
            assert kv.allocate_slots(request, 8) is not None
            kv.cache_blocks(request, 8)
        stored = [(e.lora_id, e.lora_name, tuple(e.block_hashes)) for e in sink.take()]
        assert [s[:2] for s in stored] == [(1, "qv"), (None, None)]
        assert not set(stored[0][2]) & set(stored[1][2])


class TestRequests:
    def test_lora_off_is_refused(self, setup: Setup) -> None:
        """Without ``enable_lora`` a request naming an adapter is refused, by name."""
        with (
            LLM(EngineConfig(model=str(setup.base))) as llm,
            pytest.raises(InvalidRequestError, match="enable_lora"),
        ):
            llm.generate(PROMPTS[0], GREEDY, lora_request=setup.requests["qv"])

    def test_an_id_names_one_adapter(self, setup: Setup) -> None:
        """A known id under another name or path, or a known name under another id, is
        refused; the same request again is fine."""
        qv = setup.requests["qv"]
        with LLM(config(setup)) as llm:
            run(llm, setup, [("qv", 1)])
            llm.generate(PROMPTS[1], GREEDY, lora_request=qv)
            for bad, field in (
                (LoRARequest("other", qv.lora_int_id, qv.lora_path), "lora_int_id"),
                (LoRARequest("qv", 1, str(setup.paths["od"])), "lora_int_id"),
                (LoRARequest("qv", 9, qv.lora_path), "lora_name"),
            ):
                with pytest.raises(InvalidRequestError, match=field):
                    llm.generate(PROMPTS[1], GREEDY, lora_request=bad)

    def test_one_lora_per_prompt(self, setup: Setup) -> None:
        """A list of adapters must have one entry per prompt."""
        with (
            LLM(config(setup)) as llm,
            pytest.raises(InvalidRequestError, match="lora_request"),
        ):
            llm.generate(list(PROMPTS), GREEDY, lora_request=[setup.requests["qv"]])


class TestAsyncEngine:
    @pytest.mark.anyio
    async def test_unread_adapter_is_read_then_admitted(
        self, setup: Setup, leak_check: Any
    ) -> None:
        """``generate`` with an adapter the engine has not read: the stream waits for
        it to be read off the loop, then gives the adapter's tokens; a bad directory
        ends its stream with ``InvalidRequestError``, others unaffected."""
        async with AsyncEngine(config(setup)) as engine:
            good = engine.generate(PROMPTS[0], GREEDY, lora_request=setup.requests["od"])
            bad = engine.generate(
                PROMPTS[0], GREEDY, lora_request=LoRARequest("x", 7, str(setup.base))
            )
            with pytest.raises(InvalidRequestError, match=r"adapter_config\.json"):
                async for _ in bad:
                    pass
            final = None
            async for out in good:
                final = out
            assert final is not None and list(final.token_ids) == setup.refs["od", 0]
            assert [a.name for a in engine.list_loras()] == ["od"]
            assert engine.remove_lora("od") and not engine.remove_lora("od")
            with anyio.fail_after(10):
                while not engine.is_idle:
                    await anyio.sleep(0.01)
            leak_check(engine.leak_report())

    @pytest.mark.anyio
    async def test_an_id_reloaded_with_other_weights(self, setup: Setup, leak_check: Any) -> None:
        """``remove_lora`` then the same name and id with another directory, while a
        request of the old weights still runs (``max_loras=1``): each request keeps its
        own weights' tokens (the old one finishes first: they are two adapters)."""
        qv, od_path = setup.requests["qv"], str(setup.paths["od"])
        long = SamplingParams(max_tokens=3 * N, min_tokens=3 * N, temperature=0.0)
        async with AsyncEngine(config(setup, max_loras=1)) as engine:
            await engine.add_lora(qv)
            old = engine.generate(PROMPTS[0], long, lora_request=qv)
            first = await old.__anext__()
            assert engine.remove_lora("qv")
            new = engine.generate(PROMPTS[0], GREEDY, lora_request=LoRARequest("qv", 1, od_path))
            finals = {}
            for name, stream in (("old", old), ("new", new)):
                async for out in stream:
                    finals[name] = out
            with anyio.fail_after(10):
                while not engine.is_idle:
                    await anyio.sleep(0.01)
            leak_check(engine.leak_report())
        assert first.token_ids
        assert list(finals["old"].token_ids)[:N] == setup.refs["qv", 0]
        assert list(finals["new"].token_ids) == setup.refs["od", 0]


@pytest.mark.slow
def test_tensor_parallel_workers(setup: Setup, leak_check: Callable[..., None]) -> None:
    """``multiproc`` world_size 2: the updates split as the weights are (B by output
    rows, A of o/down by input columns before the all-reduce); workers read the
    adapters from their directories and check them against the engine's content id."""
    rows = [(n, p) for p in range(len(PROMPTS)) for n in (None, "qv", "od")]
    with LLM(config(setup, executor="multiproc", world_size=2)) as llm:
        outs = run(llm, setup, rows)
        leak_check(llm.leak_report())
    for (name, p), out in zip(rows, outs, strict=True):
        assert list(out.token_ids) == setup.refs[name, p], (name, p)


class TestFamilies:
    @pytest.mark.parametrize(
        ("kind", "targets"),
        [
            ("gemma3", ["q_proj", "v_proj", "down_proj"]),
            ("qwen3_moe", ["q_proj", "o_proj"]),  # its experts take no adapter
            ("phi3", ["qkv_proj", "gate_up_proj", "o_proj"]),  # peft's names of its packs
        ],
    )
    def test_base_and_adapter_rows_match_peft(
        self, kind: str, targets: list[str], tmp_path: Path, leak_check: Any
    ) -> None:
        """Gemma 3 (GeGLU), Qwen3-MoE (attention only) and Phi-3 (an adapter on its
        packed q/k/v and gate/up, read as their parts): one batch of a base row and an
        adapter row gives transformers + peft's tokens for each."""
        base = build_checkpoint(kind, tmp_path / kind)
        adapter = build_adapter(base, tmp_path / "a", r=8, lora_alpha=16, target_modules=targets)
        prompt = PROMPTS[1]
        refs = [peft_greedy(base, None, prompt, N), peft_greedy(base, adapter, prompt, N)]
        assert refs[0] != refs[1]
        with LLM(EngineConfig(model=str(base), enable_lora=True)) as llm:
            outs = llm.generate(
                [prompt, prompt], GREEDY, lora_request=[None, LoRARequest("a", 1, str(adapter))]
            )
            leak_check(llm.leak_report())
        assert [list(o.token_ids) for o in outs] == refs
