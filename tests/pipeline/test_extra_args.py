"""``SamplingParams.extra_args`` (issue 25): per-request arguments for custom logits stages.

Checked at construction (str keys, JSON values, finite floats, bounded size and depth),
stored read-only and hashable, shown in ``repr`` only in part, and carried unchanged by
the engine↔worker wire, whose typed decoder refuses exactly what construction refuses.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import attrs
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline import LLM, EngineConfig, SamplingParams
from pipeline.artifacts import ScheduledRequest, SchedulerOutput
from pipeline.errors import InvalidRequestError, TransportError
from pipeline.executors import wire
from pipeline.executors.wire_checks import check_sendable
from pipeline.sampling_params import (
    MAX_EXTRA_ARGS_BYTES,
    MAX_EXTRA_ARGS_DEPTH,
    MAX_EXTRA_ARGS_KEYS,
    ExtraArgs,
    check_extra_args,
)


def _request(sampling: Any) -> ScheduledRequest:
    return ScheduledRequest(
        req_id="r",
        token_ids=(1, 2),
        num_computed_tokens=0,
        block_ids=(0,),
        new=True,
        sampling=sampling,
        sample=True,
        num_output_tokens=0,
    )


def _round_trip(params: SamplingParams) -> SamplingParams:
    """``params`` sent to a worker inside a step and decoded there."""
    frame = wire.encode_step(SchedulerOutput(step_id=3, requests=(_request(params),)))
    message = wire.decode(frame)
    assert isinstance(message, wire.Step)
    return message.scheduler_output.requests[0].sampling


def _nested(depth: int) -> Any:
    """A value whose lists nest ``depth`` levels below the top mapping's one."""
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


#: Values construction refuses, with the path the error names.
REFUSED: list[tuple[object, str]] = [
    ([("force", 1)], "extra_args"),
    ("force", "extra_args"),
    ({1: 2}, "extra_args key"),
    ({"a": {2: 3}}, r"extra_args\['a'\] key"),
    ({"a": math.nan}, r"extra_args\['a'\]"),
    ({"a": [1.0, math.inf]}, r"extra_args\['a'\]\[1\]"),
    ({"a": 2**63}, r"extra_args\['a'\]"),
    ({"a": -(2**63) - 1}, r"extra_args\['a'\]"),
    ({"a": b"bytes"}, r"extra_args\['a'\]"),
    ({"a": {1, 2}}, r"extra_args\['a'\]"),
    ({"a": object()}, r"extra_args\['a'\]"),
    ({"a": "\ud800"}, r"extra_args\['a'\]"),
    ({"\ud800": 1}, "extra_args"),
    ({"a": _nested(MAX_EXTRA_ARGS_DEPTH)}, "nests deeper"),
    ({str(i): i for i in range(MAX_EXTRA_ARGS_KEYS + 1)}, f"at most {MAX_EXTRA_ARGS_KEYS} keys"),
    ({"a": "x" * MAX_EXTRA_ARGS_BYTES}, f"at most {MAX_EXTRA_ARGS_BYTES} bytes"),
    ({"a": [0] * MAX_EXTRA_ARGS_BYTES}, f"at most {MAX_EXTRA_ARGS_BYTES} bytes"),
    ({"a": ["\\"] * (MAX_EXTRA_ARGS_BYTES // 5)}, f"at most {MAX_EXTRA_ARGS_BYTES} bytes"),
]


class TestConstruction:
    def test_default_is_empty(self) -> None:
        """Without extra_args a request has an empty, read-only mapping."""
        params = SamplingParams()
        assert params.extra_args == {}
        assert isinstance(params.extra_args, ExtraArgs)

    def test_values_are_read_as_a_mapping(self) -> None:
        """Keys read by subscript, get and iteration; the value equals the dict given."""
        given = {"force": 7, "words": "a b", "w": 0.5, "on": True, "none": None}
        params = SamplingParams(extra_args=given)
        assert params.extra_args["force"] == 7
        assert params.extra_args.get("missing") is None
        assert list(params.extra_args) == list(given)
        assert params.extra_args == given
        assert params.extra_args["on"] is True

    def test_lists_become_tuples_and_mappings_read_only(self) -> None:
        """Nested lists are stored as tuples, nested mappings as ExtraArgs."""
        params = SamplingParams(extra_args={"ids": [1, [2, 3]], "m": {"k": ["v"]}})
        assert params.extra_args["ids"] == (1, (2, 3))
        assert isinstance(params.extra_args["m"], ExtraArgs)
        assert params.extra_args["m"] == {"k": ("v",)}

    def test_deepest_allowed_nesting_and_largest_size_pass(self) -> None:
        """The bounds are inclusive: the deepest and largest allowed values pass."""
        SamplingParams(extra_args={"a": _nested(MAX_EXTRA_ARGS_DEPTH - 1)})
        text = "x" * (MAX_EXTRA_ARGS_BYTES - len('{"a":""}'))
        args = SamplingParams(extra_args={"a": text}).extra_args
        assert len(msgspec.json.encode(args)) == MAX_EXTRA_ARGS_BYTES
        SamplingParams(extra_args={str(i): i for i in range(MAX_EXTRA_ARGS_KEYS)})

    @pytest.mark.parametrize(("value", "names"), REFUSED)
    def test_refused_values_name_the_key_path(self, value: object, names: str) -> None:
        """A non-JSON value, a bad key or an oversized value is refused, naming where."""
        with pytest.raises(InvalidRequestError, match=names) as info:
            SamplingParams(extra_args=value)
        assert len(str(info.value)) < 300

    def test_the_server_name_is_used_when_given(self) -> None:
        """check_extra_args names the value as its caller calls it (the server's vllm_xargs)."""
        with pytest.raises(InvalidRequestError, match=r"vllm_xargs\['a'\]"):
            check_extra_args({"a": math.inf}, "vllm_xargs")

    def test_repr_is_bounded(self) -> None:
        """repr shows the first items of a large extra_args, not all of it."""
        big = {f"key{i}": "v" * 200 for i in range(MAX_EXTRA_ARGS_KEYS)}
        params = SamplingParams(extra_args=big)
        assert len(repr(params)) < len(repr(SamplingParams())) + 100
        assert "extra_args={'key0'" in repr(params)


class TestImmutability:
    @pytest.mark.parametrize(
        "mutate",
        [
            lambda d: d.__setitem__("x", 1),
            lambda d: d.__delitem__("force"),
            lambda d: d.update(x=1),
            lambda d: d.pop("force"),
            lambda d: d.popitem(),
            lambda d: d.clear(),
            lambda d: d.setdefault("x", 1),
            lambda d: d.__ior__({"x": 1}),
            lambda d: d["m"].__setitem__("x", 1),
        ],
    )
    def test_mapping_cannot_change(self, mutate: Any) -> None:
        """Every mutating method of the stored mapping (and nested ones) raises TypeError."""
        params = SamplingParams(extra_args={"force": 1, "m": {"k": 2}})
        with pytest.raises(TypeError, match="read-only"):
            mutate(params.extra_args)
        assert params.extra_args == {"force": 1, "m": {"k": 2}}

    def test_in_place_or_leaves_the_params_unchanged(self) -> None:
        """params.extra_args |= {...} neither mutates nor rebinds the field."""
        params = SamplingParams(extra_args={"force": 1})
        with pytest.raises(TypeError):
            params.extra_args |= {"x": 2}  # type: ignore[misc,operator]
        assert params.extra_args == {"force": 1}

    def test_field_cannot_be_rebound(self) -> None:
        """The params stay frozen; evolve builds new ones, checked again."""
        params = SamplingParams(extra_args={"force": 1})
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            params.extra_args = {}  # type: ignore[misc]
        assert attrs.evolve(params, extra_args={"force": 2}).extra_args == {"force": 2}
        with pytest.raises(InvalidRequestError):
            attrs.evolve(params, extra_args={"force": math.nan})

    def test_the_callers_dict_is_copied(self) -> None:
        """Changing the dict given afterwards does not change the params."""
        given: dict[str, Any] = {"force": 1}
        params = SamplingParams(extra_args=given)
        given["force"] = 2
        assert params.extra_args == {"force": 1}

    def test_params_stay_hashable_and_comparable(self) -> None:
        """Equal extra_args give equal params with equal hashes; copies are the same."""
        one = SamplingParams(extra_args={"ids": [1, 2], "m": {"k": None}})
        two = SamplingParams(extra_args={"m": {"k": None}, "ids": (1, 2)})
        assert one == two and hash(one) == hash(two)
        assert one != SamplingParams(extra_args={"ids": [1, 3], "m": {"k": None}})
        assert copy.deepcopy(one) == one and copy.copy(one.extra_args) is one.extra_args


class TestWire:
    def test_round_trip_in_a_step(self) -> None:
        """extra_args crosses the wire unchanged and arrives read-only."""
        params = SamplingParams(
            extra_args={"force": 5, "ids": [1, -2], "m": {"x": 0.25, "y": [None, True, "s"]}}
        )
        assert check_sendable(params) is params
        received = _round_trip(params)
        assert received == params
        assert isinstance(received.extra_args, ExtraArgs)
        assert isinstance(received.extra_args["m"], ExtraArgs)
        assert received.extra_args["ids"] == (1, -2)

    @pytest.mark.parametrize(
        "value",
        [
            {"a": math.nan},
            {"a": {1: 2}},
            {"a": b"x"},
            {"a": 2**64 - 1},
            {"a": msgspec.msgpack.Ext(1, b"x")},
            {"a": _nested(MAX_EXTRA_ARGS_DEPTH)},
            {str(i): i for i in range(MAX_EXTRA_ARGS_KEYS + 1)},
            {"a": "x" * MAX_EXTRA_ARGS_BYTES},
            [1, 2],
        ],
    )
    def test_decoder_refuses_what_construction_refuses(self, value: object) -> None:
        """A frame carrying an extra_args construction refuses does not decode."""
        request = msgspec.to_builtins(_request(SamplingParams()))
        request["sampling"]["extra_args"] = value
        step = {"step_id": 1, "requests": [request]}
        frame = msgspec.msgpack.encode({"type": "step", "scheduler_output": step})
        assert wire.recover_step_id(frame) == 1
        with pytest.raises(TransportError, match="extra_args"):
            wire.decode(frame)

    def test_admission_refuses_params_altered_after_construction(self) -> None:
        """extra_args replaced behind the frozen class's back fails admission."""
        params = SamplingParams()
        object.__setattr__(params, "extra_args", {"a": math.inf})
        with pytest.raises(InvalidRequestError, match="sampling params"):
            check_sendable(params)


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**65), max_value=2**65)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=4)
    | st.binary(max_size=2),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=3) | st.integers(0, 3), inner, max_size=4)
    ),
    max_leaves=10,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_json)
def test_any_value_is_refused_or_crosses_the_wire(value: Any) -> None:
    """Random JSON-ish values: construction refuses them, or they round-trip exactly."""
    try:
        params = SamplingParams(extra_args=value)
    except InvalidRequestError as exc:
        assert len(str(exc)) < 400
        return
    assert check_sendable(params) is params
    assert _round_trip(params) == params
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams) == params


@pytest.mark.timeout(120)
def test_worker_processes_receive_extra_args(llama_path: Path) -> None:
    """A multiproc engine serves requests with extra_args (decoded by each worker) and
    generates what it generates without them (no built-in stage reads them)."""
    cfg = EngineConfig(
        model=str(llama_path),
        dtype="float32",
        max_model_len=128,
        executor="multiproc",
        world_size=2,
        fan_in_timeout_s=30.0,
    )
    plain = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with_args = attrs.evolve(plain, extra_args={"force": 3, "words": ["a", "b"], "m": {"x": 1.5}})
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    with LLM(cfg) as llm:
        outs = llm.generate(prompts * 2, [plain, plain, with_args, with_args])
    assert all(o.finish_reason == "length" for o in outs)
    assert [o.token_ids for o in outs[2:]] == [o.token_ids for o in outs[:2]]
