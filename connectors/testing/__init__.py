"""Test doubles and fault injection: one package that the runtime never imports.

* :class:`RecordingConnector` (registered as ``"recording"``) records every call of both
  halves; :func:`check_lifecycle` turns the record into per-step order violations;
* :class:`FaultyConnector` (registered as ``"faulty"``) wraps any connector and injects
  :class:`Fault` s at a chosen call, step and rank;
* :class:`FaultStage` raises, hangs or is cancelled at a chosen step and rank of a graph.

The registry imports this package only when ``"recording"`` or ``"faulty"`` is looked
up; importing the runtime packages never does. The public names live in
private-by-convention modules (``recording``, ``lifecycle_check``, ``faulty``,
``fault_spec``, ``fault_stage``) and report this package as their module, as trio's
do: the wire names a metadata class ``connectors.testing:RecordingMetadata``, and a
connector's metadata allow-list covers the package its halves report (for the faulty
wrapper, ``connectors``: it forwards whichever connector's metadata it wraps).
"""

from connectors.testing.fault_spec import (
    ACTIONS,
    CALLS,
    MAX_SYNC_HANG_S,
    Fault,
    FaultAction,
    FaultInjector,
    FiredFault,
)
from connectors.testing.fault_stage import FaultStage
from connectors.testing.faulty import FaultyConnector
from connectors.testing.lifecycle_check import check_lifecycle
from connectors.testing.recording import ConnectorCall, RecordingConnector, RecordingMetadata

__all__ = [
    "ACTIONS",
    "CALLS",
    "MAX_SYNC_HANG_S",
    "ConnectorCall",
    "Fault",
    "FaultAction",
    "FaultInjector",
    "FaultStage",
    "FaultyConnector",
    "FiredFault",
    "RecordingConnector",
    "RecordingMetadata",
    "check_lifecycle",
]


def _publish(obj: object) -> None:
    """Report ``obj`` (and the classes nested in it) as defined in this package."""
    nested = [v for v in vars(obj).values() if isinstance(v, type)] if isinstance(obj, type) else []
    for item in (obj, *nested):
        module = getattr(item, "__module__", None)
        if isinstance(module, str) and module.startswith(__name__ + "."):
            setattr(item, "__module__", __name__)  # noqa: B010


for _name in __all__:
    _publish(globals()[_name])
del _name
