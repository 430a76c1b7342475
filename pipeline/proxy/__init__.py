"""``kvstep proxy``: a router in front of replicas, or of producer (prefill) and consumer
(decode) servers.

In front of replicas (``--backend``), each request goes to one of them, picked by the
policy (``round-robin``, ``least-loaded``, or ``kv-aware``: the replica that holds the
longest prefix of the prompt by its KV events, less a load term). In front of
disaggregated pools it follows vLLM's disaggregated-serving proxy: each completion goes
to a producer with ``max_tokens: 1`` and ``kv_transfer_params: {"do_remote_decode":
true}``, then with the producer's ``kv_transfer_params`` to a consumer, whose answer the
client gets unchanged.
``create_proxy_app`` returns the Starlette app; ``serve_proxy`` runs it under uvicorn.
The proxy never imports the engine.
"""

from pipeline.proxy.app import ProxyState, create_proxy_app
from pipeline.proxy.kv_aware import KVAwareRouter
from pipeline.proxy.launch import add_proxy_flags, proxy_options, serve_proxy
from pipeline.proxy.metrics import ProxyMetrics
from pipeline.proxy.options import ProxyOptions
from pipeline.proxy.pool import Backend, BackendPool
from pipeline.proxy.prefix_index import PrefixIndex

__all__ = [
    "Backend",
    "BackendPool",
    "KVAwareRouter",
    "PrefixIndex",
    "ProxyMetrics",
    "ProxyOptions",
    "ProxyState",
    "add_proxy_flags",
    "create_proxy_app",
    "proxy_options",
    "serve_proxy",
]
