"""One parser for every connector's options: a user's ``connector_options`` → a frozen class.

Each connector declares its options as a frozen attrs class whose fields are made by
:func:`option` (what the user may set, checked and normalised when the class is built)
and :func:`derived` (what the connector computes from them: a signer, a slot count);
:func:`parse_options` builds that class from the user's mapping::

    @attrs.frozen(kw_only=True)
    class StoreOptions:
        path: Path = option(directory)                     # required: no default
        max_bytes: int | None = option(optional(positive_int), default=None)
        load_timeout_s: float = option(positive_number, default=30.0)
        signer: FrameSigner | None = derived(_signer, eq=False)

    options = parse_options(StoreOptions, context.options, connector="store")

A check is a plain function ``(name, value) -> value`` that returns the value in the
type the field holds or raises :class:`~pipeline.errors.InvalidConfigError` naming the
option, the value and what is allowed, the way :class:`~pipeline.config.EngineConfig`'s
validators do. It runs as the field's attrs converter (``attrs.Converter``, given the
field), so an options class checks what it holds however it is built, and ``name`` is
the option's full name: ``connector_options['path']`` at the top,
``connector_options['tiers'][0]['connector']`` inside a nested mapping
(:func:`options_scope`). A required option the user left out reaches its check as
``None``, so the message says what the option needs.

Everything here is synchronous and cheap: options are parsed once, when a connector's
half is built, never per step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeVar

import attrs

from pipeline.checks import INT64_MAX, check_float, check_int
from pipeline.errors import InvalidConfigError

__all__ = [
    "OPTIONS_ROOT",
    "Check",
    "choice",
    "derived",
    "flag",
    "integer",
    "mapping",
    "number",
    "option",
    "option_name",
    "option_names",
    "optional",
    "options_scope",
    "options_where",
    "parse_options",
    "positive_int",
    "positive_number",
    "string",
]

OPTIONS_ROOT = "connector_options"
"""How errors name the options of the connector an engine was configured with."""

T = TypeVar("T", bound=attrs.AttrsInstance)

Check = Callable[[str, Any], Any]
"""``(name, value) -> value``: the value as the field holds it, or ``InvalidConfigError``."""

_OPTION = "kvstep.connector_option"  # field metadata: True for an option, False for derived
_scope: ContextVar[str] = ContextVar("kvstep_connector_options_scope", default=OPTIONS_ROOT)


@contextmanager
def options_scope(where: str) -> Iterator[None]:
    """Name the options parsed inside the block as ``where[...]``.

    A connector that hands a nested mapping to another connector (``multi``'s tiers,
    ``faulty``'s ``inner_options``) builds that connector inside
    ``options_scope("connector_options['tiers'][0]['options']")``, so the inner
    connector's errors name the option where the user wrote it. Synchronous; the scope
    is this thread's (and task's) only, and ends with the block.
    """
    token = _scope.set(where)
    try:
        yield
    finally:
        _scope.reset(token)


def options_where() -> str:
    """How errors name the options mapping being parsed: ``connector_options`` at the top."""
    return _scope.get()


def option_name(option: str) -> str:
    """The full name of ``option`` in the current scope: ``connector_options['NAME']``."""
    return f"{_scope.get()}[{option!r}]"


def option(
    check: Callable[..., Any],
    *,
    default: Any = attrs.NOTHING,
    factory: Callable[[], Any] | None = None,
    eq: bool = True,
    takes_self: bool = False,
) -> Any:
    """An attrs field holding one option, checked and normalised by ``check``.

    Args:
        check: ``check(name, value)`` (``check(name, value, instance)`` when
            ``takes_self``: for a default that depends on the options before it).
        default: The value when the option is not given; none makes it required.
        factory: A zero-argument callable making the default (a fresh ``dict``).
        eq: Whether the field takes part in ``==`` and ``hash``.
        takes_self: Pass the instance being built (its earlier fields are set).
    """

    def convert(value: Any, instance: Any, field: attrs.Attribute[Any]) -> Any:
        name = option_name(field.name)
        return check(name, value, instance) if takes_self else check(name, value)

    return attrs.field(
        default=attrs.Factory(factory) if factory is not None else default,
        converter=attrs.Converter(convert, takes_self=True, takes_field=True),
        eq=eq,
        hash=None if eq else False,
        metadata={_OPTION: True},
    )


def derived(compute: Callable[[Any], Any], *, eq: bool = True) -> Any:
    """An attrs field the connector computes from the options declared before it.

    ``compute(instance)`` runs when the class is built; the field is no option (the
    user cannot set it, :func:`parse_options` refuses its name) and no ``__init__``
    argument. It may raise ``InvalidConfigError`` naming an option (with
    :func:`option_name`), e.g. for a key that cannot be read.
    """
    return attrs.field(
        init=False,
        default=attrs.Factory(compute, takes_self=True),
        eq=eq,
        hash=None if eq else False,
        metadata={_OPTION: False},
    )


def option_names(cls: type) -> tuple[str, ...]:
    """The options an options class accepts, in the order it declares them."""
    return tuple(f.name for f in attrs.fields(cls) if f.metadata.get(_OPTION) is True)


def parse_options(
    cls: type[T],
    options: object,
    *,
    connector: str,
    where: str | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> T:
    """Build the options class ``cls`` from a user's mapping of options.

    Refuses, in this order: a value that is no mapping, a key ``cls`` does not declare
    as an option (naming the first such key and every allowed one), then each option's
    own check, in the order the class declares them. Synchronous, cheap; call it once,
    when a connector's half is built.

    Args:
        cls: A frozen attrs class whose fields are :func:`option` and :func:`derived`.
        options: What the user wrote (``EngineConfig.connector_options`` or a nested
            mapping of it).
        connector: Who accepts these options, as the messages name it (``"offload"``,
            ``"a tier"``).
        where: How the messages name ``options``; default: the current
            :func:`options_scope` (``connector_options`` at the top).
        defaults: Defaults the caller knows only at run time (the engine's id), used
            for the options the user did not give.

    Raises:
        InvalidConfigError: Naming the mapping or the option, the value (for a key
            that is not allowed: the key, never its value) and what is allowed.
    """
    where = _scope.get() if where is None else where
    names = option_names(cls)
    accepts = f"{connector} accepts {', '.join(names)}"
    if not isinstance(options, Mapping):
        raise InvalidConfigError(where, options, f"must be a mapping; {accepts}")
    unknown = sorted((k for k in options if k not in names), key=str)
    if unknown:
        raise InvalidConfigError(f"{where} key", unknown[0], accepts)
    values: dict[str, Any] = {k: v for k, v in (defaults or {}).items() if k not in options}
    values.update(options)
    for field in attrs.fields(cls):
        if field.metadata.get(_OPTION) is True and field.default is attrs.NOTHING:
            values.setdefault(field.name, None)  # required: its check says what it needs
    with options_scope(where):
        return cls(**values)


# ---------------------------------------------------------------- the common checks


def flag(name: str, value: object) -> bool:
    """``True`` or ``False``, never a truthy string or number."""
    if not isinstance(value, bool):
        raise InvalidConfigError(name, value, "must be true or false")
    return value


def integer(lo: int = 1, hi: int = INT64_MAX) -> Check:
    """A check of an ``int`` (never a ``bool``) in ``[lo, hi]``."""

    def check(name: str, value: object) -> int:
        return check_int(name, value, InvalidConfigError, lo=lo, hi=hi)

    return check


positive_int = integer(1)
"""A check of an integer >= 1."""


def number(
    lo: float = 0.0, hi: float = math.inf, *, lo_open: bool = True, allow_inf: bool = True
) -> Check:
    """A check of a number (never a ``bool``) in ``(lo, hi]`` (``[lo, hi]`` unless
    ``lo_open``), as a ``float``; ``math.inf`` passes when ``allow_inf``."""

    def check(name: str, value: object) -> float:
        return check_float(
            name, value, InvalidConfigError, lo=lo, hi=hi, lo_open=lo_open, allow_inf=allow_inf
        )

    return check


positive_number = number()
"""A check of a number > 0 (``math.inf`` allowed): a timeout, a TTL."""


def choice(*choices: str) -> Check:
    """A check of one of ``choices`` (the message lists them: ``a | b | c``)."""

    def check(name: str, value: object) -> str:
        if not isinstance(value, str) or value not in choices:
            raise InvalidConfigError(name, value, " | ".join(choices))
        return value

    return check


def string(name: str, value: object) -> str:
    """Any ``str``."""
    if not isinstance(value, str):
        raise InvalidConfigError(name, value, "must be a string")
    return value


def mapping(name: str, value: object) -> dict[str, Any]:
    """A mapping (another connector's options, checked by that connector), as a copy."""
    if not isinstance(value, Mapping):
        raise InvalidConfigError(name, value, "must be a mapping")
    return dict(value)


def optional(check: Check) -> Check:
    """``check``, with ``None`` passing as ``None``."""

    def maybe(name: str, value: object) -> Any:
        return None if value is None else check(name, value)

    return maybe
