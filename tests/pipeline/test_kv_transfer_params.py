"""``kv_transfer_params``: checked and copied at the door, seen by the connector's scheduler
half, and answered by its ``request_finished`` on the final output (LLM, AsyncEngine)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from transfer_connector import NAME, TransferScheduler, registered

from pipeline import LLM, AsyncEngine, EngineConfig, SamplingParams
from pipeline.errors import InvalidRequestError
from pipeline.executors import wire
from pipeline.executors.channel import Channel
from pipeline.request import RequestOutput
from pipeline.transfer_params import (
    MAX_TRANSFER_BYTES,
    MAX_TRANSFER_DEPTH,
    MAX_TRANSFER_ENTRIES,
    check_transfer_params,
    transfer_params_per_prompt,
)

PARAMS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
SENT = {"do_remote_prefill": True, "remote_block_ids": [1, 2, 3], "peer": {"host": "h", "p": 1.5}}


def nested(depth: int) -> dict[str, Any]:
    """A dict nesting ``depth`` levels (the outer dict is level 1)."""
    value: dict[str, Any] = {}
    for _ in range(depth - 1):
        value = {"d": value}
    return value


def config(**options: Any) -> EngineConfig:
    return EngineConfig(
        model="builtin:tiny",
        dtype="float32",
        max_model_len=128,
        connector=NAME,
        connector_options=options,
    )


@pytest.fixture
def connector() -> Iterator[type[TransferScheduler]]:
    with registered() as scheduler:
        yield scheduler


def _fields(params: SamplingParams) -> dict[str, Any]:
    return {"max_tokens": params.max_tokens, "temperature": 0.0, "ignore_eos": True}


async def run(engine: AsyncEngine, prompt: Any, **kw: Any) -> list[RequestOutput]:
    return [out async for out in engine.generate(prompt, PARAMS, **kw)]


class TestCheck:
    def test_none_passes(self) -> None:
        """``None`` means no params."""
        assert check_transfer_params(None) is None

    def test_returns_an_equal_copy_sharing_nothing(self) -> None:
        """The result equals the input and shares no container with it."""
        sent = {"a": [1, {"b": None}], "flag": True, "f": 0.5, "s": "x"}
        copy = check_transfer_params(sent)
        assert copy == sent and copy is not sent
        assert copy is not None and copy["a"] is not sent["a"] and copy["flag"] is True
        sent["a"][1]["b"] = "changed"  # type: ignore[index]
        assert copy["a"][1] == {"b": None}

    def test_limits_themselves_pass(self) -> None:
        """Depth, entries and size exactly at their limits are allowed."""
        check_transfer_params(nested(MAX_TRANSFER_DEPTH))
        check_transfer_params({f"k{i}": i for i in range(MAX_TRANSFER_ENTRIES)})
        check_transfer_params({"s": "x" * (MAX_TRANSFER_BYTES - 8)})

    @pytest.mark.parametrize(
        ("value", "problem"),
        [
            ([1, 2], "got a list"),
            ('{"a": 1}', "got a str"),
            ({1: "x"}, "key of type int"),
            ({"a": {None: 1}}, "key of type NoneType"),
            ({"a": math.nan}, "non-finite float"),
            ({"a": [1, -math.inf]}, "non-finite float"),
            ({"a": 2**64}, "outside 64 bits"),
            ({"a": (1, 2)}, "a tuple"),
            ({"a": b"raw"}, "a bytes"),
            ({"a": {1, 2}}, "a set"),
            ({"a": object()}, "a object"),
            (nested(MAX_TRANSFER_DEPTH + 1), "deeper than 8"),
            ({"a": [[[[[[[[1]]]]]]]]}, "deeper than 8"),
            (
                {f"k{i}": i for i in range(MAX_TRANSFER_ENTRIES + 1)},
                f"more than {MAX_TRANSFER_ENTRIES} entries",
            ),
            ({"a": list(range(10**6))}, f"more than {MAX_TRANSFER_ENTRIES} entries"),
            (
                {"a": [{"b": 1, "c": 2}] * (MAX_TRANSFER_ENTRIES // 3 + 1)},
                f"more than {MAX_TRANSFER_ENTRIES} entries",
            ),
            ({"s": "x" * (MAX_TRANSFER_BYTES + 1)}, f"more than {MAX_TRANSFER_BYTES} bytes"),
            ({"s": '"' * (MAX_TRANSFER_BYTES // 2 + 8)}, "bytes as JSON"),  # escapes double it
        ],
    )
    def test_refused_naming_the_field(self, value: object, problem: str) -> None:
        """Anything but a small JSON object is an InvalidRequestError naming the field."""
        with pytest.raises(InvalidRequestError, match="JSON object") as info:
            check_transfer_params(value)
        assert info.value.what == "kv_transfer_params"
        assert problem in str(info.value)

    def test_a_cycle_is_refused_not_a_recursion_error(self) -> None:
        """A dict that contains itself stops at the depth limit."""
        loop: dict[str, Any] = {}
        loop["self"] = loop
        with pytest.raises(InvalidRequestError, match="deeper"):
            check_transfer_params(loop)


class TestPerPrompt:
    def test_shapes(self) -> None:
        """None for all, one dict for one prompt, one entry (dict or None) per prompt."""
        assert transfer_params_per_prompt(None, 2) == [None, None]
        assert transfer_params_per_prompt({"a": 1}, 1) == [{"a": 1}]
        assert transfer_params_per_prompt([{"a": 1}, None], 2) == [{"a": 1}, None]

    @pytest.mark.parametrize(
        ("value", "message"),
        [
            ({"a": 1}, "single prompt"),
            ([{"a": 1}], "one dict or None per prompt"),
            ("a", "must be None, a dict"),
            ([{"a": 1}, [1]], "got a list"),
        ],
    )
    def test_refused(self, value: object, message: str) -> None:
        """A dict for two prompts, a list of another length, a bad entry: refused."""
        with pytest.raises(InvalidRequestError, match=message) as info:
            transfer_params_per_prompt(value, 2)
        assert info.value.what == "kv_transfer_params"


@pytest.mark.anyio
class TestAsyncEngine:
    async def test_scheduler_half_sees_a_copy_the_caller_cannot_change(
        self, connector: type[TransferScheduler]
    ) -> None:
        """get_num_new_matched_tokens sees the exact params, even if the caller mutates
        its dict right after generate; the final output carries request_finished's answer."""
        mine: dict[str, Any] = {**SENT, "remote_block_ids": [1, 2, 3]}
        connector.handed.append(mine)
        async with AsyncEngine(config()) as engine:
            stream = engine.generate([1, 2, 3, 4], PARAMS, kv_transfer_params=mine)
            mine["remote_block_ids"].append(99)
            mine["extra"] = "changed"
            outs = [out async for out in stream]
        match = [s for s in connector.seen if s.method == "match"]
        assert match and all(s.params == SENT and not s.same_object for s in match)
        assert [o.kv_transfer_params for o in outs[:-1]] == [None] * (len(outs) - 1)
        final = outs[-1]
        assert final.finished
        assert final.kv_transfer_params == {"remote_request_id": stream.request_id, "got": SENT}

    async def test_a_stop_string_final_output_carries_the_answer(
        self, connector: type[TransferScheduler]
    ) -> None:
        """A request ended by a stop string (stopped after its step) still gets the answer."""
        long = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        async with AsyncEngine(config()) as engine:
            text = [o async for o in engine.generate("hello world", long)][-1].text
            assert text
            piece = next(
                text[i : i + 2] for i in range(2, len(text) - 2) if text[i : i + 2].strip()
            )
            stopped = SamplingParams(**{**_fields(long), "stop": [piece]})
            stream = engine.generate("hello world", stopped, kv_transfer_params={"s": 1})
            outs = [o async for o in stream]
        assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == piece
        assert outs[-1].kv_transfer_params == {
            "remote_request_id": stream.request_id,
            "got": {"s": 1},
        }

    async def test_without_params_the_connector_sees_none(
        self, connector: type[TransferScheduler]
    ) -> None:
        """No params: the scheduler half sees None and the final output has none."""
        async with AsyncEngine(config()) as engine:
            outs = await run(engine, [5, 6, 7])
        assert {s.params for s in connector.seen} == {None}
        assert outs[-1].kv_transfer_params is None

    async def test_a_non_json_answer_is_dropped(self, connector: type[TransferScheduler]) -> None:
        """A connector answering a NaN: the request still finishes, without params."""
        async with AsyncEngine(config(reply="bad")) as engine:
            outs = await run(engine, [5, 6, 7], kv_transfer_params={"a": 1})
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        assert outs[-1].kv_transfer_params is None

    async def test_without_a_connector_nothing_comes_back(self) -> None:
        """No connector: the request's own params are not echoed on its output."""
        tiny = EngineConfig(model="builtin:tiny", dtype="float32", max_model_len=128)
        async with AsyncEngine(tiny) as engine:
            outs = await run(engine, [5, 6, 7], kv_transfer_params={"a": 1})
        assert outs[-1].finished and outs[-1].kv_transfer_params is None

    async def test_bad_params_are_refused_before_admission(
        self, connector: type[TransferScheduler]
    ) -> None:
        """InvalidRequestError naming kv_transfer_params; nothing is queued."""
        async with AsyncEngine(config()) as engine:
            for bad in ([1], {"a": math.nan}, nested(9), {"s": "x" * (MAX_TRANSFER_BYTES + 1)}):
                with pytest.raises(InvalidRequestError, match="kv_transfer_params"):
                    engine.generate([1, 2, 3], PARAMS, kv_transfer_params=bad)  # type: ignore[arg-type]
            assert engine.num_requests == 0
        assert connector.seen == []


class TestLLM:
    def test_params_per_prompt_round_trip(self, connector: type[TransferScheduler]) -> None:
        """One dict per prompt reaches the connector; each output has its answer."""
        with LLM(config()) as llm:
            one = llm.generate([1, 2, 3], PARAMS, kv_transfer_params={"p": 0})
            two = llm.generate([[1, 2, 3], [4, 5, 6]], PARAMS, kv_transfer_params=[{"p": 1}, None])
            with pytest.raises(InvalidRequestError, match="single prompt"):
                llm.generate([[1, 2], [3, 4]], PARAMS, kv_transfer_params={"p": 2})
            with pytest.raises(InvalidRequestError, match="kv_transfer_params"):
                llm.generate([1, 2], PARAMS, kv_transfer_params={"p": math.inf})
        assert one[0].kv_transfer_params is not None
        assert one[0].kv_transfer_params["got"] == {"p": 0}
        assert two[0].kv_transfer_params is not None
        assert two[0].kv_transfer_params["got"] == {"p": 1}
        assert two[1].kv_transfer_params is None
        seen = {s.params["p"] for s in connector.seen if s.method == "match" and s.params}
        assert seen == {0, 1}  # the refused calls queued nothing


class TestMultiproc:
    def test_params_stay_in_the_engine_process(
        self, llama_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """With worker processes, a request with params generates as usual and no frame
        sent to a worker holds them (workers get only the connector's metadata)."""
        sent: list[bytes] = []
        frame = Channel._frame

        def tap_frame(self: Channel, message: wire.Message | bytes) -> bytes:
            data = frame(self, message)
            sent.append(bytes(data))
            return data

        monkeypatch.setattr(Channel, "_frame", tap_frame)
        cfg = EngineConfig(
            model=str(llama_path),
            dtype="float32",
            max_model_len=128,
            executor="multiproc",
            world_size=2,
            connector="shared_storage",
            connector_options={"path": str(tmp_path / "store")},
        )
        marker = "kvt-marker-7f3a"
        with LLM(cfg) as llm:
            outs = llm.generate([1, 2, 3, 4], PARAMS, kv_transfer_params={marker: marker})
        assert outs[0].finish_reason == "length" and outs[0].kv_transfer_params is None
        assert sent and not any(marker.encode() in data for data in sent)
