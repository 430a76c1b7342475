"""``EngineConfig`` as command-line flags: one flag per field (``--block-size``, ...,
``--kv-events-endpoint``), the fields a command was given, ``kvstep serve``'s config
(``--kv-role`` as the nixl connector), and a config error naming its flag."""

from __future__ import annotations

import argparse
import json
import re
import types
import typing
from typing import Any

import attrs

from pipeline.cli.flag_help import config_flag_help
from pipeline.config import EngineConfig
from pipeline.errors import InvalidConfigError

__all__ = ["add_config_flags", "config_error", "config_fields", "json_object", "serve_config"]


def json_object(text: str) -> dict[str, Any]:
    """The value of ``--connector-options``: a JSON object, else an argparse error."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"invalid JSON {text!r} ({exc})") from None
    if not isinstance(value, dict):
        kind = type(value).__name__
        raise argparse.ArgumentTypeError(f"must be a JSON object {{...}}, not {kind} {text!r}")
    return value


def _endpoint_or_json(text: str) -> str | dict[str, Any]:
    """The value of ``--kv-events-endpoint``: an endpoint, or a JSON object of fields."""
    return json_object(text) if text.lstrip().startswith("{") else text


#: Fields whose flag is not ``--`` + the field name, and what that flag parses.
_FLAGS: dict[str, tuple[str, Any]] = {"kv_events": ("--kv-events-endpoint", _endpoint_or_json)}


def _flag(field: str) -> str:
    return _FLAGS[field][0] if field in _FLAGS else "--" + field.replace("_", "-")


def _flag_kind(hint: Any) -> type:
    """What a field's flag parses to: ``bool``, ``int``, ``float``, ``dict``, ``tuple``
    (one or more strings) or ``str``."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    members = typing.get_args(hint) if union else (hint,)
    kinds = {typing.get_origin(m) or m for m in members} - {type(None)}
    if len(kinds) == 1 and (kind := kinds.pop()) in (bool, int, float, dict, tuple):
        return kind
    return str


#: What the flags of the fields that take several values call each one.
_METAVARS = {"logits_processors": "MODULE:CLASS"}


def add_config_flags(
    parser: argparse.ArgumentParser, defaults: dict[str, str] | None = None
) -> None:
    hints = typing.get_type_hints(EngineConfig)
    for field in attrs.fields(EngineConfig):
        flag = _flag(field.name)
        kind = _flag_kind(hints[field.name])
        text = config_flag_help(field, defaults)
        if field.name in _FLAGS:
            parser.add_argument(
                flag,
                dest=field.name,
                type=_FLAGS[field.name][1],
                default=None,
                metavar="ENDPOINT|JSON",
                help=text,
            )
        elif kind is bool:
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=None, help=text
            )
        elif kind is dict:
            parser.add_argument(flag, type=json_object, default=None, help=f"A JSON object. {text}")
        elif kind is tuple:
            parser.add_argument(
                flag,
                nargs="+",
                action="extend",
                default=None,
                metavar=_METAVARS.get(field.name),
                help=f"One or more values (the flag may repeat). {text}",
            )
        elif kind is str:
            parser.add_argument(flag, default=None, help=text)
        else:
            parser.add_argument(flag, type=kind, default=None, help=text)


def config_fields(args: argparse.Namespace) -> dict[str, Any]:
    return {
        f.name: getattr(args, f.name)
        for f in attrs.fields(EngineConfig)
        if getattr(args, f.name, None) is not None
    }


def serve_config(args: argparse.Namespace) -> EngineConfig:
    """The engine configuration of ``kvstep serve``: the config flags, and ``--kv-role``
    as the ``nixl`` connector in that role (``--kv-transfer-key-env`` and ``--kv-peers``
    as its ``transfer_key_env`` and ``peers`` options).

    Raises:
        InvalidConfigError: ``--kv-role`` with another ``--connector``, or with a
            different ``role`` in ``--connector-options``.
    """
    fields = {"torch_compile": True, **config_fields(args)}  # SERVE_DEFAULTS
    role = getattr(args, "kv_role", None)
    if role is not None:
        connector = fields.get("connector")
        if connector not in (None, "nixl"):
            raise InvalidConfigError(
                "kv_role", role, f"is the nixl connector's role; --connector is {connector!r}"
            )
        options = dict(fields.get("connector_options") or {})
        if options.get("role", role) != role:
            raise InvalidConfigError(
                "kv_role", role, f"differs from connector_options role {options['role']!r}"
            )
        fields["connector"] = "nixl"
        fields["connector_options"] = {**options, "role": role}
    for flag, option in (("kv_transfer_key_env", "transfer_key_env"), ("kv_peers", "peers")):
        value = getattr(args, flag, None)
        if value is None:
            continue
        if role is None:
            raise InvalidConfigError(flag, value, "is an option of --kv-role (the nixl connector)")
        options = fields["connector_options"]
        if option in options and options[option] != value:
            raise InvalidConfigError(flag, value, f"differs from connector_options {option!r}")
        fields["connector_options"] = {**options, option: value}
    return EngineConfig(**fields)


def config_error(args: argparse.Namespace, exc: InvalidConfigError) -> str:
    """``exc`` as an argparse-style message, naming the flag when one was given."""
    field = re.split(r"[\[.]", exc.field, maxsplit=1)[0]
    given = field in attrs.fields_dict(EngineConfig) and getattr(args, field, None) is not None
    if given:
        flag = _flag(field)
        return f"kvstep {args.command}: error: argument {flag}: {exc}"
    return f"kvstep: error: {exc}"
