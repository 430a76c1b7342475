"""KV connectors: the API split by role, the lifecycle guard, and the registry.

The connectors themselves live in their own modules and register on first lookup; the
recording connector for tests is imported explicitly from :mod:`connectors.testing`.
"""

from connectors.base import (
    ConnectorContext,
    ForwardContext,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
    KVConnectorScheduler,
    KVConnectorWorker,
    MatchResult,
    ModelFingerprint,
    RequestFinishedResult,
    WorkerFinished,
)
from connectors.lifecycle import ALLOWED_PREVIOUS, GuardedWorker, make_worker
from connectors.registry import (
    ConnectorSpec,
    create_connector,
    get_connector,
    list_connectors,
    register_connector,
    unregister_connector,
)

__all__ = [
    "ALLOWED_PREVIOUS",
    "ConnectorContext",
    "ConnectorSpec",
    "ForwardContext",
    "GuardedWorker",
    "KVConnectorMetadata",
    "KVConnectorOutput",
    "KVConnectorRole",
    "KVConnectorScheduler",
    "KVConnectorWorker",
    "MatchResult",
    "ModelFingerprint",
    "RequestFinishedResult",
    "WorkerFinished",
    "create_connector",
    "get_connector",
    "list_connectors",
    "make_worker",
    "register_connector",
    "unregister_connector",
]
