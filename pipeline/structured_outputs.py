"""What a constrained request's output must match: :class:`StructuredOutputsParams`.

vLLM's ``StructuredOutputsParams``: exactly one of a JSON schema (``json``), a regular
expression (``regex``), a list of strings to choose from (``choice``), a grammar
(``grammar``: Lark, or GBNF/EBNF as llguidance reads it) or any JSON object
(``json_object``, OpenAI's ``response_format={"type": "json_object"}``). Set it as
``SamplingParams(structured_outputs=...)``; the ``structured`` logits stage then masks
every token that would leave the language (see :mod:`stages.structured`).

The checks here are the cheap ones (types, one kind, sizes, nesting depth); whether a
schema, regex or grammar compiles is the grammar backend's to say, before the request is
scheduled (:mod:`pipeline.grammar`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import attrs

from pipeline.errors import InvalidRequestError, short_repr

__all__ = [
    "MAX_CHOICES",
    "MAX_SPEC_BYTES",
    "MAX_SPEC_DEPTH",
    "GrammarKind",
    "Reasoning",
    "StructuredOutputsParams",
]

#: Largest spec (schema as compact JSON, regex, grammar, all choices together), in bytes.
MAX_SPEC_BYTES = 64 * 1024
#: Deepest nesting of a JSON schema's objects and arrays (``{"a": [1]}`` is 2).
MAX_SPEC_DEPTH = 32
#: Most strings of ``choice``.
MAX_CHOICES = 1024

GrammarKind = Literal["json", "regex", "choice", "grammar", "json_object"]
#: A reasoning section before the constrained output: always, or perhaps.
Reasoning = Literal["required", "optional"]
_REASONING: tuple[Reasoning, ...] = ("required", "optional")
_KINDS: tuple[GrammarKind, ...] = ("json", "regex", "choice", "grammar", "json_object")
_ANY_OBJECT = '{"type":"object"}'


def _depth(value: object, what: str) -> None:
    """Refuse a JSON value nested deeper than :data:`MAX_SPEC_DEPTH` (iteratively: a
    hostile document cannot overflow the stack)."""
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, Mapping | list | tuple):
            if depth > MAX_SPEC_DEPTH:
                raise InvalidRequestError(
                    what, "<deeply nested schema>", f"must nest at most {MAX_SPEC_DEPTH} levels"
                )
            children = node.values() if isinstance(node, Mapping) else node
            stack.extend((child, depth + 1) for child in children)


def _schema(value: object) -> str | None:
    """The schema as compact JSON text (keys sorted: one text per schema, the cache's
    key); a mapping or a JSON string of an object (or ``true``: any JSON value)."""
    what = "structured_outputs.json"
    if value is None:
        return None
    if isinstance(value, str):
        if len(value) > MAX_SPEC_BYTES:
            raise InvalidRequestError(what, f"<{len(value)} characters>", _too_big())
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise InvalidRequestError(what, value, f"must be a JSON schema: {exc}") from None
    if not isinstance(value, Mapping | bool):
        raise InvalidRequestError(what, value, "must be a JSON schema (an object)")
    _depth(value, what)
    try:
        text = json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(what, value, f"must be JSON: {exc}") from None
    if len(text.encode()) > MAX_SPEC_BYTES:
        raise InvalidRequestError(what, f"<{len(text)} characters>", _too_big())
    return text


def _text(field: str, value: object) -> str | None:
    what = f"structured_outputs.{field}"
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(what, value, "must be a non-empty string")
    if len(value.encode("utf-8", "surrogatepass")) > MAX_SPEC_BYTES:
        raise InvalidRequestError(what, f"<{len(value)} characters>", _too_big())
    return value


def _regex(value: object) -> str | None:
    return _text("regex", value)


def _grammar(value: object) -> str | None:
    return _text("grammar", value)


def _choice(value: object) -> tuple[str, ...] | None:
    what = "structured_outputs.choice"
    allowed = f"must be a list of 1 to {MAX_CHOICES} strings"
    if value is None:
        return None
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Iterable):
        raise InvalidRequestError(what, value, allowed)
    items: list[Any] = []
    for item in value:
        if len(items) == MAX_CHOICES:
            raise InvalidRequestError(what, f"<more than {MAX_CHOICES} strings>", allowed)
        items.append(item)
    if not items:
        raise InvalidRequestError(what, value, allowed)
    size = 0
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise InvalidRequestError(f"{what}[{i}]", item, "must be a string")
        size += len(item.encode("utf-8", "surrogatepass"))
    if size > MAX_SPEC_BYTES:
        raise InvalidRequestError(what, f"<{size} bytes>", _too_big())
    return tuple(items)


def _too_big() -> str:
    return f"must be at most {MAX_SPEC_BYTES // 1024} KiB"


@attrs.frozen(kw_only=True)
class StructuredOutputsParams:
    """The language a request's output must belong to; exactly one field is set.

    Attributes:
        json: A JSON schema: a mapping, or its JSON text; stored as compact JSON text
            with sorted keys. At most :data:`MAX_SPEC_BYTES` and
            :data:`MAX_SPEC_DEPTH` levels.
        regex: A regular expression the whole output matches (Rust ``regex`` syntax, as
            llguidance and xgrammar take it).
        choice: The output is one of these strings (at most :data:`MAX_CHOICES`).
        grammar: A context-free grammar: Lark (llguidance's syntax) or GBNF/EBNF.
        json_object: Any JSON object (OpenAI's ``{"type": "json_object"}``).
        reasoning: Whether the constrained output comes after a reasoning section the
            model writes freely, ``<think>...</think>`` (what a reasoning parser splits
            off as ``reasoning_content``): ``None``, no section; ``"required"``, the
            output thinks until ``</think>`` first (its ``<think>`` optional, as when the
            chat template opened it: DeepSeek-R1); ``"optional"``, a ``<think>`` block
            may come first (Qwen3). Set by the server from its ``--reasoning-parser``.

    Raises:
        InvalidRequestError: No field or more than one is set, or one is of the wrong
            type or too big; the message names the field (``structured_outputs.json``).
    """

    json: str | None = attrs.field(default=None, converter=_schema)
    regex: str | None = attrs.field(default=None, converter=_regex)
    choice: tuple[str, ...] | None = attrs.field(default=None, converter=_choice)
    grammar: str | None = attrs.field(default=None, converter=_grammar)
    json_object: bool = False
    reasoning: Reasoning | None = None

    def __attrs_post_init__(self) -> None:
        if self.reasoning not in (None, *_REASONING):
            raise InvalidRequestError(
                "structured_outputs.reasoning", self.reasoning, "must be required or optional"
            )
        if not isinstance(self.json_object, bool):
            raise InvalidRequestError(
                "structured_outputs.json_object", self.json_object, "must be true or false"
            )
        if type(self.choice) is list:  # decoded from the wire, not converted
            object.__setattr__(self, "choice", _choice(self.choice))
        given = [kind for kind in _KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(
                "structured_outputs",
                given or "nothing",
                f"must set exactly one of {', '.join(_KINDS)}",
            )

    @property
    def kind(self) -> GrammarKind:
        """Which field is set."""
        for kind in _KINDS:
            if getattr(self, kind) not in (None, False):
                return kind
        raise AssertionError("checked at construction")  # pragma: no cover

    @property
    def spec(self) -> str:
        """The set field as text (``choice`` as a JSON list, ``json_object`` as the
        schema of any object): with :attr:`kind`, what a grammar is compiled from."""
        kind = self.kind
        if kind == "choice":
            return json.dumps(list(self.choice or ()), ensure_ascii=False)
        if kind == "json_object":
            return _ANY_OBJECT
        value = getattr(self, kind)
        assert isinstance(value, str)
        return value

    @property
    def key(self) -> tuple[GrammarKind, str, Reasoning | None]:
        """What a compiled grammar is cached by: kind, spec and reasoning."""
        return self.kind, self.spec, self.reasoning

    def __repr__(self) -> str:
        value = short_repr(getattr(self, self.kind), 60)
        after = "" if self.reasoning is None else f", reasoning={self.reasoning!r}"
        return f"StructuredOutputsParams({self.kind}={value}{after})"
