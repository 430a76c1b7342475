"""``hermes`` (Qwen 2.5/3, Hermes): ``<tool_call>{...}</tool_call>`` blocks, any number,
with text around them."""

from __future__ import annotations

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

__all__ = ["HermesToolParser"]


def _held_prefix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


_OPEN: Final = "<tool_call>"
_CLOSE: Final = "</tool_call>"


def _hermes_call(body: str) -> ToolCall | None:
    return load_call(body, ("arguments", "parameters"), required=False)


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
