"""Verifying drafts: greedy keeps the target's argmax tokens; speculative sampling keeps
the target's distribution at every position (chi-square over many draws)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pipeline.artifacts import ModelOutput, SampledTokens, ScheduledRequest, SchedulerOutput
from pipeline.sampling_params import SamplingParams
from stages.model.sampling import Sampler
from stages.speculative import accept_greedy, accept_sampled, speculates, verify_drafts

# Chi-square critical value, 3 degrees of freedom (a 4-token vocabulary), p = 0.001.
CHI2_DF3_P001 = 16.27


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


class TestGreedy:
    def test_all_drafts_kept_and_one_more(self) -> None:
        assert accept_greedy([4, 5, 6, 7], [4, 5, 6]) == [4, 5, 6, 7]

    def test_the_first_difference_ends_it(self) -> None:
        """The target's token replaces the first wrong draft; later drafts are dropped."""
        assert accept_greedy([4, 9, 6, 7], [4, 5, 6]) == [4, 9]
        assert accept_greedy([1, 9, 6, 7], [4, 5, 6]) == [1]

    def test_no_drafts_is_one_token(self) -> None:
        assert accept_greedy(torch.tensor([3]), []) == [3]

    def test_positions_must_match_the_drafts(self) -> None:
        with pytest.raises(ValueError, match="3 target positions for 3 drafts"):
            accept_greedy([1, 2, 3], [1, 2, 3])


def _dists(gen: torch.Generator, rows: int, vocab: int = 4) -> torch.Tensor:
    return torch.softmax(torch.randn(rows, vocab, generator=gen) * 1.5, dim=-1)


@pytest.mark.parametrize("with_draft_probs", [True, False])
class TestSampled:
    def test_first_token_is_distributed_as_the_target(self, with_draft_probs: bool) -> None:
        """Whatever the drafts, the first output token is drawn from p_0."""
        setup = torch.Generator().manual_seed(7)
        p = _dists(setup, 3)
        q = _dists(setup, 2) if with_draft_probs else None
        gen = torch.Generator().manual_seed(11)
        counts = torch.zeros(4, dtype=torch.float64)
        for _ in range(20_000):
            if q is not None:
                drafts = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(2)]
            else:
                drafts = [2, 1]  # a fixed guess, as an n-gram makes
            out = accept_sampled(p, drafts, q, generator=gen)
            assert 1 <= len(out) <= 3 and out[:-1] == drafts[: len(out) - 1]
            counts[out[0]] += 1
        assert _chi2(counts, p[0].double()) < CHI2_DF3_P001, (counts, p[0])

    def test_second_token_follows_the_first_draft(self, with_draft_probs: bool) -> None:
        """When the first draft was kept, the next token is drawn from p_1."""
        setup = torch.Generator().manual_seed(3)
        p = _dists(setup, 3)
        q = _dists(setup, 2) if with_draft_probs else None
        gen = torch.Generator().manual_seed(5)
        counts = torch.zeros(4, dtype=torch.float64)
        for _ in range(30_000):
            drafts = [0, 3]
            if q is not None:
                drafts = [0, int(torch.multinomial(q[1], 1, generator=gen))]
            out = accept_sampled(p, drafts, q, generator=gen)
            if len(out) >= 2:
                counts[out[1]] += 1
        assert counts.sum() > 2_000
        assert _chi2(counts, p[1].double()) < CHI2_DF3_P001, (counts, p[1])

    def test_seeded_draws_repeat(self, with_draft_probs: bool) -> None:
        setup = torch.Generator().manual_seed(1)
        p = _dists(setup, 4)
        q = _dists(setup, 3) if with_draft_probs else None
        runs = [
            [accept_sampled(p, [1, 2, 3], q, torch.Generator().manual_seed(s)) for s in range(50)]
            for _ in range(2)
        ]
        assert runs[0] == runs[1]


class TestSampledEdges:
    def test_a_certain_target_is_greedy(self) -> None:
        """One-hot target rows (temperature near 0): the greedy rule's tokens."""
        argmax = [2, 0, 3]
        p = torch.nn.functional.one_hot(torch.tensor(argmax), 4).double()
        for drafts in ([2, 0], [2, 1], [1, 0]):
            assert accept_sampled(p, drafts) == accept_greedy(argmax, drafts)

    def test_shapes_are_checked(self) -> None:
        p = torch.full((3, 4), 0.25)
        with pytest.raises(ValueError, match="for 1 drafts"):
            accept_sampled(p, [1])
        with pytest.raises(ValueError, match="draft_probs"):
            accept_sampled(p, [1, 2], torch.full((2, 5), 0.2))


def _scheduled(req_id: str, drafts: tuple[int, ...], params: SamplingParams) -> ScheduledRequest:
    return ScheduledRequest(
        req_id=req_id, token_ids=(1,), num_computed_tokens=5, block_ids=(), new=False,
        sampling=params, sample=True, num_output_tokens=1, draft_token_ids=drafts,
    )  # fmt: skip


def _argmax(logits: torch.Tensor, params: Any, indices: Any) -> list[int | None]:
    return logits.argmax(dim=-1).tolist()


class TestVerifyDrafts:
    def test_only_requests_that_speculate_keep_drafts(self) -> None:
        """A greedy request keeps its drafts up to the first wrong one and the target's
        token there; a penalised one and a failed one keep what was sampled (their
        drafts are rejected); one asking for logprobs speculates too."""
        greedy = SamplingParams(temperature=0.0)
        requests = (
            _scheduled("g", (4, 5, 6), greedy),
            _scheduled("p", (4,), SamplingParams(temperature=0.0, repetition_penalty=1.2)),
            _scheduled("l", (4,), SamplingParams(temperature=0.0, logprobs=1)),
            _scheduled("f", (4,), greedy),
        )
        vocab = 8
        argmax = [5, 9, 6, 4, 4, 4]  # g: after 4 -> 5, after 5 -> 9 (≠ 6), ...
        rows = torch.nn.functional.one_hot(torch.tensor(argmax) % vocab, vocab).float()
        rows[1] = torch.nn.functional.one_hot(torch.tensor(1), vocab).float()  # 9 -> 1
        out = ModelOutput(
            req_ids=("g", "p", "l"), logits=torch.zeros(3, vocab),
            draft_req_ids=("g", "p", "l", "f"), draft_logits=rows,
        )  # fmt: skip
        sampled = SampledTokens(token_ids={"g": 4, "p": 4, "l": 4}, errors={"f": "bad row"})
        step = SchedulerOutput(step_id=1, requests=requests)
        got = verify_drafts(sampled, step, out, _argmax)
        assert got.token_ids == {"g": (4, 5, 1), "p": (4,), "l": (4, 4)}
        assert got.errors == {"f": "bad row"}
        assert [speculates(r.sampling) for r in requests] == [True, False, True, True]

    def test_no_drafts_changes_nothing(self) -> None:
        sampled = SampledTokens(token_ids={"a": 3})
        out = ModelOutput(req_ids=("a",), logits=torch.zeros(1, 4))
        step = SchedulerOutput(step_id=0, requests=())
        assert verify_drafts(sampled, step, out, _argmax) is sampled

    def test_a_seeded_request_draws_the_tokens_it_draws_without_drafts(self) -> None:
        """Each draft row is sampled with the output index its token has: a seeded
        request's kept tokens are those plain sampling gives, position by position
        (the drafts here are those very tokens, so every one is kept)."""
        vocab, k = 16, 3
        params = SamplingParams(temperature=1.0, seed=7)
        logits = torch.randn(k + 1, vocab, generator=torch.Generator().manual_seed(0))
        sampler = Sampler(seed=0, device=torch.device("cpu"))
        plain = [sampler.sample(logits[i : i + 1], [params], [1 + i])[0] for i in range(k + 1)]
        request = _scheduled("s", tuple(plain[:k]), params)
        out = ModelOutput(req_ids=("s",), logits=logits[:1], draft_req_ids=("s",),
                          draft_logits=logits[1:])  # fmt: skip

        def rows(x: torch.Tensor, p: Any, indices: Any) -> list[int | None]:
            return list(sampler.sample_rows(x, p, indices, adjust=False).tokens)

        sampled = SampledTokens(token_ids={"s": plain[0]})
        got = verify_drafts(sampled, SchedulerOutput(step_id=1, requests=(request,)), out, rows)
        assert got.token_ids == {"s": tuple(plain)}

    def test_a_failed_draft_row_ends_the_kept_drafts(self) -> None:
        request = _scheduled("g", (2, 3, 1), SamplingParams(temperature=0.0))
        rows = torch.nn.functional.one_hot(torch.tensor([3, 1, 0]), 4).float()
        out = ModelOutput(req_ids=("g",), logits=torch.zeros(1, 4), draft_req_ids=("g",),
                          draft_logits=rows)  # fmt: skip

        def failing(x: torch.Tensor, p: Any, indices: Any) -> list[int | None]:
            return [3, None, 0]

        sampled = SampledTokens(token_ids={"g": 2})
        got = verify_drafts(sampled, SchedulerOutput(step_id=1, requests=(request,)), out, failing)
        assert got.token_ids == {"g": (2, 3)}  # drafts 2 kept; after 3 the row failed
