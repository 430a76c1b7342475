"""The output text processor: incremental text, stop strings and hold-back (vLLM semantics).

Driven with ``builtin:tiny``'s real byte-level BPE tokenizer; the stop strings that
span two and three tokens are found in its own encodings, and the split is asserted.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from types import FrameType
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.config import SamplingParams
from pipeline.engine import output_text
from pipeline.engine.output_text import OutputText, TextTracker, TextUpdate, find_stop, held_back
from pipeline.request import RequestOutput
from pipeline.tokenizer import Tokenizer, load_tokenizer
from stages.model.builtin import tokenizer_dir

TEXT = "Hello there, how are you today? The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    tok = load_tokenizer(tokenizer_dir("builtin:tiny"))
    assert tok is not None
    return tok


def _feed(
    tokenizer: Any, params: SamplingParams, ids: Sequence[int], finish: str | None = None
) -> list[TextUpdate]:
    """One update per token; the last one carries ``finish`` (if not stopped before)."""
    tracker = TextTracker(tokenizer, params)
    updates = []
    for n in range(1, len(ids) + 1):
        update = tracker.update(ids[:n], finish_reason=finish if n == len(ids) else None)
        updates.append(update)
        if update.stop is not None:
            break
    return updates


def _spanning(tokenizer: Tokenizer, ids: list[int], span: int) -> tuple[str, int, int]:
    """A stop string whose characters come from ``span`` consecutive tokens of ``ids``
    (the last character(s) of the first, the whole middle ones, the first of the last),
    occurring first there; returns it, its start in the text and the index of the
    token that completes it."""
    pieces = [tokenizer.decode([t]) for t in ids]
    text = tokenizer.decode(ids)
    assert "".join(pieces) == text  # ASCII text: every token decodes on its own
    for i in range(len(ids) - span + 1):
        group = pieces[i : i + span]
        if any(len(p) < 2 for p in (group[0], group[-1])):
            continue
        stop = group[0][-1] + "".join(group[1:-1]) + group[-1][0]
        start = len("".join(pieces[: i + 1])) - 1
        if text.find(stop) == start:
            return stop, start, i + span - 1
    raise AssertionError(f"no stop string spans {span} tokens")


class TestSplitStopStrings:
    @pytest.mark.parametrize("span", [2, 3])
    def test_stop_string_across_tokens(self, tokenizer: Tokenizer, span: int) -> None:
        """A stop string split over 2 or 3 tokens stops at the token that completes it."""
        ids = tokenizer.encode(TEXT)
        stop, start, last = _spanning(tokenizer, ids, span)
        pieces = [tokenizer.decode([t]) for t in ids[last - span + 1 : last + 1]]
        assert not any(stop in p for p in pieces) and len(pieces) == span  # really split
        updates = _feed(tokenizer, SamplingParams(stop=[stop]), ids)
        assert len(updates) == last + 1  # stopped by the completing token, not before
        assert updates[-1].stop == stop
        assert updates[-1].text == TEXT[:start]
        assert "".join(u.new_text for u in updates) == TEXT[:start]

    @pytest.mark.parametrize("span", [2, 3])
    def test_the_beginning_of_a_stop_string_is_held_back(
        self, tokenizer: Tokenizer, span: int
    ) -> None:
        """While the text ends with a proper prefix of a stop string it is not emitted."""
        ids = tokenizer.encode(TEXT)
        stop, start, last = _spanning(tokenizer, ids, span)
        updates = _feed(tokenizer, SamplingParams(stop=[stop]), ids)
        for update in updates[last - span + 1 : last]:
            assert update.text == TEXT[:start]  # the partial stop string is held

    def test_include_stop_str_in_output(self, tokenizer: Tokenizer) -> None:
        """With include_stop_str_in_output the text ends with the stop string."""
        ids = tokenizer.encode(TEXT)
        stop, start, _ = _spanning(tokenizer, ids, 3)
        params = SamplingParams(stop=[stop], include_stop_str_in_output=True)
        updates = _feed(tokenizer, params, ids)
        assert updates[-1].stop == stop
        assert updates[-1].text == TEXT[: start + len(stop)]
        assert "".join(u.new_text for u in updates) == updates[-1].text

    def test_earliest_of_several_matches_wins(self, tokenizer: Tokenizer) -> None:
        """Two stop strings completed by the same update: the one that starts first wins."""
        ids = tokenizer.encode(TEXT)
        tracker = TextTracker(tokenizer, SamplingParams(stop=["lazy", "quick", "brown"]))
        update = tracker.update(ids)
        assert update.stop == "quick"
        assert update.text == TEXT[: TEXT.index("quick")]

    def test_held_text_is_flushed_on_length(self, tokenizer: Tokenizer) -> None:
        """A request that ends by length emits the text it held for a stop string."""
        ids = tokenizer.encode("Hello there, the quick")
        updates = _feed(tokenizer, SamplingParams(stop=["quick brown"]), ids, finish="length")
        assert updates[-2].text == "Hello there, the "  # " quick" would begin the stop
        assert updates[-1].stop is None
        assert updates[-1].text == "Hello there, the quick"

    def test_no_match_before_min_tokens(self, tokenizer: Tokenizer) -> None:
        """A stop string completed within the first min_tokens tokens does not stop."""
        ids = tokenizer.encode(TEXT)
        updates = _feed(tokenizer, SamplingParams(stop=["Hello"], min_tokens=3), ids, "length")
        assert all(u.stop is None for u in updates)
        assert updates[-1].text == TEXT


class TestStopTokens:
    def test_stop_token_text_is_left_out(self, tokenizer: Tokenizer) -> None:
        """A request ended by a stop token (or EOS) does not output that token's text."""
        ids = tokenizer.encode("Hello there, how")
        tracker = TextTracker(tokenizer, SamplingParams())
        assert tracker.update(ids, finish_reason="stop").text == tokenizer.decode(ids[:-1])

    def test_included_with_include_stop_str_in_output(self, tokenizer: Tokenizer) -> None:
        """With include_stop_str_in_output the stop token's text stays."""
        ids = tokenizer.encode("Hello there, how")
        tracker = TextTracker(tokenizer, SamplingParams(include_stop_str_in_output=True))
        assert tracker.update(ids, finish_reason="stop").text == "Hello there, how"


class TestHelpers:
    def test_find_stop_searches_only_where_new_characters_reach(self) -> None:
        """A match wholly inside the older text is not searched again."""
        assert find_stop("abcXYZ", 3, ["abc"]) is None
        assert find_stop("abcXYZ", 4, ["abc"]) == ("abc", 0)
        assert find_stop("abcXYZ", 1, ["YZ", "Z"]) == ("YZ", 4)

    def test_held_back_is_the_longest_proper_prefix(self) -> None:
        """The suffix held is the longest that a stop string begins with (not all of it)."""
        assert held_back("xx ab", ["abc"]) == 2
        assert held_back("xx abc", ["abc"]) == 0  # a whole match is not a proper prefix
        assert held_back("aaa", ["aab", "b"]) == 2
        assert held_back("xyz", ["abc"]) == 0
        assert held_back("", ["abc"]) == 0


def _lines_run(tokenizer: Tokenizer, stops: list[str], ids: list[int]) -> int:
    """The lines of ``pipeline.engine.output_text`` that feeding ``ids`` one output at a
    time runs: the tracker's work, counted, not timed (a busy machine cannot move it)."""
    tracker = TextTracker(tokenizer, SamplingParams(stop=tuple(stops)))
    count = 0

    def trace(frame: FrameType, event: str, arg: object) -> Any:
        nonlocal count
        if frame.f_code.co_filename != output_text.__file__:
            return None
        if event == "line":
            count += 1
        return trace

    sys.settrace(trace)
    try:
        for n in range(1, len(ids) + 1):
            assert tracker.update(ids[:n]).stop is None
    finally:
        sys.settrace(None)
    return count


class TestStopCost:
    def test_long_partial_stop_strings_cost_what_short_ones_do(self, tokenizer: Tokenizer) -> None:
        """300 outputs of "a" against 16 stop strings of 512 characters that each begin
        with "a" many times over run about the lines that 16 one-character stop strings
        do (searching near the end and trying every partial match ran ~100x as many;
        the server-level audit saw a neighbour's tokens take 3.8x longer)."""
        (a,) = tokenizer.encode("a")
        ids = [a] * 300
        benign = _lines_run(tokenizer, ["z"] * 16, ids)
        adversarial = _lines_run(tokenizer, ["aX" * 256] * 16, ids)
        assert adversarial < 1.5 * benign, (adversarial, benign)


def _output(request_id: str, ids: list[int], finish: str | None = None) -> RequestOutput:
    return RequestOutput(
        request_id=request_id,
        prompt_token_ids=(1,),
        token_ids=tuple(ids),
        new_token_ids=tuple(ids[-1:]),
        finished=finish is not None,
        finish_reason=finish,
    )


class TestOutputText:
    def test_stops_the_request_and_drops_its_tracker(self, tokenizer: Tokenizer) -> None:
        """A match stops the request in the scheduler and ends its output with "stop"."""
        stopped: list[list[str]] = []

        def stop_requests(ids: Any) -> list[RequestOutput]:
            stopped.append(list(ids))
            return []

        processor = OutputText(tokenizer, stop_requests)
        processor.add("a", SamplingParams(stop=["there"]))
        processor.add("b", SamplingParams(detokenize=False))
        ids = tokenizer.encode("Hello there")
        (a, b) = processor.process([_output("a", ids), _output("b", ids)])
        assert (a.finished, a.finish_reason, a.stop_reason, a.text) == (
            True,
            "stop",
            "there",
            "Hello ",
        )
        assert (b.text, b.new_text, b.finished) == (None, "", False)
        assert stopped == [["a"]]
        assert len(processor) == 0

    def test_no_tokenizer_no_text_and_stop_strings_refused(self) -> None:
        """Without a tokenizer nothing is tracked and stop strings are refused."""
        from pipeline.errors import InvalidRequestError

        processor = OutputText(None, lambda ids: [])
        processor.add("a", SamplingParams())
        assert len(processor) == 0
        with pytest.raises(InvalidRequestError, match="stop"):
            processor.check(SamplingParams(stop="x"))


_stops = st.lists(
    st.text(alphabet="abehlort ,.", min_size=1, max_size=6), min_size=1, max_size=4
).map(tuple)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ids=st.lists(st.integers(min_value=0, max_value=511), min_size=1, max_size=40),
    stops=_stops,
    chunks=st.lists(st.integers(min_value=1, max_value=4), min_size=40, max_size=40),
    include=st.booleans(),
    finish=st.sampled_from(["length", "stop", "abort"]),
)
def test_streamed_text_is_never_retracted(
    tokenizer: Tokenizer,
    ids: list[int],
    stops: tuple[str, ...],
    chunks: list[int],
    include: bool,
    finish: str,
) -> None:
    """On random token streams, the new_text deltas concatenate to each output's text
    and to the final text; no stop string is inside the final text unless included."""
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    tracker = TextTracker(tokenizer, params)
    emitted, n, update = "", 0, None
    for chunk in chunks:
        n = min(len(ids), n + chunk)
        update = tracker.update(ids[:n], finish_reason=finish if n == len(ids) else None)
        emitted += update.new_text
        assert update.text == emitted
        if update.stop is not None or n == len(ids):
            break
    assert update is not None
    stop_token = finish == "stop" and not include and n == len(ids)  # its text is left out
    full = tokenizer.decode(ids[: n - 1] if stop_token else ids[:n])
    if update.stop is None:
        assert emitted == full
    elif include:
        assert emitted.endswith(update.stop) and full.startswith(emitted)
    else:
        assert full.startswith(emitted + update.stop)
        assert not any(s in emitted for s in stops)
