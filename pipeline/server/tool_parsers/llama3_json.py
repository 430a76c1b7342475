"""``llama3_json`` (Llama 3.x): the whole output is JSON call objects ``{"name": ...,
"parameters": {...}}``, optionally after ``<|python_tag|>``, separated by ``;``."""

from __future__ import annotations

import re
from typing import ClassVar, Final

import attrs

from pipeline.server.tool_parsers.base import (
    ParsedTools,
    ToolCall,
    ToolCallStream,
    ToolParser,
    ToolStreamEvent,
    load_call,
)

__all__ = ["Llama3JsonToolParser"]

_NON_WS = re.compile(r"\S")
_OBJECT_STOP = re.compile(r'[{}"]')
_STRING_STOP = re.compile(r'["\\]')

_PYTHON_TAG: Final = "<|python_tag|>"


def _llama_call(text: str) -> ToolCall | None:
    return load_call(text, ("parameters", "arguments"), required=True)


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
