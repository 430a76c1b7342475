"""Sampling: greedy, temperature, top-k, top-p and per-request seeds."""

from __future__ import annotations

import torch

from pipeline.config import SamplingParams
from stages.model import Sampler, request_seed

CPU = torch.device("cpu")


def _logits(rows: int, vocab: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


class TestGreedy:
    def test_temperature_zero_is_argmax(self) -> None:
        """temperature=0 picks each row's argmax."""
        logits = _logits(8)
        tokens = Sampler(seed=0, device=CPU).sample(
            logits, [SamplingParams(temperature=0.0)] * 8, [0] * 8
        )
        assert tokens == logits.argmax(-1).tolist()

    def test_top_k_one_is_greedy(self) -> None:
        """top_k=1 at temperature 1 is greedy."""
        logits = _logits(8, seed=1)
        tokens = Sampler(seed=0, device=CPU).sample(
            logits, [SamplingParams(temperature=1.0, top_k=1)] * 8, list(range(8))
        )
        assert tokens == logits.argmax(-1).tolist()

    def test_tiny_top_p_is_greedy(self) -> None:
        """A tiny top_p keeps only the most likely token."""
        logits = _logits(16, seed=2)
        params = [SamplingParams(temperature=1.5, top_p=1e-6, seed=i) for i in range(16)]
        tokens = Sampler(seed=0, device=CPU).sample(logits, params, [0] * 16)
        assert tokens == logits.argmax(-1).tolist()

    def test_mixed_batch_keeps_greedy_rows(self) -> None:
        """Greedy rows stay argmax when random rows share the batch."""
        logits = _logits(10, seed=3)
        params = [
            SamplingParams(temperature=0.0) if i % 2 else SamplingParams(temperature=1.0)
            for i in range(10)
        ]
        tokens = Sampler(seed=0, device=CPU).sample(logits, params, [0] * 10)
        argmax = logits.argmax(-1).tolist()
        assert [tokens[i] for i in range(1, 10, 2)] == [argmax[i] for i in range(1, 10, 2)]

    def test_empty_batch(self) -> None:
        """No rows, no tokens."""
        assert Sampler(seed=0, device=CPU).sample(torch.empty(0, 8), [], []) == []


class TestSeeds:
    def test_same_seed_same_token_whatever_the_batch(self) -> None:
        """A seeded request samples the same token alone or at any row of any batch."""
        target = _logits(1, seed=4)[0]
        params = SamplingParams(temperature=1.0, seed=1234)
        alone = Sampler(seed=0, device=CPU).sample(target[None], [params], [7])[0]
        for batch_seed, size, row in ((5, 6, 0), (6, 9, 4), (7, 3, 2)):
            logits = _logits(size, seed=batch_seed)
            logits[row] = target
            others = [SamplingParams(temperature=1.0)] * size
            others[row] = params
            counts = [0] * size
            counts[row] = 7
            sampler = Sampler(seed=batch_seed, device=CPU)
            assert sampler.sample(logits, others, counts)[row] == alone

    def test_seed_and_index_drive_the_draw(self) -> None:
        """The draw depends on (seed, output index): indices give varied tokens."""
        flat = torch.zeros(1, 1000)
        sampler = Sampler(seed=0, device=CPU)
        params = SamplingParams(temperature=1.0, seed=99)
        draws = [sampler.sample(flat, [params], [i])[0] for i in range(20)]
        again = [sampler.sample(flat, [params], [i])[0] for i in range(20)]
        assert draws == again
        assert len(set(draws)) > 15
        other = [sampler.sample(flat, [SamplingParams(seed=100)], [i])[0] for i in range(20)]
        assert other != draws

    def test_request_seed_is_stable(self) -> None:
        """request_seed is a pure 63-bit function of (seed, index)."""
        assert request_seed(1, 2) == request_seed(1, 2)
        assert request_seed(1, 2) != request_seed(2, 1)
        assert 0 <= request_seed(-5, 10**9) < 2**63

    def test_unseeded_rows_follow_the_engine_seed(self) -> None:
        """Unseeded requests are reproducible from the engine seed, and vary with it."""
        logits = torch.zeros(64, 100)
        params = [SamplingParams(temperature=1.0)] * 64
        a = Sampler(seed=1, device=CPU).sample(logits, params, [0] * 64)
        b = Sampler(seed=1, device=CPU).sample(logits, params, [0] * 64)
        c = Sampler(seed=2, device=CPU).sample(logits, params, [0] * 64)
        assert a == b
        assert a != c


class TestDistribution:
    def test_temperature_matches_softmax(self) -> None:
        """Empirical frequencies match softmax(logits / T) within 0.03."""
        base = torch.tensor([2.0, 1.0, 0.0, -1.0])
        for temperature in (0.5, 1.0, 2.0):
            logits = base.repeat(4000, 1)
            params = [SamplingParams(temperature=temperature)] * 4000
            tokens = Sampler(seed=3, device=CPU).sample(logits, params, [0] * 4000)
            freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / 4000
            expected = (base / temperature).softmax(-1)
            assert (freq - expected).abs().max() < 0.03, (temperature, freq, expected)

    def test_seeded_rows_match_softmax(self) -> None:
        """Per-request seeds still draw from the right distribution."""
        base = torch.tensor([1.0, 0.0, 0.0, -2.0])
        params = [SamplingParams(temperature=1.0, seed=i) for i in range(3000)]
        tokens = Sampler(seed=0, device=CPU).sample(base.repeat(3000, 1), params, [0] * 3000)
        freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / 3000
        assert (freq - base.softmax(-1)).abs().max() < 0.03

    def test_top_k_restricts_to_k_best(self) -> None:
        """top_k=k only ever yields one of the k most likely tokens, and all of them."""
        logits = _logits(1, vocab=50, seed=8).repeat(2000, 1)
        params = [SamplingParams(temperature=5.0, top_k=3)] * 2000
        tokens = set(Sampler(seed=0, device=CPU).sample(logits, params, [0] * 2000))
        assert tokens == set(logits[0].topk(3).indices.tolist())

    def test_top_p_keeps_the_nucleus(self) -> None:
        """top_p keeps the smallest set of tokens whose mass reaches p."""
        probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
        logits = probs.log().repeat(3000, 1)
        params = [SamplingParams(temperature=1.0, top_p=0.7)] * 3000
        tokens = Sampler(seed=0, device=CPU).sample(logits, params, [0] * 3000)
        freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / 3000
        assert freq[2:].sum() == 0
        assert abs(freq[0].item() - 0.5 / 0.8) < 0.03
