"""The ``multi`` KV connector: tiers tried in order (e.g. offload → shared_storage).

Loads come from the tier with the longest hit (ties: the first, i.e. the fastest),
saves go to every tier, and blocks loaded from a slower tier are promoted (saved) to
the faster ones in the same step. Registered as ``"multi"``::

    EngineConfig(connector="multi", connector_options={"tiers": [
        {"connector": "offload", "options": {"num_blocks": 1024}},
        {"connector": "offload", "options": {"num_blocks": 8192}},
    ]})

Options: see :class:`MultiOptions`.
"""

from connectors.multi.metadata import MultiMetadata
from connectors.multi.options import MULTI_OPTIONS, MultiOptions, TierSpec
from connectors.multi.scheduler import MultiScheduler
from connectors.multi.worker import MultiWorker
from connectors.registry import register_connector

__all__ = [
    "MULTI_OPTIONS",
    "MultiMetadata",
    "MultiOptions",
    "MultiScheduler",
    "MultiWorker",
    "TierSpec",
]

register_connector("multi", MultiScheduler, MultiWorker)
