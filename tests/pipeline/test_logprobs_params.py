"""``SamplingParams.logprobs`` / ``prompt_logprobs``: validation, and the logprobs'
round trip over the engine↔worker wire (msgspec, never pickle)."""

from __future__ import annotations

import pytest

from pipeline import MAX_LOGPROBS, SamplingParams, TokenLogprob
from pipeline.artifacts import ScheduledRequest, SchedulerOutput, WorkerOutput
from pipeline.errors import InvalidRequestError
from pipeline.executors import wire
from pipeline.executors.wire_checks import check_sendable

FIELDS = ("logprobs", "prompt_logprobs")


class TestValidation:
    @pytest.mark.parametrize("field", FIELDS)
    @pytest.mark.parametrize("value", [None, 0, 1, MAX_LOGPROBS])
    def test_allowed_values(self, field: str, value: int | None) -> None:
        """None and integers in [0, MAX_LOGPROBS] are accepted as given."""
        params = SamplingParams(**{field: value})  # type: ignore[arg-type]
        assert getattr(params, field) == value

    @pytest.mark.parametrize("field", FIELDS)
    @pytest.mark.parametrize(
        "value", [True, False, -1, MAX_LOGPROBS + 1, 1 << 70, 2.0, "5", [1]], ids=repr
    )
    def test_refused_values_name_the_field(self, field: str, value: object) -> None:
        """A bool, a negative, more than MAX_LOGPROBS, or a non-int raises
        InvalidRequestError naming the field."""
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams(**{field: value})  # type: ignore[arg-type]
        assert info.value.what == field
        assert field in str(info.value)

    def test_max_logprobs_is_twenty(self) -> None:
        """The cap is vLLM's default max_logprobs."""
        assert MAX_LOGPROBS == 20


class TestWire:
    def test_sampling_params_cross_the_wire(self) -> None:
        """Params with logprobs fields pass the engine's admission and a Step frame
        decodes to equal params."""
        params = SamplingParams(logprobs=5, prompt_logprobs=0)
        assert check_sendable(params) is params
        request = ScheduledRequest(
            req_id="r",
            token_ids=(1, 2, 3),
            num_computed_tokens=0,
            block_ids=(0,),
            new=True,
            sampling=params,
            sample=False,
            num_output_tokens=0,
            prompt_logprob_targets=(2, 3, 4),
        )
        message = wire.decode(wire.encode_step(SchedulerOutput(step_id=2, requests=(request,))))
        assert isinstance(message, wire.Step)
        assert message.scheduler_output.requests == (request,)

    def test_worker_output_logprobs_cross_the_wire(self) -> None:
        """A StepDone carrying token and prompt logprobs decodes to equal values."""
        lp = TokenLogprob(4, -0.25, 1, ((4, -0.25), (9, -1.5)))
        output = WorkerOutput(
            rank=0,
            step_id=3,
            sampled_token_ids={"a": 4},
            logprobs={"a": lp},
            prompt_logprobs={"b": (lp, TokenLogprob(1, -7.0, 30))},
        )
        message = wire.decode(wire.encode(wire.StepDone(output=output, records=[])))
        assert isinstance(message, wire.StepDone)
        assert message.output == output
        assert isinstance(message.output.logprobs["a"][0], TokenLogprob)
        assert message.output.logprobs["a"][0].top == ((4, -0.25), (9, -1.5))
