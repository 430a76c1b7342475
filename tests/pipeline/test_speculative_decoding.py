"""Speculative decoding with n-gram drafts (issue 28): the tokens are those of decoding
without it, drafts are really proposed and accepted, and what is not built yet is refused
by name."""

from __future__ import annotations

import collections
import math
import random
from pathlib import Path
from typing import Any

import pytest

from pipeline import LLM, EngineConfig, SamplingParams
from pipeline.errors import InvalidConfigError
from pipeline.steplog_tools.summary import load_step_log
from stages.propose import ProposeStage

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}  # fmt: skip
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    phrase = [rng.randrange(3, 250) for _ in range(7)]
    repetitive = [t for _ in range(6) for t in phrase]  # copy-edit-like: spans repeat
    return [repetitive, [rng.randrange(3, 250) for _ in range(29)], repetitive[:20] * 2]


def _use_proposer(llm: LLM, proposer: Any) -> None:
    """Make ``llm``'s propose stage draft with ``proposer`` (a test's own)."""
    stage = next(s for s in llm.engine.core.engine_graph.stages if isinstance(s, ProposeStage))
    object.__setattr__(stage, "proposer", proposer)


def _run(prompts: list[list[int]], params: Any, **config: Any) -> tuple[list[tuple[int, ...]], int]:
    """Each output's tokens, and the drafts the engine proposed (0 without speculation);
    with speculation, checks that the drafts computed were counted and some were kept."""
    proposed = [0]
    with LLM(EngineConfig(model="builtin:tiny", **config)) as llm:
        stage = next(
            (s for s in llm.engine.core.engine_graph.stages if isinstance(s, ProposeStage)), None
        )
        if stage is not None:
            scheduler, inner = stage.scheduler, stage.scheduler.propose_drafts

            def counting(drafts: Any) -> int:
                given = inner(drafts)
                proposed[0] += given
                return given

            object.__setattr__(scheduler, "propose_drafts", counting)
        outputs = llm.generate(prompts, params)
        computed, kept = llm.engine.core.scheduler.spec_decode_counts
        if stage is not None:
            assert 0 < kept <= computed <= proposed[0], (kept, computed, proposed)
        else:
            assert computed == kept == 0
    return [tuple(o.token_ids) for o in outputs], proposed[0]


class TestGreedyTokens:
    def test_equal_with_and_without_speculation(self) -> None:
        """Repetitive and random prompts in one batch: the same greedy tokens, and
        drafts were proposed (the model's own loops and the prompts' repeats)."""
        prompts = _prompts()
        plain, none = _run(prompts, GREEDY)
        spec, proposed = _run(prompts, GREEDY, speculative_config=NGRAM)
        assert none == 0 and proposed > 0
        assert spec == plain

    def test_a_batch_mixing_greedy_and_seeded_sampling(self) -> None:
        """A seeded sampling request beside greedy ones gets no drafts and its own
        tokens; the greedy ones keep theirs."""
        prompts = _prompts()
        params = [GREEDY, SamplingParams(max_tokens=40, temperature=0.9, seed=3,
                                         ignore_eos=True), GREEDY]  # fmt: skip
        plain, _ = _run(prompts, params)
        spec, proposed = _run(prompts, params, speculative_config=NGRAM)
        assert proposed > 0 and spec == plain

    def test_without_prefix_caching_and_with_one_draft(self) -> None:
        prompts = _prompts()
        config = {"enable_prefix_caching": False}
        plain, _ = _run(prompts, GREEDY, **config)
        one = {**NGRAM, "num_speculative_tokens": 1}
        spec, proposed = _run(prompts, GREEDY, speculative_config=one, **config)
        assert proposed > 0 and spec == plain


def _chi2_critical(df: int, z: float = 3.09) -> float:
    """The chi-square critical value at ``df`` degrees of freedom for the one-sided
    normal quantile ``z`` (3.09: p = 0.001), by the Wilson-Hilferty approximation
    (within 2% of the exact value from df = 3 on)."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


def _chi2_two_samples(a: list[int], b: list[int]) -> tuple[float, int]:
    """The chi-square statistic of the 2 x V contingency table of two samples' tokens
    and its degrees of freedom; tokens drawn fewer than 10 times in all share a bin."""
    seen = collections.Counter(a + b)
    common = sorted(t for t, n in seen.items() if n >= 10)
    rows = []
    for x in (a, b):
        counts = collections.Counter(x)
        row = [counts[t] for t in common]
        rows.append([*row, len(x) - sum(row)])
    if rows[0][-1] + rows[1][-1] == 0:
        rows = [r[:-1] for r in rows]
    total = len(a) + len(b)
    stat = 0.0
    for row, size in zip(rows, (len(a), len(b)), strict=True):
        for j, observed in enumerate(row):
            expected = size * (rows[0][j] + rows[1][j]) / total
            stat += (observed - expected) ** 2 / expected
    return stat, len(rows[0]) - 1


class TestSampling:
    def test_seeded_requests_draw_the_tokens_they_draw_without_drafts(self) -> None:
        """A draft row is sampled with the noise its output index has without
        speculation, so seeded requests get the very same tokens, drafts or not; and
        again the same in a second run (deterministic)."""
        prompts = _prompts() * 2
        params = [SamplingParams(max_tokens=32, temperature=t, top_p=0.95, seed=s,
                                 ignore_eos=True)
                  for s, t in enumerate([0.1, 0.2, 0.9, 0.15, 0.3, 0.05])]  # fmt: skip
        plain, _ = _run(prompts, params)
        spec, proposed = _run(prompts, params, speculative_config=NGRAM)
        again, _ = _run(prompts, params, speculative_config=NGRAM)
        assert proposed > 0 and spec == plain == again

    def test_unseeded_tokens_are_distributed_as_without_drafts(self) -> None:
        """Many unseeded requests of one prompt (top-k 4), each step drafting the greedy
        continuation (so drafts are often kept, often not): at each output position,
        the tokens' frequencies with speculation match those without (two-sample
        chi-square, p = 0.001)."""
        prompt = [17, 93, 41, 120, 8, 66, 201] * 4
        n, length = 400, 6
        params = SamplingParams(max_tokens=length, temperature=0.1, top_k=4, ignore_eos=True)
        greedy = SamplingParams(max_tokens=length, temperature=0.0, ignore_eos=True)
        config: dict[str, Any] = {"max_num_seqs": 128, "max_num_batched_tokens": 4096}
        (guess,), _ = _run([prompt], greedy)
        plain, _ = _run([prompt] * n, params, **config)

        class GreedyGuess:
            def propose(self, token_ids: Any, k: int | None = None) -> list[int]:
                done = len(token_ids) - len(prompt)
                return list(guess[done : done + min(k or 3, 3)])

        with LLM(EngineConfig(model="builtin:tiny", speculative_config=NGRAM, **config)) as llm:
            _use_proposer(llm, GreedyGuess())
            spec = [tuple(o.token_ids) for o in llm.generate([prompt] * n, params)]
            drafted, kept = llm.engine.core.scheduler.spec_decode_counts
        assert 0.05 * drafted < kept < 0.95 * drafted, (kept, drafted)
        for position in range(length):
            stat, df = _chi2_two_samples([t[position] for t in plain],
                                         [t[position] for t in spec])  # fmt: skip
            assert df >= 1 and stat < _chi2_critical(df), (position, stat, df)


class TestBudget:
    def test_drafts_that_never_hold_turn_speculation_down(self) -> None:
        """A proposer whose every guess is wrong: after two misses the request pauses
        for longer and longer, so 64 tokens cost a few drafts, not 3 per step; the
        tokens stay those without speculation."""
        prompt = _prompts()[0]
        params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        (plain,), _ = _run([prompt], params)

        class Wrong:
            k = 3

            def propose(self, token_ids: Any, k: int | None = None) -> list[int]:
                done = len(token_ids) - len(prompt)
                return [(t + 1) % 256 for t in plain[done : done + min(k or 3, 3)]]

        with LLM(EngineConfig(model="builtin:tiny", speculative_config=NGRAM)) as llm:
            _use_proposer(llm, Wrong())
            (out,) = llm.generate([prompt], params)
            drafted, kept = llm.engine.core.scheduler.spec_decode_counts
        assert tuple(out.token_ids) == plain
        assert kept == 0 and 0 < drafted <= 12, drafted  # 3, 1, then 1 per pause of 2, 4, 8, 16


class TestProposerFailures:
    @pytest.mark.parametrize("batch", [False, True])
    def test_a_raising_proposer_costs_drafts_not_requests(
        self, tmp_path: Path, batch: bool, caplog: pytest.LogCaptureFixture
    ) -> None:
        """A proposer that raises on some calls: every request still gets the tokens of
        decoding without speculation, the failures are in the step log, and the first
        one is logged at error level."""
        prompts = _prompts()
        plain, _ = _run(prompts, GREEDY)
        calls = [0]

        class Flaky:
            k = 3

            def propose(self, token_ids: Any, k: int | None = None) -> list[int]:
                calls[0] += 1
                if calls[0] % 3 == 0:
                    raise RuntimeError("proposer broke")
                return list(token_ids[-2:])[: k or 3]

            def propose_batch(self, requests: Any) -> dict[str, list[int]]:
                return {r: self.propose(t, k) for r, (t, k) in requests.items()}

            def retain(self, live: Any) -> None:
                pass

        proposer: Any = Flaky()
        if not batch:
            del Flaky.propose_batch, Flaky.retain
        path = tmp_path / "steps.jsonl"
        config = EngineConfig(model="builtin:tiny", speculative_config=NGRAM, step_log=path)
        with caplog.at_level("DEBUG", logger="kvstep"), LLM(config) as llm:
            _use_proposer(llm, proposer)
            outs = llm.generate(prompts, GREEDY)
        assert [tuple(o.token_ids) for o in outs] == plain
        assert all(o.finish_reason == "length" for o in outs)
        failed = sum(r.get("spec_proposer_failures", 0) for r in load_step_log(path))
        assert failed > 0
        errors = [r for r in caplog.records if "proposer failed" in r.getMessage()]
        assert errors and errors[0].levelname == "ERROR"
        assert all(r.levelname == "DEBUG" for r in errors[1:])


class TestLogprobs:
    def test_kept_drafts_carry_the_logprobs_of_their_rows(self) -> None:
        """Requests asking for logprobs speculate too; each token's logprob, rank and
        alternatives equal decoding's without drafts (the row that scored it)."""
        prompts = _prompts()
        params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=3)
        runs = []
        for config in ({}, {"speculative_config": NGRAM}):
            with LLM(EngineConfig(model="builtin:tiny", **config)) as llm:
                runs.append(llm.generate(prompts, params))
                kept = llm.engine.core.scheduler.spec_decode_counts[1]
        assert kept > 0
        for plain, spec in zip(*runs, strict=True):
            assert spec.token_ids == plain.token_ids
            assert plain.logprobs is not None and spec.logprobs is not None
            assert len(spec.logprobs) == len(spec.token_ids)
            for a, b in zip(plain.logprobs, spec.logprobs, strict=True):
                assert (a.token_id, a.rank) == (b.token_id, b.rank)
                assert abs(a.logprob - b.logprob) < 1e-4
                assert [t for t, _ in a.top] == [t for t, _ in b.top]


class TestOutputs:
    def test_stop_tokens_stop_strings_and_text_as_without_drafts(self) -> None:
        """Kept drafts go through stop checks and detokenization one token at a time: a
        stop token or string inside a step's kept drafts ends the output exactly where
        decoding without drafts ends it, with the same text."""
        prompts = _prompts()
        with LLM(EngineConfig(model="builtin:tiny")) as llm:
            free = llm.generate(prompts, GREEDY)
        stop_token = free[0].token_ids[17]
        stop_text = free[2].text[len(free[2].text) // 2 :][:3]
        params = [
            SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                           stop_token_ids=[stop_token]),
            GREEDY,
            SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop_text]),
        ]  # fmt: skip
        results = []
        for config in ({}, {"speculative_config": NGRAM}):
            with LLM(EngineConfig(model="builtin:tiny", **config)) as llm:
                outs = llm.generate(prompts, params)
                results.append([(tuple(o.token_ids), o.text, o.finish_reason) for o in outs])
                kept = llm.engine.core.scheduler.spec_decode_counts[1]
        assert kept > 0
        assert results[0] == results[1]
        assert results[1][0][2] == results[1][2][2] == "stop"


class TestWithTheEnginesMachinery:
    def test_two_worker_processes(self) -> None:
        """Tensor parallel over two processes: the drafts go out with the step's
        requests, each rank computes its shard of them, rank 0 verifies; the tokens
        are those of one in-process engine without speculation."""
        prompts = _prompts()
        plain, _ = _run(prompts, GREEDY)
        spec, proposed = _run(prompts, GREEDY, speculative_config=NGRAM, executor="multiproc",
                              world_size=2)  # fmt: skip
        assert proposed > 0 and spec == plain

    def test_preemption_under_kv_pressure(self) -> None:
        """Too few blocks for the batch: requests are preempted (their drafts dropped)
        and resumed, and the tokens stay those of a roomy engine without speculation."""
        prompts = _prompts()
        roomy, _ = _run(prompts, GREEDY)
        config = EngineConfig(model="builtin:tiny", speculative_config=NGRAM, num_gpu_blocks=9)
        with LLM(config) as llm:
            got = [tuple(o.token_ids) for o in llm.generate(prompts, GREEDY)]
            drafted, kept = llm.engine.core.scheduler.spec_decode_counts
            assert llm.leak_report()["blocks_in_use"] == 0
            assert llm.engine.core.scheduler.num_preemptions > 0
        assert 0 < kept <= drafted
        assert got == roomy

    def test_prefix_cache_hits_give_the_same_tokens(self) -> None:
        """The second run of the same prompts starts from the prefix cache (blocks
        cached while drafts were verified) and gives the same tokens."""
        prompts = _prompts()
        plain, _ = _run(prompts, GREEDY)
        with LLM(EngineConfig(model="builtin:tiny", speculative_config=NGRAM)) as llm:
            first = llm.generate(prompts, GREEDY)
            again = llm.generate([p + list(o.token_ids) for p, o in zip(prompts, first,
                                  strict=True)], SamplingParams(max_tokens=8, temperature=0.0,
                                  ignore_eos=True))  # fmt: skip
        assert [tuple(o.token_ids) for o in first] == plain
        # Everything the first run computed is cached: all of the prompt but its last
        # token, to the block.
        for prompt, out, second in zip(prompts, first, again, strict=True):
            computed = len(prompt) + len(out.token_ids) - 1
            assert second.num_cached_tokens == computed // 16 * 16

    def test_shared_storage_second_engine_loads_what_the_first_saved(self, tmp_path: Path) -> None:
        """A connector saves the blocks of kept tokens (blocks drafts filled too, a
        step later); a second engine (empty prefix cache) loads them and gives the same
        tokens."""
        prompts = _prompts()
        plain, _ = _run(prompts, GREEDY)
        config: dict[str, Any] = {"connector": "shared_storage",
                  "connector_options": {"path": str(tmp_path / "store")}}  # fmt: skip
        spec, _ = _run(prompts, GREEDY, speculative_config=NGRAM, **config)
        assert spec == plain
        longer = [p + list(t[:-1]) for p, t in zip(prompts, spec, strict=True)]
        with LLM(EngineConfig(model="builtin:tiny", speculative_config=NGRAM, **config)) as llm:
            outs = llm.generate(longer, SamplingParams(max_tokens=4, temperature=0.0,
                                                       ignore_eos=True))  # fmt: skip
        for prompt, out in zip(longer, outs, strict=True):
            # All full blocks but the last one, which drafts may have filled in the
            # request's last step (no step after it to save it).
            assert out.num_cached_tokens >= (len(prompt) - 1) // 16 * 16 - 16, (
                out.num_cached_tokens,
                len(prompt),
            )
            assert out.num_cached_tokens > 0


class TestConfig:
    @pytest.mark.parametrize(
        ("value", "match"),
        [
            ({"method": "eagle", "num_speculative_tokens": 2}, "ngram, draft_model"),
            ({"method": "ngram"}, "num_speculative_tokens"),
            ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
            ({"method": "ngram", "num_speculative_tokens": 2, "k": 1}, "unknown keys"),
            ({**NGRAM, "prompt_lookup_min": 5}, "prompt_lookup_min"),
            ("ngram", "must be a dict"),
        ],
    )
    def test_bad_configs_name_what_is_wrong(self, value: Any, match: str) -> None:
        with pytest.raises(InvalidConfigError, match=match):
            EngineConfig(model="builtin:tiny", speculative_config=value)

    @pytest.mark.parametrize(
        ("options", "match"),
        [
            ({"async_scheduling": True}, "async_scheduling"),
        ],
    )
    def test_not_yet_supported_combinations_are_refused(
        self, options: dict[str, Any], match: str
    ) -> None:
        with pytest.raises(InvalidConfigError, match=match):
            EngineConfig(model="builtin:tiny", speculative_config=NGRAM, **options)
