"""Multi-token steps on the engine↔worker wire: a token sequence per request (and its
drafts) round-trips through msgspec, and a frame of another shape is refused, typed."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from pipeline.artifacts import ScheduledRequest, SchedulerOutput, WorkerOutput
from pipeline.config import SamplingParams
from pipeline.errors import TransportError
from pipeline.executors import wire
from pipeline.logprobs import TokenLogprob


def _request(**fields: Any) -> ScheduledRequest:
    base: dict[str, Any] = {
        "req_id": "a",
        "token_ids": (5,),
        "num_computed_tokens": 3,
        "block_ids": (),
        "new": False,
        "sampling": SamplingParams(),
        "sample": True,
        "num_output_tokens": 1,
    }
    return ScheduledRequest(**{**base, **fields})


def _step_done(output: dict[str, Any]) -> bytes:
    """A StepDone frame whose output is ``output`` as plain values (any shape)."""
    return msgspec.msgpack.encode({"type": "step_done", "output": output, "records": []})


def _worker_output(**fields: Any) -> dict[str, Any]:
    plain = msgspec.to_builtins(WorkerOutput(rank=0, step_id=4))
    return {**plain, **fields}


class TestRoundTrip:
    def test_token_sequences_and_their_logprobs(self) -> None:
        """Every request's tokens, and one logprob per token, decode to equal values."""
        lps = tuple(TokenLogprob(t, -0.5 * i, 1) for i, t in enumerate((7, 8, 9)))
        output = WorkerOutput(
            rank=0,
            step_id=4,
            sampled_token_ids={"a": (7, 8, 9), "b": (3,)},
            logprobs={"a": lps},
        )
        message = wire.decode(wire.encode(wire.StepDone(output=output, records=[])))
        assert isinstance(message, wire.StepDone)
        assert message.output == output
        assert message.output.sampled_token_ids == {"a": (7, 8, 9), "b": (3,)}
        assert message.output.logprobs["a"] == lps

    def test_a_bare_int_is_sent_as_one_token(self) -> None:
        """A WorkerOutput built with an int per request crosses as a one-token tuple."""
        output = WorkerOutput(rank=0, step_id=4, sampled_token_ids={"a": 5})
        message = wire.decode(wire.encode(wire.StepDone(output=output, records=[])))
        assert isinstance(message, wire.StepDone)
        assert message.output.sampled_token_ids == {"a": (5,)}

    def test_draft_tokens_of_a_step(self) -> None:
        """A scheduled request's drafts reach the worker as sent."""
        request = _request(draft_token_ids=(11, 12, 13))
        frame = wire.encode_step(SchedulerOutput(step_id=2, requests=(request,)))
        message = wire.decode(frame)
        assert isinstance(message, wire.Step)
        assert message.scheduler_output.requests == (request,)
        assert message.scheduler_output.total_num_scheduled_tokens == 4


class TestRefusal:
    def test_an_int_per_request_is_a_transport_error(self) -> None:
        """A StepDone with an int where the token sequence belongs is refused with a
        TransportError naming the field, never a half-built output."""
        frame = _step_done(_worker_output(sampled_token_ids={"a": 5}))
        with pytest.raises(TransportError, match="sampled_token_ids"):
            wire.decode(frame)

    def test_only_sequences_of_ints_decode(self) -> None:
        """A sequence of ints decodes; one holding a bool, a string or a nested list is
        refused, typed."""
        good = wire.decode(_step_done(_worker_output(sampled_token_ids={"a": [5, 6]})))
        assert isinstance(good, wire.StepDone) and good.output.sampled_token_ids == {"a": (5, 6)}
        for bad in ([True], ["5"], [[5]]):
            frame = _step_done(_worker_output(sampled_token_ids={"a": bad}))
            with pytest.raises(TransportError, match="sampled_token_ids"):
                wire.decode(frame)

    def test_a_bare_logprob_is_refused(self) -> None:
        """Logprobs cross as a sequence per request; a single entry is refused."""
        entry = msgspec.to_builtins(TokenLogprob(5, -1.0, 1))
        frame = _step_done(_worker_output(sampled_token_ids={"a": [5]}, logprobs={"a": entry}))
        with pytest.raises(TransportError, match="logprobs"):
            wire.decode(frame)

    def test_bad_drafts_fail_the_step_not_the_worker(self) -> None:
        """A Step whose drafts are not ints is refused, and its step id still reads, so
        the worker answers StepFailed for that step."""
        plain = msgspec.to_builtins(wire.Step(SchedulerOutput(step_id=9, requests=(_request(),))))
        plain["scheduler_output"]["requests"][0]["draft_token_ids"] = ["x"]
        frame = msgspec.msgpack.encode(plain)
        with pytest.raises(TransportError, match="draft_token_ids"):
            wire.decode(frame)
        assert wire.recover_step_id(frame) == 9
