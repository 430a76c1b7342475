"""Reasoning parsers (``pipeline.server.reasoning``): whole outputs, streams, bounds."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.errors import InvalidConfigError
from pipeline.server.reasoning import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    ParsedReasoning,
    Qwen3ReasoningParser,
    ReasoningDelta,
    ReasoningParser,
    get_reasoning_parser,
)

R1 = DeepSeekR1ReasoningParser()
QWEN3 = Qwen3ReasoningParser()


def run_stream(parser: ReasoningParser, chunks: Iterable[str]) -> tuple[str, str]:
    """Feed ``chunks`` and finish: the reasoning and the content emitted, joined; checks
    that no reasoning comes after content and that ``reasoning_ended`` only turns on."""
    stream = parser.stream()
    reasoning: list[str] = []
    content: list[str] = []
    ended = False
    chunks = list(chunks)
    for i in range(len(chunks) + 1):
        delta = stream.feed(chunks[i]) if i < len(chunks) else stream.finish()
        assert isinstance(delta, ReasoningDelta)
        assert not (any(content) and delta.reasoning), "reasoning after content"
        reasoning.append(delta.reasoning)
        content.append(delta.content)
        if delta.content:
            assert stream.reasoning_ended
        assert stream.reasoning_ended >= ended
        ended = stream.reasoning_ended
    return "".join(reasoning), "".join(content)


def splits(text: str, cuts: Iterable[int]) -> list[str]:
    points = sorted({0, len(text), *cuts})
    return [text[a:b] for a, b in itertools.pairwise(points)]


def assert_stream_matches(parser: ReasoningParser, text: str, chunks: list[str]) -> None:
    parsed = parser.parse(text)
    assert run_stream(parser, chunks) == (parsed.reasoning_content or "", parsed.content or "")


class TestRegistry:
    def test_names(self) -> None:
        assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3"}
        assert get_reasoning_parser("deepseek_r1") is DeepSeekR1ReasoningParser
        assert get_reasoning_parser("qwen3") is Qwen3ReasoningParser

    def test_unknown_name_lists_the_known(self) -> None:
        """An unknown name is a ValueError naming the field and the known parsers."""
        with pytest.raises(InvalidConfigError, match="deepseek_r1, qwen3") as info:
            get_reasoning_parser("granite")
        assert isinstance(info.value, ValueError)
        assert info.value.field == "reasoning_parser"


class TestDeepSeekR1Parse:
    def test_think_block_then_answer(self) -> None:
        assert R1.parse("<think>hmm</think>\n\nParis.") == ParsedReasoning("hmm", "\n\nParis.")

    def test_opening_tag_may_be_omitted(self) -> None:
        """The template opened <think>: everything up to </think> is reasoning."""
        assert R1.parse("so 2+2 is 4</think>4") == ParsedReasoning("so 2+2 is 4", "4")

    def test_no_closing_tag_is_all_reasoning(self) -> None:
        assert R1.parse("still thinking") == ParsedReasoning("still thinking", None)
        assert R1.parse("<think>still") == ParsedReasoning("still", None)

    def test_empty_parts_are_none(self) -> None:
        assert R1.parse("") == ParsedReasoning(None, None)
        assert R1.parse("<think></think>") == ParsedReasoning(None, None)
        assert R1.parse("</think>answer") == ParsedReasoning(None, "answer")

    def test_only_the_first_close_counts(self) -> None:
        """A later <think> or </think> is part of the content."""
        assert R1.parse("a</think>b</think><think>c") == ParsedReasoning("a", "b</think><think>c")

    def test_unicode(self) -> None:
        assert R1.parse("考え中😀</think>答え") == ParsedReasoning("考え中😀", "答え")


class TestQwen3Parse:
    def test_think_block_then_answer(self) -> None:
        assert QWEN3.parse("<think>\nhmm\n</think>\n\nOK") == ParsedReasoning("\nhmm\n", "\n\nOK")

    def test_no_opening_tag_is_all_content(self) -> None:
        """Without a leading <think> (thinking disabled) the whole output is content."""
        assert QWEN3.parse("a</think>b") == ParsedReasoning(None, "a</think>b")
        assert QWEN3.parse(" <think>x</think>") == ParsedReasoning(None, " <think>x</think>")
        assert QWEN3.parse("") == ParsedReasoning(None, None)

    def test_unclosed_think_is_reasoning(self) -> None:
        assert QWEN3.parse("<think>cut off by max_tokens") == ParsedReasoning(
            "cut off by max_tokens", None
        )


class TestStream:
    def test_partial_close_tag_is_held_back(self) -> None:
        """An end that may start </think> is sent only once it cannot."""
        stream = R1.stream()
        assert stream.feed("<think>abc</thi") == ("abc", "")
        assert not stream.reasoning_ended
        assert stream.feed("nk") == ("", "")
        assert stream.feed("x") == ("</thinkx", "")
        assert stream.feed("</") == ("", "")
        assert stream.feed("think>Hi") == ("", "Hi")
        assert stream.reasoning_ended
        assert stream.feed(" there</think>") == ("", " there</think>")
        assert stream.finish() == ("", "")

    def test_partial_open_tag_is_held_back(self) -> None:
        stream = QWEN3.stream()
        assert stream.feed("<th") == ("", "")
        assert not stream.reasoning_ended
        assert stream.feed("ink>x") == ("x", "")
        qwen = QWEN3.stream()
        assert qwen.feed("<tx") == ("", "<tx")
        assert qwen.reasoning_ended
        r1 = R1.stream()
        assert r1.feed("<") == ("", "")
        assert r1.feed("x") == ("<x", "")

    def test_reasoning_and_content_in_one_delta(self) -> None:
        stream = R1.stream()
        assert stream.feed("<think>a</think>b") == ("a", "b")

    def test_finish_releases_a_held_tag(self) -> None:
        """At the end a held partial tag is plain text of the section it is in."""
        for parser, text, fed, finished in [
            (R1, "<thi", ("", ""), ("<thi", "")),
            (QWEN3, "<thi", ("", ""), ("", "<thi")),
            (R1, "a</thin", ("a", ""), ("</thin", "")),
            (QWEN3, "<think>a</thin", ("a", ""), ("</thin", "")),
        ]:
            stream = parser.stream()
            assert stream.feed(text) == fed
            assert stream.finish() == finished

    def test_feed_after_finish_raises(self) -> None:
        stream = QWEN3.stream()
        stream.finish()
        assert stream.finish() == ("", "")
        with pytest.raises(RuntimeError, match="finished"):
            stream.feed("x")

    @pytest.mark.parametrize("parser", [R1, QWEN3], ids=lambda p: p.name)
    @pytest.mark.parametrize(
        "text", ["<think>a</think>b", "<think></think>", "x</think>y", "<thin</think>k", "<<think>"]
    )
    def test_every_split(self, parser: ReasoningParser, text: str) -> None:
        for i in range(len(text) + 1):
            for j in range(i, len(text) + 1):
                assert_stream_matches(parser, text, splits(text, [i, j]))


PIECES = ["<think>", "</think>", "<", "/", ">", "<th", "</thi", "think", "nk>", " ", "\n", "é😀"]


@st.composite
def split_texts(draw: st.DrawFn) -> tuple[str, list[str]]:
    parts = draw(st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=3)), max_size=16))
    text = "".join(parts)
    cuts = draw(st.lists(st.integers(0, len(text)), max_size=10))
    return text, splits(text, cuts)


@pytest.mark.parametrize("parser", [R1, QWEN3], ids=lambda p: p.name)
@settings(max_examples=500, deadline=None)
@given(case=split_texts())
def test_stream_matches_parse_for_every_split(
    parser: ReasoningParser, case: tuple[str, list[str]]
) -> None:
    """For any text and any split into deltas, the stream emits what parse gives."""
    text, chunks = case
    assert_stream_matches(parser, text, chunks)


def feed_chars(parser: ReasoningParser, text: str) -> float:
    start = time.perf_counter()
    stream = parser.stream()
    for char in text:
        stream.feed(char)
    stream.finish()
    return time.perf_counter() - start


N = 200_000
CASES: list[tuple[str, ReasoningParser, Callable[[int], str]]] = [
    ("long reasoning", R1, lambda n: "<think>" + "a" * n + "</think>" + "b" * n),
    ("partial tags", QWEN3, lambda n: "<think>" + "</thin" * (n // 6)),
    ("content", QWEN3, lambda n: "c" * n),
]


@pytest.mark.parametrize("name,parser,make", CASES, ids=[c[0] for c in CASES])
def test_200k_output_one_char_at_a_time_is_linear(
    name: str, parser: ReasoningParser, make: Callable[[int], str]
) -> None:
    """A 200 KB output fed a character at a time takes about 4x a 50 KB one, not 16x."""
    small = min(feed_chars(parser, make(N // 4)) for _ in range(2))
    big = min(feed_chars(parser, make(N)) for _ in range(2))
    assert big < 10.0
    assert big < 8 * small + 0.5, (small, big)
