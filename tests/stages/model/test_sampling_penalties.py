"""Penalties, ``logit_bias``, ``min_p`` and ``min_tokens`` (issue 12), as vLLM's sampler.

The adjusted logits of a mixed batch are computed by hand from the definitions and
compared with :func:`adjust_logits` and the greedy tokens; ``min_tokens`` keeps EOS and
stop tokens out until reached (sampler and engine); bad values name their field; the new
fields cross a multiproc worker and give the tokens an in-process engine gives, with and
without the prefix cache (whose cached tokens the worker still needs for the penalties).
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline import LLM, EngineConfig
from pipeline.config import MAX_LOGIT_BIAS, SamplingParams
from pipeline.errors import InvalidRequestError
from pipeline.executors.wire_checks import check_sendable
from stages.model.sampling import Sampler, adjust_logits

CPU = torch.device("cpu")
VOCAB = 12


def _by_hand(
    logits: np.ndarray, params: SamplingParams, prompt: list[int], output: list[int]
) -> np.ndarray:
    """One row adjusted from the definitions, one token at a time (vLLM's order)."""
    x = logits.astype(np.float64).copy()
    for tok, bias in params.logit_bias:
        x[tok] += bias
    r = params.repetition_penalty
    for tok in set(prompt) | set(output):
        x[tok] = x[tok] / r if x[tok] > 0 else x[tok] * r
    for tok in set(output):
        x[tok] -= params.frequency_penalty * output.count(tok)
        x[tok] -= params.presence_penalty
    return x


def test_mixed_batch_matches_hand_computed_logits() -> None:
    """Presence+frequency, repetition, logit_bias, min_p and plain greedy rows in one batch:
    the adjusted logits equal the hand-computed ones and the greedy tokens their argmax."""
    rng = np.random.default_rng(3)
    raw = rng.normal(0.0, 2.0, size=(5, VOCAB)).astype(np.float32)
    # Make each adjustment change the argmax: the penalised / biased tokens lead.
    raw[0, 3], raw[0, 5], raw[0, 9] = 6.0, 5.8, 5.0  # 3 twice and 5 once in the output
    raw[1, 4], raw[1, 6], raw[1, 8] = 6.0, -0.5, 5.0  # 4 in the prompt, 6 in the output
    raw[2, 1], raw[2, 7] = 6.0, 3.0
    greedy = {"temperature": 0.0, "max_tokens": 8}
    params = [
        SamplingParams(presence_penalty=0.7, frequency_penalty=0.4, **greedy),
        SamplingParams(repetition_penalty=1.5, **greedy),
        SamplingParams(logit_bias={7: 5.0, 1: -100}, **greedy),
        SamplingParams(min_p=0.3, **greedy),
        SamplingParams(**greedy),
    ]
    histories = [
        ([1, 2], [3, 3, 5]),
        ([0, 4], [6]),
        ([5], [5, 5]),  # no penalty: its history is ignored
        ([9], []),
        ([10, 11], [0]),
    ]
    token_ids = [p + o for p, o in histories]
    num_out = [len(o) for _, o in histories]
    expected = np.stack([_by_hand(raw[i], params[i], *histories[i]) for i in range(5)]).astype(
        np.float32
    )
    assert (expected.argmax(-1)[:3] != raw.argmax(-1)[:3]).all()  # the test has teeth

    adjusted = adjust_logits(torch.from_numpy(raw), params, num_out, token_ids)
    np.testing.assert_allclose(adjusted.numpy(), expected, rtol=1e-6, atol=1e-5)
    tokens = Sampler(seed=0, device=CPU).sample(torch.from_numpy(raw), params, num_out, token_ids)
    assert tokens == expected.argmax(-1).tolist()
    assert tokens[:3] == [9, 8, 7]
    # Repetition divides the positive logit of a seen token and multiplies a negative one.
    assert adjusted[1, 4] == pytest.approx(6.0 / 1.5)
    assert adjusted[1, 6] == pytest.approx(-0.75)


def test_no_adjustment_returns_the_same_tensor() -> None:
    """Rows without penalties, bias or min_tokens are the untouched fast path (no copy)."""
    logits = torch.randn(4, VOCAB)
    params = [SamplingParams(temperature=0.0)] * 4
    assert adjust_logits(logits, params, [0] * 4) is logits


def test_min_p_drops_unlikely_tokens() -> None:
    """min_p keeps tokens whose probability is at least min_p times the top one's."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()[None, :].repeat(200, 1)
    params = [SamplingParams(min_p=0.5, seed=i) for i in range(200)]
    tokens = Sampler(seed=0, device=CPU).sample(logits, params, [0] * 200)
    assert set(tokens) == {0, 1}
    plain = Sampler(seed=0, device=CPU).sample(
        logits, [SamplingParams(seed=i) for i in range(200)], [0] * 200
    )
    assert {2, 3} & set(plain)


class TestMinTokens:
    EOS = 2

    def _logits(self) -> torch.Tensor:
        logits = torch.zeros(1, VOCAB)
        logits[0, self.EOS], logits[0, 4], logits[0, 6] = 9.0, 8.0, 7.0
        return logits

    def test_eos_and_stop_ids_suppressed_until_reached(self) -> None:
        sampler = Sampler(seed=0, device=CPU, eos_token_id=self.EOS)
        params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[4])
        got = [sampler.sample(self._logits(), [params], [n])[0] for n in range(5)]
        assert got == [6, 6, 6, self.EOS, self.EOS]

    def test_ignore_eos_leaves_eos_alone(self) -> None:
        """As vLLM: with ignore_eos, EOS is no stop token, so min_tokens does not mask it."""
        sampler = Sampler(seed=0, device=CPU, eos_token_id=self.EOS)
        params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[4], ignore_eos=True)
        assert sampler.sample(self._logits(), [params], [0]) == [self.EOS]

    def test_engine_does_not_stop_before_min_tokens(self, llama_path: Path) -> None:
        cfg = EngineConfig(model=str(llama_path), dtype="float32", device="cpu")
        prompt = [5, 17, 33, 90, 4]
        with LLM(cfg) as llm:
            free = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6))[0]
            first = free.token_ids[0]
            stopped = llm.generate(
                prompt, SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[first])
            )[0]
            held = llm.generate(
                prompt,
                SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[first], min_tokens=4),
            )[0]
        assert stopped.token_ids == (first,) and stopped.finish_reason == "stop"
        assert len(held.token_ids) >= 4
        assert first not in held.token_ids[:4]

    def test_engine_does_not_end_at_eos_before_min_tokens(self) -> None:
        """The model's EOS (builtin:tiny: id 2), made the argmax by ``logit_bias``, ends a
        request at once without ``min_tokens``; with ``min_tokens=4`` it is masked for the
        first 4 tokens and ends the request as the 5th (EOS is kept in the output)."""
        cfg = EngineConfig(model="builtin:tiny")
        prompt = [5, 17, 33, 90, 4]
        eos_first = {"temperature": 0.0, "max_tokens": 8, "logit_bias": {self.EOS: 100.0}}
        with LLM(cfg) as llm:
            at_once = llm.generate(prompt, SamplingParams(**eos_first))[0]
            held = llm.generate(prompt, SamplingParams(**eos_first, min_tokens=4))[0]
            leaks = llm.leak_report()
        assert at_once.token_ids == (self.EOS,) and at_once.finish_reason == "stop"
        assert len(held.token_ids) == 5 and held.finish_reason == "stop"
        assert self.EOS not in held.token_ids[:4] and held.token_ids[4] == self.EOS
        assert leaks["blocks_in_use"] == 0 and leaks["requests"] == 0


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"presence_penalty": True}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 17, "max_tokens": 16}, "min_tokens"),
        ({"min_tokens": 1.0}, "min_tokens"),
        ({"logit_bias": {3: 100.5}}, "logit_bias[3]"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias token id"),
        ({"logit_bias": {"3": 1.0}}, "logit_bias token id"),
        ({"logit_bias": [(3, 1.0), (3, 2.0)]}, "logit_bias[3]"),
        ({"logit_bias": [(3, 1.0, 2)]}, "logit_bias"),
        ({"logit_bias": "x"}, "logit_bias"),
        ({"logit_bias": dict.fromkeys(range(MAX_LOGIT_BIAS + 1), 1.0)}, "logit_bias"),
    ],
)
def test_validation_names_the_field(fields: dict[str, object], name: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**fields)  # type: ignore[arg-type]
    assert info.value.what == name


def test_new_fields_cross_the_wire() -> None:
    params = SamplingParams(
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        repetition_penalty=1.3,
        min_p=0.05,
        logit_bias={9: 2.0, 3: -100},
        min_tokens=2,
    )
    assert params.logit_bias == ((3, -100.0), (9, 2.0))
    assert check_sendable(params) == params


def test_logit_bias_outside_the_vocab_is_refused(llama_path: Path) -> None:
    cfg = EngineConfig(model=str(llama_path), dtype="float32", device="cpu")
    with LLM(cfg) as llm, pytest.raises(InvalidRequestError) as info:
        llm.generate([1, 2, 3], SamplingParams(logit_bias={10**6: 1.0}))
    assert info.value.what == "logit_bias"


def _workload() -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(11)
    base = [rng.randrange(1, 200) for _ in range(40)]
    prompts = [
        [*base, *[rng.randrange(1, 200) for _ in range(6)]],
        [*base, *[rng.randrange(1, 200) for _ in range(9)]],
        [*base[:20], 7, 7, 7],
        [rng.randrange(1, 200) for _ in range(13)],
        [*base, 3],
    ]
    common = {"temperature": 0.0, "max_tokens": 10, "ignore_eos": True}
    params = [
        SamplingParams(presence_penalty=1.5, frequency_penalty=1.0, **common),
        SamplingParams(repetition_penalty=2.0, **common),
        SamplingParams(logit_bias={7: 3.0, 11: 2.5}, **common),
        SamplingParams(min_p=0.2, repetition_penalty=1.2, min_tokens=3, **common),
        SamplingParams(**common),
    ]
    return prompts, params


def _generate(cfg: EngineConfig) -> list[tuple[int, ...]]:
    prompts, params = _workload()
    with LLM(cfg) as llm:
        # Twice: the second pass hits the prefix cache (when on), so the worker gets
        # the cached tokens as prefix_token_ids.
        llm.generate(prompts, params)
        outs = llm.generate(prompts, params)
    assert all(o.finish_reason == "length" for o in outs)
    if cfg.enable_prefix_caching:
        assert all(o.num_cached_tokens > 0 for o in outs[:3])
    return [o.token_ids for o in outs]


def test_penalties_across_multiproc_and_prefix_cache(llama_path: Path) -> None:
    base = {
        "model": str(llama_path),
        "dtype": "float32",
        "device": "cpu",
        "max_model_len": 256,
        "max_num_batched_tokens": 32,
        "fan_in_timeout_s": 30.0,
    }
    reference = _generate(EngineConfig(**base, enable_prefix_caching=False))  # type: ignore[arg-type]
    cached = _generate(EngineConfig(**base, enable_prefix_caching=True))  # type: ignore[arg-type]
    remote = _generate(
        EngineConfig(**base, enable_prefix_caching=True, executor="multiproc", world_size=1)  # type: ignore[arg-type]
    )
    assert cached == reference
    assert remote == reference
    prompts, _ = _workload()
    plain = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    cfg = EngineConfig(**base)  # type: ignore[arg-type]
    with LLM(cfg) as llm:
        unpenalised = [o.token_ids for o in llm.generate(prompts, plain)]
    assert unpenalised[4] == reference[4]
    assert unpenalised[:3] != reference[:3]  # the penalties and the bias change the text
