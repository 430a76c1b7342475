"""Chat messages to prompt text: ``messages`` checked, then rendered with the model's
chat template in Jinja2's immutable sandbox, as transformers renders it (``trim_blocks``,
``lstrip_blocks``, ``raise_exception``), with ``add_generation_prompt=True`` and the
special tokens (``bos_token``, ...). A message's ``content`` is a string or a list of
``{"type": "text", "text": ...}`` parts (joined with newlines, as vLLM does).

Tools (OpenAI's shapes, as transformers hands them to a template): the request's tools
are the template's ``tools``; an assistant message may carry ``tool_calls`` instead of
content (each ``{"id", "type": "function", "function": {"name", "arguments"}}``, the
arguments given to the template as an object when they are a JSON object's text, as
vLLM does), and a ``tool`` message answers one (``content``, ``tool_call_id``).

Shared by the chat route and the proxy's kv-aware router (which must render a chat
exactly as a replica does); imports nothing of the server's app.
"""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING, Any, NoReturn

from pipeline.errors import InvalidRequestError

if TYPE_CHECKING:
    import jinja2

__all__ = ["MAX_MESSAGES", "ROLES", "parse_messages", "render_chat"]

ROLES = ("system", "user", "assistant", "tool")
MAX_MESSAGES = 1024
MAX_CALLS_PER_MESSAGE = 64


def parse_messages(value: object) -> list[dict[str, Any]]:
    """``messages`` checked and normalised to ``[{"role", "content", ...}]``: content a
    string (``None`` only for an assistant message with ``tool_calls``), plus
    ``tool_calls`` (assistant) or ``tool_call_id`` (tool) where given."""
    if not isinstance(value, list) or not value:
        _bad("messages", value, "must be a non-empty list of {role, content} objects")
    if len(value) > MAX_MESSAGES:
        _bad("messages", f"<{len(value)} messages>", f"must hold at most {MAX_MESSAGES}")
    messages = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            _bad(where, type(message).__name__, "must be an object with role and content")
        role = message.get("role")
        if role not in ROLES:
            _bad(f"{where}.role", role, f"must be one of {', '.join(ROLES)}")
        calls = message.get("tool_calls")
        normal: dict[str, Any] = {"role": str(role)}
        if role == "assistant" and calls is not None:
            normal["tool_calls"] = _tool_calls(where, calls)
            content = message.get("content")
            normal["content"] = None if content is None else _content(where, content)
        else:
            normal["content"] = _content(where, message.get("content"))
        if role == "tool" and message.get("tool_call_id") is not None:
            call_id = message["tool_call_id"]
            if not isinstance(call_id, str):
                _bad(f"{where}.tool_call_id", call_id, "must be a string")
            normal["tool_call_id"] = call_id
        messages.append(normal)
    return messages


def _tool_calls(where: str, calls: object) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls``, arguments as an object where they parse."""
    if not isinstance(calls, list) or len(calls) > MAX_CALLS_PER_MESSAGE:
        _bad(f"{where}.tool_calls", calls, f"must be a list of at most {MAX_CALLS_PER_MESSAGE}")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            _bad(at, call, 'must be {"type": "function", "function": {"name", "arguments"}}')
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):
            _bad(f"{at}.function.arguments", arguments, "must be a string (JSON text)")
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = None
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            _bad(f"{at}.id", call_id, "must be a string")
        out.append({
            "id": call_id,
            "type": "function",
            "function": {
                "name": function["name"],
                "arguments": parsed if isinstance(parsed, dict) else arguments,
            },
        })  # fmt: skip
    return out


def _content(where: str, content: object) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        _bad(f"{where}.content", content, "must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            _bad(f"{where}.content[{j}]", part, 'must be {"type": "text", "text": ...}')
        text = part.get("text")
        if not isinstance(text, str):
            _bad(f"{where}.content[{j}].text", text, "must be a string")
        texts.append(text)
    return "\n".join(texts)


def _bad(field: str, value: object, why: str) -> NoReturn:
    if isinstance(value, str) and len(value) > 40:
        value = value[:40] + "..."
    elif isinstance(value, list | dict):
        value = f"<{type(value).__name__} of {len(value)}>"
    raise InvalidRequestError(field, value, why)


def render_chat(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> str:
    """The prompt text of ``messages`` (and ``tools``, the template's ``tools``: ``None``
    when the request gave none) through the tokenizer's chat template.

    Raises:
        InvalidRequestError: The model has no tokenizer or no chat template
            (``param`` ``messages``), or the template refused the messages.
    """
    import jinja2

    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        what = "tokenizer.json" if tokenizer is None else "chat_template in tokenizer_config.json"
        raise InvalidRequestError(
            "messages",
            "...",
            f"cannot be rendered: the model has no chat template (no {what}); "
            "use /v1/completions with a prompt instead",
        )
    special = dict(getattr(tokenizer, "special_tokens", {}))
    try:
        return _compile(template).render(
            messages=messages, tools=tools, add_generation_prompt=True, **special
        )
    except jinja2.TemplateError as exc:
        raise InvalidRequestError(
            "messages", "...", f"the chat template refused them: {exc}"
        ) from exc


@functools.lru_cache(maxsize=4)
def _compile(template: str) -> jinja2.Template:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(template)


def _raise_exception(message: str) -> NoReturn:
    import jinja2

    raise jinja2.TemplateError(message)
