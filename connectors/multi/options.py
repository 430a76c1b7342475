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

from pipeline.errors import InvalidConfigError

__all__ = ["MULTI_OPTIONS", "MultiOptions", "TierSpec"]

MULTI_OPTIONS = ("tiers",)
"""Every option the multi connector accepts."""

_TIER_KEYS = ("connector", "options")


@attrs.frozen(kw_only=True)
class TierSpec:
    """One tier: a registered connector name and its own ``connector_options``."""

    connector: str
    options: Mapping[str, Any] = attrs.field(factory=dict, eq=False, hash=False)


def _tier(index: int, raw: object) -> TierSpec:
    where = f"connector_options['tiers'][{index}]"
    if not isinstance(raw, Mapping):
        raise InvalidConfigError(where, raw, "must be a mapping {'connector': name, 'options': {}}")
    unknown = sorted(set(raw) - set(_TIER_KEYS))
    if unknown:
        raise InvalidConfigError(where, unknown[0], f"a tier accepts {', '.join(_TIER_KEYS)}")
    name = raw.get("connector")
    if not isinstance(name, str) or not name:
        raise InvalidConfigError(f"{where}['connector']", name, "must be a registered name")
    if name == "multi":
        raise InvalidConfigError(f"{where}['connector']", name, "a tier cannot be multi itself")
    options = raw.get("options", {})
    if not isinstance(options, Mapping):
        raise InvalidConfigError(f"{where}['options']", options, "must be a mapping")
    return TierSpec(connector=name, options=dict(options))


@attrs.frozen(kw_only=True)
class MultiOptions:
    """What the multi connector was configured with.

    Attributes:
        tiers: The tiers, fastest first (at least one).
    """

    tiers: tuple[TierSpec, ...]

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> MultiOptions:
        """Validate ``options``; tier names are looked up when the tiers are built.

        Raises:
            InvalidConfigError: An unknown option, no ``tiers``, an empty or non-list
                ``tiers``, or a malformed tier (not a mapping, unknown key, a missing or
                empty connector name, ``"multi"`` itself, options that are no mapping).
        """
        unknown = sorted(set(options) - set(MULTI_OPTIONS))
        if unknown:
            raise InvalidConfigError(
                "connector_options", unknown[0], f"multi accepts {', '.join(MULTI_OPTIONS)}"
            )
        tiers = options.get("tiers")
        if not isinstance(tiers, list | tuple) or not tiers:
            raise InvalidConfigError(
                "connector_options['tiers']",
                tiers,
                "must be a non-empty list of {'connector': name, 'options': {...}}",
            )
        return cls(tiers=tuple(_tier(i, raw) for i, raw in enumerate(tiers)))
