"""What every tool-call format shares: the calls and deltas a parser gives, the parser
and stream interfaces, and the reading of one call's JSON (:func:`load_call`).

See :mod:`pipeline.server.tool_parsers` for how the chat route uses a parser.
"""

from __future__ import annotations

import abc
import json
import secrets
from typing import ClassVar, Final, TypeAlias

import attrs

from pipeline.errors import InvalidConfigError

__all__ = [
    "MAX_TOOL_CALLS",
    "ParsedTools",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStream",
    "ToolParser",
    "ToolStreamEvent",
    "load_call",
    "new_call_id",
]

#: Most tool calls parsed from one output; the text of any later call stays content.
MAX_TOOL_CALLS: Final = 64


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


def load_call(text: str, argument_keys: tuple[str, ...], *, required: bool) -> ToolCall | None:
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
