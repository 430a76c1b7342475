"""Tool-call parsers (``pipeline.server.tool_parsers``): whole outputs, streams, bounds.

The property tests feed random texts (built from tags, JSON calls, braces, quotes,
whitespace and unicode) split at random points, and check that a stream emits exactly
what ``parse`` gives for the whole text.
"""

from __future__ import annotations

import itertools
import json
import re
import time
from collections.abc import Callable, Iterable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.errors import InvalidConfigError
from pipeline.server.tool_parsers import (
    MAX_TOOL_CALLS,
    TOOL_PARSERS,
    HermesToolParser,
    Llama3JsonToolParser,
    ParsedTools,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    get_tool_parser,
    new_call_id,
)

HERMES = HermesToolParser()
LLAMA = Llama3JsonToolParser()


def block(name: str, arguments: object, key: str = "arguments") -> str:
    """A hermes block as Qwen writes it."""
    return f"<tool_call>\n{json.dumps({'name': name, key: arguments})}\n</tool_call>"


def llama(name: str, parameters: object, key: str = "parameters") -> str:
    return json.dumps({"name": name, key: parameters})


def calls_of(parsed: ParsedTools) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in parsed.tool_calls]


def run_stream(parser: ToolParser, chunks: Iterable[str]) -> tuple[str, list[ToolCallDelta]]:
    """Feed ``chunks`` and finish; the content emitted (joined) and the deltas, checking
    that a feed's content events are never empty and never two in a row."""
    stream = parser.stream()
    events: list[str | ToolCallDelta] = []
    for batch in [*(stream.feed(chunk) for chunk in chunks), stream.finish()]:
        for a, b in itertools.pairwise(batch):
            assert not (isinstance(a, str) and isinstance(b, str)), batch
        assert all(e != "" for e in batch)
        events += batch
    deltas = [e for e in events if isinstance(e, ToolCallDelta)]
    assert [d.index for d in deltas] == list(range(len(deltas)))
    assert [(d.id, d.name, d.arguments) for d in deltas] == [
        (c.id, c.name, c.arguments) for c in stream.tool_calls
    ]
    return "".join(e for e in events if isinstance(e, str)), deltas


def assert_stream_matches(parser: ToolParser, text: str, chunks: list[str]) -> None:
    parsed = parser.parse(text)
    content, deltas = run_stream(parser, chunks)
    assert content == (parsed.content or "")
    assert [(d.name, d.arguments) for d in deltas] == calls_of(parsed)


def splits(text: str, cuts: Iterable[int]) -> list[str]:
    points = sorted({0, len(text), *cuts})
    return [text[a:b] for a, b in itertools.pairwise(points)]


class TestToolCall:
    def test_id_is_call_and_24_hex(self) -> None:
        """A fresh id is "call_" and 24 hex characters, different each time."""
        ids = {new_call_id() for _ in range(50)}
        assert len(ids) == 50
        assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)
        assert re.fullmatch(r"call_[0-9a-f]{24}", ToolCall(name="f", arguments="{}").id)

    def test_to_json_is_the_openai_shape(self) -> None:
        """to_json gives the message's tool_calls entry, with index for a stream."""
        call = ToolCall(id="call_x", name="f", arguments='{"a":1}')
        function = {"name": "f", "arguments": '{"a":1}'}
        assert call.to_json() == {"id": "call_x", "type": "function", "function": function}
        assert call.to_json(2) == {
            "index": 2,
            "id": "call_x",
            "type": "function",
            "function": function,
        }

    def test_delta_to_json(self) -> None:
        """A first delta carries id, type and name; a later one only arguments."""
        call = ToolCall(id="call_x", name="f", arguments="{}")
        assert ToolCallDelta.whole(0, call).to_json() == call.to_json(0)
        assert ToolCallDelta(index=1, arguments='"b"}').to_json() == {
            "index": 1,
            "function": {"arguments": '"b"}'},
        }


class TestRegistry:
    def test_names(self) -> None:
        """Both parsers are registered under their vLLM names."""
        assert set(TOOL_PARSERS) == {"hermes", "llama3_json"}
        assert get_tool_parser("hermes") is HermesToolParser
        assert get_tool_parser("llama3_json") is Llama3JsonToolParser

    def test_unknown_name_lists_the_known(self) -> None:
        """An unknown name is a ValueError naming the field and the known parsers."""
        with pytest.raises(InvalidConfigError, match="hermes, llama3_json") as info:
            get_tool_parser("mistral")
        assert isinstance(info.value, ValueError)
        assert info.value.field == "tool_call_parser"

    def test_registry_is_read_only(self) -> None:
        with pytest.raises(TypeError):
            TOOL_PARSERS["x"] = HermesToolParser  # type: ignore[index]

    @pytest.mark.parametrize("bad", [0, -1, True, 1.5])
    def test_max_calls_must_be_a_positive_int(self, bad: object) -> None:
        with pytest.raises(InvalidConfigError, match="max_calls"):
            HermesToolParser(bad)  # type: ignore[arg-type]


class TestHermesParse:
    def test_plain_text_is_content(self) -> None:
        """An output without tags is all content, unchanged (whitespace included)."""
        assert HERMES.parse("  Hello\n") == ParsedTools(content="  Hello\n")
        assert HERMES.parse("") == ParsedTools(content=None)

    def test_one_call(self) -> None:
        """A block alone is a call and no content; arguments are dumped compactly."""
        parsed = HERMES.parse(block("get_weather", {"city": "Paris", "days": [1, 2]}))
        assert parsed.content is None
        assert calls_of(parsed) == [("get_weather", '{"city":"Paris","days":[1,2]}')]

    def test_several_calls_and_text_before(self) -> None:
        """Text before the calls is content; whitespace next to a call is dropped."""
        text = "Let me check.\n\n" + block("a", {"x": 1}) + "\n" + block("b", {}) + "\n"
        parsed = HERMES.parse(text)
        assert parsed.content == "Let me check."
        assert calls_of(parsed) == [("a", '{"x":1}'), ("b", "{}")]

    def test_text_between_and_after_is_content(self) -> None:
        text = block("a", {}) + "\nthen\n" + block("b", {}) + " done "
        parsed = HERMES.parse(text)
        assert parsed.content == "thendone "
        assert calls_of(parsed) == [("a", "{}"), ("b", "{}")]

    @pytest.mark.parametrize(
        "body",
        [
            "{not json}",
            '{"name": "f", "arguments": {}',  # unbalanced
            '{"arguments": {}}',  # no name
            '{"name": 3, "arguments": {}}',  # name not a string
            '{"name": "", "arguments": {}}',
            '["f", {}]',
            '{"name": "f", "arguments": [1, 2]}',  # arguments neither object nor string
            '{"name": "f", "arguments": {"x": NaN}}',  # not JSON
            '{"name": "f", "arguments": {"x": "\\ud800"}}',  # a lone surrogate
            "",
        ],
    )
    def test_a_block_that_is_not_a_call_stays_content(self, body: str) -> None:
        """Invalid JSON, or JSON that is not a call, stays content, tags and all."""
        text = f"Hi <tool_call>{body}</tool_call> " + block("ok", {})
        parsed = HERMES.parse(text)
        assert parsed.content == f"Hi <tool_call>{body}</tool_call>"
        assert calls_of(parsed) == [("ok", "{}")]

    def test_unclosed_block_is_content(self) -> None:
        text = block("a", {}) + '\n<tool_call>\n{"name": "b", "argum'
        parsed = HERMES.parse(text)
        assert parsed.content == '<tool_call>\n{"name": "b", "argum'
        assert calls_of(parsed) == [("a", "{}")]

    def test_braces_and_tags_inside_strings(self) -> None:
        """Braces, quotes and escapes inside JSON strings are just text."""
        args = {"code": 'if (x) { print("}{") }', "nested": {"a": {"b": '\\"}'}}}
        parsed = HERMES.parse(block("run", args))
        assert calls_of(parsed) == [("run", json.dumps(args, separators=(",", ":")))]
        assert json.loads(parsed.tool_calls[0].arguments) == args

    def test_unicode_kept_unescaped(self) -> None:
        text = "天気は" + block("天気", {"都市": "東京 😀"}, key="parameters")
        parsed = HERMES.parse(text)
        assert parsed.content == "天気は"
        assert calls_of(parsed) == [("天気", '{"都市":"東京 😀"}')]

    def test_string_arguments_are_kept_as_written(self) -> None:
        """Arguments given as a string holding JSON stay that string."""
        parsed = HERMES.parse(block("f", '{"a": 1,  "b": 2}'))
        assert calls_of(parsed) == [("f", '{"a": 1,  "b": 2}')]

    def test_missing_or_null_arguments_are_empty(self) -> None:
        text = '<tool_call>{"name": "f"}</tool_call><tool_call>{"name": "g", "arguments": null}'
        parsed = HERMES.parse(text + "</tool_call>")
        assert calls_of(parsed) == [("f", "{}"), ("g", "{}")]

    def test_deep_nesting_does_not_raise(self) -> None:
        """JSON nested deeper than the recursion limit stays content."""
        body = '{"name": "f", "arguments": ' + "[" * 100_000 + "]" * 100_000 + "}"
        text = f"<tool_call>{body}</tool_call>"
        assert HERMES.parse(text) == ParsedTools(content=text)

    def test_at_most_max_calls(self) -> None:
        """Calls past the cap stay content (the default cap is 64)."""
        text = "".join(block(f"f{i}", {"i": i}) for i in range(MAX_TOOL_CALLS + 2))
        parsed = HERMES.parse(text)
        assert len(parsed.tool_calls) == MAX_TOOL_CALLS
        assert parsed.content == block("f64", {"i": 64}) + block("f65", {"i": 65})
        small = HermesToolParser(2).parse(text)
        assert [c.name for c in small.tool_calls] == ["f0", "f1"]

    def test_ids_are_fresh(self) -> None:
        parsed = HERMES.parse(block("a", {}) + block("a", {}))
        assert parsed.tool_calls[0].id != parsed.tool_calls[1].id


class TestHermesStream:
    def test_a_call_is_emitted_when_its_block_closes(self) -> None:
        """The call comes out whole, with id and name, on the feed that closes it."""
        stream = HERMES.stream()
        assert stream.feed('<tool_call>\n{"name": "f", "arguments": {"a"') == []
        assert stream.feed(": 1}}\n</tool_") == []
        (delta,) = stream.feed("call>")
        assert isinstance(delta, ToolCallDelta)
        assert (delta.index, delta.name, delta.arguments) == (0, "f", '{"a":1}')
        assert delta.id == stream.tool_calls[0].id
        assert stream.finish() == []

    def test_a_partial_open_tag_is_held_back(self) -> None:
        """An end that may start <tool_call> is not content until it cannot be one."""
        stream = HERMES.stream()
        assert stream.feed("Hi <tool_") == ["Hi"]
        assert stream.feed("ca") == []
        assert stream.feed("x") == [" <tool_cax"]
        assert stream.feed(" <") == []
        assert stream.finish() == [" <"]

    def test_whitespace_before_a_call_is_held_and_dropped(self) -> None:
        stream = HERMES.stream()
        assert stream.feed("Sure.\n\n") == ["Sure."]
        assert stream.feed("<tool_call>") == []
        assert [type(e) for e in stream.feed('{"name": "f"}</tool_call>\n')] == [ToolCallDelta]
        assert stream.feed("\n  ") == []
        assert stream.feed(" ok") == ["ok"]

    def test_unclosed_block_becomes_content_at_finish(self) -> None:
        stream = HERMES.stream()
        assert stream.feed('ok\n<tool_call>{"name": "f", "argu') == ["ok"]
        assert stream.finish() == ['\n<tool_call>{"name": "f", "argu']
        assert stream.tool_calls == ()

    def test_invalid_block_is_content_when_it_closes(self) -> None:
        stream = HERMES.stream()
        assert stream.feed("<tool_call>{oops}</tool_call") == []
        assert stream.feed("> x") == ["<tool_call>{oops}</tool_call> x"]

    def test_feed_after_finish_raises_and_finish_twice_is_empty(self) -> None:
        stream = HERMES.stream()
        assert stream.feed("a <tool") == ["a"]
        assert stream.finish() == [" <tool"]
        assert stream.finish() == []
        with pytest.raises(RuntimeError, match="finished"):
            stream.feed("b")

    @pytest.mark.parametrize(
        "text",
        [
            "Let me look.\n" + block("search", {"q": "}{ <tool_call>"}) + "\nDone.",
            block("a", {"x": "é"}) + "\n" + block("b", "x") + "\n",
            "x <tool_call>{bad}</tool_call>\n" + block("c", {}),
            "<tool_call>" + block("d", {}),
        ],
    )
    def test_every_two_way_and_three_way_split(self, text: str) -> None:
        """Tags split across deltas at every position give the same result."""
        n = len(text)
        for i in range(n + 1):
            assert_stream_matches(HERMES, text, splits(text, [i]))
        for i in range(0, n + 1, 3):
            for j in range(i, n + 1, 2):
                assert_stream_matches(HERMES, text, splits(text, [i, j]))
        assert_stream_matches(HERMES, text, list(text))

    def test_calls_past_the_cap_stream_as_content(self) -> None:
        text = "".join(block(f"f{i}", {}) + "\n" for i in range(4))
        parser = HermesToolParser(2)
        content, deltas = run_stream(parser, list(text))
        assert [d.name for d in deltas] == ["f0", "f1"]
        assert content == block("f2", {}) + "\n" + block("f3", {}) + "\n"
        assert_stream_matches(parser, text, list(text))


class TestLlama3Parse:
    def test_one_call(self) -> None:
        parsed = LLAMA.parse(llama("get_weather", {"city": "Paris"}))
        assert parsed.content is None
        assert calls_of(parsed) == [("get_weather", '{"city":"Paris"}')]

    def test_python_tag_and_whitespace(self) -> None:
        text = "\n<|python_tag|> " + llama("f", {"a": 1}) + "\n"
        assert calls_of(LLAMA.parse(text)) == [("f", '{"a":1}')]
        assert LLAMA.parse(text).content is None

    def test_several_calls_separated_by_semicolons(self) -> None:
        text = llama("a", {}) + "; " + llama("b", {"x": [1]}, key="arguments") + ";"
        parsed = LLAMA.parse(text)
        assert parsed.content is None
        assert calls_of(parsed) == [("a", "{}"), ("b", '{"x":[1]}')]

    def test_calls_separated_by_whitespace(self) -> None:
        text = llama("a", {}) + "\n" + llama("b", {})
        assert calls_of(LLAMA.parse(text)) == [("a", "{}"), ("b", "{}")]

    @pytest.mark.parametrize(
        "text",
        [
            "Hello",
            'Sure: {"name": "f", "parameters": {}}',  # text before the JSON
            '{"name": "John", "age": 30}',  # a JSON answer, no parameters
            '{"name": "f", "parameters": {}',  # never closes
            '{"name": "f", "parameters": {},}',  # not JSON
            '<|python_tag|>print("hi")',
            '<|python_tag|><|python_tag|>{"name": "f", "parameters": {}}',
            '{"name": "f", "parameters": 3}',
            "",
        ],
    )
    def test_not_calls_is_all_content(self, text: str) -> None:
        assert LLAMA.parse(text) == ParsedTools(content=text or None)

    def test_text_after_the_last_call_is_content(self) -> None:
        """After a call, the text from its first non-whitespace character is content."""
        first = llama("a", {})
        assert LLAMA.parse(first + "\n\nThat is all.").content == "That is all."
        parsed = LLAMA.parse(first + '; {"name": "b"}')
        assert parsed.content == '; {"name": "b"}'
        assert calls_of(parsed) == [("a", "{}")]
        assert LLAMA.parse(first + ";;").content == ";;"

    def test_braces_in_strings(self) -> None:
        args = {"s": '}{"\\', "t": {"u": "{{"}}
        parsed = LLAMA.parse(llama("f", args))
        assert json.loads(parsed.tool_calls[0].arguments) == args

    def test_unicode(self) -> None:
        parsed = LLAMA.parse(llama("翻訳", {"text": "naïve 😀"}))
        assert calls_of(parsed) == [("翻訳", '{"text":"naïve 😀"}')]

    def test_at_most_max_calls(self) -> None:
        text = "; ".join(llama(f"f{i}", {}) for i in range(MAX_TOOL_CALLS + 1))
        parsed = LLAMA.parse(text)
        assert len(parsed.tool_calls) == MAX_TOOL_CALLS
        assert parsed.content == "; " + llama("f64", {})


class TestLlama3Stream:
    def test_calls_are_emitted_as_their_objects_close(self) -> None:
        stream = LLAMA.stream()
        assert stream.feed('<|python_tag|>{"name": "a", "parameters": {"s": "}"') == []
        (first,) = stream.feed("}}")
        assert isinstance(first, ToolCallDelta) and first.name == "a"
        assert stream.feed(' ; {"name": "b", "parameters": {}}') != []
        assert [c.name for c in stream.tool_calls] == ["a", "b"]
        assert stream.finish() == []

    def test_plain_answer_streams_at_once(self) -> None:
        """An output that cannot be a call is content from its first character."""
        stream = LLAMA.stream()
        assert stream.feed("  ") == []
        assert stream.feed("Hello") == ["  Hello"]
        assert stream.feed(" world") == [" world"]

    def test_a_json_answer_is_content_when_it_closes(self) -> None:
        stream = LLAMA.stream()
        assert stream.feed('{"name": "John",') == []
        assert stream.feed(' "age": 30} ok') == ['{"name": "John", "age": 30} ok']

    @pytest.mark.parametrize(
        "text",
        [
            "<|python_tag|>" + llama("a", {"q": '}{\\"'}) + "; " + llama("b", {}),
            llama("a", {}) + "\nThanks",
            " <|python_ta",
            llama("a", {}) + ' ; {"x": 1}',
            llama("a", {}) + " ;; x",
            llama("a", {}) + "; \n",
        ],
    )
    def test_every_split(self, text: str) -> None:
        for i in range(len(text) + 1):
            assert_stream_matches(LLAMA, text, splits(text, [i]))
        assert_stream_matches(LLAMA, text, list(text))


# --- split invariance ---------------------------------------------------------------------

FRAGMENTS = [
    "<tool_call>",
    "</tool_call>",
    "<tool_",
    "</tool",
    "tool_call>",
    "<",
    ">",
    "/",
    "<|python_tag|>",
    "<|python",
    "{",
    "}",
    '"',
    "\\",
    '\\"',
    ";",
    ":",
    ",",
    " ",
    "\n",
    "\t",
    "\u2003",
    "\x1c",
    "é",
    "日本",
    "😀",
    '"name"',
    '"arguments"',
    '"parameters"',
    "null",
]
HERMES_BLOCKS = [
    block("f", {"x": 1}),
    block("g", {"s": "}{\"'"}, key="parameters"),
    block("h", '{"a": 1}'),
    "<tool_call>{bad}</tool_call>",
    '<tool_call>\n{"name": "k"}\n</tool_call>',
    "<tool_call>",
    "<tool_",
]
LLAMA_OBJECTS = [
    llama("f", {"x": [1, {"y": "}"}]}),
    llama("g", {}, key="arguments"),
    llama("q", {"s": '"}\\{'}),
    '{"name": "n"}',
    '{"name": "m", "parameters": {}',
    '{"a": "\\\\"}',
    "<|python_tag|>",
]
FRAGMENTS += HERMES_BLOCKS + LLAMA_OBJECTS

SEPARATORS = ["", " ", "\n", ";", "; ", " ;\n", ";;", "\u2003", "x", "<"]
texts = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=4)), max_size=24).map(
    "".join
)
# Outputs shaped like each format: calls, broken calls and separators in a row.
hermes_like = st.lists(
    st.one_of(st.sampled_from(HERMES_BLOCKS), st.sampled_from(SEPARATORS)), max_size=12
).map("".join)
llama_like = st.lists(
    st.one_of(st.sampled_from(LLAMA_OBJECTS), st.sampled_from(SEPARATORS)), max_size=12
).map("".join)
starts = st.sampled_from(["", "<|python_tag|>", " ", "Hi ", "\n"])


@st.composite
def split_texts(draw: st.DrawFn) -> tuple[str, list[str]]:
    text = draw(starts) + draw(st.one_of(texts, hermes_like, llama_like))
    cuts = draw(st.lists(st.integers(0, len(text)), max_size=12))
    if draw(st.booleans()):
        cuts += list(range(0, len(text) + 1, draw(st.integers(1, 4))))
    return text, splits(text, cuts)


PARSERS = [HERMES, HermesToolParser(2), LLAMA, Llama3JsonToolParser(2)]


@pytest.mark.parametrize("parser", PARSERS, ids=lambda p: f"{p.name}-{p.max_calls}")
@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=split_texts())
def test_stream_matches_parse_for_every_split(
    parser: ToolParser, case: tuple[str, list[str]]
) -> None:
    """For any text and any split into deltas, the stream emits what parse gives."""
    text, chunks = case
    assert "".join(chunks) == text
    assert_stream_matches(parser, text, chunks)


# --- linear time --------------------------------------------------------------------------

N = 200_000


def feed_chars(parser: ToolParser, text: str) -> float:
    """Seconds to stream ``text`` one character a delta."""
    start = time.perf_counter()
    stream = parser.stream()
    feed = stream.feed
    for char in text:
        feed(char)
    stream.finish()
    return time.perf_counter() - start


def linear_cases() -> list[tuple[str, ToolParser, Callable[[int], str]]]:
    return [
        ("hermes plain", HERMES, lambda n: "a" * n),
        ("hermes whitespace", HERMES, lambda n: " \n" * (n // 2)),
        ("hermes unclosed block", HERMES, lambda n: "<tool_call>" + "y" * n),
        ("hermes partial tags", HERMES, lambda n: "<tool_cal" * (n // 9)),
        ("hermes long call", HERMES, lambda n: block("f", {"s": "z" * n})),
        ("hermes many calls", HERMES, lambda n: block("f", {}) * (n // 40)),
        ("llama long call", LLAMA, lambda n: llama("f", {"s": '\\"{' * (n // 3)})),
        ("llama unclosed object", LLAMA, lambda n: "{" + '"a": {' * (n // 6)),
        ("llama leading whitespace", LLAMA, lambda n: " " * n + llama("f", {})),
        ("llama plain", LLAMA, lambda n: "b" * n),
    ]


@pytest.mark.parametrize("name,parser,make", linear_cases(), ids=[c[0] for c in linear_cases()])
def test_200k_output_one_char_at_a_time_is_linear(
    name: str, parser: ToolParser, make: Callable[[int], str]
) -> None:
    """A 200 KB output fed a character at a time takes about 4x a 50 KB one, not 16x."""
    small = min(feed_chars(parser, make(N // 4)) for _ in range(2))
    big = min(feed_chars(parser, make(N)) for _ in range(2))
    assert big < 10.0
    assert big < 8 * small + 0.5, (small, big)
    text = make(N)
    assert_stream_matches(parser, text, [text[i : i + 4096] for i in range(0, len(text), 4096)])
