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

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

from pipeline.errors import InvalidConfigError
from pipeline.server.tool_parsers.base import (
    MAX_TOOL_CALLS,
    ParsedTools,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
    ToolStreamEvent,
    new_call_id,
)
from pipeline.server.tool_parsers.hermes import HermesToolParser
from pipeline.server.tool_parsers.llama3_json import Llama3JsonToolParser

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
