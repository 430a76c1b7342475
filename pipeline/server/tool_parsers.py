"""Tool-call parsers: a model's generated text to OpenAI ``tool_calls`` (``--tool-call-parser``).

A chat model asked to call a tool writes the call as text in its own format; the server
turns that text back into the ``tool_calls`` of the OpenAI response and leaves the rest
as ``content``. Each format is a :class:`ToolParser`, chosen by name from
:data:`TOOL_PARSERS` (:func:`get_tool_parser`):

- ``"hermes"`` (Qwen 2.5/3, Hermes): ``<tool_call>\\n{"name": ..., "arguments": {...}}
  \\n</tool_call>`` blocks, any number, with text around them;
- ``"llama3_json"`` (Llama 3.x): the whole output is a JSON object ``{"name": ...,
  "parameters": {...}}`` (or ``"arguments"``), optionally after ``<|python_tag|>``,
  several separated by ``;``.

How the chat route uses one (one parser per server, one parse or stream per choice):

- a non-streaming choice: ``parser.parse(text)`` on the whole generated text gives a
  :class:`ParsedTools` (``content`` and ``tool_calls`` of the message);
- a streaming choice: ``s = parser.stream()``, then ``s.feed(delta)`` with each text
  delta as it is detokenized and ``s.finish()`` once the choice ends; each returns, in
  order, the content text that may be sent now (``str``) and the tool-call deltas
  (:class:`ToolCallDelta`, ``delta.to_json()`` is one entry of a chunk's
  ``delta.tool_calls``). ``s.tool_calls`` are the calls so far (``finish_reason``
  ``"tool_calls"`` when there are any).

For every split of a text into deltas, the content a stream emits, concatenated, is
``parse(text).content`` (``""`` for ``None``) and its calls are ``parse(text).tool_calls``
(names and arguments; each :class:`ToolCall` draws a fresh id). The tags must survive
detokenization: ``<tool_call>`` is an ordinary added token of Qwen's tokenizer, while
Llama's ``<|python_tag|>`` is special (and optional here).

Model output is never an error: text that looks like a call but is not one (JSON that
does not parse, no string ``name``, arguments that are neither an object nor a string, a
block that never closes) stays content, and nothing here raises on any text. At most
``max_calls`` (:data:`MAX_TOOL_CALLS`) calls are parsed per output; later ones stay
content. Parsing is linear in the text: a stream keeps a cursor and holds back only what
it cannot decide yet. Everything here is plain synchronous code (no awaits, so
cancellation-safe); a stream is used by one task.
"""

from __future__ import annotations

import abc
import json
import re
import secrets
from collections.abc import Mapping
from types import MappingProxyType
from typing import ClassVar, Final, TypeAlias

import attrs

from pipeline.errors import InvalidConfigError

__all__ = [
    "MAX_TOOL_CALLS",
    "TOOL_PARSERS",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "ParsedTools",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStream",
    "ToolParser",
    "ToolStreamEvent",
    "get_tool_parser",
    "new_call_id",
]

#: Most tool calls parsed from one output; the text of any later call stays content.
MAX_TOOL_CALLS: Final = 64

_NON_WS = re.compile(r"\S")
_OBJECT_STOP = re.compile(r'[{}"]')
_STRING_STOP = re.compile(r'["\\]')


def new_call_id() -> str:
    """A fresh tool-call id: ``"call_"`` and 24 random hex characters (``secrets``)."""
    return "call_" + secrets.token_hex(12)


@attrs.frozen(kw_only=True)
class ToolCall:
    """One parsed tool call.

    Attributes:
        id: The call's id (:func:`new_call_id` unless given).
        name: The function name, as the model wrote it (a non-empty string).
        arguments: The arguments as a JSON string: an object the model wrote is re-dumped
            compactly (``{"a":1}``, non-ASCII kept); a string it wrote is kept as is.
    """

    id: str = attrs.field(factory=new_call_id)
    name: str
    arguments: str

    def to_json(self, index: int | None = None) -> dict[str, object]:
        """The OpenAI shape, ``{"id", "type": "function", "function": {"name",
        "arguments"}}``, with ``"index"`` first when given (a stream delta's entry)."""
        out: dict[str, object] = {} if index is None else {"index": index}
        out["id"] = self.id
        out["type"] = "function"
        out["function"] = {"name": self.name, "arguments": self.arguments}
        return out


@attrs.frozen(kw_only=True)
class ToolCallDelta:
    """A piece of the ``index``-th tool call of a stream, as a chunk carries it.

    The first delta of a call has its ``id`` and ``name``; later ones (``None`` there)
    only add to ``arguments``. The parsers here emit each call whole, in one delta, once
    its text is complete, so every delta they emit is a first one with all the arguments.

    Attributes:
        index: The call's position among the output's calls (0, 1, ...).
        arguments: The argument text this delta adds.
        id: The call's id, on its first delta.
        name: The function name, on its first delta.
    """

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    @classmethod
    def whole(cls, index: int, call: ToolCall) -> ToolCallDelta:
        """The single delta that carries all of ``call``."""
        return cls(index=index, arguments=call.arguments, id=call.id, name=call.name)

    def to_json(self) -> dict[str, object]:
        """The entry of a chunk's ``delta.tool_calls``: ``{"index", "id", "type",
        "function": {"name", "arguments"}}``, with only what this delta has."""
        out: dict[str, object] = {"index": self.index}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        function: dict[str, str] = {}
        if self.name is not None:
            function["name"] = self.name
        function["arguments"] = self.arguments
        out["function"] = function
        return out


#: What a stream emits: content text to send now, or a tool-call delta.
ToolStreamEvent: TypeAlias = str | ToolCallDelta


@attrs.frozen(kw_only=True)
class ParsedTools:
    """A whole output split into the message's ``content`` and ``tool_calls``.

    Attributes:
        content: The text that is not a call (``None`` when there is none).
        tool_calls: The calls, in the order they were written.
    """

    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()


class ToolCallStream(abc.ABC):
    """The streaming side of a :class:`ToolParser`: fed text deltas, it says what to send.

    ``feed`` is called with each delta of one output, in order, and ``finish`` once at
    its end; ``feed`` after ``finish`` raises ``RuntimeError`` and a second ``finish``
    returns ``[]``. Each returns the events to send now, in order: content text
    (``str``; never empty, never two in a row) and :class:`ToolCallDelta`. Text that may
    still turn out to be part of a call is held back until it is decided (at the latest
    by ``finish``, where whatever is held becomes content). Neither method raises on any
    text.
    """

    def __init__(self, max_calls: int) -> None:
        self._max_calls = max_calls
        self._calls: list[ToolCall] = []
        self._finished = False

    @property
    def tool_calls(self) -> tuple[ToolCall, ...]:
        """The calls emitted so far, in order (their ids are the deltas' ids)."""
        return tuple(self._calls)

    def feed(self, delta: str) -> list[ToolStreamEvent]:
        """Take the next text delta; return the events that may be sent now."""
        if self._finished:
            raise RuntimeError("this tool-call stream is finished; start another one")
        out: list[ToolStreamEvent] = []
        self._feed(delta, out)
        return out

    def finish(self) -> list[ToolStreamEvent]:
        """End the output: return the events for what was held back (now content)."""
        if self._finished:
            return []
        self._finished = True
        out: list[ToolStreamEvent] = []
        self._finish(out)
        return out

    @abc.abstractmethod
    def _feed(self, delta: str, out: list[ToolStreamEvent]) -> None:
        """Consume ``delta``, appending to ``out`` (with :meth:`_text`, :meth:`_call`)."""

    @abc.abstractmethod
    def _finish(self, out: list[ToolStreamEvent]) -> None:
        """Append to ``out`` what is held back, as content."""

    @staticmethod
    def _text(out: list[ToolStreamEvent], text: str) -> None:
        """Append content ``text`` to ``out``, merged into a content event before it."""
        if not text:
            return
        if out and isinstance(out[-1], str):
            out[-1] += text
        else:
            out.append(text)

    def _call(self, out: list[ToolStreamEvent], call: ToolCall) -> None:
        """Record ``call`` and append its delta to ``out``."""
        out.append(ToolCallDelta.whole(len(self._calls), call))
        self._calls.append(call)


@attrs.frozen
class ToolParser(abc.ABC):
    """A tool-call format: :meth:`parse` for a whole output, :meth:`stream` for deltas.

    Attributes:
        max_calls: Most calls parsed from one output (at least 1); later ones stay
            content.

    Raises:
        InvalidConfigError: ``max_calls`` below 1.
    """

    #: The name the parser is chosen by (``--tool-call-parser``).
    name: ClassVar[str]

    max_calls: int = MAX_TOOL_CALLS

    def __attrs_post_init__(self) -> None:
        calls = self.max_calls
        if isinstance(calls, bool) or not isinstance(calls, int) or calls < 1:
            raise InvalidConfigError("max_calls", calls, "an integer of at least 1")

    @abc.abstractmethod
    def parse(self, text: str) -> ParsedTools:
        """Split a whole generated ``text`` into content and tool calls; never raises."""

    @abc.abstractmethod
    def stream(self) -> ToolCallStream:
        """A fresh stream for one output."""

    @abc.abstractmethod
    def forcing_grammar(self, call_json: str, *, parallel: bool) -> str:
        """A Lark grammar (llguidance's dialect) of outputs that are calls only, in this
        format: one call, or one or more when ``parallel``. ``call_json`` is the JSON
        schema a call object must match (its ``name`` and arguments), as JSON text;
        :attr:`arguments_key` is the key it must use for the arguments. What the grammar
        accepts, :meth:`parse` reads back as those calls with no content."""

    #: The key of a call object's arguments in this format.
    arguments_key: ClassVar[str] = "arguments"


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def _load_call(text: str, argument_keys: tuple[str, ...], *, required: bool) -> ToolCall | None:
    """The call that the JSON ``text`` describes, or ``None`` when it describes none.

    ``text`` must be an object with a non-empty string ``"name"`` and its arguments under
    the first of ``argument_keys`` it has (an object, a string, or ``null``/absent for
    ``"{}"``; absent is refused when ``required``). Anything a client could not encode as
    UTF-8 (a lone surrogate escape) is refused too.
    """
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    key = next((k for k in argument_keys if k in obj), None)
    if key is None and required:
        return None
    args = None if key is None else obj[key]
    if args is None:
        arguments = "{}"
    elif isinstance(args, str):
        arguments = args
    elif isinstance(args, dict):
        try:
            arguments = json.dumps(args, ensure_ascii=False, separators=(",", ":"))
        except (ValueError, RecursionError):
            return None
    else:
        return None
    try:
        name.encode("utf-8")
        arguments.encode("utf-8")
    except UnicodeEncodeError:
        return None
    return ToolCall(name=name, arguments=arguments)


def _held_prefix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


# --- hermes -----------------------------------------------------------------------------

_OPEN: Final = "<tool_call>"
_CLOSE: Final = "</tool_call>"


def _hermes_call(body: str) -> ToolCall | None:
    return _load_call(body, ("arguments", "parameters"), required=False)


@attrs.frozen
class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Qwen, Hermes).

    A block is the text from ``<tool_call>`` to the next ``</tool_call>``; its JSON (any
    whitespace around it) must be an object with a string ``"name"`` and ``"arguments"``
    (or ``"parameters"``; absent is ``{}``). A block that is not a call stays content,
    tags included; so does a ``<tool_call>`` that never closes. The whitespace between
    a call and the text next to it is dropped (``"Sure.\\n<tool_call>..."`` has content
    ``"Sure."``; calls separated by newlines have none).
    """

    name: ClassVar[str] = "hermes"

    def parse(self, text: str) -> ParsedTools:
        """Split ``text`` into content and calls (see the class doc); never raises."""
        segments = [""]  # the text before, between and after the calls
        calls: list[ToolCall] = []
        pos = 0
        while len(calls) < self.max_calls:
            start = text.find(_OPEN, pos)
            if start < 0:
                break
            end = text.find(_CLOSE, start + len(_OPEN))
            if end < 0:
                break
            call = _hermes_call(text[start + len(_OPEN) : end])
            end += len(_CLOSE)
            if call is None:
                segments[-1] += text[pos:end]
            else:
                segments[-1] += text[pos:start]
                calls.append(call)
                segments.append("")
            pos = end
        segments[-1] += text[pos:]
        if not calls:
            return ParsedTools(content=text or None)
        last = len(segments) - 1
        pieces = [
            seg.rstrip() if i == 0 else seg.lstrip() if i == last else seg.strip()
            for i, seg in enumerate(segments)
        ]
        return ParsedTools(content="".join(pieces) or None, tool_calls=tuple(calls))

    def stream(self) -> ToolCallStream:
        """A fresh :class:`ToolCallStream` for one output.

        It holds back the whitespace at the end of the text so far and an end that may be
        the start of ``<tool_call>`` (``"<tool_c"``); inside a block it holds everything
        until ``</tool_call>``, then emits the call whole (one :class:`ToolCallDelta` with
        all its arguments) or, when the block is not a call, the block as content.
        """
        return _HermesStream(self.max_calls)

    def forcing_grammar(self, call_json: str, *, parallel: bool) -> str:
        """``<tool_call>\\n{...}\\n</tool_call>`` blocks, newline-separated."""
        calls = 'call ("\\n" call)*' if parallel else "call"
        return f'start: {calls}\ncall: "{_OPEN}\\n" obj "\\n{_CLOSE}"\nobj: %json {call_json}\n'


class _HermesStream(ToolCallStream):
    """The hermes stream; state: outside a block (held whitespace ``_ws``, held partial
    open tag ``_partial``) or inside one (body chunks, the body's last characters)."""

    def __init__(self, max_calls: int) -> None:
        super().__init__(max_calls)
        self._ws: list[str] = []  # whitespace held back: dropped if a call follows
        self._partial = ""  # a held proper prefix of <tool_call>
        self._in_block = False
        self._body: list[str] = []  # the text of the open block after <tool_call>
        self._tail = ""  # its last len(</tool_call>) - 1 characters
        self._after_call = False  # dropping the whitespace after a call

    def _feed(self, delta: str, out: list[ToolStreamEvent]) -> None:
        while delta:
            delta = self._block(delta, out) if self._in_block else self._outside(delta, out)

    def _finish(self, out: list[ToolStreamEvent]) -> None:
        held = "".join(self._ws)
        if self._in_block:
            self._text(out, held + _OPEN + "".join(self._body))
        else:
            self._text(out, held + self._partial)

    def _outside(self, delta: str, out: list[ToolStreamEvent]) -> str:
        """Consume ``delta`` outside a block; return the rest, inside a new block."""
        if self._after_call:
            delta = delta.lstrip()
            if not delta:
                return ""
            self._after_call = False
        if len(self._calls) >= self._max_calls:
            self._text(out, delta)
            return ""
        text = self._partial + delta
        start = text.find(_OPEN)
        if start >= 0:
            self._hold(text[:start], out)
            self._partial = ""
            self._in_block = True
            return text[start + len(_OPEN) :]
        keep = _held_prefix(text, _OPEN)
        self._hold(text[: len(text) - keep], out)
        self._partial = text[len(text) - keep :]
        return ""

    def _hold(self, text: str, out: list[ToolStreamEvent]) -> None:
        """Emit ``text`` (after the held whitespace) but hold its trailing whitespace."""
        body = text.rstrip()
        if body:
            self._text(out, "".join(self._ws) + body)
            self._ws = [text[len(body) :]]
        elif text:
            self._ws.append(text)

    def _block(self, delta: str, out: list[ToolStreamEvent]) -> str:
        """Consume ``delta`` inside a block; return the rest after its close tag."""
        text = self._tail + delta
        end = text.find(_CLOSE)
        if end < 0:
            self._body.append(delta)
            self._tail = text[-(len(_CLOSE) - 1) :]
            return ""
        cut = end - len(self._tail)  # where the close tag starts in delta (< 0: in the tail)
        body = "".join(self._body)
        body = body[: len(body) + cut] if cut < 0 else body + delta[:cut]
        self._in_block = False
        self._body = []
        self._tail = ""
        call = _hermes_call(body)
        if call is None:
            self._text(out, "".join(self._ws) + _OPEN + body + _CLOSE)
        else:
            self._call(out, call)
            self._after_call = True
        self._ws = []
        return delta[cut + len(_CLOSE) :]


# --- llama3_json ------------------------------------------------------------------------

_PYTHON_TAG: Final = "<|python_tag|>"


def _llama_call(text: str) -> ToolCall | None:
    return _load_call(text, ("parameters", "arguments"), required=True)


def _skip_ws(text: str, pos: int) -> int:
    """The index of the first non-whitespace character of ``text`` from ``pos`` (or its
    length)."""
    match = _NON_WS.search(text, pos)
    return len(text) if match is None else match.start()


def _object_end(text: str, start: int) -> int:
    """The index after the ``}`` that closes the ``{`` at ``start`` (braces in JSON
    strings do not count), or -1 when it never closes."""
    depth = 0
    in_string = escaped = False
    for pos in range(start, len(text)):
        char = text[pos]
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return pos + 1
    return -1


@attrs.frozen
class Llama3JsonToolParser(ToolParser):
    """Llama 3.x JSON calls: ``{"name": ..., "parameters": {...}}``, ``;``-separated.

    The output is calls only when, after optional whitespace and ``<|python_tag|>``, it
    starts with a JSON object with a string ``"name"`` and ``"parameters"`` (or
    ``"arguments"``; one of them is required, so an answer that merely is a JSON object
    with a ``"name"`` stays content). Further objects follow after whitespace and at most
    one ``;``. When the first object is not a call the whole text is content; after the
    last call, the text from the first non-whitespace character on is content (a lone
    trailing ``;`` is dropped).
    """

    name: ClassVar[str] = "llama3_json"

    def parse(self, text: str) -> ParsedTools:
        """Split ``text`` into content and calls (see the class doc); never raises."""
        pos = _skip_ws(text, 0)
        if text.startswith(_PYTHON_TAG, pos):
            pos = _skip_ws(text, pos + len(_PYTHON_TAG))
        calls: list[ToolCall] = []
        last_end = 0
        while len(calls) < self.max_calls and text.startswith("{", pos):
            end = _object_end(text, pos)
            call = None if end < 0 else _llama_call(text[pos:end])
            if call is None:
                break
            calls.append(call)
            last_end = end
            pos = _skip_ws(text, end)
            if text.startswith(";", pos):
                pos = _skip_ws(text, pos + 1)
        if not calls:
            return ParsedTools(content=text or None)
        rest = text[last_end:].lstrip()
        content = None if rest.rstrip() in ("", ";") else rest
        return ParsedTools(content=content, tool_calls=tuple(calls))

    def stream(self) -> ToolCallStream:
        """A fresh :class:`ToolCallStream` for one output.

        While the output may still be calls, it holds back everything since the start
        (before the first call) or since the last call; each call is emitted whole (one
        :class:`ToolCallDelta` with all its arguments) once its object closes. As soon as
        the text cannot be a call, what was held and all that follows is content.
        """
        return _Llama3Stream(self.max_calls)

    arguments_key: ClassVar[str] = "parameters"

    def forcing_grammar(self, call_json: str, *, parallel: bool) -> str:
        """JSON call objects, ``;``-separated."""
        calls = 'obj (";" obj)*' if parallel else "obj"
        return f"start: {calls}\nobj: %json {call_json}\n"


class _Llama3Stream(ToolCallStream):
    """The llama3_json stream: before the first object, inside an object, between calls,
    or passing content through."""

    _START, _OBJECT, _BETWEEN, _PASS = range(4)

    def __init__(self, max_calls: int) -> None:
        super().__init__(max_calls)
        self._state = self._START
        # Everything since the point content would start at if the text stopped being
        # calls now: the whole text before the first call, after a call from its first
        # non-whitespace character.
        self._held: list[str] = []
        self._tag = -1  # characters of <|python_tag|> matched; -1 before its "<"
        self._object: list[str] = []
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._semicolon = False

    def _feed(self, delta: str, out: list[ToolStreamEvent]) -> None:
        while delta:
            if self._state == self._START:
                delta = self._start(delta, out)
            elif self._state == self._OBJECT:
                delta = self._in_object(delta, out)
            elif self._state == self._BETWEEN:
                delta = self._between(delta, out)
            else:
                self._text(out, delta)
                delta = ""

    def _finish(self, out: list[ToolStreamEvent]) -> None:
        if self._state != self._BETWEEN:  # between calls, only "; " can be held: dropped
            self._text(out, "".join(self._held))

    def _fail(self, out: list[ToolStreamEvent]) -> None:
        """The text is no (further) call: emit what was held and pass the rest through."""
        self._text(out, "".join(self._held))
        self._held = []
        self._state = self._PASS

    def _begin_object(self) -> None:
        self._state = self._OBJECT
        self._object = []
        self._depth = 0
        self._in_string = self._escaped = False

    def _start(self, delta: str, out: list[ToolStreamEvent]) -> str:
        """Consume ``delta`` before the first object: whitespace, ``<|python_tag|>``."""
        pos = 0
        while pos < len(delta):
            if self._tag in (-1, len(_PYTHON_TAG)):
                pos = _skip_ws(delta, pos)
                if pos == len(delta):
                    break
                char = delta[pos]
                if char == "{":
                    self._held.append(delta[:pos])
                    self._begin_object()
                    return delta[pos:]
                if char != "<" or self._tag != -1:
                    self._fail(out)
                    return delta
                self._tag = 0
            take = min(len(_PYTHON_TAG) - self._tag, len(delta) - pos)
            if delta[pos : pos + take] != _PYTHON_TAG[self._tag : self._tag + take]:
                self._fail(out)
                return delta
            self._tag += take
            pos += take
        self._held.append(delta)
        return ""

    def _in_object(self, delta: str, out: list[ToolStreamEvent]) -> str:
        """Consume ``delta`` inside an object; return the rest after it closes."""
        end = self._scan(delta)
        if end < 0:
            self._object.append(delta)
            self._held.append(delta)
            return ""
        self._object.append(delta[:end])
        self._held.append(delta[:end])
        call = _llama_call("".join(self._object))
        self._object = []
        if call is None:
            self._fail(out)
        else:
            self._call(out, call)
            self._held = []
            self._state = self._BETWEEN
            self._semicolon = False
        return delta[end:]

    def _scan(self, delta: str) -> int:
        """Follow the object's braces through ``delta``: the index after its closing
        ``}``, or -1 when it is still open."""
        pos = 0
        while pos < len(delta):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                    pos += 1
                    continue
                match = _STRING_STOP.search(delta, pos)
                if match is None:
                    return -1
                pos = match.end()
                if match.group() == "\\":
                    self._escaped = True
                else:
                    self._in_string = False
                continue
            match = _OBJECT_STOP.search(delta, pos)
            if match is None:
                return -1
            pos = match.end()
            char = match.group()
            if char == '"':
                self._in_string = True
            elif char == "{":
                self._depth += 1
            else:
                self._depth -= 1
                if self._depth == 0:
                    return pos
        return -1

    def _between(self, delta: str, out: list[ToolStreamEvent]) -> str:
        """Consume ``delta`` after a call: whitespace, one ``;``, the next ``{``."""
        pos = 0
        while True:
            start = _skip_ws(delta, pos)
            if self._held:  # after the ";": its whitespace is content if no call follows
                self._held.append(delta[pos:start])
            if start == len(delta):
                return ""
            char = delta[start]
            if char == ";" and not self._semicolon:
                self._semicolon = True
                self._held.append(";")
                pos = start + 1
                continue
            if char == "{" and len(self._calls) < self._max_calls:
                self._begin_object()
                return delta[start:]
            self._fail(out)
            return delta[start:]


TOOL_PARSERS: Final[Mapping[str, type[ToolParser]]] = MappingProxyType(
    {cls.name: cls for cls in (HermesToolParser, Llama3JsonToolParser)}
)
"""The tool-call parsers by name (read-only)."""


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class called ``name`` in :data:`TOOL_PARSERS`.

    Raises:
        InvalidConfigError: (a ``ValueError``) no parser has that name; the message lists
            the known ones.
    """
    try:
        return TOOL_PARSERS[name]
    except (KeyError, TypeError):
        known = ", ".join(sorted(TOOL_PARSERS))
        raise InvalidConfigError("tool_call_parser", name, f"one of {known}") from None
