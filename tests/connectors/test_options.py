"""The shared connector options parser (connectors/options.py) and the connectors on it."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from connectors.base import ConnectorContext, KVConnectorRole
from connectors.multi import MultiOptions
from connectors.offload import OFFLOAD_OPTIONS, OffloadOptions
from connectors.options import (
    derived,
    flag,
    integer,
    mapping,
    option,
    option_names,
    optional,
    options_scope,
    parse_options,
    positive_number,
)
from connectors.registry import create_connector
from pipeline.errors import InvalidConfigError


def _double(options: Any) -> int:
    return 2 * options.size


@attrs.frozen(kw_only=True)
class Inner:
    colour: str = option(lambda name, value: value, default="red")


def _inners(name: str, value: object) -> tuple[Inner, ...]:
    assert isinstance(value, list)
    return tuple(
        parse_options(Inner, raw, connector="an inner", where=f"{name}[{i}]")
        for i, raw in enumerate(value)
    )


@attrs.frozen(kw_only=True)
class Sample:
    size: int = option(integer(1, 10))
    ratio: float = option(positive_number, default=1.0)
    fast: bool = option(flag, default=False)
    limit: int | None = option(optional(integer(0)), default=None)
    extra: dict[str, Any] = option(mapping, factory=dict)
    inners: tuple[Inner, ...] = option(_inners, factory=list)
    twice: int = derived(_double)


def parse(options: object) -> Sample:
    return parse_options(Sample, options, connector="sample")


def refused(options: object) -> InvalidConfigError:
    with pytest.raises(InvalidConfigError) as info:
        parse(options)
    assert isinstance(info.value, ValueError)
    return info.value


class TestParseOptions:
    def test_builds_the_frozen_class_with_defaults_and_derived_fields(self) -> None:
        """Given options are checked and kept, the rest default, derived fields computed."""
        got = parse({"size": 3, "ratio": 2, "extra": {"a": 1}})
        assert (got.size, got.ratio, got.fast, got.limit, got.twice) == (3, 2.0, False, None, 6)
        assert type(got.ratio) is float and got.extra == {"a": 1}
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            got.size = 4  # type: ignore[misc]

    def test_unknown_key_names_the_key_and_every_allowed_one(self) -> None:
        """An unknown key is refused by name (never its value), listing the options."""
        error = refused({"size": 1, "colour": "secret-value"})
        assert error.field == "connector_options key" and error.value == "colour"
        assert error.allowed == "sample accepts size, ratio, fast, limit, extra, inners"
        assert "secret-value" not in str(error)

    def test_a_derived_field_is_no_option(self) -> None:
        """A derived field's name is refused like any unknown key."""
        assert refused({"size": 1, "twice": 2}).value == "twice"
        assert option_names(Sample) == ("size", "ratio", "fast", "limit", "extra", "inners")

    @pytest.mark.parametrize(
        ("options", "field", "allowed"),
        [
            ({"size": True}, "size", "must be an integer in [1, 10]"),
            ({"size": 11}, "size", "must be an integer in [1, 10]"),
            ({"size": 1, "ratio": "2"}, "ratio", "must be a number > 0"),
            ({"size": 1, "ratio": 0}, "ratio", "must be a number > 0"),
            ({"size": 1, "fast": "yes"}, "fast", "must be true or false"),
            ({"size": 1, "limit": -1}, "limit", "must be an integer >= 0"),
            ({"size": 1, "extra": [1]}, "extra", "must be a mapping"),
        ],
    )
    def test_wrong_type_or_range_names_the_option_the_value_and_what_is_allowed(
        self, options: dict[str, Any], field: str, allowed: str
    ) -> None:
        """Each check raises InvalidConfigError naming the option's full name."""
        error = refused(options)
        assert error.field == f"connector_options[{field!r}]"
        assert error.value == options[field] and error.allowed == allowed

    def test_a_missing_required_option_reaches_its_check_as_none(self) -> None:
        """No value for a required option: its check says what it needs."""
        error = refused({})
        assert (error.field, error.value) == ("connector_options['size']", None)

    def test_not_a_mapping_is_refused(self) -> None:
        """The options themselves must be a mapping."""
        error = refused([("size", 1)])
        assert error.field == "connector_options" and "must be a mapping" in error.allowed

    def test_nested_options_are_named_by_their_path(self) -> None:
        """A nested mapping parsed with the parser names its keys under its parent."""
        got = parse({"size": 1, "inners": [{}, {"colour": "blue"}]})
        assert [i.colour for i in got.inners] == ["red", "blue"]
        error = refused({"size": 1, "inners": [{}, {"shade": 1}]})
        assert error.field == "connector_options['inners'][1] key" and error.value == "shade"
        assert error.allowed == "an inner accepts colour"

    def test_a_scope_names_options_where_the_user_wrote_them(self) -> None:
        """Inside options_scope the same options are named under the scope's path."""
        scope = options_scope("connector_options['tiers'][2]['options']")
        with scope, pytest.raises(InvalidConfigError) as info:
            parse({"size": 0})
        assert info.value.field == "connector_options['tiers'][2]['options']['size']"
        assert refused({"size": 0}).field == "connector_options['size']"  # scope ended

    def test_defaults_fill_only_what_is_not_given(self) -> None:
        """Run-time defaults (an engine's id) yield to what the user gave."""
        assert parse_options(Sample, {}, connector="s", defaults={"size": 4}).size == 4
        assert parse_options(Sample, {"size": 2}, connector="s", defaults={"size": 4}).size == 2


class TestConnectorOptions:
    def test_offload_unknown_key_is_named_as_a_key(self) -> None:
        """offload's unknown key: the key, and every option offload accepts."""
        with pytest.raises(InvalidConfigError) as info:
            OffloadOptions.from_options({"num_blocks": 2, "colour": "red"})
        assert info.value.field == "connector_options key" and info.value.value == "colour"
        assert all(name in info.value.allowed for name in OFFLOAD_OPTIONS)

    def test_a_multi_tier_error_names_the_tier(self) -> None:
        """A malformed tier is named by its index."""
        with pytest.raises(InvalidConfigError) as info:
            MultiOptions.from_options({"tiers": [{"connector": "offload"}, {"connectr": "x"}]})
        assert info.value.field == "connector_options['tiers'][1] key"

    @pytest.mark.parametrize("role", [KVConnectorRole.WORKER, KVConnectorRole.SCHEDULER])
    def test_a_tiers_own_options_are_named_under_the_tier(self, role: KVConnectorRole) -> None:
        """The tier connector's own error names the option where the user wrote it."""
        tiers = [{"connector": "offload", "options": {"num_blocks": 0}}]
        ctx = ConnectorContext(role=role, options={"tiers": tiers})
        with pytest.raises(InvalidConfigError) as info:
            create_connector("multi", role, ctx)
        assert info.value.field == "connector_options['tiers'][0]['options']['num_blocks']"

    @pytest.mark.parametrize("role", [KVConnectorRole.WORKER, KVConnectorRole.SCHEDULER])
    def test_faultys_inner_options_are_named_under_inner_options(
        self, role: KVConnectorRole
    ) -> None:
        """faulty's inner connector names its options under inner_options."""
        import connectors.testing  # noqa: F401  (registers "faulty")

        options = {"inner": "offload", "inner_options": {"num_blocks": 1, "async_load": 1}}
        ctx = ConnectorContext(role=role, options=options)
        with pytest.raises(InvalidConfigError) as info:
            create_connector("faulty", role, ctx)
        assert info.value.field == "connector_options['inner_options']['async_load']"
