"""Hostile sampling parameters are refused at admission, naming the field (issue 10).

Findings 1, 2 and 17: a ``bool`` where a number is meant, a number out of range, a huge
integer and an unbounded ``stop_token_ids`` raise ``InvalidRequestError``; whatever
passes crosses the engine↔worker wire (msgspec) unchanged.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline import SamplingParams
from pipeline.artifacts import ScheduledRequest, SchedulerOutput
from pipeline.config import MAX_STOP_TOKEN_IDS, SAMPLING_EPS
from pipeline.errors import InvalidRequestError
from pipeline.executors import wire
from pipeline.executors.wire_checks import check_sendable

FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos")


def _round_trip(params: SamplingParams) -> SamplingParams:
    """``params`` sent to a worker inside a step and decoded there."""
    request = ScheduledRequest(
        req_id="r",
        token_ids=(1, 2),
        num_computed_tokens=0,
        block_ids=(0,),
        new=True,
        sampling=params,
        sample=True,
        num_output_tokens=0,
    )
    frame = wire.encode_step(SchedulerOutput(step_id=3, requests=(request,)))
    message = wire.decode(frame)
    assert isinstance(message, wire.Step)
    return message.scheduler_output.requests[0].sampling


class TestTypes:
    @pytest.mark.parametrize(
        "fields",
        [
            {"temperature": True},
            {"temperature": False},
            {"seed": True},
            {"top_k": True},
            {"top_p": True},
            {"ignore_eos": "no"},
            {"ignore_eos": {}},
            {"ignore_eos": 1},
            {"stop_token_ids": [True]},
        ],
    )
    def test_bools_and_wrong_types_are_refused(self, fields: dict[str, Any]) -> None:
        """Finding 1: a bool where a number is meant, or a non-bool ignore_eos, is refused."""
        (name,) = fields
        with pytest.raises(InvalidRequestError, match=name):
            SamplingParams(**fields)

    @pytest.mark.parametrize(
        "fields",
        [
            {"temperature": 10**400},
            {"temperature": math.inf},
            {"top_p": 10**400},
            {"seed": 2**64},
            {"seed": -(2**63) - 1},
            {"top_k": 2**40},
            {"max_tokens": 2**63},
            {"stop_token_ids": [2**64]},
        ],
    )
    def test_out_of_range_numbers_are_refused(self, fields: dict[str, Any]) -> None:
        """Finding 2: 10**400, inf, NaN and integers beyond 64 bits are refused at admission."""
        (name,) = fields
        with pytest.raises(InvalidRequestError, match=name) as info:
            SamplingParams(**fields)
        assert len(str(info.value)) < 300  # the value is named, never embedded whole

    def test_numbers_are_stored_as_the_types_the_wire_expects(self) -> None:
        """Finding 2: an int temperature is stored as a float; 64-bit seeds round-trip."""
        params = SamplingParams(temperature=1, top_p=1, seed=2**63 - 1)
        assert type(params.temperature) is float and type(params.top_p) is float
        assert _round_trip(params) == params
        assert _round_trip(SamplingParams(seed=-(2**63))).seed == -(2**63)

    def test_tiny_temperature_is_greedy(self) -> None:
        """Finding 1: a temperature below 1e-5 samples greedily (no NaN probabilities)."""
        assert SamplingParams(temperature=SAMPLING_EPS / 2).greedy
        assert not SamplingParams(temperature=SAMPLING_EPS).greedy

    def test_message_of_a_huge_value_is_short(self) -> None:
        """Finding 2: the error names the field and stays short whatever the value."""
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams(temperature=10**5000)
        assert "temperature" in str(info.value) and len(str(info.value)) < 200


class TestStopTokenIds:
    def test_at_most_the_cap(self) -> None:
        """Finding 17: more than MAX_STOP_TOKEN_IDS stop tokens are refused, lazily."""
        assert len(SamplingParams(stop_token_ids=range(MAX_STOP_TOKEN_IDS)).stop_token_ids) == (
            MAX_STOP_TOKEN_IDS
        )
        with pytest.raises(InvalidRequestError, match="stop_token_ids") as info:
            SamplingParams(stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1))
        assert len(str(info.value)) < 300
        with pytest.raises(InvalidRequestError, match="stop_token_ids"):
            SamplingParams(stop_token_ids=range(10**12))  # never materialised

    def test_kept_as_a_set(self) -> None:
        """Finding 17: stop tokens are checked as a set (duplicates collapse)."""
        params = SamplingParams(stop_token_ids=[7, 3, 7, 3])
        assert params.stop_token_ids == frozenset({3, 7})
        assert _round_trip(params).stop_token_ids == frozenset({3, 7})

    @pytest.mark.parametrize("value", [b"12", 5])
    def test_not_a_list_is_refused(self, value: object) -> None:
        """Finding 17: bytes or a number is not a list of token ids."""
        with pytest.raises(InvalidRequestError, match="stop_token_ids"):
            SamplingParams(stop_token_ids=value)  # type: ignore[arg-type]


class TestAdmissionAgreesWithTheWire:
    def test_params_altered_after_checking_are_refused(self) -> None:
        """Finding 1: params altered after construction fail admission, not the worker."""
        params = SamplingParams()
        object.__setattr__(params, "temperature", True)
        with pytest.raises(InvalidRequestError, match="sampling params"):
            check_sendable(params)
        with pytest.raises(InvalidRequestError, match="sampling params"):
            check_sendable({"temperature": 1.0})


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=8,
)
_likely = {
    "max_tokens": st.integers(min_value=-2, max_value=2**64) | _json,
    "temperature": st.floats(allow_nan=True, allow_infinity=True) | st.integers() | _json,
    "top_p": st.floats(min_value=-0.5, max_value=1.5) | _json,
    "top_k": st.integers(min_value=-3, max_value=2**33) | _json,
    "seed": st.integers(min_value=-(2**65), max_value=2**65) | _json,
    "stop_token_ids": st.lists(st.integers(min_value=-2, max_value=2**32), max_size=5) | _json,
    "ignore_eos": st.booleans() | _json,
}


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.fixed_dictionaries({}, optional=_likely))
def test_any_json_params_are_refused_or_cross_the_wire(fields: dict[str, Any]) -> None:
    """Findings 1, 2, 17: random JSON-ish fields raise InvalidRequestError or round-trip."""
    try:
        params = SamplingParams(**fields)
    except InvalidRequestError as exc:
        assert len(str(exc)) < 400
        return
    assert check_sendable(params) is params
    assert _round_trip(params) == params
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams) == params
    assert math.isfinite(params.temperature) and 0 < params.top_p <= 1
