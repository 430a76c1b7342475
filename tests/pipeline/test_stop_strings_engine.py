"""Stop strings and output text through LLM and AsyncEngine on ``builtin:tiny``,
and the validation of ``stop``, ``include_stop_str_in_output`` and ``detokenize``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anyio
import msgspec
import pytest

from pipeline import LLM, AsyncEngine, EngineConfig, RequestOutput, SamplingParams
from pipeline.artifacts import ScheduledRequest, SchedulerOutput
from pipeline.errors import InvalidRequestError
from pipeline.executors import wire
from pipeline.executors.wire_checks import check_sendable
from pipeline.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS

PROMPT = "Hello there, how"
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    """One engine for the module (builtin:tiny cached off $HOME, as conftest does)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVSTEP_CACHE_DIR", str(tmp_path_factory.mktemp("kvstep-cache-stop")))
        with LLM(EngineConfig(model="builtin:tiny")) as engine:
            yield engine


@pytest.fixture(scope="module")
def unconstrained(llm: LLM) -> RequestOutput:
    (out,) = llm.generate(PROMPT, GREEDY)
    assert out.text is not None and out.finish_reason == "length"
    return out


def _stop_string(text: str) -> tuple[str, int]:
    """A 3-character ASCII stop string of ``text`` (letters and spaces), its first
    occurrence at least 3 characters in."""
    for start in range(3, len(text) - 3):
        candidate = text[start : start + 3]
        plain = all(c.isascii() and (c.isalpha() or c == " ") for c in candidate)
        if plain and text.find(candidate) == start:
            return candidate, start
    raise AssertionError(f"no stop string in {text!r}")


def _idle(report: dict[str, int]) -> None:
    assert not {k: v for k, v in report.items() if k != "cached_blocks" and v}


class TestLLM:
    def test_stop_string_ends_the_request_early(
        self, llm: LLM, unconstrained: RequestOutput
    ) -> None:
        """A stop string from the greedy text stops there with "stop", blocks freed."""
        assert unconstrained.text is not None
        stop, start = _stop_string(unconstrained.text)
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
        (out,) = llm.generate(PROMPT, params)
        assert (out.finish_reason, out.stop_reason) == ("stop", stop)
        assert out.text == unconstrained.text[:start]
        assert len(out.token_ids) < len(unconstrained.token_ids)
        assert out.token_ids == unconstrained.token_ids[: len(out.token_ids)]
        _idle(llm.leak_report())
        (again,) = llm.generate(PROMPT, GREEDY)  # the next request is unaffected
        assert (again.token_ids, again.text) == (unconstrained.token_ids, unconstrained.text)
        assert again.stop_reason is None
        _idle(llm.leak_report())

    def test_include_stop_str_in_output(self, llm: LLM, unconstrained: RequestOutput) -> None:
        """include_stop_str_in_output keeps the stop string at the end of the text."""
        assert unconstrained.text is not None
        stop, start = _stop_string(unconstrained.text)
        params = SamplingParams(
            max_tokens=24, temperature=0.0, stop=stop, include_stop_str_in_output=True
        )
        (out,) = llm.generate(PROMPT, params)
        assert out.text == unconstrained.text[: start + len(stop)]
        assert out.stop_reason == stop

    def test_stop_token_id_is_the_stop_reason(self, llm: LLM, unconstrained: RequestOutput) -> None:
        """A stop_token_ids token that ends the request is its stop_reason."""
        tokens = unconstrained.token_ids
        index = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
        params = SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[tokens[index]])
        (out,) = llm.generate(PROMPT, params)
        assert (out.finish_reason, out.stop_reason) == ("stop", tokens[index])
        assert out.token_ids == tokens[: index + 1]

    def test_detokenize_off_gives_no_text(self, llm: LLM, unconstrained: RequestOutput) -> None:
        """detokenize=False: the same tokens, no text."""
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, detokenize=False)
        (out,) = llm.generate(PROMPT, params)
        assert (out.text, out.new_text) == (None, "")
        assert out.token_ids == unconstrained.token_ids

    def test_no_tokenizer_refuses_stop_strings(self, llama_path: Path) -> None:
        """An engine without a tokenizer refuses stop strings at admission; no text."""
        config = EngineConfig(model=str(llama_path), dtype="float32", max_model_len=512)
        with LLM(config) as plain:
            with pytest.raises(InvalidRequestError, match="stop"):
                plain.generate([1, 2, 3], SamplingParams(stop="x"))
            (out,) = plain.generate([1, 2, 3], SamplingParams(max_tokens=3))
            assert out.text is None
            _idle(plain.leak_report())


@pytest.mark.anyio
class TestAsyncEngine:
    async def test_streamed_deltas_build_the_text(self, unconstrained: RequestOutput) -> None:
        """Each output's new_text extends text; the stream stops at the stop string."""
        assert unconstrained.text is not None
        stop, start = _stop_string(unconstrained.text)
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
        async with AsyncEngine(EngineConfig(model="builtin:tiny")) as engine:
            streamed, last = "", None
            async for out in engine.generate(PROMPT, params):
                streamed += out.new_text
                assert out.text == streamed
                last = out
            assert last is not None and last.finished
            assert (last.finish_reason, last.stop_reason) == ("stop", stop)
            assert streamed == unconstrained.text[:start]
            _idle(engine.leak_report())

    async def test_an_aborted_request_leaves_no_text_state(self) -> None:
        """Aborting a stream mid-way flushes its text and drops its tracker."""
        params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True, stop="zqzq")
        async with AsyncEngine(EngineConfig(model="builtin:tiny")) as engine:
            stream = engine.generate(PROMPT, params)
            async for out in stream:
                assert not out.finished
                break
            await stream.aclose()
            with anyio.fail_after(10):
                while engine.num_requests or engine.leak_report()["text_trackers"]:
                    await anyio.sleep(0.01)
            _idle(engine.leak_report())


def _round_trip(params: SamplingParams) -> SamplingParams:
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
    message = wire.decode(wire.encode_step(SchedulerOutput(step_id=1, requests=(request,))))
    assert isinstance(message, wire.Step)
    return message.scheduler_output.requests[0].sampling


class TestValidation:
    def test_a_string_or_strings_become_a_tuple(self) -> None:
        """stop accepts one string or an iterable of strings; stored as a tuple."""
        assert SamplingParams(stop="ab").stop == ("ab",)
        assert SamplingParams(stop=iter(["a", "b"])).stop == ("a", "b")
        assert SamplingParams().stop == ()

    @pytest.mark.parametrize(
        "fields",
        [
            {"stop": [""]},
            {"stop": ["x" * (MAX_STOP_STRING_CHARS + 1)]},
            {"stop": ["x"] * (MAX_STOP_STRINGS + 1)},
            {"stop": [1]},
            {"stop": b"x"},
            {"stop": True},
            {"stop": 5},
            {"stop": {"a": 1}},
            {"stop": [None]},
            {"stop": ["ok", "\ud800"]},
            {"stop": "x", "detokenize": False},
            {"include_stop_str_in_output": 1},
            {"include_stop_str_in_output": "yes"},
            {"detokenize": 0},
            {"detokenize": None},
        ],
    )
    def test_bad_values_are_refused_naming_the_field(self, fields: dict) -> None:
        """A bad stop, include_stop_str_in_output or detokenize names the field."""
        with pytest.raises(InvalidRequestError, match=next(iter(fields))) as info:
            SamplingParams(**fields)
        assert len(str(info.value)) < 300

    def test_a_huge_iterable_is_refused_lazily(self) -> None:
        """An endless iterable of stop strings is refused without being read whole."""
        import itertools

        with pytest.raises(InvalidRequestError, match="stop"):
            SamplingParams(stop=itertools.repeat("x"))

    def test_the_limits_pass(self) -> None:
        """MAX_STOP_STRINGS strings of MAX_STOP_STRING_CHARS characters are allowed."""
        stop = ["x" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS
        assert len(SamplingParams(stop=stop).stop) == MAX_STOP_STRINGS

    def test_round_trips_the_wire(self) -> None:
        """The new fields cross the engine↔worker wire unchanged."""
        params = SamplingParams(
            stop=["a", "é 🙂"], include_stop_str_in_output=True, detokenize=True
        )
        assert _round_trip(params) == params
        assert check_sendable(params) is params
        off = SamplingParams(detokenize=False)
        assert _round_trip(off) == off
        decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
        assert decoded == params

    def test_altered_params_are_refused_at_admission(self) -> None:
        """A stop altered after construction is refused by the wire check."""
        params = SamplingParams()
        object.__setattr__(params, "stop", ("",))
        with pytest.raises(InvalidRequestError):
            check_sendable(params)
