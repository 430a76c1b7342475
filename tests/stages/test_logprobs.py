"""Logprobs in the stages: the computation from raw logits, the prompt rows of a batch,
the scheduler's prompt targets and prefix-cache bypass, fan-in and the update."""

from __future__ import annotations

import attrs
import pytest
import torch
from schedule_driver import make_scheduler

from pipeline.artifacts import FanInOutput, ScheduledRequest, SchedulerOutput, WorkerOutput
from pipeline.config import SamplingParams
from pipeline.errors import InvalidRequestError
from pipeline.logprobs import TokenLogprob
from pipeline.request import Request, RequestOutput
from stages.aggregator import FanInAggregator
from stages.model.inputs import RequestStates
from stages.model.logprobs import LogprobRequest, request_logprobs, token_logprobs
from stages.scheduler import Scheduler
from stages.scheduler.apply_output import _record_logprobs

VOCAB = 50


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def fake_logprob(token: int, position: int) -> TokenLogprob:
    """A made-up but checkable logprob: encodes the position it was computed at."""
    return TokenLogprob(token, -float(position), 1, ())


class TestTokenLogprobs:
    def test_values_are_log_softmax_of_the_raw_logits(self) -> None:
        """Each row's logprob, rank and top-k are those of log_softmax(logits)."""
        logits = _logits(4)
        tokens = [3, 7, 11, 0]
        result = token_logprobs(logits, tokens, [5, 0, 2, 20])
        lsm = logits.log_softmax(-1)
        for i, entry in enumerate(result):
            assert entry.token_id == tokens[i]
            assert entry.logprob == pytest.approx(lsm[i, tokens[i]].item(), abs=1e-6)
            assert entry.rank == int((lsm[i] >= lsm[i, tokens[i]]).sum())
            values, ids = lsm[i].topk([5, 0, 2, 20][i])
            assert [t for t, _ in entry.top] == ids.tolist()
            assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-6)

    def test_most_likely_token_has_rank_one(self) -> None:
        """The argmax token has rank 1 and heads its own top list."""
        logits = _logits(3, seed=1)
        best = logits.argmax(-1).tolist()
        for i, entry in enumerate(token_logprobs(logits, best, [1, 1, 1])):
            assert entry.rank == 1
            assert entry.top[0][0] == best[i]

    def test_many_rows_are_computed_in_blocks(self) -> None:
        """Over a thousand rows give the same values as one row at a time."""
        logits = _logits(1100, seed=2)
        tokens = (torch.arange(1100) % VOCAB).tolist()
        result = token_logprobs(logits, tokens, [3] * 1100)
        for i in (0, 511, 512, 1099):
            assert result[i] == token_logprobs(logits[i : i + 1], [tokens[i]], [3])[0]

    def test_token_outside_the_vocabulary_is_refused(self) -> None:
        """A token id the logits do not have raises ValueError."""
        with pytest.raises(ValueError, match="outside the vocabulary"):
            token_logprobs(_logits(1), [VOCAB], [0])


class TestRequestLogprobs:
    def test_a_failing_request_fails_alone(self) -> None:
        """A request whose rows cannot be scored is reported; the others get theirs."""
        logits = _logits(5)
        result = request_logprobs(
            logits,
            [
                LogprobRequest("good", 0, (1, 2), 1),
                LogprobRequest("bad", 2, (VOCAB + 3,), 0),
                LogprobRequest("also-good", 3, (4, 5), 0),
            ],
        )
        assert set(result.logprobs) == {"good", "also-good"}
        assert "outside the vocabulary" in result.errors["bad"]
        assert result.logprobs["also-good"] == tuple(token_logprobs(logits[3:5], [4, 5], [0, 0]))

    def test_rows_of_each_request_are_its_own(self) -> None:
        """Requests that are not adjacent in the logits still read their own rows."""
        logits = _logits(6)
        result = request_logprobs(
            logits, [LogprobRequest("a", 4, (1,), 0), LogprobRequest("b", 0, (2, 3), 2)]
        )
        assert result.logprobs["a"] == tuple(token_logprobs(logits[4:5], [1], [0]))
        assert result.logprobs["b"] == tuple(token_logprobs(logits[0:2], [2, 3], [2, 2]))


def _scheduled(
    req_id: str, tokens: tuple[int, ...], targets: tuple[int, ...] = (), computed: int = 0
) -> ScheduledRequest:
    return ScheduledRequest(
        req_id=req_id,
        token_ids=tokens,
        num_computed_tokens=computed,
        block_ids=(0, 1, 2, 3),
        new=True,
        sampling=SamplingParams(prompt_logprobs=1 if targets else None),
        sample=False,
        num_output_tokens=0,
        prompt_logprob_targets=targets,
    )


class TestPromptRows:
    def _states(self) -> RequestStates:
        return RequestStates(block_size=4, num_blocks=8, max_model_len=64, vocab_size=VOCAB)

    def test_rows_of_the_requests_that_ask(self) -> None:
        """Prompt rows are the first len(targets) rows of each asking request's chunk."""
        so = SchedulerOutput(
            step_id=1,
            requests=(
                _scheduled("a", (1, 2, 3)),
                _scheduled("b", (4, 5, 6, 7), targets=(5, 6, 7, 8)),
                _scheduled("c", (9, 10, 11), targets=(10, 11)),
            ),
        )
        states = self._states()
        states.update(so)
        batch = states.prepare(so, torch.device("cpu"))
        assert batch.prompt_rows is not None
        assert batch.prompt_rows.tolist() == [3, 4, 5, 6, 7, 8]
        assert batch.prompt_req_ids == ("b", "c")

    def test_no_rows_when_nobody_asks(self) -> None:
        """Without prompt targets the batch has no prompt rows (the hot path)."""
        so = SchedulerOutput(step_id=1, requests=(_scheduled("a", (1, 2, 3)),))
        states = self._states()
        states.update(so)
        batch = states.prepare(so, torch.device("cpu"))
        assert batch.prompt_rows is None
        assert batch.prompt_req_ids == ()

    @pytest.mark.parametrize("targets", [(1, 2, 3, 4), (VOCAB,), (-1,)])
    def test_inconsistent_targets_are_refused(self, targets: tuple[int, ...]) -> None:
        """More targets than tokens, or a target outside the vocabulary, is refused."""
        so = SchedulerOutput(step_id=1, requests=(_scheduled("a", (1, 2, 3), targets),))
        with pytest.raises(InvalidRequestError, match="prompt_logprob_targets"):
            self._states().update(so)


def _run(
    scheduler: Scheduler, *, drop_prompt_logprobs: str | None = None, max_steps: int = 200
) -> tuple[list[SchedulerOutput], dict[str, RequestOutput]]:
    """Drive ``scheduler`` with a fake model that returns a logprob for every target."""
    steps: list[SchedulerOutput] = []
    final: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        so = scheduler.schedule()
        steps.append(so)
        sampled = {r.req_id: 7 for r in so.requests if r.sample}
        prompt = {
            r.req_id: tuple(
                fake_logprob(t, r.num_computed_tokens + i)
                for i, t in enumerate(r.prompt_logprob_targets)
            )
            for r in so.requests
            if r.prompt_logprob_targets and r.req_id != drop_prompt_logprobs
        }
        logprobs = {
            r.req_id: fake_logprob(7, r.num_computed_tokens + len(r.token_ids) - 1)
            for r in so.requests
            if r.sample and r.sampling.logprobs is not None
        }
        output = FanInOutput(
            step_id=so.step_id,
            sampled_token_ids=sampled,
            logprobs=logprobs,
            prompt_logprobs=prompt,
        )
        for out in scheduler.update_from_output(so, output):
            if out.finished:
                final[out.request_id] = out
    return steps, final


class TestSchedulerPromptLogprobs:
    def test_chunks_send_the_targets_across_chunk_boundaries(self) -> None:
        """Each chunk's targets are the prompt tokens after its positions, including the
        next chunk's first; together they cover prompt tokens 1..P-1 once."""
        scheduler = make_scheduler(max_num_batched_tokens=8)
        prompt = list(range(100, 120))
        scheduler.add_request(Request("r", prompt, SamplingParams(max_tokens=2, prompt_logprobs=2)))
        steps, final = _run(scheduler)
        chunks = [r for so in steps for r in so.requests]
        targets = [t for r in chunks for t in r.prompt_logprob_targets]
        assert targets == prompt[1:]
        assert chunks[0].prompt_logprob_targets == tuple(prompt[1:9])  # 8 rows, the 9th token
        out = final["r"]
        assert out.prompt_logprobs is not None
        assert out.prompt_logprobs[0] is None
        assert [e.token_id for e in out.prompt_logprobs[1:]] == prompt[1:]  # type: ignore[union-attr]
        assert [e.logprob for e in out.prompt_logprobs[1:]] == [  # type: ignore[union-attr]
            -float(p) for p in range(len(prompt) - 1)
        ]
        assert out.logprobs is None

    def test_generated_logprobs_are_cumulative(self) -> None:
        """One logprob per generated token, in order, on every output."""
        scheduler = make_scheduler()
        scheduler.add_request(Request("r", [1, 2, 3], SamplingParams(max_tokens=3, logprobs=0)))
        _, final = _run(scheduler)
        out = final["r"]
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 3
        assert [e.logprob for e in out.logprobs] == [-2.0, -3.0, -4.0]
        assert out.prompt_logprobs is None

    def test_prompt_logprobs_requests_take_no_prefix_cache_hit(self) -> None:
        """A cached prompt is reused by a plain request, computed whole for one that
        asks for prompt logprobs."""
        scheduler = make_scheduler()
        prompt = list(range(1, 18))
        scheduler.add_request(Request("warm", prompt, SamplingParams(max_tokens=1)))
        _run(scheduler)
        scheduler.add_request(Request("plain", prompt, SamplingParams(max_tokens=1)))
        steps, final = _run(scheduler)
        assert final["plain"].num_cached_tokens == 16
        scheduler.add_request(
            Request("asks", prompt, SamplingParams(max_tokens=1, prompt_logprobs=0))
        )
        steps, final = _run(scheduler)
        assert final["asks"].num_cached_tokens == 0
        assert steps[0].requests[0].num_computed_tokens == 0
        assert len(final["asks"].prompt_logprobs or ()) == len(prompt)

    def test_missing_prompt_logprobs_fail_the_request_alone(self) -> None:
        """A step that brings no prompt logprobs for a request fails it, not the others."""
        scheduler = make_scheduler()
        scheduler.add_request(Request("bad", [1, 2, 3, 4], SamplingParams(prompt_logprobs=1)))
        scheduler.add_request(Request("ok", [5, 6, 7, 8], SamplingParams(max_tokens=2)))
        _, final = _run(scheduler, drop_prompt_logprobs="bad")
        assert final["bad"].finish_reason == "error"
        assert "prompt logprobs" in (final["bad"].error or "")
        assert final["ok"].finish_reason == "length"

    def test_one_token_prompt_has_only_the_first_entry(self) -> None:
        """A one-token prompt has prompt logprobs (None,) and no targets."""
        scheduler = make_scheduler()
        scheduler.add_request(Request("r", [9], SamplingParams(max_tokens=1, prompt_logprobs=3)))
        steps, final = _run(scheduler)
        assert steps[0].requests[0].prompt_logprob_targets == ()
        assert final["r"].prompt_logprobs == (None,)


class TestFanIn:
    def test_driver_logprobs_are_kept(self) -> None:
        """Logprobs come from rank 0; other ranks' are ignored, whatever the order."""
        lp = TokenLogprob(3, -0.5, 1, ((3, -0.5),))
        other = TokenLogprob(4, -9.0, 2, ())
        agg = FanInAggregator(2)
        merged = agg.merge(
            1,
            [
                WorkerOutput(rank=1, step_id=1, logprobs={"r": other}),
                WorkerOutput(
                    rank=0, step_id=1, logprobs={"r": lp}, prompt_logprobs={"r": (lp, lp)}
                ),
            ],
        )
        assert merged.logprobs == {"r": (lp,)}
        assert merged.prompt_logprobs == {"r": (lp, lp)}


class TestRecordLogprobs:
    def _item(self, request: Request, start: int, n: int) -> ScheduledRequest:
        prompt = request.prompt_token_ids
        return ScheduledRequest(
            req_id=request.request_id,
            token_ids=tuple(prompt[start : start + n]),
            num_computed_tokens=start,
            block_ids=(),
            new=start == 0,
            sampling=request.sampling_params,
            sample=False,
            num_output_tokens=0,
            prompt_logprob_targets=tuple(prompt[start + 1 : min(start + n + 1, len(prompt))]),
        )

    def _output(self, item: ScheduledRequest, shift: float = 0.0) -> FanInOutput:
        entries = tuple(
            TokenLogprob(t, -float(item.num_computed_tokens + i) - shift, 1, ())
            for i, t in enumerate(item.prompt_logprob_targets)
        )
        return FanInOutput(step_id=1, prompt_logprobs={item.req_id: entries})

    def test_a_recomputed_chunk_overwrites_and_a_gap_is_refused(self) -> None:
        """After a preemption the prompt is scored again from position 0 (entries are
        overwritten, never duplicated); entries past the filled ones are an error."""
        request = Request("r", [10, 11, 12, 13, 14, 15], SamplingParams(prompt_logprobs=0))
        first = self._item(request, 0, 3)
        assert _record_logprobs(request, first, self._output(first), None) is None
        assert len(request.prompt_logprobs or ()) == 4
        again = self._item(request, 0, 3)
        assert _record_logprobs(request, again, self._output(again, shift=0.5), None) is None
        assert [e.logprob for e in request.prompt_logprobs[1:]] == [-0.5, -1.5, -2.5]  # type: ignore[index,union-attr]
        gap = self._item(request, 4, 2)
        assert "gap" in (_record_logprobs(request, gap, self._output(gap), None) or "")
        rest = self._item(request, 3, 3)
        assert _record_logprobs(request, rest, self._output(rest), None) is None
        assert isinstance(request.prompt_logprobs, tuple)
        assert len(request.prompt_logprobs) == 6
        assert not request.needs_prompt_logprobs

    def test_a_sampled_token_without_its_logprob_is_an_error(self) -> None:
        """A request that asked for logprobs and got a token without one fails."""
        request = Request("r", [1, 2], SamplingParams(logprobs=2))
        item = attrs.evolve(self._item(request, 0, 2), sample=True, prompt_logprob_targets=())
        error = _record_logprobs(request, item, FanInOutput(step_id=1), 5)
        assert error is not None and "logprob" in error
        wrong = FanInOutput(step_id=1, logprobs={"r": TokenLogprob(6, -1.0, 1, ())})
        assert _record_logprobs(request, item, wrong, 5) is not None
        right = FanInOutput(step_id=1, logprobs={"r": TokenLogprob(5, -1.0, 1, ())})
        assert _record_logprobs(request, item, right, 5) is None
        assert request.logprobs == [TokenLogprob(5, -1.0, 1, ())]
