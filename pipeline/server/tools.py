"""Chat tools: ``tools``, ``tool_choice`` and ``parallel_tool_calls``, as OpenAI takes them.

:func:`parse_tools` checks the fields into a :class:`ToolRequest`, which the chat route
uses three ways:

- the prompt: :meth:`ToolRequest.template_tools` is what the model's chat template gets
  as ``tools`` (transformers' ``tools=`` argument: one ``{"type": "function",
  "function": {...}}`` per tool), so the model sees the tools in its own format;
- forcing: with ``tool_choice`` ``"required"`` or a named function,
  :meth:`ToolRequest.forcing_spec` is a grammar, in the server's tool-call format, of
  outputs that are calls only (to the named function, or to any of the tools; one call,
  or several when ``parallel_tool_calls``), each call's arguments valid against that
  tool's ``parameters``. The ``structured`` logits stage then keeps the model inside it
  (with the xgrammar backend, which reads no Lark: one call, as a JSON object in
  llama3_json's format ``{"name": ..., "parameters": {...}}``);
- reading: ``"auto"``, ``"required"`` and named choices parse the output with the
  server's tool-call parser (:mod:`pipeline.server.tool_parsers`) into
  ``message.tool_calls``; ``"none"`` leaves the output as content.

``tool_choice`` defaults to ``"auto"`` with tools and ``"none"`` without (as OpenAI);
``"auto"`` needs a tool-call parser (``kvstep serve --tool-call-parser``), as vLLM's
``--enable-auto-tool-choice``; the forced choices use the parser's format, or hermes'
when the server has none.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, Final, Literal

import attrs

from pipeline.errors import InvalidRequestError
from pipeline.server.tool_parsers import TOOL_PARSERS, ToolParser
from pipeline.structured_outputs import StructuredOutputsParams

__all__ = ["BODY_FIELDS", "MAX_TOOLS", "Tool", "ToolRequest", "parse_tools"]

#: Most tools one request may give (OpenAI's limit).
MAX_TOOLS: Final = 128
#: The body fields this module reads.
BODY_FIELDS: Final = frozenset({"tools", "tool_choice", "parallel_tool_calls"})
#: The format of forced calls when the server has no tool-call parser.
DEFAULT_FORMAT: Final = "hermes"
#: The grammar backends that read Lark (with llguidance's ``%json``): forced calls in
#: the parser's own format; with the others, one JSON call object.
LARK_BACKENDS: Final = frozenset({"llguidance"})
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_CHOICES = ("none", "auto", "required")
_ANY_OBJECT: Final[Mapping[str, Any]] = {"type": "object"}


@attrs.frozen(kw_only=True)
class Tool:
    """One function the model may call.

    Attributes:
        name: The function name (1 to 64 of ``A-Z a-z 0-9 _ -``, as OpenAI).
        description: What it does, or ``None``.
        parameters: The JSON schema of its arguments (an object schema; ``{"type":
            "object"}`` when the request gave none).
    """

    name: str
    description: str | None
    parameters: Mapping[str, Any]

    def to_json(self) -> dict[str, Any]:
        """OpenAI's ``{"type": "function", "function": {...}}`` (the template's entry)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = dict(self.parameters)
        return {"type": "function", "function": function}


@attrs.frozen(kw_only=True)
class ToolRequest:
    """A chat request's tools, checked.

    Attributes:
        tools: The tools, in the request's order (names unique).
        choice: ``"none"``, ``"auto"``, ``"required"``, or ``"named"``: the model must
            call :attr:`function`.
        function: With ``"named"``, the function's name.
        parallel: ``parallel_tool_calls``: whether one answer may hold several calls.
    """

    tools: tuple[Tool, ...]
    choice: Literal["none", "auto", "required", "named"]
    function: str | None = None
    parallel: bool = True

    @property
    def parses_calls(self) -> bool:
        """Whether the output is read for tool calls (every choice but ``"none"``)."""
        return self.choice != "none" and bool(self.tools)

    @property
    def forced(self) -> tuple[Tool, ...]:
        """The tools the output must call one of (none unless required or named)."""
        if self.choice == "required":
            return self.tools
        if self.choice == "named":
            return tuple(tool for tool in self.tools if tool.name == self.function)
        return ()

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The chat template's ``tools`` (``None`` when the request gave none)."""
        return [tool.to_json() for tool in self.tools] if self.tools else None

    def forcing_spec(
        self, parser: ToolParser, *, lark: bool = True
    ) -> StructuredOutputsParams | None:
        """The grammar of outputs that are :attr:`forced` calls in ``parser``'s format,
        or ``None`` when nothing is forced. Without ``lark`` (a grammar backend that
        reads no Lark: xgrammar) it is the JSON schema of one call object, the whole
        output, whatever ``parallel`` says.

        Raises:
            InvalidRequestError: The grammar is over the size a spec may have (too many
                or too large tools); names ``tools``.
        """
        forced = self.forced
        if not forced:
            return None
        key = parser.arguments_key
        options = [
            {
                "type": "object",
                "properties": {"name": {"const": tool.name}, key: dict(tool.parameters)},
                "required": ["name", key],
                "additionalProperties": False,
            }
            for tool in forced
        ]
        schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
        try:
            if not lark:
                return StructuredOutputsParams(json=schema)
            schema["x-guidance"] = {"whitespace_flexible": False}
            grammar = parser.forcing_grammar(json.dumps(schema), parallel=self.parallel)
            return StructuredOutputsParams(grammar=grammar)
        except InvalidRequestError as exc:
            raise InvalidRequestError("tools", f"<{len(forced)} tools>", exc.allowed) from None


def forcing_parser(configured: ToolParser | None, grammar_backend: str) -> ToolParser:
    """The format forced calls are written in: the server's parser, else hermes'; with a
    grammar backend that reads no Lark, one JSON call object (llama3_json's format)."""
    if grammar_backend not in LARK_BACKENDS:
        return TOOL_PARSERS["llama3_json"](max_calls=1)
    return configured if configured is not None else TOOL_PARSERS[DEFAULT_FORMAT]()


def parse_tools(body: Mapping[str, Any]) -> ToolRequest | None:
    """The body's tools, or ``None`` when it has none and ``tool_choice`` is absent or
    ``"none"``.

    Raises:
        InvalidRequestError: A malformed tool (the message names ``tools[i].function.name``
            and the like), duplicate names, a ``tool_choice`` naming no given tool, or a
            choice other than ``"none"`` without tools.
    """
    tools = _tools(body.get("tools"))
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequestError("parallel_tool_calls", parallel, "must be true or false")
    choice, function = _choice(body.get("tool_choice"), tools)
    if not tools:
        return None
    return ToolRequest(
        tools=tools, choice=choice, function=function, parallel=parallel is not False
    )


def _tools(value: object) -> tuple[Tool, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise InvalidRequestError("tools", value, "must be a list of function tools")
    if len(value) > MAX_TOOLS:
        raise InvalidRequestError("tools", f"<{len(value)} tools>", f"at most {MAX_TOOLS}")
    tools: list[Tool] = []
    for i, item in enumerate(value):
        tool = _tool(f"tools[{i}]", item)
        if any(seen.name == tool.name for seen in tools):
            raise InvalidRequestError(f"tools[{i}].function.name", tool.name, "is given twice")
        tools.append(tool)
    return tuple(tools)


def _tool(where: str, item: object) -> Tool:
    if not isinstance(item, dict) or item.get("type") != "function":
        raise InvalidRequestError(
            where, item, 'must be {"type": "function", "function": {"name": ...}}'
        )
    function = item.get("function")
    if not isinstance(function, dict):
        raise InvalidRequestError(f"{where}.function", function, "must be an object")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidRequestError(
            f"{where}.function.name", name, "must be 1 to 64 of A-Z a-z 0-9 _ -"
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidRequestError(f"{where}.function.description", description, "a string")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = dict(_ANY_OBJECT)
    else:
        what = f"{where}.function.parameters"
        if not isinstance(parameters, dict):
            raise InvalidRequestError(what, parameters, "must be a JSON schema (an object)")
        try:  # the checks a response_format schema gets: size and depth
            StructuredOutputsParams(json=parameters)
        except InvalidRequestError as exc:
            raise InvalidRequestError(what, exc.value, exc.allowed) from None
    return Tool(name=name, description=description, parameters=parameters)


_Choice = Literal["none", "auto", "required", "named"]


def _choice(value: object, tools: tuple[Tool, ...]) -> tuple[_Choice, str | None]:
    if value is None:
        return ("auto" if tools else "none"), None
    if isinstance(value, str):
        if value not in _CHOICES:
            raise InvalidRequestError(
                "tool_choice", value, 'must be "none", "auto", "required" or a named function'
            )
        if value != "none" and not tools:
            raise InvalidRequestError("tool_choice", value, "needs tools")
        return value, None  # type: ignore[return-value]  # one of _CHOICES
    if not isinstance(value, dict) or value.get("type") != "function":
        raise InvalidRequestError(
            "tool_choice", value, '{"type": "function", "function": {"name": ...}}'
        )
    function = value.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not any(tool.name == name for tool in tools):
        names = ", ".join(tool.name for tool in tools) or "none given"
        raise InvalidRequestError("tool_choice.function.name", name, f"must be a tool: {names}")
    return "named", name
