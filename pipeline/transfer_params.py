"""``kv_transfer_params``: a request's own data for the KV connector, checked at the door.

As in vLLM's disaggregated prefill/decode, a request may carry a small JSON object that
the connector's scheduler half reads (``Request.kv_transfer_params``, e.g. in
``get_num_new_matched_tokens``), and the connector's ``request_finished`` may answer one
that comes back on the request's final ``RequestOutput`` (and in the HTTP response).

The object comes from outside (an HTTP body, a caller's ``dict``), so before a request is
admitted :func:`check_transfer_params` refuses anything but plain JSON within fixed
bounds, with an ``InvalidRequestError`` naming ``kv_transfer_params`` and what is
allowed, and returns a fresh copy (encoded with ``msgspec.json`` and decoded again, never
pickled): the engine never keeps a reference to the caller's mutable object.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NoReturn

import msgspec

from pipeline.checks import INT64_MAX, INT64_MIN
from pipeline.errors import InvalidRequestError

__all__ = [
    "MAX_TRANSFER_BYTES",
    "MAX_TRANSFER_DEPTH",
    "MAX_TRANSFER_ENTRIES",
    "TRANSFER_PARAMS",
    "check_transfer_params",
    "transfer_params_per_prompt",
]

#: The field's name, as errors and the HTTP API spell it.
TRANSFER_PARAMS = "kv_transfer_params"
#: Deepest nesting of objects and arrays (the top-level object is level 1).
MAX_TRANSFER_DEPTH = 8
#: Most entries in all: every object key and every array item, at any level. A remote
#: prefill's answer lists the producer's blocks one entry each (vLLM's form): 8,192
#: entries carry a prompt of over 130k tokens at block size 16.
MAX_TRANSFER_ENTRIES = 8192
#: Largest size of the object encoded as JSON (UTF-8): room for 8,192 block ids of up
#: to 10 digits, still a small fraction of the server's default 4 MiB body.
MAX_TRANSFER_BYTES = 128 * 1024

_ALLOWED = (
    "must be a JSON object: a dict with str keys whose values are str, int (64-bit), "
    "finite float, bool, None, list or dict, nested at most "
    f"{MAX_TRANSFER_DEPTH} deep, with at most {MAX_TRANSFER_ENTRIES} entries in all and "
    f"at most {MAX_TRANSFER_BYTES} bytes as JSON"
)


def check_transfer_params(value: object) -> dict[str, Any] | None:
    """``value`` checked and copied, or ``None`` for ``None``.

    Cheap whatever the input: sizes are counted before anything is encoded, so a
    million-item list or a huge string is refused without being walked or copied.

    Returns:
        A new ``dict`` of builtin JSON values, equal to ``value`` and sharing nothing
        with it.

    Raises:
        InvalidRequestError: Names ``kv_transfer_params``, where in it the problem is,
            and what is allowed.
    """
    if value is None:
        return None
    if not isinstance(value, dict):
        _refuse(type(value).__name__, f"got a {type(value).__name__}")
    _Walk().visit(value, TRANSFER_PARAMS, 1)
    try:
        encoded = msgspec.json.encode(value)
    except (TypeError, ValueError, OverflowError) as exc:  # a subclass that lies
        _refuse("...", f"cannot be encoded as JSON ({exc})")
    if len(encoded) > MAX_TRANSFER_BYTES:
        _refuse(f"<{len(encoded)} bytes>", f"is {len(encoded)} bytes as JSON")
    copy: dict[str, Any] = msgspec.json.decode(encoded)
    return copy


def transfer_params_per_prompt(value: object, num_prompts: int) -> list[dict[str, Any] | None]:
    """``LLM.generate``'s ``kv_transfer_params`` as one checked copy (or ``None``) per prompt.

    ``None`` gives none to every prompt; one ``dict`` is for a single prompt only (a
    transfer belongs to one request); a list or tuple gives one ``dict`` or ``None`` per
    prompt, in order.

    Raises:
        InvalidRequestError: Names ``kv_transfer_params``: one dict for several prompts,
            a list of another length, or an entry :func:`check_transfer_params` refuses.
    """
    if value is None:
        return [None] * num_prompts
    if isinstance(value, dict):
        if num_prompts != 1:
            raise InvalidRequestError(
                TRANSFER_PARAMS,
                value,
                f"one dict is for a single prompt, not {num_prompts}: pass a list with one "
                "dict (or None) per prompt",
            )
        return [check_transfer_params(value)]
    if not isinstance(value, Sequence) or isinstance(value, str | bytes | bytearray):
        raise InvalidRequestError(
            TRANSFER_PARAMS,
            type(value).__name__,
            "must be None, a dict (one prompt) or a list of one dict or None per prompt",
        )
    if len(value) != num_prompts:
        raise InvalidRequestError(
            TRANSFER_PARAMS,
            f"<{len(value)} entries>",
            f"must hold one dict or None per prompt ({num_prompts})",
        )
    return [check_transfer_params(each) for each in value]


class _Walk:
    """One bounded walk: counts entries and string sizes, refuses early."""

    def __init__(self) -> None:
        self.entries = 0
        self.chars = 0  # a lower bound of the JSON size

    def visit(self, value: object, path: str, depth: int) -> None:
        if isinstance(value, dict | list):
            if depth > MAX_TRANSFER_DEPTH:
                _refuse("...", f"nests deeper than {MAX_TRANSFER_DEPTH} levels at {path}")
            self.entries += len(value)
            if self.entries > MAX_TRANSFER_ENTRIES:
                _refuse("...", f"has more than {MAX_TRANSFER_ENTRIES} entries")
            if isinstance(value, list):
                for i, item in enumerate(value):
                    self.visit(item, f"{path}[{i}]", depth + 1)
                return
            for key, item in value.items():
                if not isinstance(key, str):
                    _refuse(key, f"has a key of type {type(key).__name__} at {path}")
                self._count(len(key))
                self.visit(item, f"{path}.{key[:40]}", depth + 1)
            return
        if value is None or isinstance(value, bool):
            return
        if isinstance(value, str):
            self._count(len(value))
        elif isinstance(value, int):
            if not INT64_MIN <= value <= INT64_MAX:
                _refuse(value, f"has an int outside 64 bits at {path}")
        elif isinstance(value, float):
            if not math.isfinite(value):
                _refuse(value, f"has a non-finite float at {path}")
        else:
            _refuse(type(value).__name__, f"has a {type(value).__name__} at {path}")

    def _count(self, chars: int) -> None:
        self.chars += chars
        if self.chars > MAX_TRANSFER_BYTES:
            _refuse("...", f"is more than {MAX_TRANSFER_BYTES} bytes as JSON")


def _refuse(value: object, problem: str) -> NoReturn:
    raise InvalidRequestError(TRANSFER_PARAMS, value, f"{problem}; {_ALLOWED}")
