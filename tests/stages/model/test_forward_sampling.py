"""Sampling: greedy, temperature, top-k, top-p and per-request seeds."""

from __future__ import annotations

import torch

from pipeline.config import SamplingParams
from stages.model import Sampler, request_seed
from stages.model.sampling import CANDIDATES

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


class TestInverseCdf:
    """One uniform per row, the first token whose cumulative probability exceeds it."""

    def test_masked_tokens_are_never_drawn_at_either_end_of_u(self) -> None:
        """u = 0 and u just below 1 (whose product with the total rounds up to it)
        still land on tokens with probability, never on a masked one around them."""
        logits = torch.tensor([[float("-inf"), 0.0, float("-inf"), 1.0, float("-inf")]])
        sampler = Sampler(seed=0, device=CPU)
        params = [SamplingParams(temperature=1.0)]
        for u in (0.0, 0.5, 1.0 - 2.0**-53):
            sampler._uniforms = lambda *_, u=u: torch.tensor([u], dtype=torch.float64)  # type: ignore[method-assign]
            token = sampler.sample(logits, params, [0])[0]
            assert token in (1, 3), (u, token)
        sampler._uniforms = lambda *_: torch.tensor([1.0 - 2.0**-53], dtype=torch.float64)  # type: ignore[method-assign]
        assert sampler.sample(logits, params, [0]) == [3]  # the last token with mass

    def test_the_top_edge_of_u_among_ranked_candidates(self) -> None:
        """u just below 1 with top_k (only the best tokens ranked): the last of them,
        not an index past the candidates."""
        logits = _logits(1, vocab=5000, seed=6)
        sampler = Sampler(seed=0, device=CPU)
        sampler._uniforms = lambda *_: torch.tensor([1.0 - 2.0**-53], dtype=torch.float64)  # type: ignore[method-assign]
        token = sampler.sample(logits, [SamplingParams(temperature=1.0, top_k=3)], [0])[0]
        assert token == logits[0].topk(3).indices[2].item()

    def test_a_row_without_a_finite_logit_fails_alone(self) -> None:
        logits = torch.tensor([[0.0, 1.0, 2.0], [float("-inf")] * 3, [2.0, 1.0, 0.0]])
        params = [SamplingParams(temperature=1.0)] * 3
        tokens, errors = Sampler(seed=0, device=CPU).sample_rows(logits, params, [0, 0, 0])
        assert list(errors) == [1] and "finite logit" in errors[1]
        assert tokens[1] is None and tokens[0] in (0, 1, 2) and tokens[2] in (0, 1, 2)

    def test_one_random_number_per_row(self) -> None:
        """The shared generator advances by one draw per unseeded row, whatever the
        vocabulary: a request's token does not depend on the vocabulary's size."""
        small, large = _logits(4, vocab=8, seed=1), _logits(4, vocab=50_000, seed=1)
        params = [SamplingParams(temperature=1.0)] * 4
        a, b = Sampler(seed=5, device=CPU), Sampler(seed=5, device=CPU)
        a.sample(small, params, [0] * 4)
        b.sample(large, params, [0] * 4)
        assert a._generator.get_state().equal(b._generator.get_state())


def _nucleus(logits: torch.Tensor, top_p: float) -> set[int]:
    probs, order = logits.softmax(-1).sort(descending=True)
    before = probs.cumsum(-1) - probs
    return set(order[before < top_p].tolist())


class TestRankedCandidates:
    """top-k/top-p rank only a row's best tokens when that is exact (a large vocabulary)."""

    def test_a_narrow_nucleus_is_drawn_from_the_candidates(self) -> None:
        logits = _logits(1, vocab=5000, seed=4) * 4  # peaked: a nucleus of a few tokens
        nucleus = _nucleus(logits[0], 0.9)
        assert len(nucleus) < 50
        params = [SamplingParams(temperature=1.0, top_p=0.9)] * 3000
        tokens = Sampler(seed=0, device=CPU).sample(logits.repeat(3000, 1), params, [0] * 3000)
        assert set(tokens) == nucleus

    def test_a_wide_nucleus_reaches_past_the_candidates(self) -> None:
        """A flat row's nucleus is larger than CANDIDATES: the whole row is ranked, and
        tokens ranked beyond the candidates are drawn."""
        logits = _logits(1, vocab=5000, seed=4) * 0.1
        nucleus = _nucleus(logits[0], 0.95)
        assert len(nucleus) > CANDIDATES
        beyond = set(logits[0].topk(5000).indices[CANDIDATES:].tolist())
        params = [SamplingParams(temperature=1.0, top_p=0.95)] * 3000
        tokens = set(Sampler(seed=0, device=CPU).sample(logits.repeat(3000, 1), params, [0] * 3000))
        assert tokens <= nucleus and tokens & beyond

    def test_top_k_and_top_p_rows_in_one_batch(self) -> None:
        logits = torch.cat([_logits(1, vocab=5000, seed=5) * 4] * 2)
        params = [SamplingParams(temperature=1.0, top_k=3), SamplingParams(top_p=0.8)] * 1000
        tokens = Sampler(seed=0, device=CPU).sample(logits.repeat(1000, 1), params, [0] * 2000)
        assert set(tokens[0::2]) == set(logits[0].topk(3).indices.tolist())
        assert set(tokens[1::2]) == _nucleus(logits[0], 0.8)
