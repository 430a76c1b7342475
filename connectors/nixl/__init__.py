"""The ``nixl`` KV connector: prefill on one engine, decode on another, over NIXL.

Following vLLM's NixlConnector protocol: the producer (prefill) engine finishes a
request whose ``kv_transfer_params`` say ``do_remote_decode`` with its blocks held and
answers ``do_remote_prefill`` params; the consumer (decode) engine, given those params,
parks the request, reads the producer's blocks with NIXL READs (UCX backend) after a
one-time ZeroMQ handshake per producer rank, and decodes. Registered as ``"nixl"``::

    EngineConfig(connector="nixl", connector_options={"role": "producer", "port": 5600})

Needs the ``nixl`` extra (``nixl-cu12``, ``pyzmq``), imported when a worker registers
its cache. Options: see :mod:`connectors.nixl.options`.
"""

from connectors.nixl.agent import NOTIF_PREFIX, KVAgent, ReadHandle
from connectors.nixl.errors import HandshakeError, NixlError, PeerMismatchError, TransferError
from connectors.nixl.handshake import HandshakeServer, PeerInfo, fetch_peer_info
from connectors.nixl.metadata import NixlMetadata, RemoteRead
from connectors.nixl.options import NIXL_OPTIONS, NixlOptions, RemotePrefill
from connectors.nixl.scheduler import NixlScheduler, model_key
from connectors.nixl.worker import NixlWorker
from connectors.registry import register_connector

__all__ = [
    "NIXL_OPTIONS",
    "NOTIF_PREFIX",
    "HandshakeError",
    "HandshakeServer",
    "KVAgent",
    "NixlError",
    "NixlMetadata",
    "NixlOptions",
    "NixlScheduler",
    "NixlWorker",
    "PeerInfo",
    "PeerMismatchError",
    "ReadHandle",
    "RemotePrefill",
    "RemoteRead",
    "TransferError",
    "fetch_peer_info",
    "model_key",
]

register_connector("nixl", NixlScheduler, NixlWorker)
