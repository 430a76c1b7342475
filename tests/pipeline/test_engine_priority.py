"""Priorities and tenant fair share through the engine: the order requests get served
in, tokens unchanged by preemption, nothing leaked."""

from __future__ import annotations

import statistics
from pathlib import Path

import anyio
import pytest
import torch

from pipeline import LLM, AsyncEngine, EngineConfig, InvalidRequestError, SamplingParams
from pipeline.request import RequestOutput

NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 40, (n,), generator=gen).tolist()
    return [torch.randint(0, 256, (k,), generator=gen).tolist() for k in lengths]


def _config(path: Path, **fields: object) -> EngineConfig:
    return EngineConfig(model=str(path), dtype="float32", max_model_len=512, **fields)  # type: ignore[arg-type]


def _ttft(out: RequestOutput) -> float:
    first = out.metrics.first_token_time
    assert first is not None
    return first - out.metrics.arrival_time


class TestPriority:
    @pytest.mark.parametrize("async_scheduling", [False, True])
    def test_high_priority_overtakes_a_queue_of_low_ones(
        self, llama_path: Path, leak_check, async_scheduling: bool
    ) -> None:
        """max_num_seqs=2, 20 low-priority requests then 2 high-priority ones (sent once
        the lows run): both high ones' TTFT is below the median low one's, running lows
        are preempted for them, and every request's tokens are its FCFS tokens."""
        prompts = _prompts(22)
        with LLM(_config(llama_path, max_num_seqs=2)) as llm:
            expected = [out.token_ids for out in llm.generate(prompts, GREEDY)]
        config = _config(
            llama_path,
            max_num_seqs=2,
            scheduling_policy="priority",
            async_scheduling=async_scheduling,
        )
        finals: dict[int, RequestOutput] = {}

        async def main() -> tuple[int, dict[str, int]]:
            async with AsyncEngine(config) as engine:
                started = anyio.Event()

                async def run(index: int, priority: int) -> None:
                    stream = engine.generate(prompts[index], GREEDY, priority=priority)
                    async for out in stream:
                        if out.new_token_ids:
                            started.set()
                        finals[index] = out

                async with anyio.create_task_group() as tg:
                    for index in range(20):
                        tg.start_soon(run, index, 1)
                    await started.wait()  # the lows hold both slots now
                    for index in (20, 21):
                        tg.start_soon(run, index, 0)
                while not engine.is_idle:
                    await anyio.sleep(0.01)
                return engine.core.scheduler.num_preemptions, engine.leak_report()

        preemptions, report = anyio.run(main)
        low = statistics.median(_ttft(finals[i]) for i in range(20))
        assert _ttft(finals[20]) < low
        assert _ttft(finals[21]) < low
        assert preemptions >= 1
        assert [finals[i].token_ids for i in range(22)] == expected
        leak_check(report)

    def test_llm_takes_a_priority_per_prompt(self, llama_path: Path, leak_check) -> None:
        """LLM.generate takes one priority per prompt: with one slot, the lowest number
        is served first, ties in prompt order."""
        prompts = _prompts(4, seed=1)
        config = _config(llama_path, max_num_seqs=1, scheduling_policy="priority")
        with LLM(config) as llm:
            outs = llm.generate(prompts, GREEDY, priority=[3, 1, 2, 1])
            report = llm.leak_report()
        order = sorted(range(4), key=lambda i: outs[i].metrics.first_token_time or 0.0)
        assert order == [1, 3, 2, 0]
        leak_check(report)

    def test_nonzero_priority_needs_the_priority_policy(self, llama_path: Path) -> None:
        """As vLLM: under fcfs a non-zero priority is refused naming the field, before
        anything is queued; a bool is not a priority."""
        with LLM(_config(llama_path)) as llm:
            with pytest.raises(InvalidRequestError, match=r"priority.*priority scheduling"):
                llm.generate([1, 2, 3], GREEDY, priority=1)
            with pytest.raises(InvalidRequestError, match="priority"):
                llm.generate([1, 2, 3], GREEDY, priority=True)  # type: ignore[arg-type]
            with pytest.raises(InvalidRequestError, match="tenant"):
                llm.generate([1, 2, 3], GREEDY, tenant="")
            assert llm.generate([1, 2, 3], GREEDY, priority=0)[0].finished


class TestTenantFairShare:
    @pytest.mark.parametrize("fair", [True, False])
    def test_a_flooding_tenant_does_not_starve_another(
        self, llama_path: Path, leak_check, fair: bool
    ) -> None:
        """Tenant A sends 50 requests, then tenant B 5: with fair share, B's requests
        all finish before A's last 25; without it (FCFS), they finish after."""
        prompts = _prompts(55, seed=2)
        params = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4)
        config = _config(llama_path, max_num_seqs=4, tenant_fair_share=fair)
        with LLM(config) as llm:
            outs = llm.generate(prompts, params, tenant=["A"] * 50 + ["B"] * 5)
            report = llm.leak_report()
        finished = [out.metrics.finished_time or 0.0 for out in outs]
        a_last_25 = sorted(finished[:50])[25:]
        b_done = max(finished[50:])
        assert (b_done < min(a_last_25)) is fair
        leak_check(report)
