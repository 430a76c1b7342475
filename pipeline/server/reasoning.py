"""Reasoning parsers: ``<think>...</think>`` to ``reasoning_content`` (``--reasoning-parser``).

A reasoning model writes its thinking between ``<think>`` and ``</think>`` and then its
answer; the server returns the thinking as the message's ``reasoning_content`` and the
answer as its ``content``. Each model family is a :class:`ReasoningParser`, chosen by
name from :data:`REASONING_PARSERS` (:func:`get_reasoning_parser`):

- ``"deepseek_r1"`` (DeepSeek-R1 and its distills, and models whose chat template opens
  ``<think>`` itself, such as Qwen3 "thinking-2507"): the output may start with
  ``<think>`` or not (the template wrote it); everything up to the first ``</think>`` is
  reasoning, and an output that never writes ``</think>`` is all reasoning;
- ``"qwen3"`` (Qwen3 hybrid models): reasoning only when the output starts with
  ``<think>`` (with ``enable_thinking=False`` the template closes an empty think block and
  the output is all content); from there up to ``</think>`` is reasoning (all of the rest
  when it never closes, as a stream would have sent it).

How the chat route uses one (one parser per server, one parse or stream per choice):
``parser.parse(text)`` splits a whole output (:class:`ParsedReasoning`, ``None`` for an
empty part); ``s = parser.stream()``, ``s.feed(delta)`` per text delta and ``s.finish()``
at the end each return a :class:`ReasoningDelta` of the text to send now (``""`` for
none, reasoning before content). ``s.reasoning_ended`` says whether the reasoning section
is over, i.e. whether what follows is content (where structured output and tool-call
parsing apply; a tool parser is fed the content deltas).

A stream holds back only an end of the text that may be the start of a tag (``"</thi"``).
For every split of a text into deltas, a stream's reasoning and content, concatenated,
are ``parse(text)``'s (``""`` for ``None``). The tags themselves are in neither part.
Nothing here raises on any text; all of it is plain synchronous code (cancellation-safe),
and a stream is used by one task.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from types import MappingProxyType
from typing import ClassVar, Final, NamedTuple

import attrs

from pipeline.errors import InvalidConfigError

__all__ = [
    "REASONING_PARSERS",
    "DeepSeekR1ReasoningParser",
    "ParsedReasoning",
    "Qwen3ReasoningParser",
    "ReasoningDelta",
    "ReasoningParser",
    "ReasoningStream",
    "get_reasoning_parser",
]

_OPEN: Final = "<think>"
_CLOSE: Final = "</think>"


class ParsedReasoning(NamedTuple):
    """A whole output split into ``reasoning_content`` and ``content`` (``None``: empty)."""

    reasoning_content: str | None
    content: str | None


class ReasoningDelta(NamedTuple):
    """What a stream may send now: ``reasoning`` text, then ``content`` text (``""``:
    nothing)."""

    reasoning: str
    content: str


def _held_prefix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningStream:
    """The streaming side of a :class:`ReasoningParser`.

    :meth:`feed` is called with each text delta of one output, in order, and
    :meth:`finish` once at its end (``feed`` after it raises ``RuntimeError``; a second
    ``finish`` returns an empty delta). Neither raises on any text.

    Args:
        implicit_open: Whether an output that does not start with ``<think>`` is
            reasoning all the same (``deepseek_r1``) rather than all content (``qwen3``).
    """

    _START, _REASONING, _CONTENT = range(3)

    def __init__(self, *, implicit_open: bool) -> None:
        self._implicit_open = implicit_open
        self._state = self._START
        self._held = ""  # a proper prefix of <think> (at the start) or of </think>
        self._finished = False

    @property
    def reasoning_ended(self) -> bool:
        """Whether the reasoning section is over: ``</think>`` was seen, or (``qwen3``)
        the output did not start with ``<think>``. Everything fed after it is content."""
        return self._state == self._CONTENT

    def feed(self, delta: str) -> ReasoningDelta:
        """Take the next text delta; return the reasoning and content to send now."""
        if self._finished:
            raise RuntimeError("this reasoning stream is finished; start another one")
        if self._state == self._START:
            text = self._held + delta
            if len(text) < len(_OPEN) and _OPEN.startswith(text):  # still maybe <think>
                self._held = text
                return ReasoningDelta("", "")
            self._held = ""
            if text.startswith(_OPEN):
                self._state = self._REASONING
                delta = text[len(_OPEN) :]
            elif self._implicit_open:
                self._state = self._REASONING
                delta = text
            else:
                self._state = self._CONTENT
                return ReasoningDelta("", text)
        if self._state == self._CONTENT:
            return ReasoningDelta("", delta)
        text = self._held + delta
        end = text.find(_CLOSE)
        if end >= 0:
            self._held = ""
            self._state = self._CONTENT
            return ReasoningDelta(text[:end], text[end + len(_CLOSE) :])
        keep = _held_prefix(text, _CLOSE)
        self._held = text[len(text) - keep :]
        return ReasoningDelta(text[: len(text) - keep], "")

    def finish(self) -> ReasoningDelta:
        """End the output: return what was held back (a partial tag, now plain text)."""
        if self._finished:
            return ReasoningDelta("", "")
        self._finished = True
        held, self._held = self._held, ""
        if self._state == self._START and not self._implicit_open:
            self._state = self._CONTENT  # it never was <think>: all content
            return ReasoningDelta("", held)
        return ReasoningDelta(held, "")


@attrs.frozen
class ReasoningParser(abc.ABC):
    """A reasoning format: :meth:`parse` for a whole output, :meth:`stream` for deltas."""

    #: The name the parser is chosen by (``--reasoning-parser``).
    name: ClassVar[str]
    #: Whether an output that does not start with ``<think>`` is reasoning all the same.
    implicit_open: ClassVar[bool]

    def parse(self, text: str) -> ParsedReasoning:
        """Split a whole generated ``text`` into reasoning and content; never raises."""
        if text.startswith(_OPEN):
            start = len(_OPEN)
        elif self.implicit_open:
            start = 0
        else:
            return ParsedReasoning(None, text or None)
        end = text.find(_CLOSE, start)
        if end < 0:
            return ParsedReasoning(text[start:] or None, None)
        return ParsedReasoning(text[start:end] or None, text[end + len(_CLOSE) :] or None)

    def stream(self) -> ReasoningStream:
        """A fresh :class:`ReasoningStream` for one output."""
        return ReasoningStream(implicit_open=self.implicit_open)


@attrs.frozen
class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1: reasoning up to the first ``</think>``, with or without ``<think>``."""

    name: ClassVar[str] = "deepseek_r1"
    implicit_open: ClassVar[bool] = True


@attrs.frozen
class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: reasoning only in a ``<think>`` block the output starts with."""

    name: ClassVar[str] = "qwen3"
    implicit_open: ClassVar[bool] = False


REASONING_PARSERS: Final[Mapping[str, type[ReasoningParser]]] = MappingProxyType(
    {cls.name: cls for cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)}
)
"""The reasoning parsers by name (read-only)."""


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class called ``name`` in :data:`REASONING_PARSERS`.

    Raises:
        InvalidConfigError: (a ``ValueError``) no parser has that name; the message lists
            the known ones.
    """
    try:
        return REASONING_PARSERS[name]
    except (KeyError, TypeError):
        known = ", ".join(sorted(REASONING_PARSERS))
        raise InvalidConfigError("reasoning_parser", name, f"one of {known}") from None
