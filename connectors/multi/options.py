"""The multi connector's options, validated once from ``EngineConfig.connector_options``::

    {"tiers": [{"connector": "offload", "options": {"num_blocks": 4096}},
               {"connector": "shared_storage", "options": {"path": "/kv"}}]}

Tiers are listed fastest first: a hit is loaded from the tier with the longest hit (ties
go to the faster tier), and blocks loaded from a slower tier are promoted to the faster
ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from connectors.options import mapping, option, option_names, parse_options
from pipeline.errors import InvalidConfigError

__all__ = ["MULTI_OPTIONS", "MultiOptions", "TierSpec"]


def _tier_connector(name: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidConfigError(name, value, "must be a registered name")
    if value == "multi":
        raise InvalidConfigError(name, value, "a tier cannot be multi itself")
    return value


@attrs.frozen(kw_only=True)
class TierSpec:
    """One tier: a registered connector name and its own ``connector_options``.

    The tier's options are that connector's to check, when the tier is built (inside
    :func:`~connectors.options.options_scope`, so its errors name
    ``connector_options['tiers'][i]['options'][...]``).
    """

    connector: str = option(_tier_connector)
    options: Mapping[str, Any] = option(mapping, factory=dict, eq=False)


def _tiers(name: str, value: object) -> tuple[TierSpec, ...]:
    if not isinstance(value, list | tuple) or not value:
        raise InvalidConfigError(
            name, value, "must be a non-empty list of {'connector': name, 'options': {...}}"
        )
    return tuple(
        raw
        if isinstance(raw, TierSpec)
        else parse_options(TierSpec, raw, connector="a tier", where=f"{name}[{i}]")
        for i, raw in enumerate(value)
    )


@attrs.frozen(kw_only=True)
class MultiOptions:
    """What the multi connector was configured with.

    Attributes:
        tiers: The tiers, fastest first (at least one).
    """

    tiers: tuple[TierSpec, ...] = option(_tiers)

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> MultiOptions:
        """Validate ``options``; once, when a half is built. Tier names are looked up,
        and each tier's options checked, when the tiers are built.

        Raises:
            InvalidConfigError: An unknown option, no ``tiers``, an empty or non-list
                ``tiers``, or a malformed tier (not a mapping, unknown key, a missing or
                empty connector name, ``"multi"`` itself, options that are no mapping).
        """
        return parse_options(cls, options, connector="multi")


MULTI_OPTIONS = option_names(MultiOptions)
"""Every option the multi connector accepts."""
