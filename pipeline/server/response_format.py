"""A request body's output constraint: OpenAI's ``response_format`` and vLLM's fields.

One body may constrain its output in one of these ways (more than one is a 400 naming
both), all becoming :class:`~pipeline.structured_outputs.StructuredOutputsParams`:

- OpenAI's ``response_format``: ``{"type": "text"}`` (no constraint),
  ``{"type": "json_object"}`` (any JSON object) or ``{"type": "json_schema",
  "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``; another ``type`` is a
  400 naming ``response_format.type``;
- vLLM's ``structured_outputs``: an object with exactly one of ``json``, ``regex``,
  ``choice``, ``grammar`` (Lark or GBNF/EBNF, as llguidance reads it) and
  ``json_object``; vLLM's tuning keys are taken only at their neutral value
  (``disable_fallback`` and the others false, no ``whitespace_pattern``), an unknown
  key is a 400 naming it;
- vLLM's legacy ``guided_json``, ``guided_regex``, ``guided_choice`` and
  ``guided_grammar`` (``guided_decoding_backend`` is accepted and ignored: kvstep runs
  its own backend).

A spec's cheap checks (kind, size, depth) happen here, with the field the client wrote
in the error; whether it compiles is asked of the engine before the request is admitted
(:func:`pipeline.server.fanin.admit`), so a spec that does not compile is a 400 too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pipeline.errors import InvalidRequestError
from pipeline.structured_outputs import StructuredOutputsParams

__all__ = ["BODY_FIELDS", "LEGACY_FIELDS", "parse_output_constraint"]

#: vLLM's legacy per-kind fields and the kind each sets.
LEGACY_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
#: Every body field this module reads.
BODY_FIELDS = frozenset(
    {"response_format", "structured_outputs", "guided_decoding_backend", *LEGACY_FIELDS}
)
_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's StructuredOutputsParams keys kvstep does not implement, and their neutral values.
_NEUTRAL_KEYS: dict[str, tuple[object, ...]] = {
    "disable_fallback": (False,),
    "disable_any_whitespace": (False,),
    "disable_additional_properties": (False,),
    "whitespace_pattern": (),
    "structural_tag": (),
}


def parse_output_constraint(body: Mapping[str, Any]) -> StructuredOutputsParams | None:
    """The body's constraint on the output, or ``None`` when it has none.

    Raises:
        InvalidRequestError: A malformed or oversized spec, an unknown
            ``response_format.type``, or two constraints in one body; ``what`` is the
            field as the client wrote it (``response_format.json_schema.schema``).
    """
    found: list[tuple[str, StructuredOutputsParams]] = []
    if body.get("response_format") is not None:
        spec = _response_format(body["response_format"])
        if spec is not None:
            found.append(("response_format", spec))
    if body.get("structured_outputs") is not None:
        found.append(("structured_outputs", _structured_outputs(body["structured_outputs"])))
    for field, kind in LEGACY_FIELDS.items():
        if body.get(field) is not None:
            found.append((field, _one(field, kind, body[field])))
    if len(found) > 1:
        names = " and ".join(name for name, _ in found)
        raise InvalidRequestError(
            found[1][0], names, "constrains the output a second way: give one of them"
        )
    return found[0][1] if found else None


def _response_format(value: object) -> StructuredOutputsParams | None:
    if not isinstance(value, dict):
        raise InvalidRequestError(
            "response_format", value, 'must be an object such as {"type": "json_object"}'
        )
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise InvalidRequestError(
            "response_format.type", kind, "must be one of text, json_object, json_schema"
        )
    schema = value.get("json_schema")
    if not isinstance(schema, dict):
        raise InvalidRequestError(
            "response_format.json_schema",
            schema,
            'must be an object {"name": ..., "schema": {...}} (as OpenAI)',
        )
    if not isinstance(schema.get("name", ""), str):
        raise InvalidRequestError("response_format.json_schema.name", schema["name"], "a string")
    if not isinstance(schema.get("strict", False), bool | None):
        raise InvalidRequestError(
            "response_format.json_schema.strict", schema["strict"], "must be true or false"
        )
    if schema.get("schema") is None:
        raise InvalidRequestError(
            "response_format.json_schema.schema", None, "is required: the JSON schema"
        )
    return _one("response_format.json_schema.schema", "json", schema["schema"])


def _structured_outputs(value: object) -> StructuredOutputsParams:
    if not isinstance(value, dict):
        raise InvalidRequestError(
            "structured_outputs", value, f"must be an object with one of {', '.join(_KINDS)}"
        )
    given: dict[str, Any] = {}
    for key, item in value.items():
        where = f"structured_outputs.{key}" if isinstance(key, str) else "structured_outputs"
        if key in _KINDS:
            if item is not None:
                given[key] = item
        elif key in _NEUTRAL_KEYS:
            if item is not None and item not in _NEUTRAL_KEYS[key]:
                raise InvalidRequestError(where, item, "is not supported by kvstep")
        else:
            allowed = f"is not a field; use one of {', '.join(_KINDS)}"
            raise InvalidRequestError(where, key, allowed)
    if "json_object" in given and given["json_object"] is False:
        del given["json_object"]
    return _build("structured_outputs", given)


def _one(field: str, kind: str, value: object) -> StructuredOutputsParams:
    """A spec of one ``kind`` given in ``field``; errors name ``field``."""
    return _build(field, {kind: value}, single=True)


def _build(field: str, given: dict[str, Any], *, single: bool = False) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**given)
    except InvalidRequestError as exc:
        if single and exc.what.startswith("structured_outputs."):
            # structured_outputs.json[3] -> guided_json[3]: the field the client wrote
            rest = exc.what.partition(".")[2]
            kind = next(iter(given))
            what = field + rest[len(kind) :]
            raise InvalidRequestError(what, exc.value, exc.allowed) from None
        raise
