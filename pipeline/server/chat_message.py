"""A chat choice's text as an OpenAI message: ``reasoning_content``, ``content``, ``tool_calls``.

A :class:`MessageReader` reads one choice's generated text, whole or delta by delta,
through the server's reasoning parser (``--reasoning-parser``: the thinking becomes
``reasoning_content``) and then, on what follows the reasoning, the request's tool-call
parser (the calls become ``tool_calls``, the rest ``content``). Without either, the text
is the content, as before.

Streaming and not agree: for any split of a text into deltas, the deltas' fields
concatenate to the whole message's (the parsers' own promise), and a partial call or
tag is held back, never sent as content. Everything here is synchronous and never raises
on model output.
"""

from __future__ import annotations

from typing import Any

from pipeline.server.reasoning import ReasoningParser, ReasoningStream
from pipeline.server.tool_parsers import ToolCallDelta, ToolCallStream, ToolParser

__all__ = ["MessageReader"]


class MessageReader:
    """Reads one choice's text into message fields (one reader per choice).

    Args:
        tools: The tool-call parser to read calls with, or ``None``: no calls.
        reasoning: The reasoning parser, or ``None``: no ``reasoning_content``.
    """

    def __init__(self, tools: ToolParser | None, reasoning: ReasoningParser | None) -> None:
        self._tools = tools
        self._reasoning = reasoning
        self._tool_stream: ToolCallStream | None = None
        self._reasoning_stream: ReasoningStream | None = None
        self.made_calls = False
        """Whether the text held at least one tool call (``finish_reason`` then
        becomes ``"tool_calls"`` when the choice ended by itself)."""

    def message(self, text: str) -> dict[str, Any]:
        """The whole message's fields of a whole ``text`` (``content`` ``None`` when
        only calls were written; ``tool_calls`` and ``reasoning_content`` only when a
        parser is set)."""
        fields: dict[str, Any] = {}
        content: str | None = text
        if self._reasoning is not None:
            parsed = self._reasoning.parse(text)
            fields["reasoning_content"] = parsed.reasoning_content
            content = parsed.content
        if self._tools is None:
            fields["content"] = content
            return fields
        tools = self._tools.parse(content or "")
        fields["content"] = tools.content
        if tools.tool_calls:
            self.made_calls = True
            fields["tool_calls"] = [call.to_json() for call in tools.tool_calls]
        return fields

    def delta(self, text: str, *, last: bool) -> dict[str, Any]:
        """The fields of a stream chunk's ``delta`` for the next text ``text`` (``last``:
        the choice ended, so whatever was held back is sent now)."""
        reasoning, content = "", text
        if self._reasoning is not None:
            if self._reasoning_stream is None:
                self._reasoning_stream = self._reasoning.stream()
            step = self._reasoning_stream.feed(text)
            reasoning, content = step.reasoning, step.content
            if last:
                rest = self._reasoning_stream.finish()
                reasoning, content = reasoning + rest.reasoning, content + rest.content
        fields: dict[str, Any] = {}
        if reasoning:
            fields["reasoning_content"] = reasoning
        if self._tools is None:
            fields["content"] = content
            return fields
        if self._tool_stream is None:
            self._tool_stream = self._tools.stream()
        events = self._tool_stream.feed(content)
        if last:
            events += self._tool_stream.finish()
        calls = [event.to_json() for event in events if isinstance(event, ToolCallDelta)]
        fields["content"] = "".join(event for event in events if isinstance(event, str))
        if calls:
            self.made_calls = True
            fields["tool_calls"] = calls
        return fields
